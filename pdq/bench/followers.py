"""A crowd on one gateway: thousands of concurrent StreamResult followers, GetResult long-polls and
GenerateStreams on a handful of running requests, on a bounded number of Redis connections.

    python -m pdq.bench.followers --calls 10000        # spawns a cluster, prints a JSON report
    python -m pdq.bench.followers --token-delay 10000  # the follower alone: a token's delay
                                                       # with 10,000 other streams followed

This machine cannot generate for 10,000 requests at once, so the crowd is honest about what it
measures: REQUESTS requests run (slowed by PDQ_FAULTS decode_step_delay_ms so that they outlive
the crowd's arrival), and CALLS calls follow them at once: most with StreamResult from token 0,
LONG_POLL_SHARE with GetResult long-polls until the end, plus a few GenerateStreams of their own.
Every call must end OK with its request's full token sequence (the same for every follower of
a request, the request's own result), and Redis's connected_clients, sampled all along, must
stay bounded by the processes' pools (not grow with the calls).
"""

import argparse
import asyncio
import json
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

LONG_POLL_SHARE = 0.3
CHANNELS = 64
CALL_TIMEOUT_S = 600.0
PROMPT = "Once upon a time, in a queue far away,"


@dataclass
class Report:
    calls: int = 0
    ok: int = 0
    errors: dict = field(default_factory=dict)  # status code name -> count
    wrong: int = 0  # calls that ended OK with other tokens than their request's result
    messages: int = 0  # stream messages and long-poll answers received
    max_tokens: int = 0
    requests: int = 0
    connected_clients_before: int = 0
    connected_clients_max: int = 0
    xread_calls: int = 0  # XREADs Redis served during the crowd (all processes)
    xrange_calls: int = 0
    crowd_s: float = 0.0
    first_message_s: dict = field(default_factory=dict)  # p50 / p99 / max from a stream call's start to its first message
    examples: list = field(default_factory=list)  # a few error messages


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


async def _stream(stub, method, request, metadata, report: Report, firsts: list[float]) -> list[int]:
    """Token ids of a stream call, checked contiguous from 0 and ended with a finish reason."""
    from pdq.v1 import generation_pb2 as gen_pb

    tokens: list[int] = []
    finish = 0
    started = time.monotonic()
    async for msg in method(request, metadata=metadata, timeout=CALL_TIMEOUT_S):
        if started:  # the first message (the request id): the call was taken
            firsts.append(time.monotonic() - started)
            started = 0.0
        report.messages += 1
        if msg.HasField("index"):
            if msg.index != len(tokens):
                raise ValueError(f"index {msg.index} after {len(tokens)} tokens")
            tokens += list(msg.token_ids) or [msg.token_id]
        finish = msg.finish_reason or finish
    if finish == gen_pb.FINISH_REASON_UNSPECIFIED:
        raise ValueError("no finish reason")
    return tokens


async def _long_poll(stub, rid: str, metadata, report: Report) -> list[int]:
    from pdq.v1 import generation_pb2 as gen_pb

    while True:
        got = await stub.GetResult(gen_pb.GetResultRequest(request_id=rid, wait_ms=30_000), metadata=metadata,
                                   timeout=CALL_TIMEOUT_S)
        report.messages += 1
        if got.done:
            return list(got.result.token_ids)


async def _calls(client) -> dict[str, int]:
    stats = await client.info("commandstats")
    return {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("xread", "xrange")}


def _sample_clients(redis_url: str, report: Report, stop: threading.Event) -> None:
    """Redis's connected_clients every 50 ms until `stop` (a thread: the event loop of the
    crowd is too busy to sample on time). The sampler's own connection counts too."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=30, socket_connect_timeout=30)
    try:
        while not stop.wait(0.05):
            report.connected_clients_max = max(report.connected_clients_max,
                                               client.info("clients")["connected_clients"])
    finally:
        client.close()


async def crowd(target: str, api_key: str, redis_url: str, calls: int, requests: int = 4, max_tokens: int = 48,
                generate_streams: int = 4) -> Report:
    """Submits `requests` greedy requests of `max_tokens` tokens, then makes `calls` calls at
    once that follow them (plus `generate_streams` GenerateStreams of their own); -> Report."""
    import grpc
    import redis.asyncio as aioredis

    from pdq.transport.serving import GRPC_OPTIONS
    from pdq.v1 import generation_pb2 as gen_pb
    from pdq.v1 import generation_pb2_grpc as gen_grpc

    report = Report(calls=calls + generate_streams, max_tokens=max_tokens, requests=requests)
    metadata = (("authorization", f"Bearer {api_key}"),)
    channels = [grpc.aio.insecure_channel(target, options=GRPC_OPTIONS) for _ in range(CHANNELS)]
    stubs = [gen_grpc.GenerationStub(ch) for ch in channels]
    request = gen_pb.GenerateRequest(prompt=PROMPT, sampling=gen_pb.SamplingParams(max_tokens=max_tokens,
                                                                                   ignore_eos=True))
    probe = aioredis.Redis.from_url(redis_url)
    report.connected_clients_before = (await probe.info("clients"))["connected_clients"]
    before = await _calls(probe)
    rids = [(await stubs[0].Submit(request, metadata=metadata)).request_id for _ in range(requests)]
    got: dict[str, list[list[int]]] = {rid: [] for rid in rids}
    own: list[list[int]] = []
    codes: Counter = Counter()
    firsts: list[float] = []

    async def call(i: int) -> None:
        stub = stubs[i % CHANNELS]
        kind = "GenerateStream" if i >= calls else "GetResult" if (i // requests) % 10 < LONG_POLL_SHARE * 10 else "StreamResult"
        try:
            if i >= calls:  # a GenerateStream of its own request
                own.append(await _stream(stub, stub.GenerateStream, request, metadata, report, firsts))
            else:
                rid = rids[i % requests]
                if (i // requests) % 10 < LONG_POLL_SHARE * 10:
                    got[rid].append(await _long_poll(stub, rid, metadata, report))
                else:
                    got[rid].append(await _stream(stub, stub.StreamResult, gen_pb.StreamResultRequest(request_id=rid),
                                                  metadata, report, firsts))
            codes["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1
            if len(report.examples) < 5:
                report.examples.append(f"{kind} after {time.monotonic() - started:.1f} s: {exc.code().name}: "
                                       f"{exc.details()} ({exc.debug_error_string()})")
        except ValueError as exc:
            codes["BAD_STREAM"] += 1
            if len(report.examples) < 5:
                report.examples.append(f"bad stream: {exc}")

    started = time.monotonic()
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_clients, args=(redis_url, report, stop), daemon=True)
    sampler.start()
    started = time.monotonic()
    await asyncio.gather(*(call(i) for i in range(calls + generate_streams)))
    report.crowd_s = round(time.monotonic() - started, 2)
    firsts.sort()
    if firsts:
        report.first_message_s = {"p50": round(firsts[len(firsts) // 2], 3),
                                  "p99": round(firsts[int(len(firsts) * 0.99)], 3), "max": round(firsts[-1], 3)}
    stop.set()
    sampler.join()
    after = await _calls(probe)
    await probe.aclose()
    report.xread_calls = after["xread"] - before["xread"]
    report.xrange_calls = after["xrange"] - before["xrange"]
    for rid in rids:  # each request's own result: what every follower of it must have got
        result = await stubs[0].GetResult(gen_pb.GetResultRequest(request_id=rid), metadata=metadata)
        want = list(result.result.token_ids)
        report.wrong += sum(tokens != want for tokens in got[rid]) + (len(want) != max_tokens)
    report.wrong += sum(len(tokens) != max_tokens for tokens in own)
    for ch in channels:
        await ch.close()
    report.ok = codes.pop("OK", 0)
    report.errors = dict(codes)
    return report


async def token_delay(redis_url: str, idle: int, tokens: int = 200, step_s: float = 0.02) -> dict:
    """How long one running stream's entries take from XADD to its subscriber's queue while
    `idle` other streams (queued requests) are followed too, one entry every `step_s`. -> ms."""
    import redis.asyncio as aioredis

    from gateway.follower import OutputFollower

    writer = aioredis.Redis.from_url(redis_url)
    follower = OutputFollower(redis_url, writer)
    for i in range(idle):
        follower.subscribe(f"bench:idle:{i}")
    running = follower.subscribe("bench:running")
    delays = []
    for i in range(tokens):
        started = time.perf_counter()
        await writer.xadd("bench:running", {"i": i})
        await running.queue.get()
        delays.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(step_s)
    await follower.close()
    await writer.delete("bench:running")
    await writer.aclose()
    delays.sort()
    return {"idle_streams": idle, "tokens": tokens, "p50_ms": round(delays[len(delays) // 2], 3),
            "p99_ms": round(delays[int(len(delays) * 0.99)], 3)}


def main(argv: list[str] | None = None) -> int:
    from gateway.follower import COLD_READERS, HOT_READERS
    from pdq.ops.up import Cluster

    parser = argparse.ArgumentParser(prog="python -m pdq.bench.followers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10_000, help="concurrent followers and long-polls")
    parser.add_argument("--requests", type=int, default=4, help="running requests they follow")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--generate-streams", type=int, default=4, help="GenerateStreams of their own besides")
    parser.add_argument("--step-delay-ms", type=int, default=150,
                        help="decode_step_delay_ms of the decode worker: the requests outlive the crowd's arrival")
    parser.add_argument("--redis-max-connections", type=int, default=16, help="pool bound of every process")
    parser.add_argument("--token-delay", type=int, metavar="IDLE", default=-1,
                        help="instead: a running stream's XADD-to-subscriber delay with IDLE other streams followed "
                             "(and with none), on a private Redis")
    args = parser.parse_args(argv)
    if args.token_delay >= 0:
        from pdq.ops.redis_server import RedisServer

        with RedisServer() as server:
            rows = [asyncio.run(token_delay(server.url, idle)) for idle in sorted({0, args.token_delay})]
        print(json.dumps(rows, indent=2))
        return 0
    env = {"PDQ_FAULTS": f"decode_step_delay_ms={args.step_delay_ms}",
           "PDQ_REDIS_MAX_CONNECTIONS": str(args.redis_max_connections)}
    say(f"starting a cluster (colocated decode worker, {env})")
    with Cluster(model="builtin", port=0, colocate=True, metrics_port=-1, extra_env=env) as cluster:
        report = asyncio.run(crowd(cluster.target, cluster.client_key, cluster.redis_url, args.calls, args.requests,
                                   args.max_tokens, args.generate_streams))
        processes = len(cluster.children)
    out = {**asdict(report), "processes": processes, "redis_max_connections_per_process": args.redis_max_connections,
           "gateway_follower_connections": COLD_READERS + HOT_READERS}
    print(json.dumps(out, indent=2))
    return 0 if not report.errors and not report.wrong else 1


if __name__ == "__main__":
    raise SystemExit(main())
