"""A real cluster with tracing on, exporting to an in-process OTLP collector."""

import pytest

from pdq.client import Client
from pdq.ops.redis_server import free_port
from pdq.ops.up import Cluster
from tests.observability.collector import Collector


@pytest.fixture(scope="package")
def collector():
    c = Collector(free_port())  # started by traced_cluster, once its processes are up
    yield c
    c.stop()


@pytest.fixture(scope="package")
def traced_cluster(collector):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    # the collector's gRPC server starts after the fork()s: gRPC threads in a forking parent can abort its children
    with Cluster(model="builtin", port=0, extra_env=env, http_port=free_port()) as cluster:
        collector.start()
        yield cluster


@pytest.fixture
def client(traced_cluster):
    with Client(traced_cluster.target) as c:  # finds the cluster's dev API key by itself
        yield c
