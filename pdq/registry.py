"""Worker registry in Redis: workers heartbeat their facts; the scheduler reads who is alive.

A worker is alive while its last heartbeat (its score in `p:workers:{role}`) is younger than the
scheduler's worker timeout. An operator drain (`set_drained`) is kept apart from the worker's own
facts, so its heartbeats cannot undo it. A worker that leaves (`deregister`) is marked draining and stays
listed until that timeout passes, so it can finish its running requests; then the scheduler
reaps it: whatever it still holds goes back to the queue (`RequestStore.reap_worker`).
"""

from dataclasses import dataclass
from typing import Any

from pdq.keys import Keys
from pdq.store import RequestStore, _str, _then, now_ms


ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # "prefill" | "decode"
    address: str  # host:port reachable from other hosts
    free_slots: int = 0
    capacity: int = 0
    running: int = 0
    draining: bool = False
    heartbeat_ms: int = 0


def heartbeat(store: RequestStore, info: WorkerInfo, ttl_s: float) -> Any:
    """Registers or refreshes a worker (sync or async store), in one round trip, and tells the
    scheduler on the heartbeat channel while requests are queued (a heartbeat on change is how
    it learns that a slot is free). Entries expire after ttl_s."""
    return store.heartbeat(info.worker_id, info.role, int(ttl_s * 1000),
                           {"role": info.role, "address": info.address, "free_slots": info.free_slots,
                            "capacity": info.capacity, "running": info.running, "draining": int(info.draining)})


def deregister(client: Any, keys: Keys, worker_id: str, role: str) -> Any:
    """Takes no new work from now on (draining); the entry goes when the scheduler reaps it."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.worker(worker_id), "draining", 1)
    pipe.expire(keys.worker(worker_id), 60)  # never a key without expiry, even if it had lapsed
    return pipe.execute()


def dead_workers(client: Any, keys: Keys, role: str, timeout_s: float) -> Any:
    """Ids of workers of `role` whose last heartbeat is older than timeout_s."""
    cutoff = now_ms() - int(timeout_s * 1000)
    return _then(client.zrangebyscore(keys.workers(role), "-inf", f"({cutoff}"), lambda ids: [_str(i) for i in ids])


def forget(client: Any, keys: Keys, worker_id: str, role: str) -> Any:
    """Removes a reaped worker from the registry (and ends an operator drain of it)."""
    pipe = client.pipeline(transaction=True)
    pipe.zrem(keys.workers(role), worker_id)
    pipe.delete(keys.worker(worker_id))
    pipe.srem(keys.drained, worker_id)
    return pipe.execute()


def set_drained(client: Any, keys: Keys, worker_id: str, drained: bool) -> Any:
    """An operator drains (or undrains) a worker: while drained it gets no new work and
    finishes what it runs. Kept until undrained or the worker is reaped."""
    return (client.sadd if drained else client.srem)(keys.drained, worker_id)


def live_workers(store: RequestStore, roles: tuple[str, ...], timeout_s: float) -> Any:
    """The workers of each of `roles` that sent a heartbeat within timeout_s, in one round trip
    (async store). -> {role: [WorkerInfo]}"""
    def parse(got: tuple[dict[str, list[tuple[str, dict[str, str]]]], set[str]]) -> dict[str, list[WorkerInfo]]:
        rows, drained = got
        return {role: [WorkerInfo(worker_id=wid, role=role, address=h["address"],
                                  free_slots=int(h.get("free_slots", 0)), capacity=int(h.get("capacity", 0)),
                                  running=int(h.get("running", 0)),
                                  draining=h.get("draining") == "1" or wid in drained,
                                  heartbeat_ms=int(h.get("heartbeat_ms", 0)))
                       for wid, h in rows[role] if "address" in h]
                for role in roles}
    return _then(store.workers(roles, now_ms() - int(timeout_s * 1000)), parse)
