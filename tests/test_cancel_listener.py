"""pdq.state.cancel_listener.CancelListener rides dropped connections: it subscribes again (its thread never
dies), hears cancels and deadline moves after that, and a catch-up reads back from the records
what was published while it was away. A real Redis; connections dropped with CLIENT KILL."""

import time

import pytest
import redis

from pdq.state.ending import Ending
from pdq.state.keys import Keys
from pdq.ops.redis_server import RedisServer
from pdq.state.request import State
from pdq.state.store import SyncStore
from pdq.state.cancel_listener import CancelListener
from tests.test_store import make_spec


def wait_for(what: str, check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.01)
    return got


@pytest.fixture
def store(redis_client, prefix):
    return SyncStore(redis_client, prefix, result_ttl_s=60)


def claimed(store: SyncStore, rid: str, **spec) -> int:
    """Submits and claims a request. -> its epoch"""
    store.submit(make_spec(rid, **spec))
    return store.claim([(rid, "decode-1")], "prefill-1")[0].epoch


def test_the_cancel_listener_hears_cancels_and_deadline_moves_after_its_connection_is_killed(
        redis_server, redis_client, store, prefix):
    listener = CancelListener(redis_server.url, Keys(prefix))
    try:
        for round_ in range(1, 4):  # again and again: the thread never dies
            assert redis_client.client_kill_filter(_type="pubsub", skipme=True) >= 1
            wait_for("the listener to subscribe again", lambda: listener.gaps == round_ and listener.subscribed.is_set())
            rid = f"r{round_}"
            claimed(store, rid)
            assert store.set_deadline(rid, 123_456) == State.PREFILLING
            wait_for("the deadline move", lambda: listener.deadline(rid, 0) == 123_456)
            store.end(rid, Ending(State.CANCELLED, "cancelled"))
            wait_for("the cancel", lambda: listener.pop(rid))
        assert listener._thread.is_alive()
    finally:
        listener.close()
    assert not listener._thread.is_alive()


def test_after_a_gap_the_listener_catches_up_on_what_it_missed(redis_server, redis_client, store, prefix):
    """While it cannot subscribe (ACL), messages go to nobody; once back, `gaps` moved and a
    catch-up over the held requests finds the ended ones, those moved on to another attempt,
    and the moved deadlines."""
    user = f"u{prefix}"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all"])
    listener = CancelListener(redis_server.url.replace("redis://", f"redis://{user}:pw@"), Keys(prefix))
    try:
        held = {rid: claimed(store, rid, deadline_ms=1000) for rid in ("cancelled", "moved", "requeued", "same")}
        redis_client.acl_setuser(user, enabled=True, commands=["-subscribe"])
        assert redis_client.client_kill_filter(_type="pubsub", user=user) == 1
        wait_for("a failed resubscribe", lambda: listener.liveness.failing >= 1)
        store.end("cancelled", Ending(State.CANCELLED, "cancelled"))  # published to nobody
        store.set_deadline("moved", 999_000)
        store.requeue("requeued", held["requeued"], "worker lost", 3)
        redis_client.acl_setuser(user, enabled=True, commands=["+subscribe"])
        wait_for("the listener to be back", lambda: listener.gaps == 1)
        assert not listener.pop("cancelled") and listener.deadline("moved", 1000) == 1000  # nothing was heard
        listener.catch_up(store, [*held.items(), ("unknown", 1)])
        assert [listener.pop(rid) for rid in ("cancelled", "moved", "requeued", "same", "unknown")] == [
            True, False, True, False, True]
        assert listener.deadline("moved", 1000) == 999_000 and listener.deadline("same", 1000) == 1000
    finally:
        listener.close()
        redis_client.acl_deluser(user)


def test_the_listener_closes_at_once_while_redis_is_down(prefix, tmp_path):
    server = RedisServer(directory=str(tmp_path)).start()
    listener = CancelListener(server.url, Keys(prefix))
    server.stop()
    wait_for("the lost connection", lambda: listener.liveness.failing >= 1)
    listener.close()
    assert not listener._thread.is_alive()


def test_a_listener_that_cannot_subscribe_in_the_outage_window_raises():
    with pytest.raises(redis.ConnectionError, match="cannot subscribe"):
        CancelListener("redis://127.0.0.1:1/0", Keys("x"), outage_s=0.5)
