"""Offer a workload to a running cluster over gRPC streaming and record every token's arrival.

Every request in flight is a coroutine on one asyncio event loop (`pdq.client.AsyncClient`,
grpc.aio), each tenant with its own client so that its API key rides on its requests: a
stream's token message costs this process less CPU than with a thread per request (no thread
to wake per message), CPU that on a small machine comes out of the cluster's. A token message
is one with `index` set; the first message of a stream carries no token and is not a first
token. Requests are greedy with `ignore_eos`, so
each produces exactly `max_tokens` tokens. Each client's connection is up before the clock
starts, as a serving client's long-lived channel would be: a run measures serving, not the
TCP and HTTP/2 set-up of a new channel (round trips before the first request could leave).
"""

import asyncio
import time
from collections.abc import Callable

import grpc

from pdq.ops import cpu
from pdq.bench import http_client
from pdq.bench.arrivals import Arrivals
from pdq.bench.prefix import PrefixProbe
from pdq.bench.procstat import CpuProbe
from pdq.bench.record import RequestRecord, RunRecord
from pdq.bench.workload import BenchRequest, Workload
from pdq.client import AsyncClient, finish_name

Progress = Callable[[RequestRecord], None]
CONNECT_TIMEOUT_S = 5.0


async def stream_one(client: AsyncClient, req: BenchRequest, rec: RequestRecord, t0: float,
                     timeout_s: float, stream_interval: int = 1) -> RequestRecord:
    """Runs one request to its end, filling `rec` (times relative to t0): each token of a
    message arrives when the message does. Never raises for an RPC error."""
    clock = time.perf_counter
    times = rec.token_times
    try:
        async for msg in client.generate_stream(list(req.prompt_token_ids), timeout=timeout_s,
                                                max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True,
                                                stream_interval=stream_interval):
            if msg.HasField("index"):
                times.extend([clock() - t0] * max(1, len(msg.token_ids)))  # a server before token_ids: one
            if msg.finish_reason:
                rec.finish_reason = finish_name(msg.finish_reason)
    except grpc.RpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.end = clock() - t0
    return rec


def run_service(target: str, name: str, strategy: str, workload: Workload, arrivals: Arrivals, *,
                api_keys: dict[str, str | None] | None = None, timeout_s: float = 600.0,
                on_done: Progress | None = None, cpu_probe: CpuProbe | None = None,
                client_policy: str = "normal", stream_interval: int = 1,
                prefix_probe: "PrefixProbe | None" = None, http_model: str = "") -> RunRecord:
    """Offers `workload` to the gateway at `target` with `arrivals`; returns when every request
    has ended. api_keys: tenant name -> API key (None or missing: the `Client` default,
    $PDQ_API_KEY or the dev key of a local `pdq up`). cpu_probe: the cluster's processes, whose
    CPU time during the run goes into the record. client_policy: the CPU policy (pdq.ops.cpu) of
    this thread and gRPC's, for the run. stream_interval: decode steps per stream message
    after the first token (GenerateRequest.stream_interval). prefix_probe: the cluster's prefix
    cache counters, whose change during the run goes into the record's notes. A `target` that
    starts with http:// or https:// is an OpenAI-compatible base URL (e.g. http://host:8000/v1):
    the requests go to its /completions, naming `http_model` (`pdq.bench.http_client`)."""
    if prefix_probe:
        prefix_probe.start()
    with cpu.policy(client_policy):
        record = asyncio.run(_offer(target, name, strategy, workload, arrivals, api_keys or {}, timeout_s,
                                    on_done, cpu_probe, stream_interval, http_model))
    if prefix_probe:
        record.notes["prefix_cache"] = prefix_probe.stop()
    return record


async def _offer(target: str, name: str, strategy: str, workload: Workload, arrivals: Arrivals,
                 api_keys: dict[str, str | None], timeout_s: float, on_done: Progress | None,
                 cpu_probe: CpuProbe | None, stream_interval: int, http_model: str = "") -> RunRecord:
    reqs = workload.requests
    tenants = {r.tenant for r in reqs}
    http = http_client.session(len(reqs)) if is_http(target) else None
    clients = {} if http else {t: AsyncClient(target, api_key=api_keys.get(t)) for t in tenants}
    try:  # connected before the clock starts (see the module doc); if that fails, each request says why
        await asyncio.wait_for(
            asyncio.gather(*(c.channel.channel_ready() for c in clients.values()),
                           *(http_client.connect(http, target, api_keys.get(t), sum(r.tenant == t for r in reqs))
                             for t in (tenants if http else ()))),
            min(timeout_s, CONNECT_TIMEOUT_S))
    except asyncio.TimeoutError:
        pass
    records: list[RequestRecord | None] = [None] * len(reqs)
    offsets = arrivals.offsets(len(reqs))
    if cpu_probe:
        cpu_probe.start()
    cpu0 = time.process_time()
    t0 = time.perf_counter()

    async def one(i: int, due: float) -> None:
        rec = records[i] = RequestRecord(reqs[i], due)
        try:
            if http:
                await http_client.stream_one_http(http, target, http_model, api_keys.get(reqs[i].tenant), reqs[i],
                                                  rec, t0, timeout_s)
            else:
                await stream_one(clients[reqs[i].tenant], reqs[i], rec, t0, timeout_s, stream_interval)
        except Exception as exc:  # a bug here must not hang the run: record it as the request's error
            rec.error, rec.end = f"client: {exc!r}", time.perf_counter() - t0
        if on_done:
            on_done(rec)

    try:
        if offsets is None:  # closed loop: each of C senders sends its next request when one ends
            order = iter(range(len(reqs)))

            async def sender() -> None:
                for i in order:
                    await one(i, time.perf_counter() - t0)

            await asyncio.gather(*(sender() for _ in range(arrivals.concurrency)))
        else:
            tasks = []
            for i, due in enumerate(offsets):
                delay = t0 + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, due)))
            await asyncio.gather(*tasks)
    finally:
        for c in clients.values():
            await c.close()
        if http:
            await http.close()
    client_cpu = time.process_time() - cpu0
    return RunRecord(name, strategy, workload, arrivals, list(records), client_cpu_s=client_cpu,
                     server_cpu_s=cpu_probe.stop() if cpu_probe else None)


def is_http(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def warm_up(target: str, vocab_id: int, n: int = 2, api_key: str | None = None, timeout_s: float = 600.0,
            http_model: str = "") -> None:
    """Sends `n` small requests at once and waits for them (loads lazily initialised paths)."""
    if n < 1:
        return

    async def go() -> list[RequestRecord]:
        req = BenchRequest(-1, (vocab_id,) * 16, 4)
        if is_http(target):
            async with http_client.session(n) as http:
                return await asyncio.gather(*(http_client.stream_one_http(
                    http, target, http_model, api_key, req, RequestRecord(req, 0.0), 0.0, timeout_s)
                    for _ in range(n)))
        async with AsyncClient(target, api_key=api_key) as client:
            return await asyncio.gather(*(stream_one(client, req, RequestRecord(req, 0.0), 0.0, timeout_s)
                                          for _ in range(n)))

    errors = [r.error for r in asyncio.run(go()) if r.error]
    if errors:
        raise RuntimeError(f"warm-up request failed: {errors[0]}")
