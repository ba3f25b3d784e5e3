"""The Lua scripts name request states as `pdq.state.request.State` does: every state a script compares,
writes, ends with or returns is one of its values, and the scripts' terminal set is its own."""

import re

from pdq.state.keys import SCRIPTS, _LIB
from pdq.state.request import TERMINAL, State

# where a state name stands in the scripts: compared, written to the record, a finish, an outcome
STATE_AT = [r"(?:==|~=)\s*'([A-Z_]+)'", r"finish\(\w+, '([A-Z_]+)'", r"'state', '([A-Z_]+)'",
            r"outcome(?:, why)? = '([A-Z_]+)'", r"return '([A-Z_]+)'", r"ipairs\(\{((?:'[A-Z_]+',?\s*)+)\}\)"]


def test_every_state_a_script_uses_is_a_state():
    used = set()
    for source in SCRIPTS.values():
        for pattern in STATE_AT:
            for match in re.findall(pattern, source):
                used |= set(re.findall(r"[A-Z_]+", match))
    assert used <= {s.value for s in State}, used - {s.value for s in State}
    assert {"QUEUED", "PREFILLING", "TRANSFERRING", "FAILED", "TIMED_OUT", "CANCELLED"} <= used  # the check sees them


def test_the_scripts_terminal_states_are_the_enums():
    table = re.search(r"local TERMINAL = \{([^}]*)\}", _LIB).group(1)
    assert set(re.findall(r"([A-Z_]+)=true", table)) == {s.value for s in TERMINAL}
