"""`python -m pdq.cli`: the `pdq` command."""

import sys

from pdq.cli import main

sys.exit(main())
