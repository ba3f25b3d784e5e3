"""The Redis scripts' arguments are a named contract: each script names them on its first line
(`-- ARGS: ...`), reads them only by those names (`A.name`; a tail of values from ARGV[TAIL]),
and the store passes them by name (`pdq.state.keys.pack`), refusing a missing or unknown one."""

import re

import pytest

from pdq.state.keys import _SOURCES, ARGS, SCRIPT_NAMES, pack


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_a_script_reads_exactly_the_arguments_it_names_and_no_argv_by_position(name):
    body = "\n".join(line for line in _SOURCES[name].split("\n") if not line.lstrip().startswith("--"))
    used = set(re.findall(r"\bA\.(\w+)", body))
    assert used == set(ARGS[name].names), (sorted(used - set(ARGS[name].names)), sorted(set(ARGS[name].names) - used))
    assert not re.findall(r"ARGV\[\d+\]", body)  # the named ones by name; only a tail by index (ARGV[i])
    assert ("TAIL" in body) == ARGS[name].tail


def test_the_store_passes_arguments_by_name_in_the_scripts_order_and_refuses_a_wrong_name():
    assert pack("lead", {"lease": 2000, "id": "s1"}) == ["s1", 2000]
    assert pack("workers", {"cutoff": 5}, ["prefill", "decode"]) == [5, "prefill", "decode"]
    with pytest.raises(TypeError, match=r"missing \['lease'\], unknown \['ttl'\]"):
        pack("lead", {"id": "s1", "ttl": 2000})
    with pytest.raises(TypeError, match="no values after"):
        pack("resign", {"id": "s1"}, ["extra"])
