"""A worker's ears for requests that end or change elsewhere: the cancel and deadline channels.

Pub/sub keeps nothing for an absent subscriber, so the listener counts its gaps and a model loop
that sees a new one reads back the records of what it holds (`CancelListener.catch_up`).
"""

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdq.state import redisconn
from pdq.state.keys import Keys
from pdq.observability.liveness import Liveness
from pdq.state.request import TERMINAL
from pdq.state.store import SyncStore

log = logging.getLogger("pdq.worker")


class CancelListener:
    """Follows the cancel and deadline channels in a thread of its own: `ended` holds ids of
    requests that just ended (cancelled, timed out, finished elsewhere), so a model loop can drop
    them at its next step; `deadlines` holds deadlines an operator moved, for `deadline()`.

    The thread rides Redis failures: a dropped connection is logged (once per streak), backed off
    and subscribed again. Pub/sub keeps nothing for an absent subscriber, so after every
    resubscribe `gaps` goes up, and a model loop that sees it change calls `catch_up` with the
    requests it holds: their state and deadline are read back from their records, as if the
    messages of the gap had been heard."""

    def __init__(self, redis_url: str, keys: Keys, outage_s: float = redisconn.DEFAULT_OUTAGE_S):
        """Returns once subscribed; raises redis.ConnectionError if that takes longer than outage_s."""
        # no retries of its own: a broken connection must surface here, to be followed by a catch-up.
        # Named (CLIENT LIST) after this process, so an operator or a drill can find it.
        # With a Sentinel URL, each subscription asks the Sentinels for the primary: after a
        # failover the listener subscribes on the new one.
        self.client = redis.Redis.from_pool(redisconn.pool(
            redis_url, retry=Retry(NoBackoff(), 0), client_name=f"pdq-cancels-{os.getpid()}",
            socket_connect_timeout=redisconn.CONNECT_TIMEOUT_S, socket_keepalive=True,
            health_check_interval=redisconn.HEALTH_CHECK_INTERVAL_S))
        self.channel = keys.cancel_channel
        self.deadline_channel = keys.deadline_channel
        self.ended: set[str] = set()
        self.deadlines: dict[str, int] = {}  # rid -> deadline (Unix ms) set by an operator
        self.gaps = 0  # resubscriptions after a lost connection
        self.subscribed = threading.Event()  # set while subscribed
        self.liveness = Liveness("cancel-listener")
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._was_subscribed = False
        self._thread = threading.Thread(target=self._main, name="cancel-listener", daemon=True)
        self._thread.start()
        if not self.subscribed.wait(outage_s):
            self.close()
            raise redis.ConnectionError(f"cannot subscribe to {self.channel} within {outage_s:g} s")

    def _main(self) -> None:
        try:
            while not self._closed.is_set():
                pubsub = self.client.pubsub()
                try:
                    self._listen(pubsub)
                except Exception as exc:
                    if self._closed.is_set():
                        return
                    self.subscribed.clear()
                    self._closed.wait(redisconn.backoff_s(self.liveness.error(exc)))
                finally:
                    try:
                        pubsub.close()
                    except Exception:
                        pass
        finally:
            self.liveness.stopped()

    def _listen(self, pubsub: Any) -> None:
        """Subscribes, then hands messages on until closed (returns) or the connection fails (raises)."""
        pubsub.subscribe(self.channel, self.deadline_channel)
        confirmed = 0
        while confirmed < 2:  # both subscriptions are in force once Redis confirmed them
            message = pubsub.get_message(timeout=1.0)
            if self._closed.is_set():
                return
            if message is not None:
                confirmed += message["type"] == "subscribe"
                self._handle(message)
        if self._was_subscribed:
            self.gaps += 1  # after the confirmations: what a catch-up reads covers the gap
            log.warning("cancel listener subscribed again; model loops catch up on the requests they hold")
        self._was_subscribed = True
        self.subscribed.set()
        self.liveness.beat()
        while not self._closed.is_set():
            message = pubsub.get_message(timeout=1.0)  # a message wakes it at once; close() sends one
            if message is not None:
                self._handle(message)
            self.liveness.beat()

    def _handle(self, message: dict) -> None:
        if message["type"] != "message":
            return
        channel, data = message["channel"].decode(), message["data"].decode()
        if channel == self.channel:
            if data:  # "": a listener's close() waking its thread
                self._on_ended(data)
        elif channel == self.deadline_channel:
            rid, _, deadline = data.partition(" ")
            self.note_deadline(rid, int(deadline))

    def _on_ended(self, rid: str) -> None:
        with self._lock:
            self.ended.add(rid)
            self.deadlines.pop(rid, None)
            if len(self.ended) > 100_000:  # ids of requests we never held; bound the memory
                self.ended.clear()

    def note_deadline(self, rid: str, deadline: int) -> None:
        """A deadline heard on the channel or read from the request's record: `deadline(rid)`
        answers it from now on."""
        with self._lock:
            if len(self.deadlines) > 100_000:
                self.deadlines.clear()
            self.deadlines[rid] = deadline

    def catch_up(self, store: SyncStore, held: list[tuple[str, int]]) -> None:
        """After a gap (`gaps` changed; read it before calling): reads the state, epoch and
        deadline of each held (request id, epoch) in one round trip, and notes as ended those
        that ended or moved on to another attempt, and the deadlines of the rest, as the
        messages missed would have. Called from a model loop, with its store's client."""
        if not held:
            return
        pipe = store.client.pipeline(transaction=False)
        for rid, _ in held:
            pipe.hmget(store.keys.request(rid), "state", "epoch", "deadline_ms")
        rows = pipe.execute()
        terminal = {state.value for state in TERMINAL}
        for (rid, epoch), (state, record_epoch, deadline) in zip(held, rows):
            if state is None or state.decode() in terminal or int(record_epoch or 0) != epoch:
                self._on_ended(rid)
            elif deadline is not None:
                self.note_deadline(rid, int(deadline))

    def caught_up(self, seen: int, store: SyncStore, held: Callable[[], list[tuple[str, int]]]) -> int:
        """`catch_up` on `held()` if the listener had a gap since `seen` (the count of gaps the
        calling model loop caught up on). -> that count now."""
        gaps = self.gaps
        if gaps != seen:
            self.catch_up(store, held())
        return gaps

    def reread_deadlines(self, store: SyncStore, rids: list[str]) -> list[int]:
        """The deadlines (Unix ms, 0 = none) the records of `rids` hold now, in one round trip
        (none for no rids), noted as if heard. A model loop calls it before it times requests
        out: an operator may have moved a deadline and the notice missed this listener."""
        if not rids:
            return []
        deadlines = store.deadlines(rids)
        for rid, deadline in zip(rids, deadlines):
            self.note_deadline(rid, deadline)
        return deadlines

    def deadline(self, rid: str, given_ms: int) -> int:
        """The request's deadline (Unix ms, 0 = none): the latest an operator set, else `given_ms`."""
        return self.deadlines.get(rid, given_ms)

    def pop(self, rid: str) -> bool:
        """True (once) when rid has ended since it was last asked about."""
        with self._lock:
            if rid in self.ended:
                self.ended.discard(rid)
                return True
            return False

    def close(self) -> None:
        """Stops the thread: at once while it backs off, else when the wake-up message below
        reaches it (or its 1 s poll ends); waits at most 2 s (the thread is a daemon)."""
        self._closed.set()
        try:
            self.client.publish(self.channel, "")
        except (redis.RedisError, OSError):
            pass
        self._thread.join(timeout=2)
        self.client.close()
