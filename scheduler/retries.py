"""What the dispatcher does when a prefill batch comes back: the IO of retries.

`BatchOutcome` sorts a batch's items (`scheduler.policies.retry.classify`): hand-offs that worked
or failed, the request's own failures, attempts lost to infrastructure. `Retries.settle` then
counts the hand-offs per worker (HANDOFFS in `pdq.state.keys`), quarantines a worker whose hand-offs
keep failing (QUARANTINE; `Quarantine` decides), and gives each failed attempt back (REQUEUE:
a failure is held back and avoids its workers next time; a lost attempt is bounded apart).
Quarantines live in Redis, so every scheduler respects them and the Operator API lists them.

On the fault-free path it costs nothing: a batch whose hand-offs all succeeded, between workers
with no failure streak (as last read from the registry or from HANDOFFS), is not sent to Redis.
"""

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pdq.observability import metrics, telemetry
from pdq.config import SchedulerConfig
from pdq.state.registry import WorkerInfo
from pdq.state.ending import LOST
from pdq.state.store import AsyncStore, now_ms
from pdq.v1 import internal_pb2 as pb
from scheduler.policies import DecodeSlots, Quarantine, classify

log = logging.getLogger("pdq.scheduler")


@dataclass
class BatchOutcome:
    """A finished prefill batch, sorted: `failed` request -> (kind, error); `handoffs`: (prefill
    worker id, decode worker id, ok, error) of each item that reached its KV hand-off."""

    batch: pb.PrefillBatch
    reserved: list[DecodeSlots]  # the decode worker of each item, in order
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)
    handoffs: list[tuple[str, str, bool, str]] = field(default_factory=list)

    @classmethod
    def of(cls, batch: pb.PrefillBatch, reserved: list[DecodeSlots], worker_id: str,
           result: pb.PrefillBatchResult) -> "BatchOutcome":
        """The worker's answer: each failed item classified by what it said."""
        out = cls(batch, reserved)
        decode_of = {it.spec.request_id: dw.worker_id for it, dw in zip(batch.items, reserved)}
        for r in result.results:
            kind, handoff = classify(r.failure, r.error) if not r.ok else ("", True)
            if handoff and r.request_id in decode_of:
                out.handoffs.append((worker_id, decode_of[r.request_id], r.ok, r.error))
            if not r.ok:
                out.failed[r.request_id] = (kind, r.error)
        return out

    @classmethod
    def lost(cls, batch: pb.PrefillBatch, reserved: list[DecodeSlots], error: str) -> "BatchOutcome":
        """The call did not reach its worker, or nobody can tell what it did: every attempt lost."""
        return cls(batch, reserved, {it.spec.request_id: (LOST, error) for it in batch.items})


class Retries:
    def __init__(self, config: SchedulerConfig, store: AsyncStore,
                 release: Callable[[DecodeSlots, str], Awaitable[None]]):
        self.config = config
        self.store = store
        self.release = release  # frees a request's decode reservation
        self.handoffs = HandoffHealth(config, store)

    async def settle(self, outcome: BatchOutcome, live: dict[str, list[WorkerInfo]]) -> list[str]:
        """Records the batch's hand-offs and gives its failed attempts back; `live`: the registry
        as last read. -> the requests put back in the queue."""
        requeued = []
        for item, dw in zip(outcome.batch.items, outcome.reserved):
            if item.spec.request_id in outcome.failed:
                kind, error = outcome.failed[item.spec.request_id]
                if await self.give_back(item, dw, kind, error) == "QUEUED":
                    requeued.append(item.spec.request_id)
        if outcome.handoffs:
            try:
                await self.handoffs.record(outcome.batch.batch_id, outcome.handoffs, live)
            except Exception as exc:  # Redis gone: these hand-offs go uncounted
                log.warning("batch %s: could not count its KV hand-offs: %s", outcome.batch.batch_id, exc)
        return requeued

    async def give_back(self, item: pb.PrefillItem, dw: DecodeSlots, kind: str, error: str) -> str | None:
        """Releases a failed attempt's decode reservation and gives the attempt back (REQUEUE).
        -> the request's state after (None: stale)."""
        rid = item.spec.request_id
        log.warning("request %s attempt %d %s: %s", rid, item.epoch, "lost" if kind == LOST else "failed", error)
        await self.release(dw, rid)
        state = await self.store.requeue(rid, item.epoch, error, self.config.max_attempts, kind)
        metrics.REQUEUES.labels("prefill" if kind != LOST else "prefill_lost", state or "stale").inc()
        telemetry.end(telemetry.start("pdq.requeue", item.spec.traceparent,
                                      attributes={"pdq.request_id": rid, "pdq.attempt": item.epoch}),
                      "requeued" if state == "QUEUED" else "failed", error,
                      event_attributes={"pdq.state": state or "stale", "pdq.error": error, "pdq.requeue.kind": kind})
        return state


class HandoffHealth:
    def __init__(self, config: SchedulerConfig, store: AsyncStore):
        self.store = store
        self.policy = Quarantine(config.quarantine_after, int(config.quarantine_s * 1000),
                                 int(config.quarantine_max_s * 1000))
        self.streaks: dict[str, int] = {}  # worker -> its failed hand-offs in a row, as last read

    def seen(self, workers: list[WorkerInfo]) -> None:
        """Workers as just read from the registry (their streaks)."""
        for w in workers:
            self.streaks[w.worker_id] = w.handoff_streak

    async def record(self, event: str, handoffs: list[tuple[str, str, bool, str]],
                     live: dict[str, list[WorkerInfo]]) -> None:
        """Counts a batch's hand-offs: (prefill worker id, decode worker id, ok, error) each;
        `event` names the batch (a replay is not counted twice); `live`: the registry as last
        read. Quarantines the workers the policy picks."""
        pairs: list[tuple[str, str, bool]] = []
        errors: dict[str, str] = {}
        for prefill, decode, ok, error in handoffs:
            pairs += [(prefill, decode, ok), (decode, prefill, ok)]
            if not ok:
                errors[prefill] = errors[decode] = error
        if all(ok and not self.streaks.get(w) for w, _, ok in pairs):
            return
        records = await self.store.handoffs(event, pairs)
        now = now_ms()
        roles = {w.worker_id: role for role, workers in live.items() for w in workers}
        benched: set[str] = set()  # quarantined by this call
        for rec in records:
            self.streaks[rec.worker_id] = rec.streak
            role = roles.get(rec.worker_id)
            if rec.until_ms > now or role is None:
                continue
            others = sum(1 for w in live[role] if w.worker_id != rec.worker_id and w.worker_id not in benched
                         and not w.draining and not w.quarantined(now))
            ms = self.policy.duration_ms(rec.streak, rec.peers, rec.times, others)
            if ms is None:
                continue
            reason = (f"{rec.streak} KV hand-offs in a row failed, with {rec.peers} different workers; "
                      f"the last: {errors.get(rec.worker_id, '?')}")
            if await self.store.quarantine(rec.worker_id, now + ms, reason, rec.times):
                benched.add(rec.worker_id)
                self.streaks[rec.worker_id] = 0
                log.warning("%s worker %s quarantined for %.0f s: %s", role, rec.worker_id, ms / 1000, reason)
