"""The private Redis server keeps its port and directory across a restart: a durable one comes
back with its data (AOF, appendfsync always), as `pdq up` restarts it."""

import os
import signal

import redis

from pdq.ops.redis_server import RedisServer


def restart(server: RedisServer) -> None:
    """Killed without a shutdown (as a crash), then started again as `pdq up` does."""
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    server.start()


def test_a_durable_server_restarted_keeps_its_port_directory_and_every_acknowledged_write():
    with RedisServer(durable=True) as server:
        port, directory, url = server.port, server.directory, server.url
        with redis.Redis.from_url(url) as r:
            for i in range(100):
                r.set(f"k{i}", i)
        restart(server)
        assert (server.port, server.directory, server.url) == (port, directory, url)
        assert os.path.isdir(directory)
        with redis.Redis.from_url(url) as r:
            assert [int(v) for v in r.mget([f"k{i}" for i in range(100)])] == list(range(100))
    assert not os.path.exists(directory)  # stop() ends it for good


def test_a_plain_server_restarts_on_its_port_empty():
    with RedisServer() as server:
        with redis.Redis.from_url(server.url) as r:
            r.set("k", 1)
        restart(server)
        with redis.Redis.from_url(server.url) as r:
            assert r.get("k") is None and r.ping()


def test_a_first_start_on_a_port_another_process_took_moves_to_a_new_one_but_a_given_port_stays():
    """Between `free_port` and redis-server binding, another process (a parallel test worker)
    may take the port: a server that chose its port itself starts on another; one given its
    port fails, naming the port and its log's reason."""
    import socket

    import pytest

    from pdq.ops.redis_server import PortTaken

    with socket.socket() as squatter:  # bound, not listening: redis-server cannot bind it, a client is refused
        squatter.bind(("127.0.0.1", 0))
        taken = squatter.getsockname()[1]
        server = RedisServer()
        server.port = taken  # as if another process bound the port free_port chose
        with server:
            assert server.port != taken
            with redis.Redis.from_url(server.url) as r:
                assert r.ping()
        given = RedisServer(port=taken)
        with pytest.raises(PortTaken, match=f"port {taken}.*Address already in use"):
            given.start()
        given.stop()
