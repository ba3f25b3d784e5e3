"""docs/configuration.md is what the config dataclasses say now, and names every PDQ_* variable
the code reads."""

import re
from pathlib import Path

from pdq.ops.configdoc import OTHER, PATH, env_names, render

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pdq", "gateway", "scheduler", "prefill_worker", "decode_worker")


def test_docs_configuration_is_current():
    assert PATH.read_text() == render(), "docs/configuration.md is stale: run `make docs` (python -m pdq.ops.configdoc)"


def test_every_pdq_variable_the_code_reads_is_documented_and_none_that_it_does_not():
    used = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            used |= set(re.findall(r"[\"'](PDQ_[A-Z0-9_]+)[\"']", path.read_text()))
    assert used - env_names() == set(), "read by the code, missing from pdq/configdoc.py"
    assert set(OTHER) - used == set(), "documented in pdq/configdoc.py, read by no code"
