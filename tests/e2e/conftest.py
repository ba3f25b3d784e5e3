"""A real cluster for end-to-end tests: every role its own process, gRPC on loopback, a
private Redis server, the built-in model."""

import pytest
import redis

from pdq.client import Client
from pdq.up import Cluster


@pytest.fixture(scope="session")
def cluster():
    with Cluster(model="builtin", port=0) as c:
        yield c


@pytest.fixture
def client(cluster):
    with Client(cluster.target) as c:
        yield c


@pytest.fixture
def store_client(cluster):
    r = redis.Redis.from_url(cluster.redis_url)
    yield r
    r.close()
