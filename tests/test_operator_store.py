"""The store calls behind the Operator API, against a real Redis server: the request index
(ListRequests), its pruning with the records' TTL, deadline notices, and sticky drains."""

import asyncio
import time

import redis.asyncio as aioredis

from pdq.state.ending import Ending
from pdq.state.keys import Keys
from pdq.state.registry import WorkerInfo, forget, heartbeat, live_workers, set_drained
from pdq.state.request import State
from pdq.state.store import AsyncStore, SyncStore
from pdq.state.cancel_listener import CancelListener
from tests.test_store import make_spec


def store_of(redis_client, prefix, ttl=60):
    return SyncStore(redis_client, prefix, result_ttl_s=ttl)


def list_all(store, **kw):
    pages, cursor = [], ""
    while True:
        ids, cursor = store.list_requests(cursor=cursor, **kw)
        pages.append(ids)
        if not cursor:
            return pages


def test_list_requests_newest_first_filtered_and_paginated(redis_client, prefix):
    store = store_of(redis_client, prefix)
    for i in range(7):
        store.submit(make_spec(f"a{i}", tenant="acme" if i % 2 == 0 else "globex"))
    store.end("a2", Ending(State.CANCELLED, "cancelled"))
    assert list_all(store, limit=3) == [["a6", "a5", "a4"], ["a3", "a2", "a1"], ["a0"]]
    assert list_all(store, limit=2, tenant="acme") == [["a6", "a4"], ["a2", "a0"]]
    assert list_all(store, limit=10, state="CANCELLED") == [["a2"]]
    assert list_all(store, limit=10, tenant="globex", state="QUEUED") == [["a5", "a3", "a1"]]
    assert list_all(store, limit=10, tier="batch") == [[]]
    # a bounded scan returns a short page with a cursor that goes on where it stopped
    ids, cursor = store.list_requests(state="CANCELLED", limit=10, max_scan=2)
    assert (ids, cursor) == ([], store.client.hget(store.keys.request("a5"), "seq").decode())
    assert store.list_requests(state="CANCELLED", limit=10, cursor=cursor) == (["a2"], "")


def test_ended_requests_leave_the_index_with_their_records(redis_client, prefix):
    store = store_of(redis_client, prefix, ttl=1)
    store.submit(make_spec("old"))
    store.end("old", Ending(State.COMPLETED, "length"))
    assert store.list_requests()[0] == ["old"]
    deadline = time.monotonic() + 10
    while store.client.exists(store.keys.request("old")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store.client.exists(store.keys.request("old"))
    store.submit(make_spec("new"))
    store.end("new", Ending(State.COMPLETED, "length"))  # an end prunes the index of expired ones
    assert store.client.zrange(store.keys.index(), 0, -1) == [b"new"]
    assert store.client.zrange(store.keys.index("acme"), 0, -1) == [b"new"]
    assert store.client.zcard(store.keys.ended) == 1


def test_set_deadline_tells_the_workers(redis_server, redis_client, prefix):
    store = store_of(redis_client, prefix)
    listener = CancelListener(redis_server.url, Keys(prefix))
    try:
        store.submit(make_spec("r", deadline_ms=111))
        deadline = time.monotonic() + 5
        channel = store.keys.deadline_channel
        while redis_client.pubsub_numsub(channel)[0][1] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)  # subscribing is asynchronous; a publish before it would be lost
        assert store.set_deadline("r", 999_999) == State.QUEUED
        while listener.deadline("r", 111) == 111 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert listener.deadline("r", 111) == 999_999
        assert store.record("r")["deadline_ms"] == "999999"
        store.end("r", Ending(State.CANCELLED, "cancelled"))
        while listener.deadlines and time.monotonic() < deadline:
            time.sleep(0.02)
        assert listener.deadlines == {}  # forgotten once the request ended
        assert store.set_deadline("r", 5) == State.CANCELLED
        assert store.set_deadline("nope", 5) is None
    finally:
        listener.close()


def test_a_heartbeat_tells_the_scheduler_only_while_requests_are_queued(redis_client, prefix):
    """The heartbeat channel wakes the dispatcher for queued work: with none queued a heartbeat
    only refreshes the registry; with a request queued it is published."""
    store = SyncStore(redis_client, prefix)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(store.keys.heartbeat_channel)
    assert pubsub.get_message(timeout=5.0)["type"] == "subscribe"
    info = WorkerInfo("d1", "decode", "127.0.0.1:1", free_slots=3, capacity=4)
    try:
        heartbeat(store, info, 5)
        assert redis_client.hget(store.keys.worker("d1"), "free_slots") == b"3"
        assert redis_client.zscore(store.keys.workers("decode"), "d1") is not None
        assert 0 < redis_client.pttl(store.keys.worker("d1")) <= 5000
        store.submit(make_spec("r"))
        heartbeat(store, info, 5)
        redis_client.publish(store.keys.heartbeat_channel, "end")  # marks the end of what the beats sent
        published = []
        while not published or published[-1] != b"end":
            published.append(pubsub.get_message(timeout=5.0)["data"])
        assert published == [b"d1", b"end"]  # the second beat only
    finally:
        pubsub.close()


def test_an_operator_drain_survives_the_workers_heartbeats(redis_server, prefix):
    async def run():
        client = aioredis.Redis.from_url(redis_server.url)
        store = AsyncStore(client, prefix)
        keys = store.keys
        info = WorkerInfo("d1", "decode", "127.0.0.1:1", free_slots=4, capacity=4)

        async def draining() -> list[bool]:
            live = await live_workers(store, ("prefill", "decode"), 10)
            assert live["prefill"] == []
            assert [(w.worker_id, w.address, w.free_slots, w.capacity) for w in live["decode"]] == [
                ("d1", "127.0.0.1:1", 4, 4)]
            return [w.draining for w in live["decode"]]
        try:
            await heartbeat(store, info, 5)
            await set_drained(client, keys, "d1", True)
            await heartbeat(store, info, 5)  # the worker says draining=False
            assert await draining() == [True]
            await set_drained(client, keys, "d1", False)
            assert await draining() == [False]
            await set_drained(client, keys, "d1", True)
            await forget(client, keys, "d1", "decode")  # reaped: the drain goes with it
            assert not await client.exists(keys.drained)
        finally:
            await client.aclose()
    asyncio.run(run())


def test_a_worker_is_shown_quarantined_only_until_its_quarantine_ends():
    from gateway.operator import worker_info
    from pdq.state.store import now_ms

    later, earlier = now_ms() + 60_000, now_ms() - 1
    shown = worker_info(WorkerInfo("p0", "prefill", "h:1", quarantined_until_ms=later, quarantine_reason="3 failed"))
    assert (shown.quarantined_until_ms, shown.quarantine_reason) == (later, "3 failed")
    ended = worker_info(WorkerInfo("p0", "prefill", "h:1", quarantined_until_ms=earlier, quarantine_reason="3 failed"))
    assert (ended.quarantined_until_ms, ended.quarantine_reason) == (0, "")


def test_a_request_shows_its_client_request_id_and_lost_attempts():
    from gateway.operator import request_info

    info = request_info({"id": "abc", "client_request_id": "my-id", "lost": "2", "attempts": "3"})
    assert (info.client_request_id, info.lost_attempts, info.attempts) == ("my-id", 2, 3)


def test_pdq_workers_shows_a_quarantine_with_its_time_left_and_reason(capsys):
    import argparse

    from pdq.cli.operator import _print_workers
    from pdq.state.store import now_ms
    from pdq.v1 import operator_pb2 as op_pb

    _print_workers([op_pb.WorkerInfo(worker_id="p0", role="prefill", address="h:1", heartbeat_ms=now_ms(),
                                     quarantined_until_ms=now_ms() + 60_000, quarantine_reason="3 KV hand-offs failed"),
                    op_pb.WorkerInfo(worker_id="d0", role="decode", address="h:2", heartbeat_ms=now_ms())],
                   argparse.Namespace(json=False))
    lines = capsys.readouterr().out.splitlines()
    assert "QUARANTINED" in lines[0]
    assert "s left" in lines[1] and lines[2].split()[-3] == "no"  # d0: not quarantined (then "0.0s ago")
    assert lines[3].startswith("p0: quarantined (") and lines[3].endswith("): 3 KV hand-offs failed")
