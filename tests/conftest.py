"""Shared fixtures: a private real Redis server per test session, a fresh key prefix per test."""

import os
import signal
import uuid
from pathlib import Path

import pytest
import redis
from hypothesis import settings


from pdq.ops.redis_server import RedisServer

# One model cache for the whole run (built once, reused by every process the tests start).
os.environ.setdefault("PDQ_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".venv" / "pdq-cache"))

# A run started in the background by a non-interactive shell (`nohup make test &`, some CI
# runners) ignores SIGINT, and every process it starts inherits that: the tests that press
# Ctrl-C on a `pdq` command need it delivered, as at a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Property tests draw the same examples on every `make test` run, so a failure reproduces;
# PDQ_HYPOTHESIS=explore draws new ones each run (use it to hunt, then pin what it finds).
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("PDQ_HYPOTHESIS", "repeatable"))


@pytest.fixture(scope="session")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def prefix() -> str:
    return "t" + uuid.uuid4().hex[:8]


# The files that start clusters or spawn `pdq` commands run first, heaviest first, so that the
# unit tests' many short files fill in the end of a two-process run (`make test`: xdist hands out
# whole files in collection order as its processes free up). In collection order a cluster file
# collected last kept one process busy for minutes while the other had nothing left to do.
HEAVY_FIRST = (
    "tests/chaos/test_chaos_run.py",
    "tests/bench/test_bench_e2e.py",
    "tests/e2e/test_handoff_faults.py",
    "tests/e2e/test_cli.py",
    "tests/e2e/test_worker_redis_faults.py",
    "tests/e2e/",
    "tests/scheduler/test_cluster.py",
    "tests/observability/",
    "tests/test_sentinel.py",
    "tests/test_redisconn.py",
    "tests/test_up.py",
    "tests/test_cli_roles.py",
    "tests/model/",
    "tests/chaos/test_faults_hook.py",
)


def pytest_collection_modifyitems(session, config, items):
    root = Path(__file__).resolve().parent.parent

    def rank(item) -> int:
        path = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        return next((i for i, prefix in enumerate(HEAVY_FIRST) if path.startswith(prefix)), len(HEAVY_FIRST))

    items.sort(key=rank)  # stable: the order inside each file, and among equals, stays
