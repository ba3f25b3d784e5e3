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

# Workers load the model in float32 on every CI machine: without a dtype, one on a CPU with AMX or AVX512_BF16
# would run bfloat16 (pdq.engine.runner.serving_dtype), and the tests that compare a cluster's
# tokens with transformers' float32 generate() would depend on which machine CI landed on.
# tests/engine/test_serving_dtype.py covers the default itself.
os.environ["PDQ_DTYPE"] = "float32"

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
