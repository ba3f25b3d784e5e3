"""A real cluster for end-to-end tests: every role its own process, gRPC (and the OpenAI-compatible
HTTP door) on loopback, a private Redis server, the built-in model, API keys for two client
tenants and an admin."""

import json

import pytest
import redis

from pdq.client import Client
from pdq.ops.redis_server import free_port
from pdq.ops.up import Cluster

KEYS = {"acme": "test-key-acme-0001", "globex": "test-key-globex-0002", "ops": "test-key-ops-admin-03"}


@pytest.fixture(scope="session")
def auth_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "keys.json"
    path.write_text(json.dumps({"keys": [
        {"key": KEYS["acme"], "tenant": "acme", "role": "client"},
        {"key": KEYS["globex"], "tenant": "globex", "role": "client"},
        {"key": KEYS["ops"], "tenant": "ops", "role": "admin"},
    ], "tenants": {"globex": {"weight": 2.0}}}))
    return path


@pytest.fixture(scope="session")
def cluster(auth_file):
    with Cluster(model="builtin", port=0, auth=False, extra_env={"PDQ_AUTH_FILE": str(auth_file)},
                 http_port=free_port()) as c:
        yield c


@pytest.fixture
def client(cluster):
    with Client(cluster.target, api_key=KEYS["acme"]) as c:
        yield c


@pytest.fixture
def other_tenant(cluster):
    with Client(cluster.target, api_key=KEYS["globex"]) as c:
        yield c


@pytest.fixture
def store_client(cluster):
    r = redis.Redis.from_url(cluster.redis_url)
    yield r
    r.close()
