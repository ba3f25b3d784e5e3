"""free_port hands each port out once per process: two children given ports before either binds
must not get the same one (a flaky "Address already in use" at cluster start)."""

from pdq.ops.redis_server import free_port


def test_free_port_never_repeats_within_a_process():
    ports = [free_port() for _ in range(300)]  # none bound in between, as when a cluster starts
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < 32768 for p in ports)

