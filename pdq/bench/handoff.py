"""`pdq bench --handoff`: the P/D disaggregation goals, measured on a spawned cluster.

1. Hand-off throughput: real KV caches of the model (a prompt of the mixed workload's median
   length, and a long one) prefilled in this process, then sent with the prefill worker's own
   code (`kv_transfer.encode_frames`, ~1 MiB messages) over both transports, `PushKV` (gRPC
   streaming) and the decode worker's TCP data plane (`kv_tcp.Pusher`), to a real decode worker
   process on loopback, which writes it into a KV pool slot and checks the checksum.
   Timed from the first message to the decode worker's answer (the cache is in its pool);
   GB/s = cache bytes / that time (median of repeats). The KV room is reserved before the
   prefill, as the scheduler does. Also: CONCURRENT hand-offs of the median cache at once over
   one channel (as one prefill worker finishing several requests), aggregate GB/s = their bytes
   / the wall time from the first message to the last answer (median of rounds). Side by side:
   the same bytes over a bare grpc.aio stream to a server that only counts them
   (`pdq.bench.grpc_ceiling`): the most Python gRPC moves here, so the share of it pdq reaches.
2. TTFT overhead: in the same run, the prefill of the median prompt alone (forward pass) against
   prefill + the hand-off's own work (export from the pool, transfer). pdq streams the first token
   from the prefill worker before the hand-off, so the client's TTFT does not wait for it; the
   ratio is what the hand-off would add if the first token waited for the KV to land (the
   second token does). The cluster's client-side TTFT at the median prompt is reported alongside.
3. Load split: the mixed workload (all at once) on 2 decode workers; each request's record in
   Redis names its decode worker.
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter

REPEATS = 10
TRANSPORTS = ("grpc", "tcp")  # PushKV; the decode worker's TCP data plane (pdq.transport.kv_tcp)
LONG_PROMPT = 2000
CONCURRENT = 4
SLOT_WAIT_S = 120.0  # how long a hand-off waits for the decode worker to free a KV slot


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 3)


async def _push(address: str, runner, prompt: list[int], tag: str, chunk_bytes: int, concurrent: int = 0,
                ceiling: str = "") -> dict:
    """Prefills `prompt` here REPEATS times (timing the forward pass and the KV export); then,
    over each transport (PushKV, then the decode worker's TCP data plane), hands that KV to the
    decode worker at `address` REPEATS times, each into a fresh reservation; with `concurrent`,
    that many hand-offs at once, REPEATS times; then the same bytes to the bare server at
    `ceiling`."""
    import grpc
    import torch

    from pdq.transport import kv_tcp, kv_transfer
    from pdq.bench import grpc_ceiling
    from pdq.engine.runner import PrefillItem
    from pdq.transport.serving import GRPC_OPTIONS
    from prefill_worker.server import PUSH_KV
    from pdq.v1 import internal_pb2 as pb
    from pdq.v1 import internal_pb2_grpc as pb_grpc

    prefill_s, export_s = [], []
    for i in range(REPEATS + 1):  # the first round warms up
        rid = f"bench-prefill-{tag}-{i}"
        runner.allocate(rid)
        try:
            t0 = time.perf_counter()
            logits = runner.prefill([PrefillItem(rid, prompt, 0)])
            first = int(torch.argmax(logits[0]))
            t1 = time.perf_counter()
            layers = [(k.cpu(), v.cpu()) for k, v in runner.export_kv(rid, len(prompt))]  # as prefill_worker
            t2 = time.perf_counter()
        finally:
            runner.free(rid)
        if i:
            prefill_s.append(t1 - t0)
            export_s.append(t2 - t1)
    n_bytes = sum(t.numel() * t.element_size() for pair in layers for t in pair)
    out = {"prompt_tokens": len(prompt), "kv_bytes": n_bytes, "repeats": REPEATS,
           "prefill_ms": _median_ms(prefill_s), "export_ms": _median_ms(export_s)}
    pushes: dict[str, list[float]] = {}  # transport -> seconds of each hand-off
    pusher = kv_tcp.Pusher(None)
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        grpc_push = channel.stream_unary(PUSH_KV, request_serializer=None,  # as the prefill worker sends
                                         response_deserializer=pb.PushKVResponse.FromString)

        async def reserve(rid: str) -> str:
            """A KV slot for `rid`, once one is free: the sequences of the previous hand-offs leave
            the decode worker's pool on its own time (slower on a busy machine), not before
            their push returns. Not timed."""
            deadline = time.monotonic() + SLOT_WAIT_S
            while not (resp := await stub.Reserve(pb.ReserveRequest(request_id=rid, tokens=len(prompt) + 1),
                                                  timeout=10)).granted:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"decode worker {address} has had no free KV slot for {SLOT_WAIT_S:.0f}s")
                await asyncio.sleep(0.01)
            return resp.kv_address

        async def send(transport: str, rid: str, kv_address: str) -> None:
            frames = kv_transfer.encode_frames(_header(rid, prompt, first), layers, chunk_bytes)
            if transport == "tcp":
                if not kv_address:
                    raise RuntimeError(f"decode worker {address} runs no TCP data plane (PDQ_KV_TRANSPORT=tcp)")
                await pusher.push(kv_address, frames, timeout=60)
            elif not (await grpc_push(frames, timeout=60)).accepted:
                raise RuntimeError("the decode worker refused the hand-off")

        for transport in TRANSPORTS:
            push_s = pushes[transport] = []
            for i in range(REPEATS + 1):
                rid = f"bench-handoff-{tag}-{transport}-{i}-{time.monotonic_ns()}"
                kv_address = await reserve(rid)
                t0 = time.perf_counter()
                await send(transport, rid, kv_address)
                if i:
                    push_s.append(time.perf_counter() - t0)
            res = out[transport] = {"push_ms": _median_ms(push_s),
                                    "push_gbps": round(n_bytes / statistics.median(push_s) / 1e9, 3)}
            if concurrent:
                walls = []
                for i in range(REPEATS + 1):
                    rids = [f"bench-handoff-{tag}-{transport}-x{i}-{j}-{time.monotonic_ns()}" for j in range(concurrent)]
                    kv_addresses = [await reserve(rid) for rid in rids]
                    t0 = time.perf_counter()
                    await asyncio.gather(*(send(transport, rid, kv) for rid, kv in zip(rids, kv_addresses)))
                    if i:
                        walls.append(time.perf_counter() - t0)
                wall = statistics.median(walls)
                res["concurrent"] = {"transfers": concurrent, "wall_ms": round(wall * 1000, 3),
                                     "aggregate_gbps": round(concurrent * n_bytes / wall / 1e9, 3)}
    await pusher.close()
    if ceiling:
        frames = list(kv_transfer.encode_frames(_header("ceiling", prompt, first), layers, chunk_bytes))
        bare = await grpc_ceiling.measure(ceiling, frames, REPEATS)
        out["bare_grpc"] = {"ms": _median_ms(bare), "gbps": grpc_ceiling.median_gbps(n_bytes, bare),
                            "pdq_grpc_share": round(statistics.median(bare) / statistics.median(pushes["grpc"]), 3)}
    return out


def _header(rid: str, prompt: list[int], first: int):
    from pdq.v1 import generation_pb2 as gen_pb
    from pdq.v1 import internal_pb2 as pb

    spec = pb.RequestSpec(request_id=rid, prompt_token_ids=prompt, sampling=gen_pb.SamplingParams(max_tokens=2))
    return pb.KVHeader(spec=spec, epoch=1, generated_token_ids=[first])


def _client_ttft(target: str, prompt: list[int]) -> float:
    from pdq.client import Client

    ttfts = []
    with Client(target) as c:
        for _ in range(REPEATS + 1):
            t0 = time.perf_counter()
            stream = c.generate_stream(prompt, max_tokens=2, ignore_eos=True)
            for msg in stream:
                if msg.HasField("index"):
                    ttfts.append(time.perf_counter() - t0)
                    break
            for _ in stream:
                pass
    return _median_ms(ttfts[1:])


def _split(cluster, workload) -> dict:
    """Runs the workload all at once; -> requests per decode worker address."""
    import redis

    from pdq.client import Client

    with Client(cluster.target) as c:
        rids = [c.submit(list(r.prompt_token_ids), max_tokens=r.max_tokens, ignore_eos=True)
                for r in workload.requests]
        for rid in rids:
            while not c.get_result(rid, wait_ms=5_000).done:
                pass
    r = redis.Redis.from_url(cluster.redis_url)
    try:
        served = Counter((r.hget(f"pdq:req:{rid}", "decode_worker") or b"?").decode() for rid in rids)
    finally:
        r.close()
    return dict(served)


def run(args: argparse.Namespace) -> int:
    from pdq.bench.baselines import import_torch

    import_torch()  # the same OpenMP policy as the workers `pdq up` starts

    from pdq.bench.command import run_dtype
    from pdq.bench.options import _pairs, dtype_env
    from pdq.bench.workload import build, vocabulary
    from pdq.engine.runner import ModelRunner, torch_dtype
    from pdq.model.loader import resolve_model
    from pdq.ops.child import spawn, stop
    from pdq.ops.redis_server import free_port
    from pdq.ops.up import Cluster

    try:
        env = _pairs(args.env, "--env")
        env.update(dtype_env(args))
        dtype = run_dtype(getattr(args, "dtype", None))  # the workers' own: the runner's K/V is theirs
        model_dir = str(resolve_model(args.model))
        workload = build("mixed", vocabulary(model_dir), n=args.requests or 32, seed=args.seed)
    except ValueError as exc:
        say(f"pdq bench: {exc}")
        return 2
    median_len = int(statistics.median(r.prompt_len for r in workload.requests))
    median_prompt = list(next(r for r in workload.requests if r.prompt_len >= median_len).prompt_token_ids[:median_len])
    vocab = vocabulary(model_dir)
    long_prompt = [vocab[(i * 7919) % len(vocab)] for i in range(LONG_PROMPT)]
    chunk_bytes = int(env.get("PDQ_KV_CHUNK_BYTES", 1 << 20))
    say(f"pdq bench --handoff: model {args.model}, median prompt {median_len} tokens, long prompt {LONG_PROMPT}; "
        f"{workload.describe()}")
    runner = ModelRunner.from_pretrained(model_dir, kv_budget_tokens=4096, max_seq_len=2048,
                                         dtype=torch_dtype(dtype))
    with Cluster(model=args.model, prefill=1, decode=2, port=0, auth=False, metrics_port=-1,
                 redis_url=args.redis_url, extra_env={"PDQ_KV_TRANSPORT": "tcp", **env}) as cluster:
        decode0 = next(ch for ch in cluster.children if ch.name == "decode-0")
        address = f"{cluster.host}:{decode0.port}"
        bare_port = free_port()  # the bare gRPC server runs as nice as the decode workers
        bare = spawn([sys.executable, "-m", "pdq.bench.grpc_ceiling", str(bare_port)], nice=cluster.worker_nice)
        try:
            handoff = {name: asyncio.run(_push(address, runner, prompt, name, chunk_bytes, concurrent,
                                               f"127.0.0.1:{bare_port}"))
                       for name, prompt, concurrent in (("median", median_prompt, CONCURRENT),
                                                        ("long", long_prompt, 0))}
        finally:
            stop(bare)
        ttft_ms = _client_ttft(cluster.target, median_prompt)
        served = _split(cluster, workload)
    from pdq.bench.report import machine

    med = handoff["median"]
    overhead = {t: (med["export_ms"] + med[t]["push_ms"]) / med["prefill_ms"] for t in TRANSPORTS}
    total = sum(served.values())
    shares = {k: round(v / total, 3) for k, v in served.items()}
    out = {"model": args.model, "machine": machine(), "handoff": handoff,
           "ttft": {"prefill_alone_ms": med["prefill_ms"], "client_ttft_ms": ttft_ms,
                    **{t: {"prefill_plus_handoff_ms": round(med["prefill_ms"] + med["export_ms"] + med[t]["push_ms"], 3),
                           "handoff_overhead": round(overhead[t], 3),
                           "handoff_over_client_ttft": round((med["export_ms"] + med[t]["push_ms"]) / ttft_ms, 3)}
                       for t in TRANSPORTS}},
           "decode_split": {"requests": total, "per_worker": served, "shares": shares}}
    print(f"hand-off throughput (goal >= 1 GB/s), median of {REPEATS}, over PushKV (grpc) and the decode "
          "worker's TCP data plane (tcp):")
    for name, h in handoff.items():
        print(f"  {name:6s} prompt {h['prompt_tokens']:5d} tok  KV {h['kv_bytes'] / 1e6:7.2f} MB  "
              f"(export {h['export_ms']:.2f} ms)")
        for t in TRANSPORTS:
            print(f"    {t:4s}  push {h[t]['push_ms']:8.2f} ms  {h[t]['push_gbps']:6.2f} GB/s")
            if "concurrent" in h[t]:
                c = h[t]["concurrent"]
                print(f"    {t:4s}  x{c['transfers']} at once: {c['wall_ms']:8.2f} ms  {c['aggregate_gbps']:6.2f} GB/s aggregate")
        if "bare_grpc" in h:
            b = h["bare_grpc"]
            print(f"    same bytes, bare grpc.aio stream (gRPC's ceiling here): {b['ms']:8.2f} ms  "
                  f"{b['gbps']:6.2f} GB/s; PushKV reaches {b['pdq_grpc_share']:.0%} of it")
    print(f"TTFT overhead at the median prompt (goal <= 10%): prefill alone {med['prefill_ms']:.2f} ms; + hand-off " +
          ", ".join(f"{t} {med['export_ms'] + med[t]['push_ms']:.2f} ms = {overhead[t]:+.1%}" for t in TRANSPORTS) +
          f"; client TTFT through the cluster {ttft_ms:.1f} ms (the first token does not wait for the hand-off)")
    print(f"decode split (goal 50% +- 10% each), {total} requests: " +
          ", ".join(f"{k} {v} ({shares[k]:.0%})" for k, v in sorted(served.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
