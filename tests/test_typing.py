"""The Redis contract is typed: mypy checks pdq/state strictly, and that each store operation has
its own result type, awaited on an AsyncStore and returned by a SyncStore (tests/typing/)."""

from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["pdq/state/store.py", "pdq/state/calls.py", "pdq/state/registry.py", "tests/typing/store_use.py"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One mypy cache for the module: the second check reuses what the first one analysed."""
    return tmp_path_factory.mktemp("mypy-cache")


def mypy(cache: Path, *paths: str) -> tuple[str, int]:
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache),
                                "--no-error-summary", *paths])
    return out + err, status


def test_the_store_its_calls_and_their_uses_type_check_strictly(cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    out, status = mypy(cache, *CHECKED)
    assert status == 0, out


def test_a_misused_store_fails_the_check(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    wrong = tmp_path / "misuse.py"
    wrong.write_text(
        "from pdq.state.store import AsyncStore, SyncStore\n"
        "async def service(store: AsyncStore) -> None:\n"
        "    kept: list[bool] = store.step([])\n"  # not awaited: an awaitable, not the result
        "def thread(store: SyncStore) -> None:\n"
        "    n: int = store.states(['r'])\n"  # a list of states, not an int
        "    store.transition('r', 1, 'DECODING')\n")  # a state is a State, not a str
    out, status = mypy(cache, str(wrong))
    assert status == 1
    assert {line.split(":")[1] for line in out.splitlines() if ": error:" in line} == {"3", "5", "6"}, out
