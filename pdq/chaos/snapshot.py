"""What Redis holds after a run, read into plain data for the checker (`check`): the requests'
records and output streams, the client ids' mappings, and everything that must be back to zero
once no request lives (queues, counters, leases, held sets, deadlines, the workers' KV slots).
Key names come from `pdq.state.keys.Keys`; nothing here writes."""

from dataclasses import dataclass, field

import redis

from pdq.state.keys import Keys

TENANT = "default"  # the roles run open: every caller is this tenant


@dataclass
class Snapshot:
    records: dict[str, dict] = field(default_factory=dict)  # rid -> record fields (without spec)
    outputs: dict[str, list[dict]] = field(default_factory=dict)  # rid -> its output stream's entries, in order
    idem: dict[str, str] = field(default_factory=dict)  # client id -> rid (p:idem)
    index: list[str] = field(default_factory=list)  # every request id listed (p:index)
    state: "Leftovers" = None


@dataclass
class Leftovers:
    """What must be empty or zero once every request ended."""

    queues: dict[str, list[str]] = field(default_factory=dict)  # p:q:* -> members
    backlogs: dict[str, list[str]] = field(default_factory=dict)  # p:backlog:* -> tenants
    depth: dict[str, dict] = field(default_factory=dict)  # p:depth:* -> fields
    load: dict[str, str] = field(default_factory=dict)  # p:load
    leases: list[str] = field(default_factory=list)  # p:leases members
    held: dict[str, list[str]] = field(default_factory=dict)  # p:held:{worker} -> members
    deadlines: dict[str, str] = field(default_factory=dict)  # p:deadlines member -> its record's state ("" = none)
    live: dict[str, list[str]] = field(default_factory=dict)  # p:live:{tenant} -> members
    decode_workers: dict[str, dict] = field(default_factory=dict)  # id -> registry hash (free_slots, capacity, running)
    prefill_workers: dict[str, dict] = field(default_factory=dict)
    now_ms: int = 0  # Redis's clock when read


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _scan(client: redis.Redis, pattern: str) -> list[str]:
    return sorted(_s(k) for k in client.scan_iter(match=pattern, count=1000))


def read_leftovers(client: redis.Redis, keys: Keys) -> Leftovers:
    p = keys.prefix
    out = Leftovers()
    for k in _scan(client, f"{p}:q:*"):
        out.queues[k] = [_s(m) for m in client.zrange(k, 0, -1)]
    for k in _scan(client, f"{p}:backlog:*"):
        out.backlogs[k] = [_s(m) for m in client.zrange(k, 0, -1)]
    for k in _scan(client, f"{p}:depth:*"):
        out.depth[k] = {_s(a): _s(b) for a, b in client.hgetall(k).items()}
    out.load = {_s(a): _s(b) for a, b in client.hgetall(keys.load).items()}
    out.leases = [_s(m) for m in client.zrange(keys.leases, 0, -1)]
    for k in _scan(client, f"{p}:held:*"):
        out.held[k] = sorted(_s(m) for m in client.smembers(k))
    for m in client.zrange(keys.deadlines, 0, -1):
        out.deadlines[_s(m)] = _s(client.hget(keys.request(_s(m)), "state") or b"")
    for k in _scan(client, f"{p}:live:*"):
        out.live[k] = sorted(_s(m) for m in client.smembers(k))
    for role, into in (("decode", out.decode_workers), ("prefill", out.prefill_workers)):
        for wid in client.zrange(keys.workers(role), 0, -1):
            into[_s(wid)] = {_s(a): _s(b) for a, b in client.hgetall(keys.worker(_s(wid))).items()}
    sec, usec = client.time()
    out.now_ms = int(sec) * 1000 + int(usec) // 1000
    return out


def read_snapshot(client: redis.Redis, keys: Keys, client_ids: list[str], rids: set[str]) -> Snapshot:
    """Records and output streams of `rids` and of every listed request, the mappings of
    `client_ids`, and the leftovers."""
    snap = Snapshot()
    snap.index = [_s(m) for m in client.zrange(keys.index(), 0, -1)]
    pipe = client.pipeline(transaction=False)
    for cid in client_ids:
        pipe.get(keys.idempotency(TENANT, cid))
    for cid, rid in zip(client_ids, pipe.execute()):
        if rid is not None:
            snap.idem[cid] = _s(rid)
    every = sorted(set(rids) | set(snap.index) | set(snap.idem.values()))
    for start in range(0, len(every), 500):
        chunk = every[start:start + 500]
        pipe = client.pipeline(transaction=False)
        for rid in chunk:
            pipe.hgetall(keys.request(rid))
            pipe.xrange(keys.output(rid))
        got = pipe.execute()
        for i, rid in enumerate(chunk):
            rec, entries = got[2 * i], got[2 * i + 1]
            if rec:
                snap.records[rid] = {_s(a): _s(b) for a, b in rec.items() if _s(a) != "spec"}
            if entries:
                snap.outputs[rid] = [{_s(a): _s(b) for a, b in fields.items()} for _, fields in entries]
    snap.state = read_leftovers(client, keys)
    return snap
