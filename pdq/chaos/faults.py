"""The fault injector: runs the seeded fault schedule (`plan.plan_faults`) against the cluster.

Faults strike one at a time, in schedule order, each among requests in flight:

- before fault k, the injector waits until the cluster is up and SERVING again after the
  previous fault (if k takes something down: so at every moment at least one worker of each
  role is healthy, and a request that FAILS is one a healthy worker could have served); then
  fault k is *ready*;
- the load does not start request `trigger` of fault k before fault k is ready (`wait_ready`),
  so a slow heal slows the load down instead of letting faults pile up at its end;
- fault k strikes once `lead` more requests have started (the concurrency: the cluster is busy
  again), or as soon as the load waits for the next fault to be ready.

So every fault lands among requests in flight, however fast or slow the machine is.

- kill_prefill / kill_decode / kill_gateway: SIGKILL, then a restart under the same id and
  ports after `delay_s`;
- kill_scheduler: SIGKILL of the leading scheduler; once the standby leads (its takeover time
  noted), a restart under the same id and port after `delay_s` (as a standby);
- redis_restart: SIGKILL of Redis, down `delay_s`, restarted on its AOF;
- conn_drop: CLIENT KILL TYPE normal and TYPE pubsub: every client connection dropped, Redis up;
- kv_corrupt: SIGUSR1 to a SERVING prefill worker, whose next KV hand-off is corrupted
  (`pdq.ops.faults`, PDQ_FAULTS=kv_corrupt_on_signal).
"""

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from pdq.chaos.cluster import HOST, ChaosCluster, Role
from pdq.chaos.plan import FaultPlan

log = logging.getLogger("pdq.chaos")

HEAL_TIMEOUT_S = 180.0  # a role not SERVING this long after its restart is reported, and the run goes on


@dataclass
class Struck:
    """A fault as it happened."""

    kind: str
    target: str  # the process it hit
    trigger: int
    t: float  # when it struck (seconds since the run started)
    restarted_t: float = 0.0  # kills: when the process was started again
    healed_t: float = 0.0  # when the whole cluster was SERVING again (0 = not seen)
    in_flight: int = 0  # requests of the load in flight when it struck
    took_over_s: float = 0.0  # kill_scheduler of the leader: seconds until another scheduler led (0: none did)
    detail: str = ""


@dataclass
class Injector:
    cluster: ChaosCluster
    schedule: list[FaultPlan]  # in trigger order
    clock: object  # seconds since the run started
    lead: int = 1  # requests started after a fault is ready before it strikes (the load's concurrency)
    struck: list[Struck] = field(default_factory=list)
    unhealed: list[str] = field(default_factory=list)  # faults after which the cluster did not come back
    started: int = 0  # requests the load has started
    ready: int = -1  # the fault (index in schedule) waiting to strike; every one before it struck
    load_waits_for: int = -1  # the fault the load waits for to be ready (-1 = it does not wait)
    in_flight: Callable[[], int] = lambda: 0  # the load's requests in flight now (set by the load)
    _progress: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def note_started(self, n: int) -> None:
        async with self._progress:
            self.started = n
            self._progress.notify_all()

    async def wait_ready(self, n: int) -> None:
        """Returns once every fault whose trigger is at most n is ready or struck (the load calls
        it before starting request n)."""
        due = sum(f.trigger <= n for f in self.schedule) - 1
        async with self._progress:
            if self.ready >= due:
                return
            self.load_waits_for = due
            self._progress.notify_all()
            try:
                await self._progress.wait_for(lambda: self.ready >= due)
            finally:
                self.load_waits_for = -1

    async def run(self) -> None:
        """Strikes every fault; a failure of the injector itself is noted (`unhealed`), and the
        load is never left waiting for it."""
        try:
            for k, fault in enumerate(self.schedule):
                if fault.kind != "kv_corrupt":
                    await self._heal()
                async with self._progress:
                    self.ready = k
                    self._progress.notify_all()
                    await self._progress.wait_for(lambda: self.started >= fault.trigger + self.lead
                                                  or self.load_waits_for > k)
                in_flight = self.in_flight()
                struck = await self._strike(fault)
                struck.in_flight = in_flight
                self.struck.append(struck)
                if struck.restarted_t or fault.kind == "redis_restart":
                    asyncio.create_task(self._note_healed(struck))
        except Exception as exc:  # a harness failure: reported, and the run goes on without the rest
            log.exception("the fault injector failed")
            self.unhealed.append(f"the fault injector failed after {len(self.struck)} fault(s): {exc!r}")
        finally:
            async with self._progress:
                self.ready = len(self.schedule)
                self._progress.notify_all()
        await self._heal()

    async def finish(self) -> None:
        """Every fault struck (the rest at once, if the load ended first), and the cluster back up."""
        await self.note_started(1 << 62)

    async def _heal(self) -> None:
        if not await self.cluster.wait_serving(HEAL_TIMEOUT_S):
            down = [r.name for r in self.cluster.everything if not r.alive() or not await r.serving()]
            self.unhealed.append(f"t={self.clock():.1f}s: not SERVING {HEAL_TIMEOUT_S:.0f}s after the last fault: "
                                 + ", ".join(down))

    async def _note_healed(self, struck: Struck) -> None:
        if await self.cluster.wait_serving(HEAL_TIMEOUT_S):
            struck.healed_t = round(self.clock(), 2)

    async def _strike(self, fault: FaultPlan) -> Struck:
        kind = fault.kind
        if kind == "kill_scheduler" and len(self.cluster.of_role("scheduler")) > 1:
            return await self._kill_leader(fault)
        if kind.startswith("kill_"):
            role = kind.removeprefix("kill_")
            targets = self.cluster.of_role(role)
            return await self._kill(targets[fault.target % len(targets)], fault)
        if kind == "redis_restart":
            return await self._kill(self.cluster.redis, fault)
        if kind == "conn_drop":
            return await self._drop_connections(fault)
        if kind == "kv_corrupt":
            return await self._corrupt(fault)
        raise ValueError(f"unknown fault {kind!r}")

    async def _kill(self, role: Role, fault: FaultPlan) -> Struck:
        struck = Struck(fault.kind, role.name, fault.trigger, round(self.clock(), 2))
        await role.kill()
        await asyncio.sleep(fault.delay_s)
        role.start(self.clock())  # on the event loop's thread: see pdq.chaos.cluster
        struck.restarted_t = round(self.clock(), 2)
        struck.detail = f"down {struck.restarted_t - struck.t:.2f}s"
        return struck

    async def _kill_leader(self, fault: FaultPlan) -> Struck:
        """SIGKILL of the scheduler that leads; its restart waits until a standby leads."""
        schedulers = self.cluster.of_role("scheduler")
        held = await self.cluster.leader()
        role = next((r for r in schedulers if f"chaos-{r.name}" == held), schedulers[fault.target % len(schedulers)])
        struck = Struck(fault.kind, role.name, fault.trigger, round(self.clock(), 2))
        await role.kill()
        give_up = self.clock() + HEAL_TIMEOUT_S
        while (now := await self.cluster.leader()) in ("", held) and self.clock() < give_up:
            await asyncio.sleep(0.05)
        took_over = self.clock() - struck.t
        await asyncio.sleep(fault.delay_s)
        role.start(self.clock())
        struck.restarted_t = round(self.clock(), 2)
        if now in ("", held):
            self.unhealed.append(f"t={struck.t:.1f}s: no other scheduler led within {HEAL_TIMEOUT_S:.0f}s "
                                 f"of the leader's death")
        if now not in ("", held):
            struck.took_over_s = round(took_over, 2)
        struck.detail = f"the leader ({held or 'none'}); {now} led {took_over:.2f}s later"
        return struck

    async def _drop_connections(self, fault: FaultPlan) -> Struck:
        struck = Struck(fault.kind, "redis", fault.trigger, round(self.clock(), 2))
        client = aioredis.Redis(host=HOST, port=self.cluster.redis.port)
        try:  # SKIPME yes (the default): this connection stays
            normal = await client.execute_command("CLIENT", "KILL", "TYPE", "normal")
            pubsub = await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            struck.detail = f"{normal} normal and {pubsub} pubsub connections dropped"
        finally:
            await client.aclose()
        return struck

    async def _corrupt(self, fault: FaultPlan) -> Struck:
        """SIGUSR1 to the planned prefill worker, or the other one if the planned one is not
        SERVING (a worker still starting has no handler yet: the signal would kill it)."""
        workers = self.cluster.of_role("prefill")
        order = workers[fault.target % len(workers):] + workers[:fault.target % len(workers)]
        give_up = self.clock() + HEAL_TIMEOUT_S
        while self.clock() < give_up:
            for role in order:
                if not role.down and role.alive() and await role.serving():
                    os.kill(role.pid, signal.SIGUSR1)
                    return Struck(fault.kind, role.name, fault.trigger, round(self.clock(), 2),
                                  detail="its next KV hand-off is corrupted")
            await asyncio.sleep(0.1)
        raise RuntimeError(f"no prefill worker SERVING for {HEAL_TIMEOUT_S:.0f}s: cannot corrupt a hand-off")
