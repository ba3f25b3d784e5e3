"""Redis clients of pdq processes (pdq.redisconn) against a real redis-server that is stopped and
restarted under them: commands ride through an outage shorter than the window, fail after a
longer one, and a bounded pool makes a burst of calls wait instead of failing."""

import asyncio
import time

import pytest
import redis

from pdq import redisconn
from pdq.redis_server import RedisServer, free_port


@pytest.fixture
def server():
    """A private redis-server on a fixed port, so it can be restarted under the same URL."""
    port = free_port()
    state = {"server": RedisServer(port=port).start()}

    def restart() -> None:
        state["server"].stop()
        state["server"] = RedisServer(port=port).start()

    state["restart"] = restart
    yield state
    state["server"].stop()


def test_a_sync_client_carries_on_after_redis_restarted(server):
    client = redisconn.connect(server["server"].url, outage_s=5)
    client.set("k", "v")
    server["restart"]()  # every pooled connection is now a dead socket
    assert client.get("k") is None  # a fresh server; no ConnectionError
    client.close()


async def test_an_async_client_carries_on_after_redis_restarted(server):
    client = redisconn.connect_async(server["server"].url, outage_s=5)
    await client.set("k", "v")
    server["restart"]()
    assert await client.get("k") is None
    await client.aclose()


async def test_an_outage_shorter_than_the_window_is_ridden_through(server):
    url = server["server"].url
    client = redisconn.connect_async(url, outage_s=10)
    await client.ping()
    server["server"].stop()
    port = server["server"].port
    loop = asyncio.get_running_loop()
    loop.call_later(0.8, lambda: server.__setitem__("server", RedisServer(port=port).start()))
    started = time.monotonic()
    assert await client.set("after", "1")  # waits for the server, then goes through
    assert time.monotonic() - started >= 0.7
    await client.aclose()


async def test_an_outage_longer_than_the_window_fails_the_command_after_it(server):
    client = redisconn.connect_async(server["server"].url, outage_s=0.5)
    await client.ping()
    server["server"].stop()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError) as err:
        await client.get("k")
    waited = time.monotonic() - started
    assert 0.5 <= waited < 5
    assert redisconn.unavailable(err.value)
    await client.aclose()


def test_a_sync_outage_longer_than_the_window_fails_after_it(server):
    client = redisconn.connect(server["server"].url, outage_s=0.5)
    client.ping()
    server["server"].stop()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    assert 0.5 <= time.monotonic() - started < 5


async def test_a_burst_larger_than_the_pool_waits_for_connections_instead_of_failing(server):
    client = redisconn.connect_async(server["server"].url, max_connections=2, outage_s=10)
    # each call holds its connection ~50 ms (a blocking pop that times out): 40 of them on 2 connections
    got = await asyncio.gather(*(client.blpop([f"empty-{i}"], timeout=0.05) for i in range(40)))
    assert got == [None] * 40
    info = await client.info("clients")
    assert info["connected_clients"] <= 2 + 1  # the pool's, and maybe one of the server's own
    await client.aclose()


def test_only_connection_failures_count_as_unavailable():
    assert redisconn.unavailable(redis.ConnectionError("x"))
    assert redisconn.unavailable(redis.TimeoutError("x"))
    assert redisconn.unavailable(redis.BusyLoadingError("loading"))
    assert not redisconn.unavailable(redis.ResponseError("ERR bad script"))
    assert not redisconn.unavailable(ValueError("x"))
