"""The gateway's output follower on a real Redis: a few blocking XREADs serve every followed
stream and every subscriber of one stream, and ride out Redis outages."""

import asyncio
import tempfile

import pytest
import redis.asyncio as aioredis

from gateway import follower as follower_mod
from gateway.follower import FollowerUnavailable, OutputFollower
from gateway.results import Event, follow
from pdq.state import redisconn
from pdq.state.request import State
from pdq.ops.redis_server import RedisServer
from pdq.state.store import AsyncStore


async def next_batch(sub, timeout: float = 10.0):
    got = await asyncio.wait_for(sub.queue.get(), timeout)
    assert not isinstance(got, Exception), got
    return [fields for _, fields in got]


async def entries(sub, n: int, timeout: float = 10.0) -> list[dict]:
    got: list[dict] = []
    while len(got) < n:
        got += await next_batch(sub, timeout)
    return got


async def reading(follower: OutputFollower) -> None:
    """Until every reader with streams is blocked (or about to block) in its XREAD."""
    while not all(r.reading for r in follower.readers if r.streams):
        await asyncio.sleep(0)


def never_returns(monkeypatch) -> None:
    """XREADs block for an hour: an entry gets through in time only if its reader is woken."""
    monkeypatch.setattr(follower_mod, "HOT_BLOCK_MS", 3_600_000)
    monkeypatch.setattr(follower_mod, "COLD_BLOCK_MS", 3_600_000)


def reader_of(follower: OutputFollower, key: str):
    return next(r for r in follower.readers if key.encode() in r.streams)


@pytest.fixture
def restartable():
    """A durable redis-server on a fixed port and directory: stopped and started again under
    the follower, its streams kept (AOF), as a production Redis restarts."""
    server = RedisServer(directory=tempfile.mkdtemp(prefix="pdq-follower-"), durable=True)
    server.start()
    yield server
    server.stop()


async def test_every_stream_gets_its_entries_in_order(redis_server, prefix):
    other = aioredis.Redis.from_url(redis_server.url)
    follower = OutputFollower(redis_server.url, other)
    keys = [f"{prefix}:out:{i}" for i in range(20)]
    subs = [follower.subscribe(k) for k in keys]
    for step in range(5):  # like a decode step: one entry per stream in one round trip
        pipe = other.pipeline()
        for i, key in enumerate(keys):
            pipe.xadd(key, {"i": step, "k": i})
        await pipe.execute()
    for i, sub in enumerate(subs):
        assert await entries(sub, 5) == [{b"i": str(s).encode(), b"k": str(i).encode()} for s in range(5)]
    for sub in subs:
        follower.unsubscribe(sub)
    assert follower.streams == 0
    await follower.close()
    await other.aclose()


async def test_a_stream_followed_while_the_read_blocks_is_read_at_once(redis_server, prefix, monkeypatch):
    other = aioredis.Redis.from_url(redis_server.url)
    # A blocked XREAD that nothing wakes would hold a new stream's entries for the whole block
    # time: with an hour, only the CLIENT UNBLOCK wake-up gets the entry through in time.
    never_returns(monkeypatch)
    follower = OutputFollower(redis_server.url, other, cold=1, hot=1)
    follower.subscribe(f"{prefix}:idle")
    first = follower.subscribe(f"{prefix}:a")
    await other.xadd(f"{prefix}:a", {"n": 1})
    assert await entries(first, 1) == [{b"n": b"1"}]
    await reading(follower)  # the hot reader on a, the cold one on idle
    await other.xadd(f"{prefix}:b", {"n": 2})  # written before b is followed: read from the start
    second = follower.subscribe(f"{prefix}:b")
    assert await entries(second, 1) == [{b"n": b"2"}]
    await other.xadd(f"{prefix}:a", {"n": 3})  # and a, on the hot reader, goes on
    assert await entries(first, 1) == [{b"n": b"3"}]
    await follower.close()
    await other.aclose()


async def test_every_follower_of_one_stream_gets_all_of_it_however_late_it_joins(redis_server, prefix, monkeypatch):
    # subscribers get their entries a few per event-loop turn, while the stream moves from its
    # cold reader to a hot one and more entries come: each still sees every entry once, in order
    monkeypatch.setattr(follower_mod, "WAKES_PER_TURN", 8)
    other = aioredis.Redis.from_url(redis_server.url)
    store = AsyncStore(other, prefix)
    follower = OutputFollower(redis_server.url, other)
    key = store.keys.output("r1")

    async def read_all() -> list[int]:  # the token indices, however many entries an event joins
        return [event.index + k async for event in follow(store, follower, "r1") if event.state is None
                for k in range(len(event.token_ids))]

    early = [asyncio.create_task(read_all()) for _ in range(50)]
    for i in range(3):
        await other.xadd(key, {"i": i, "t": 7, "x": "a"})
    while follower.streams == 0 or not any(s.last != b"0-0" for r in follower.readers for s in r.streams.values()):
        await asyncio.sleep(0.01)  # the follower has read some of the stream: later followers join mid-way
    late = [asyncio.create_task(read_all()) for _ in range(50)]
    for i in range(3, 6):
        await other.xadd(key, {"i": i, "t": 7, "x": "a"})
    await other.xadd(key, {"done": "COMPLETED", "r": "length"})
    got = await asyncio.wait_for(asyncio.gather(*early, *late), 30)
    assert got == [list(range(6))] * 100  # every one from the first entry, none twice
    assert follower.streams == 0  # the last to leave stops following it
    await follower.close()
    await other.aclose()


async def test_entries_keep_their_order_while_a_stream_moves_to_a_hot_reader(redis_server, prefix, monkeypatch):
    # one entry per read and one subscriber per event-loop turn: the cold reader hands out the
    # first entry over 500 turns while the later ones already wait in Redis for the hot reader
    monkeypatch.setattr(follower_mod, "COUNT", 1)
    monkeypatch.setattr(follower_mod, "WAKES_PER_TURN", 1)
    other = aioredis.Redis.from_url(redis_server.url)
    follower = OutputFollower(redis_server.url, other)
    key = f"{prefix}:order"
    for n in range(4):
        await other.xadd(key, {"n": n})
    subs = [follower.subscribe(key) for _ in range(500)]
    want = [{b"n": str(n).encode()} for n in range(4)]
    assert [await entries(sub, 4) for sub in subs] == [want] * 500
    await follower.close()
    await other.aclose()


async def test_a_stream_moves_to_a_hot_reader_with_its_first_entry(redis_server, prefix):
    # a token of a running request waits for an XREAD over the running streams only, not
    # over every stream of a queued request
    other = aioredis.Redis.from_url(redis_server.url)
    follower = OutputFollower(redis_server.url, other)
    waiting = [follower.subscribe(f"{prefix}:queued:{i}") for i in range(500)]
    running = follower.subscribe(f"{prefix}:running")
    assert reader_of(follower, f"{prefix}:running") in follower.cold
    for n in range(3):
        await other.xadd(f"{prefix}:running", {"n": n})
        assert await entries(running, 1) == [{b"n": str(n).encode()}]
        assert reader_of(follower, f"{prefix}:running") in follower.hot
    assert sum(len(r.streams) for r in follower.hot) == 1
    assert sum(len(r.streams) for r in follower.cold) == len(waiting)
    await follower.close()
    await other.aclose()


async def test_an_entry_that_does_not_parse_fails_its_own_streams_followers_only(redis_server, prefix):
    other = aioredis.Redis.from_url(redis_server.url)
    follower = OutputFollower(redis_server.url, other, cold=1, hot=1, parse=Event)
    broken, fine = follower.subscribe(f"{prefix}:broken"), follower.subscribe(f"{prefix}:fine")
    await other.xadd(f"{prefix}:broken", {"i": "not a number", "t": "7"})
    await other.xadd(f"{prefix}:fine", {"i": 0, "t": "7", "x": "a"})
    got = await asyncio.wait_for(broken.queue.get(), 10)
    assert isinstance(got, FollowerUnavailable) and got.reason == "SERVER_ERROR"
    assert "does not parse" in str(got)
    (_, event), = await asyncio.wait_for(fine.queue.get(), 10)
    assert isinstance(event, Event) and event.token_ids == [7]  # parsed once, by the follower
    await other.xadd(f"{prefix}:fine", {"i": 1, "t": "8", "x": "b"})
    (_, event), = await asyncio.wait_for(fine.queue.get(), 10)
    assert event.index == 1
    await follower.close()
    await other.aclose()


async def test_a_long_poll_returns_what_came_within_its_wait(redis_server, prefix):
    other = aioredis.Redis.from_url(redis_server.url)
    store = AsyncStore(other, prefix)
    follower = OutputFollower(redis_server.url, other)
    await other.xadd(store.keys.output("r2"), {"i": 0, "t": 5, "x": "a"})
    got = [event.index async for event in follow(store, follower, "r2", wait_ms=200)]
    assert got == [0]  # no end yet: it stops at its wait
    assert [event.index async for event in follow(store, follower, "r2", wait_ms=0)] == [0]
    assert follower.streams == 0
    await follower.close()
    await other.aclose()


async def test_connections_stay_bounded_however_many_follow(redis_server, prefix):
    other = aioredis.Redis.from_url(redis_server.url)
    follower = OutputFollower(redis_server.url, other)
    before = (await other.info("clients"))["connected_clients"]
    subs = [follower.subscribe(f"{prefix}:s{i % 200}") for i in range(2000)]
    await other.xadd(f"{prefix}:s7", {"n": 1})
    for sub in subs[7::200]:
        assert await entries(sub, 1) == [{b"n": b"1"}]
    assert (await other.info("clients"))["connected_clients"] <= before + len(follower.readers)
    await follower.close()
    await other.aclose()


async def test_an_outage_shorter_than_the_window_pauses_the_stream_and_loses_nothing(restartable, prefix, monkeypatch):
    never_returns(monkeypatch)  # only a wake to the new connection's id helps
    client = redisconn.connect_async(restartable.url, outage_s=30)
    follower = OutputFollower(restartable.url, client, outage_s=30, cold=1, hot=1)
    follower.subscribe(f"{prefix}:idle")  # keeps the cold reader blocked in its XREAD
    sub = follower.subscribe(f"{prefix}:a")
    await client.xadd(f"{prefix}:a", {"n": 1})
    assert await entries(sub, 1) == [{b"n": b"1"}]
    await reading(follower)
    old_connects = [r.connects for r in follower.readers]
    restartable.stop()
    restartable.start()  # its AOF back: the stream as it was
    await client.xadd(f"{prefix}:a", {"n": 2})
    await client.xadd(f"{prefix}:a", {"n": 3})
    assert await entries(sub, 2, timeout=30) == [{b"n": b"2"}, {b"n": b"3"}]  # nothing lost, nothing again
    while not all(r.connects > old and r.client_id is not None for r, old in zip(follower.readers, old_connects)):
        await asyncio.sleep(0.01)  # the cold reader reconnects too (its XREAD failed)
    await reading(follower)
    second = follower.subscribe(f"{prefix}:b")  # its wake names the cold reader's new connection
    await client.xadd(f"{prefix}:b", {"n": 4})
    assert await entries(second, 1) == [{b"n": b"4"}]
    await follower.close()
    await client.aclose()


async def test_past_the_window_each_subscription_ends_unavailable_and_the_follower_recovers(restartable, prefix):
    client = redisconn.connect_async(restartable.url, outage_s=30)
    follower = OutputFollower(restartable.url, client, outage_s=1.0)
    sub = follower.subscribe(f"{prefix}:a")
    await client.xadd(f"{prefix}:a", {"n": 1})
    assert await entries(sub, 1) == [{b"n": b"1"}]
    restartable.stop()
    got = await asyncio.wait_for(sub.queue.get(), 30)
    assert isinstance(got, FollowerUnavailable) and got.reason == "REDIS_UNAVAILABLE"
    assert "Redis unreachable" in str(got)
    assert follower.streams == 0
    restartable.start()
    again = follower.subscribe(f"{prefix}:a")  # the same follower, nothing restarted
    assert again.start == b"0-0"
    await client.xadd(f"{prefix}:a", {"n": 2})
    assert await entries(again, 2, timeout=30) == [{b"n": b"1"}, {b"n": b"2"}]
    await follower.close()
    await client.aclose()


async def test_closing_ends_every_subscription_as_the_gateway_stopping(redis_server, prefix):
    other = aioredis.Redis.from_url(redis_server.url)
    follower = OutputFollower(redis_server.url, other)
    subs = [follower.subscribe(f"{prefix}:{i}") for i in range(3)]
    await follower.close()
    for sub in subs:
        got = sub.queue.get_nowait()
        assert isinstance(got, FollowerUnavailable) and got.reason == "GATEWAY_STOPPING"
    late = follower.subscribe(f"{prefix}:x")
    assert isinstance(late.queue.get_nowait(), FollowerUnavailable)
    await other.aclose()


class CountingWaker:
    """The follower's waker (a Redis client), counting its CLIENT UNBLOCKs."""

    def __init__(self, client):
        self.client, self.unblocks = client, 0

    async def client_unblock(self, client_id):
        self.unblocks += 1
        return await self.client.client_unblock(client_id)


async def test_a_stream_added_to_a_busy_reader_rides_its_next_read_without_a_wake(redis_server, prefix, monkeypatch):
    """A reader whose XREAD returns by itself within WAKE_AFTER_S (entries keep coming, as from
    a decode worker's steps) takes a stream added meanwhile in its next XREAD: no CLIENT UNBLOCK.
    One blocked with nothing coming is woken after WAKE_AFTER_S."""
    never_returns(monkeypatch)
    monkeypatch.setattr(follower_mod, "WAKE_AFTER_S", 0.2)
    other = aioredis.Redis.from_url(redis_server.url)
    waker = CountingWaker(other)
    follower = OutputFollower(redis_server.url, waker, cold=1, hot=1)
    busy = follower.subscribe(f"{prefix}:out:busy")
    await reading(follower)
    new = follower.subscribe(f"{prefix}:out:new")  # added while the XREAD blocks: a wake is due in 0.2 s
    await other.xadd(f"{prefix}:out:busy", {"i": 0})  # ... but the XREAD returns by itself first
    assert await entries(busy, 1) == [{b"i": b"0"}]
    await other.xadd(f"{prefix}:out:new", {"i": 0})
    assert await entries(new, 1, timeout=5) == [{b"i": b"0"}]
    assert waker.unblocks == 0
    quiet = follower.subscribe(f"{prefix}:out:quiet")  # a blocked XREAD with nothing coming
    await reading(follower)
    idle = follower.subscribe(f"{prefix}:out:idle")  # only the wake, after the wait, gets it in
    await other.xadd(f"{prefix}:out:idle", {"i": 0})
    assert await entries(idle, 1, timeout=5) == [{b"i": b"0"}]
    assert waker.unblocks >= 1
    follower.unsubscribe(quiet)
    await follower.close()
    await other.aclose()


async def test_a_follower_that_fell_behind_gets_the_entries_at_hand_as_one_event(redis_server, prefix):
    """`follow` hands a subscriber that fell behind every token entry already queued as one
    event (the gateway then sends one message, not one per entry); tokens, texts and order are
    the stream's, and the end stays an event of its own."""
    other = aioredis.Redis.from_url(redis_server.url)
    store = AsyncStore(other, prefix)
    follower = OutputFollower(redis_server.url, other)
    key = store.keys.output("r")
    events = follow(store, follower, "r")
    await other.xadd(key, {"i": 0, "t": 5, "x": "a"})
    first = await asyncio.wait_for(anext(events), 10)
    assert (first.index, first.token_ids, first.texts) == (0, [5], ["a"])
    probe = follower.subscribe(key)  # subscribed after `events`: handed each batch after it
    for i, (t, x) in enumerate([(6, "b"), (7, "cd"), (8, "é")], start=1):
        await other.xadd(key, {"i": i, "t": t, "x": x})
    await entries(probe, 3)  # all three wait in `events`' queue too, while it is not reading
    behind = await asyncio.wait_for(anext(events), 10)
    assert (behind.index, behind.token_ids, behind.texts, behind.state) == (1, [6, 7, 8], ["b", "cd", "é"], None)
    await other.xadd(key, {"i": 4, "t": 9, "x": "f"})
    await other.xadd(key, {"done": "COMPLETED", "r": "length"})
    await entries(probe, 2)
    rest = [event async for event in events]
    assert [(e.index, e.token_ids, e.state) for e in rest] == [(4, [9], None), (None, [], State.COMPLETED)]
    follower.unsubscribe(probe)
    await follower.close()
    await other.aclose()


def test_coalesce_joins_consecutive_token_events_and_changes_none_of_them():
    from gateway.results import coalesce

    def tokens(i: int, *ids: int) -> Event:
        return Event({"i": i, "t": ",".join(map(str, ids)), "x": "".join(chr(96 + t % 26) for t in ids),
                      "l": ",".join("1" for _ in ids)})
    given = [tokens(0, 1), tokens(1, 2, 3), tokens(3, 4), tokens(7, 5), Event({"done": "COMPLETED", "r": "length"})]
    got = coalesce(given)
    assert [(e.index, e.token_ids, e.texts, e.state) for e in got] == [
        (0, [1, 2, 3, 4], ["a", "b", "c", "d"], None),  # 0, 1-2, 3: consecutive
        (7, [5], ["e"], None),  # not the next index: kept apart
        (None, [], [], State.COMPLETED)]
    assert [(e.index, e.token_ids) for e in given[:3]] == [(0, [1]), (1, [2, 3]), (3, [4])]  # shared: unchanged
    assert coalesce([]) == [] and coalesce(given[3:]) == given[3:]
    long = [tokens(i * 100, *range(i * 100, i * 100 + 100)) for i in range(6)]  # entries of 100 tokens
    assert [(e.index, len(e.token_ids)) for e in coalesce(long)] == [(0, 200), (200, 200), (400, 200)]  # <= 256
