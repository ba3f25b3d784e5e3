"""The janitor loop: deadlines, dead workers and expired leases.

It ends live requests past their deadline (TIMED_OUT, in any state; a worker running one drops
it at its next step, told on the cancel channel) when the earliest deadline comes: it sleeps
until then, and is poked when a request with a deadline is submitted or an operator moves one,
so an idle scheduler does not poll Redis (on a shared machine its polling took CPU from the
model). A submitted deadline no earlier than the end of the sleep under way changes nothing
(the sweep at its end sees it), so a burst of submits does not sweep once per request. Every
quarter of `worker_timeout_s` it reads every worker's heartbeat and reaps those it has itself
seen silent for worker_timeout_s of unbroken observation (`scheduler.policies.liveness`: a Redis
outage, a slow read or a restart starts the observation over, so workers that could not beat are
not taken for dead); their attempts are lost: back to the queue under a new epoch (or FAILED
past max_lost_attempts). Once its observation has run unbroken that long it also requeues
requests whose prefill lease expired. All of it is Redis scripts, so a restarted scheduler
simply carries on. A failed round is logged and retried after a backoff; the loop never dies
of Redis.
"""

import asyncio
import logging
import time
from collections.abc import Callable

from pdq.observability import metrics
from pdq.state import redisconn
from pdq.config import SchedulerConfig
from pdq.observability.liveness import Liveness
from pdq.state.registry import forget, heartbeats
from pdq.state.store import Deposed, AsyncStore, now_ms
from scheduler.leader import Leadership, Sole
from scheduler.policies import HeartbeatWatch

log = logging.getLogger("pdq.scheduler")

# Longest sleep between sweeps: a deadline set without a poke (another scheduler's submit)
# is still enforced within this.
MAX_SLEEP_S = 1.0
MIN_SLEEP_S = 0.005  # a due deadline the sweep could not end (Redis trouble) is retried this often, not in a spin


def sleep_s(next_deadline_ms: int | None, now_ms_: int, until_reap_s: float) -> float:
    """How long the janitor may sleep: until the earliest deadline, the next reap or MAX_SLEEP_S,
    whichever comes first (at least MIN_SLEEP_S)."""
    wait = min(MAX_SLEEP_S, until_reap_s)
    if next_deadline_ms is not None:
        wait = min(wait, (next_deadline_ms - now_ms_) / 1000)
    return max(MIN_SLEEP_S, wait)


class Janitor:
    def __init__(self, config: SchedulerConfig, store: AsyncStore, on_requeue: Callable[[], None],
                 leader: Leadership | Sole | None = None):
        self.config = config
        self.store = store
        self.leader = leader or Sole()  # it sweeps only while this leads; its epoch fences the sweeps
        self.on_requeue = on_requeue  # wakes the dispatcher
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._poke = asyncio.Event()
        self._last_reap = 0.0
        self._wake_ms: int | None = None  # when the sleep under way ends (Unix ms); None: not sleeping
        self.watch = HeartbeatWatch(config.worker_timeout_s, config.worker_timeout_s / 2)
        self.reaps = 0  # reap rounds done (tests wait on it)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="janitor")

    async def stop(self) -> None:
        self._stopping.set()
        if self._task:
            await self._task

    def lead(self) -> None:
        """This scheduler took the lease: observe the workers afresh (a standby saw none of their
        heartbeats) and sweep at once."""
        self.watch = HeartbeatWatch(self.config.worker_timeout_s, self.config.worker_timeout_s / 2)
        self._last_reap = 0.0
        self._poke.set()

    def poke(self, deadline_ms: int = 0) -> None:
        """A deadline was set or moved: look again (it may be earlier than the one slept for).
        deadline_ms: the new deadline, when known (a submit); 0: unknown (an operator moved one)."""
        if deadline_ms and self._wake_ms is not None and deadline_ms >= self._wake_ms:
            return  # the sweep at the end of this sleep sees it
        self._poke.set()

    async def _loop(self) -> None:
        live = Liveness("janitor")
        try:
            await self._rounds(live)
        finally:
            live.stopped()

    async def _rounds(self, live: Liveness) -> None:
        while not self._stopping.is_set():
            self._poke.clear()
            try:
                if self.leader.leading:
                    await self.sweep()
                    until_reap = self._last_reap + self.config.worker_timeout_s / 4 - time.monotonic()
                    wait = sleep_s(await self.store.next_deadline_ms(), now_ms(), until_reap)
                else:  # on standby: taking the lease pokes it
                    wait = MAX_SLEEP_S
                live.beat()
            except Deposed:  # another scheduler leads: it sweeps
                self.leader.deposed()
                wait = MAX_SLEEP_S
            except Exception as exc:  # keep sweeping; Redis may come back
                if not redisconn.unavailable(exc):
                    log.exception("janitor sweep failed")
                wait = max(MIN_SLEEP_S, redisconn.backoff_s(live.error(exc)))
            if self._poke.is_set():
                continue
            stop, poke = asyncio.ensure_future(self._stopping.wait()), asyncio.ensure_future(self._poke.wait())
            self._wake_ms = now_ms() + int(wait * 1000)
            try:
                await asyncio.wait((stop, poke), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._wake_ms = None
                stop.cancel()
                poke.cancel()

    async def sweep(self) -> None:
        """One pass: deadlines always, workers and leases when their period has come."""
        while True:
            due = await self.store.expire_deadlines(256, fence=self.leader.epoch)
            metrics.TIMEOUTS.labels("scheduler").inc(due)
            if due < 256:
                break
        now = time.monotonic()
        if now - self._last_reap >= self.config.worker_timeout_s / 4:
            self._last_reap = now
            await self.reap()

    async def reap(self) -> tuple[int, int]:
        """Requeues the attempts of dead workers and, once its observation has settled, of
        expired prefill leases. -> (requeued, failed)"""
        client, keys, attempts = self.store.client, self.store.keys, self.config.max_attempts
        requeued = failed = 0
        beats = await heartbeats(client, keys)
        dead = self.watch.observe(time.monotonic(), {w: hb for w, (_, hb) in beats.items()},
                                  redisconn.OUTAGES.last_failure)
        for wid in dead:
            role = beats[wid][0]
            r, f = await self.store.reap_worker(wid, attempts, fence=self.leader.epoch)
            metrics.REQUEUES.labels("worker_lost", "QUEUED").inc(r)
            metrics.REQUEUES.labels("worker_lost", "FAILED").inc(f)
            await forget(client, keys, wid, role)
            self.watch.forget(wid)
            log.warning("%s worker %s stopped heartbeating: %d request(s) requeued, %d failed", role, wid, r, f)
            requeued, failed = requeued + r, failed + f
        while self.watch.settled(time.monotonic()):
            r, f = await self.store.expire_leases(attempts, 256, fence=self.leader.epoch)
            metrics.REQUEUES.labels("lease_expired", "QUEUED").inc(r)
            metrics.REQUEUES.labels("lease_expired", "FAILED").inc(f)
            if r or f:
                log.warning("prefill lease expired: %d request(s) requeued, %d failed", r, f)
            requeued, failed = requeued + r, failed + f
            if r + f < 256:
                break
        self.reaps += 1
        if requeued:
            self.on_requeue()
        return requeued, failed
