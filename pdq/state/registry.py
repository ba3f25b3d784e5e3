"""Worker registry in Redis: workers heartbeat their facts; the scheduler reads who is alive.

A worker is listed while its last heartbeat (its score in `p:workers:{role}`) is younger than the
worker timeout. The scheduler's janitor reaps a worker only when it has itself seen no new
heartbeat of it for that long (`scheduler.policies.liveness`), so a Redis outage, which stops
every heartbeat, is not taken for dead workers. An operator drain (`set_drained`) is kept apart
from the worker's own facts, so its heartbeats cannot undo it; so is a quarantine (a worker whose
KV hand-offs keep failing, `p:health:{id}`, set by the scheduler). A worker that leaves
(`deregister`) is marked draining and stays listed until that timeout passes, so it can finish
its running requests; then the scheduler reaps it: whatever it still holds goes back to the
queue (`RequestStore.reap_worker`).
"""

from dataclasses import dataclass
from typing import Awaitable, overload

import redis.asyncio as aioredis

from pdq.state.keys import Keys
from pdq.state.calls import Call, mapped
from pdq.state.store import AsyncStore, Registry, RequestStore, SyncStore, _str, now_ms


ROLES = ("prefill", "decode")
# Cached-prefix hashes a heartbeat carries at most (`WorkerInfo.prefixes`), each the first
# PREFIX_HEX hex digits of a KV block's chain hash (64 bits: a collision only misplaces a request).
MAX_PREFIXES = 512
PREFIX_HEX = 16


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
    quarantined_until_ms: int = 0  # while in the future: quarantined (its hand-offs kept failing)
    quarantine_reason: str = ""
    handoff_streak: int = 0  # its failed KV hand-offs in a row
    kv_free_tokens: int = 0  # KV positions in free blocks
    kv_total_tokens: int = 0  # KV positions of the whole pool
    kv_block_size: int = 0
    reserved: int = 0  # decode: seats held (reserved or running)
    prefixes: tuple[str, ...] = ()  # short chain hashes of its cached KV blocks (`scheduler.policies.prefix`)
    kv_dtype: str = ""  # its model's dtype ("bfloat16", ...; "" unknown): a KV hand-off needs the same at both ends

    def quarantined(self, now_ms_: int) -> bool:
        return self.quarantined_until_ms > now_ms_


@overload
def heartbeat(store: AsyncStore, info: WorkerInfo, ttl_s: float) -> Awaitable[None]: ...
@overload
def heartbeat(store: SyncStore, info: WorkerInfo, ttl_s: float) -> None: ...


def heartbeat(store: AsyncStore | SyncStore, info: WorkerInfo, ttl_s: float) -> Awaitable[None] | None:
    """Registers or refreshes a worker (sync or async store), in one round trip, and tells the
    scheduler on the heartbeat channel while requests are queued (a heartbeat on change is how
    it learns that a slot is free). Entries expire after ttl_s."""
    return store.heartbeat(info.worker_id, info.role, int(ttl_s * 1000),
                           {"role": info.role, "address": info.address, "free_slots": info.free_slots,
                            "capacity": info.capacity, "running": info.running, "draining": int(info.draining),
                            "kv_free_tokens": info.kv_free_tokens, "kv_total_tokens": info.kv_total_tokens,
                            "kv_block_size": info.kv_block_size, "reserved": info.reserved,
                            "prefixes": " ".join(info.prefixes[:MAX_PREFIXES]), "kv_dtype": info.kv_dtype})


async def deregister(client: aioredis.Redis, keys: Keys, worker_id: str, role: str) -> None:
    """Takes no new work from now on (draining); the entry goes when the scheduler reaps it."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.worker(worker_id), "draining", 1)
    pipe.expire(keys.worker(worker_id), 60)  # never a key without expiry, even if it had lapsed
    await pipe.execute()


async def heartbeats(client: aioredis.Redis, keys: Keys, roles: tuple[str, ...] = ROLES
                     ) -> dict[str, tuple[str, float]]:
    """Every registered worker's last heartbeat (ms, as its worker wrote it), in one round trip.
    -> {worker id: (role, heartbeat ms)}"""
    pipe = client.pipeline(transaction=False)
    for role in roles:
        pipe.zrange(keys.workers(role), 0, -1, withscores=True)
    raw = await pipe.execute()
    return {_str(wid): (role, float(score)) for role, rows in zip(roles, raw) for wid, score in rows}


async def forget(client: aioredis.Redis, keys: Keys, worker_id: str, role: str) -> None:
    """Removes a reaped worker from the registry (and ends an operator drain of it; a quarantine
    is kept: a worker restarted under the same id is still quarantined until it ends)."""
    pipe = client.pipeline(transaction=True)
    pipe.zrem(keys.workers(role), worker_id)
    pipe.delete(keys.worker(worker_id))
    pipe.srem(keys.drained, worker_id)
    await pipe.execute()


async def set_drained(client: aioredis.Redis, keys: Keys, worker_id: str, drained: bool) -> None:
    """An operator drains (or undrains) a worker: while drained it gets no new work and
    finishes what it runs. Kept until undrained or the worker is reaped."""
    await (client.sadd if drained else client.srem)(keys.drained, worker_id)


def registry_call(store: AsyncStore | SyncStore, roles: tuple[str, ...], timeout_s: float) -> Call[Registry]:
    """The registry's read for `live_from`, as a call to send alone or with others
    (`pdq.state.calls.joined`): the workers of `roles` that heartbeat within timeout_s."""
    return RequestStore.workers.build(store, roles, now_ms() - int(timeout_s * 1000))


def live_from(registry: Registry, roles: tuple[str, ...]) -> dict[str, list[WorkerInfo]]:
    """The registry as read (`registry_call`) -> {role: [WorkerInfo]}."""
    rows, drained = registry
    return {role: [WorkerInfo(worker_id=wid, role=role, address=h["address"],
                              free_slots=int(h.get("free_slots", 0)), capacity=int(h.get("capacity", 0)),
                              running=int(h.get("running", 0)),
                              kv_free_tokens=int(h.get("kv_free_tokens", 0)),
                              kv_total_tokens=int(h.get("kv_total_tokens", 0)),
                              kv_block_size=int(h.get("kv_block_size", 0)), reserved=int(h.get("reserved", 0)),
                              prefixes=tuple(h.get("prefixes", "").split()), kv_dtype=h.get("kv_dtype", ""),
                              draining=h.get("draining") == "1" or wid in drained,
                              heartbeat_ms=int(h.get("heartbeat_ms", 0)), quarantined_until_ms=until,
                              quarantine_reason=reason, handoff_streak=streak)
                   for wid, h, (until, reason, streak) in rows[role] if "address" in h]
            for role in roles}


def live_call(store: AsyncStore | SyncStore, roles: tuple[str, ...], timeout_s: float
              ) -> Call[dict[str, list[WorkerInfo]]]:
    """The read of `live_workers`, as a call to send alone or with others."""
    return mapped(registry_call(store, roles, timeout_s), lambda registry: live_from(registry, roles))


async def live_workers(store: AsyncStore, roles: tuple[str, ...], timeout_s: float) -> dict[str, list[WorkerInfo]]:
    """The workers of each of `roles` that sent a heartbeat within timeout_s, in one round trip.
    -> {role: [WorkerInfo]}"""
    return await store.run(live_call(store, roles, timeout_s))
