"""Offer a workload to a running cluster over gRPC streaming and record every token's arrival.

One thread per request in flight (the sync `Client` is thread-safe; each tenant gets its own
client so that its API key rides on its requests). A token message is one with `index` set;
the first message of a stream carries no token and is not a first token. Requests are greedy
with `ignore_eos`, so each produces exactly `max_tokens` tokens.
"""

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from pdq import cpu
from pdq.bench.arrivals import Arrivals
from pdq.bench.procstat import CpuProbe
from pdq.bench.record import RequestRecord, RunRecord
from pdq.bench.workload import BenchRequest, Workload
from pdq.client import Client, finish_name

MAX_THREADS = 512

Progress = Callable[[RequestRecord], None]


def stream_one(client: Client, req: BenchRequest, rec: RequestRecord, t0: float, timeout_s: float) -> RequestRecord:
    """Runs one request to its end, filling `rec` (times relative to t0). Never raises for an RPC error."""
    clock = time.perf_counter
    times = rec.token_times
    try:
        for msg in client.generate_stream(list(req.prompt_token_ids), timeout=timeout_s, max_tokens=req.max_tokens,
                                          temperature=0.0, ignore_eos=True):
            if msg.HasField("index"):
                times.append(clock() - t0)
            if msg.finish_reason:
                rec.finish_reason = finish_name(msg.finish_reason)
    except grpc.RpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.end = clock() - t0
    return rec


def run_service(target: str, name: str, strategy: str, workload: Workload, arrivals: Arrivals, *,
                api_keys: dict[str, str | None] | None = None, timeout_s: float = 600.0,
                on_done: Progress | None = None, cpu_probe: CpuProbe | None = None,
                client_policy: str = "normal") -> RunRecord:
    """Offers `workload` to the gateway at `target` with `arrivals`; returns when every request
    has ended. api_keys: tenant name -> API key (None or missing: the `Client` default,
    $PDQ_API_KEY or the dev key of a local `pdq up`). cpu_probe: the cluster's processes, whose
    CPU time during the run goes into the record. client_policy: the CPU policy (pdq.cpu) of the
    client threads, for the run."""
    api_keys = api_keys or {}
    tenants = {r.tenant for r in workload.requests}
    clients = {t: Client(target, api_key=api_keys.get(t)) for t in tenants}
    reqs = workload.requests
    records: list[RequestRecord | None] = [None] * len(reqs)
    finished: queue.Queue[RequestRecord] = queue.Queue()
    offsets = arrivals.offsets(len(reqs))
    workers = min(len(reqs), MAX_THREADS) if offsets is not None else arrivals.concurrency
    if cpu_probe:
        cpu_probe.start()
    cpu0 = time.process_time()
    t0 = time.perf_counter()

    def one(i: int, due: float) -> None:
        rec = records[i] = RequestRecord(reqs[i], due)
        try:
            stream_one(clients[reqs[i].tenant], reqs[i], rec, t0, timeout_s)
        except Exception as exc:  # a bug here must not hang the run: record it as the request's error
            rec.error, rec.end = f"client: {exc!r}", time.perf_counter() - t0
        finally:
            finished.put(rec)

    try:
        with cpu.policy(client_policy), ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench") as pool:
            if offsets is None:  # closed loop: each worker sends its next request when one ends
                order = iter(range(len(reqs)))
                lock = threading.Lock()

                def loop() -> None:
                    while True:
                        with lock:
                            i = next(order, None)
                        if i is None:
                            return
                        one(i, time.perf_counter() - t0)

                futures = [pool.submit(loop) for _ in range(workers)]
            else:
                futures = []
                for i, due in enumerate(offsets):
                    delay = t0 + due - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    futures.append(pool.submit(one, i, due))
            for _ in range(len(reqs)):
                rec = finished.get()
                if on_done:
                    on_done(rec)
            for f in futures:
                f.result()
    finally:
        for c in clients.values():
            c.close()
    client_cpu = time.process_time() - cpu0
    return RunRecord(name, strategy, workload, arrivals, list(records), client_cpu_s=client_cpu,
                     server_cpu_s=cpu_probe.stop() if cpu_probe else None)


def warm_up(target: str, vocab_id: int, n: int = 2, api_key: str | None = None, timeout_s: float = 600.0) -> None:
    """Sends `n` small requests at once and waits for them (loads lazily initialised paths)."""
    if n < 1:
        return
    with Client(target, api_key=api_key) as client:
        req = BenchRequest(-1, (vocab_id,) * 16, 4)
        with ThreadPoolExecutor(max_workers=n) as pool:
            recs = list(pool.map(lambda _: stream_one(client, req, RequestRecord(req, 0.0), 0.0, timeout_s), range(n)))
    errors = [r.error for r in recs if r.error]
    if errors:
        raise RuntimeError(f"warm-up request failed: {errors[0]}")
