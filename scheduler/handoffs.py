"""The dispatcher's record of KV hand-offs: counts each finished batch's hand-offs per worker in
Redis (HANDOFFS in `pdq.keys`) and quarantines a worker whose hand-offs keep failing (QUARANTINE),
as `scheduler.policies.retry.Quarantine` decides. Quarantines live in Redis, so every scheduler
respects them and the Operator API lists them.

On the fault-free path it costs nothing: a batch whose hand-offs all succeeded, between workers
with no failure streak (as last read from the registry or from HANDOFFS), is not sent to Redis.
"""

import logging

from pdq.config import SchedulerConfig
from pdq.registry import WorkerInfo
from pdq.store import RequestStore, now_ms
from scheduler.policies import Quarantine

log = logging.getLogger("pdq.scheduler")


class HandoffHealth:
    def __init__(self, config: SchedulerConfig, store: RequestStore):
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
