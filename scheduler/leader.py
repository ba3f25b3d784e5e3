"""Which scheduler dispatches: one at a time, under a lease in Redis with a fencing epoch.

Every scheduler replica serves Submit and Cancel (each an atomic script: any replica will do).
One of them leads: only it runs dispatch rounds and janitor sweeps, and their writes (CLAIM,
the deadline sweep, reaping workers, expiring leases) carry its epoch. A script refuses a write
whose epoch is no longer the latest (`pdq.state.store.Deposed`), so a scheduler that lost its lease
while paused or cut off from Redis cannot claim or reap after another took over.

The leader renews its lease every quarter of `leader_lease_s`; standbys try to take it as often.
A leader that dies is replaced within about 1.25 leases; one that stops resigns, and a standby
takes over at its next try. A scheduler restarted under the same id (`--scheduler-id`) takes its
own lease back at once. A leader that cannot renew stops leading on its own clock when the lease
it last renewed runs out, before any standby can take it.
"""

import asyncio
import logging
import time
from collections.abc import Callable

from pdq.observability import metrics
from pdq.state import redisconn
from pdq.observability.liveness import Liveness
from pdq.state.store import AsyncStore

log = logging.getLogger("pdq.scheduler")


class Leadership:
    """This scheduler's side of the election. `leading` and `epoch` are read by the dispatch
    loop and the janitor before each round; `on_change(leading)` is called on every change."""

    def __init__(self, store: AsyncStore, scheduler_id: str, lease_s: float,
                 on_change: Callable[[bool], None] = lambda leading: None):
        self.store = store
        self.id = scheduler_id
        self.lease_s = lease_s
        self.on_change = on_change
        self.epoch = 0  # the epoch it leads under; 0 on standby
        self.holder = ""  # who holds the lease, as last read
        self._until = 0.0  # monotonic time its lease runs out, as renewed last
        self._told = False  # what on_change said last
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def leading(self) -> bool:
        return self.epoch > 0 and time.monotonic() < self._until

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="leadership")

    async def stop(self) -> None:
        """Stops trying and, when leading, resigns so that a standby takes over at once."""
        self._stopping.set()
        if self._task:
            await self._task
        if self.epoch:
            try:
                await self.store.resign(self.id)
            except Exception as exc:  # Redis is away: the lease runs out on its own
                log.warning("could not resign the dispatch lease: %s", exc)
            self._set(0)

    def deposed(self) -> None:
        """A write under this scheduler's epoch was refused: it no longer leads."""
        if self.epoch:
            log.warning("scheduler %s deposed (epoch %d): another scheduler leads", self.id, self.epoch)
            self._set(0)

    async def try_lead(self) -> bool:
        """One round: takes or renews the lease. -> whether this scheduler leads now."""
        sent = time.monotonic()
        epoch, self.holder = await self.store.lead(self.id, int(self.lease_s * 1000))
        if epoch:
            self._until = sent + self.lease_s  # Redis counts the lease from later than `sent`
        if epoch != self.epoch:
            if epoch:
                log.info("scheduler %s leads (epoch %d)", self.id, epoch)
            elif self.epoch:
                log.warning("scheduler %s lost the dispatch lease to %s", self.id, self.holder)
            self._set(epoch)
        return bool(epoch)

    def _set(self, epoch: int) -> None:
        self.epoch = epoch
        metrics.SCHEDULER_LEADER.set(1 if epoch else 0)
        if bool(epoch) != self._told:
            self._told = bool(epoch)
            self.on_change(self._told)

    async def _loop(self) -> None:
        live = Liveness("leadership")
        period = self.lease_s / 4
        try:
            while not self._stopping.is_set():
                try:
                    await self.try_lead()
                    live.beat()
                    wait = period
                except Exception as exc:  # Redis away: keep trying; stop leading when the lease runs out
                    if not redisconn.unavailable(exc):
                        log.exception("dispatch lease round failed")
                    wait = min(period, redisconn.backoff_s(live.error(exc)))
                if self.epoch and not self.leading:  # not renewed in time: a standby may hold it now
                    log.warning("scheduler %s could not renew the dispatch lease in time", self.id)
                    self._set(0)
                try:
                    await asyncio.wait_for(self._stopping.wait(), wait)
                except asyncio.TimeoutError:
                    pass
        finally:
            live.stopped()


class Sole:
    """No election, for a dispatcher or janitor used on its own (tests, tools): it always
    leads, and its writes are unfenced (epoch 0)."""

    epoch = 0
    leading = True

    def deposed(self) -> None:
        pass
