"""`pdq chaos`: plan, reference, cluster, load and faults together, drain, snapshot, check, report.

Exit status: 0 when every check passed, 1 when any failed, 2 on bad flags. Stdout gets the
human summary; stderr the progress; --out (or a new temporary directory) gets chaos.json, one line
per request (requests.jsonl: its plan, what the load saw, its record), every process's log and,
with --keep-redis, Redis's AOF.
"""

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import redis

from pdq.chaos import report
from pdq.chaos.check import TERMINAL, check_leaks, check_run
from pdq.chaos.cluster import HOST, ChaosCluster
from pdq.chaos.faults import Injector
from pdq.chaos.load import Load, monotonic_clock
from pdq.chaos.options import ChaosOptions
from pdq.chaos.plan import longest, plan_faults, plan_requests, prompts
from pdq.chaos.snapshot import read_leftovers, read_snapshot
from pdq.state.keys import Keys

DECODE_WORKERS = 2


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        opts = ChaosOptions.from_args(args)
    except ValueError as exc:
        say(f"pdq chaos: {exc}")
        return 2
    result, violations = chaos(opts)
    print(report.summary(result, violations), flush=True)
    return 0 if result["ok"] else 1


def chaos(opts: ChaosOptions) -> tuple[dict, list]:
    """One whole run. -> (the JSON result, written to OUT/chaos.json; the violations)."""
    from pdq.chaos.reference import greedy_reference
    from pdq.model.loader import resolve_model

    started = time.monotonic()
    out = Path(opts.out or tempfile.mkdtemp(prefix="pdq-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(resolve_model(opts.model))
    texts, plans, schedule = prompts(), plan_requests(opts), plan_faults(opts)
    say(f"pdq chaos: {opts.requests} requests, concurrency {opts.concurrency}, seed {opts.seed}; faults: "
        + (", ".join(f"{k} {n}" for k, n in Counter(f.kind for f in schedule).items()) or "none") + f"; out {out}")
    references = greedy_reference(model_dir, texts, [longest(i) for i in range(len(texts))])
    say(f"pdq chaos: reference outputs of {len(texts)} prompts computed in {time.monotonic() - started:.1f}s")
    load, injector, cluster, snap, load_s = asyncio.run(_run(opts, out, model_dir, texts, plans, schedule))
    logs = {role.name: role.log.read_text(errors="replace") for role in cluster.roles if role.log.exists()}
    violations = check_run(plans, load.outcomes, snap, references, load.stall.stalls, cluster.exits,
                           injector.unhealed, DECODE_WORKERS, logs)
    result = report.build(opts, plans, load.outcomes, snap, injector.struck, load.counts, violations, load_s,
                          time.monotonic() - started, out, cluster.exits, logs)
    report.write(result, out / "chaos.json")
    report.write_outcomes(plans, load.outcomes, snap, out / "requests.jsonl")
    if not opts.keep_redis:
        shutil.rmtree(out / "redis", ignore_errors=True)
    return result, violations


async def _run(opts: ChaosOptions, out: Path, model_dir: str, texts, plans, schedule):
    clock = monotonic_clock()
    cluster = ChaosCluster(out, model_dir, clock, extra_env=dict(item.split("=", 1) for item in opts.env))
    keys = Keys()
    try:
        say("pdq chaos: starting the cluster ...")
        await cluster.start()
        say(f"pdq chaos: cluster SERVING at t={clock():.1f}s; load and faults start")
        injector = Injector(cluster, schedule, clock, lead=opts.concurrency)
        faults = asyncio.create_task(injector.run())
        load = Load(cluster.target, plans, texts, injector, clock, opts.concurrency, opts.request_bound_s,
                    opts.stall_s, opts.seed)
        t0 = clock()
        ticker = asyncio.create_task(_progress(load, injector, clock))
        try:
            await load.run()
        finally:
            ticker.cancel()
        load_s = clock() - t0
        say(f"pdq chaos: load done in {load_s:.1f}s; {len(injector.struck)} of {len(schedule)} faults struck")
        await injector.finish()
        await faults
        client = redis.Redis(host=HOST, port=cluster.redis.port)
        try:
            rids = {r for o in load.outcomes for r in o.rids}
            await _drain(client, keys, rids, opts.drain_s)
            await _settle(client, keys, opts.settle_s)
            snap = await asyncio.to_thread(read_snapshot, client, keys, [p.client_id for p in plans], rids)
        finally:
            client.close()
    finally:
        await cluster.stop()
    return load, injector, cluster, snap, load_s


async def _progress(load: Load, injector: Injector, clock, every_s: float = 15.0) -> None:
    while True:
        await asyncio.sleep(every_s)
        ended = sum(1 for o in load.outcomes if o.t_end)
        say(f"pdq chaos: t={clock():.0f}s: {injector.started} requests started, {ended} ended; "
            f"{len(injector.struck)} of {len(injector.schedule)} faults struck")


async def _drain(client: redis.Redis, keys: Keys, rids: set[str], bound_s: float) -> None:
    """Waits until every accepted request has ended (or bound_s passed)."""
    pending = sorted(rids)
    deadline = time.monotonic() + bound_s
    while pending and time.monotonic() < deadline:
        states = await asyncio.to_thread(_states, client, keys, pending)
        pending = [rid for rid, s in zip(pending, states) if s not in TERMINAL]
        if pending:
            await asyncio.sleep(0.5)
    say(f"pdq chaos: drained; {len(pending)} request(s) not ended")


def _states(client: redis.Redis, keys: Keys, rids: list[str]) -> list[str]:
    pipe = client.pipeline(transaction=False)
    for rid in rids:
        pipe.hget(keys.request(rid), "state")
    return [s.decode() if s else "" for s in pipe.execute()]


async def _settle(client: redis.Redis, keys: Keys, bound_s: float) -> None:
    """Waits until queues, counters, leases, held sets and KV slots are back to zero (or bound_s
    passed): freed slots show in the next heartbeat, an orphaned reservation expires in seconds."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if not check_leaks(await asyncio.to_thread(read_leftovers, client, keys), DECODE_WORKERS):
            say("pdq chaos: settled")
            return
        await asyncio.sleep(0.5)
    say(f"pdq chaos: not settled after {bound_s:.0f}s")
