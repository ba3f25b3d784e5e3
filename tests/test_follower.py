"""The gateway's output follower on a real Redis: one XREAD for every followed stream."""

import asyncio

import redis.asyncio as aioredis

from gateway import follower as follower_mod
from gateway.follower import OutputFollower
from pdq.redis_server import RedisServer


def clients(redis_server):
    """(reader on a connection of its own, another client): what the gateway gives its follower."""
    return (aioredis.Redis.from_url(redis_server.url, single_connection_client=True),
            aioredis.Redis.from_url(redis_server.url))


async def next_entry(sub, timeout: float = 10.0):
    got = await asyncio.wait_for(sub.queue.get(), timeout)
    assert not isinstance(got, Exception), got
    return got[1]


async def blocked_on_one_stream(redis_server, prefix):
    """A follower whose XREAD is (about to be) blocked on stream `a` alone. -> (follower, other)"""
    reader, other = clients(redis_server)
    follower = OutputFollower(reader, other)
    first = follower.subscribe(f"{prefix}:a")
    await other.xadd(f"{prefix}:a", {"n": 1})
    assert await next_entry(first) == {b"n": b"1"}
    while not follower._reading:
        await asyncio.sleep(0)
    return follower, other


async def test_every_stream_gets_its_entries_in_order(redis_server, prefix):
    reader, other = clients(redis_server)
    follower = OutputFollower(reader, other)
    keys = [f"{prefix}:out:{i}" for i in range(20)]
    subs = [follower.subscribe(k) for k in keys]
    for step in range(5):  # like a decode step: one entry per stream in one round trip
        pipe = other.pipeline()
        for i, key in enumerate(keys):
            pipe.xadd(key, {"i": step, "k": i})
        await pipe.execute()
    for i, sub in enumerate(subs):
        got = [await next_entry(sub) for _ in range(5)]
        assert got == [{b"i": str(s).encode(), b"k": str(i).encode()} for s in range(5)]
    for sub in subs:
        follower.unsubscribe(sub)
    assert not follower.subs
    await follower.close()
    await other.aclose()


async def test_a_stream_followed_while_the_read_blocks_is_read_at_once(redis_server, prefix, monkeypatch):
    # A blocked XREAD that nothing wakes would hold a new stream's entries for the whole block
    # time: with an hour, only the CLIENT UNBLOCK wake-up gets the entry through in time.
    monkeypatch.setattr(follower_mod, "MAX_BLOCK_MS", 3_600_000)
    follower, other = await blocked_on_one_stream(redis_server, prefix)
    await other.xadd(f"{prefix}:b", {"n": 2})  # written before b is followed: read from the start
    second = follower.subscribe(f"{prefix}:b")
    assert await next_entry(second) == {b"n": b"2"}
    await follower.close()
    await other.aclose()


async def test_a_stream_followed_twice_is_left_to_the_second_caller(redis_server, prefix):
    reader, other = clients(redis_server)
    follower = OutputFollower(reader, other)
    sub = follower.subscribe(f"{prefix}:x")
    assert follower.subscribe(f"{prefix}:x") is None
    follower.unsubscribe(sub)
    assert follower.subscribe(f"{prefix}:x") is not None
    await follower.close()
    await other.aclose()


async def test_a_failed_read_reaches_every_follower(prefix):
    with RedisServer() as server:  # a private server, to stop under the follower
        reader, other = clients(server)
        follower = OutputFollower(reader, other)
        sub = follower.subscribe(f"{prefix}:y")
        await other.xadd(f"{prefix}:y", {"n": 1})
        assert await next_entry(sub) == {b"n": b"1"}
    got = await asyncio.wait_for(sub.queue.get(), 60)  # Redis is gone: the read fails, after retries
    assert isinstance(got, Exception)
    assert not follower.subs
    await follower.close()
    await other.aclose()


async def test_a_stale_reader_id_is_read_again(redis_server, prefix, monkeypatch):
    # after redis-py reconnects the reader, CLIENT UNBLOCK of the old id wakes nothing: the
    # follower stops trying, the XREAD returns at its block time, and the id is read anew
    monkeypatch.setattr(follower_mod, "MAX_BLOCK_MS", 300)
    follower, other = await blocked_on_one_stream(redis_server, prefix)
    real_id = follower._reader_id
    follower._reader_id = real_id + 10_000  # as if the connection had been replaced
    second = follower.subscribe(f"{prefix}:b")
    await other.xadd(f"{prefix}:b", {"n": 2})
    assert await next_entry(second) == {b"n": b"2"}
    while follower._reader_id != real_id:  # read again from the live connection
        await asyncio.sleep(0.01)
    await follower.close()
    await other.aclose()
