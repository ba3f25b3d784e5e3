"""What tracing every request costs: `pdq bench --spawn` on the mixed workload with tracing off,
then on (every request sampled, OTLP/gRPC to an in-process sink that counts the spans), in
alternating pairs so the machine's noise falls on both sides alike.

    .venv/bin/python scripts/trace_cost.py [--pairs 3] [--requests 64] [--workload mixed]

Prints each run's output tokens/s and server CPU, then on/off ratios: of the medians, and the
geometric mean of the pairs' ratios.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    """Accepts OTLP trace exports and only counts their spans."""

    def __init__(self):
        self.spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


def bench(args: argparse.Namespace, env: dict[str, str], out: str) -> dict:
    cmd = [sys.executable, "-m", "pdq.cli", "bench", "--spawn", "--strategies", "continuous",
           "--workload", args.workload, "--requests", str(args.requests), "--json", out, "--no-progress"]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        run = json.load(f)["runs"][0]
    return {"tok_s": run["output_tokens_per_s"], "ok": run["completed"], "cpu": sum(run["server_cpu_pct"].values()),
            "ttft_p50": run["ttft_ms"]["p50"], "itl_p50": run["itl_ms"]["p50"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--workload", default="mixed")
    args = parser.parse_args()

    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
              "OTEL_TRACES_SAMPLER": "always_on"}
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    results: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                before = sink.spans
                got = bench(args, traced if mode == "on" else {}, os.path.join(tmp, f"{mode}{i}.json"))
                got["spans"] = sink.spans - before
                results[mode].append(got)
                print(f"pair {i} {mode:>3}: {got['tok_s']:7.1f} out tok/s  {got['ok']}/{args.requests} ok  "
                      f"server CPU {got['cpu']:5.0f}%  TTFT p50 {got['ttft_p50']:7.0f} ms  "
                      f"ITL p50 {got['itl_p50']:5.1f} ms  spans exported {got['spans']}", flush=True)
    server.stop(None)
    on = [r["tok_s"] for r in results["on"]]
    off = [r["tok_s"] for r in results["off"]]
    paired = [a / b for a, b in zip(on, off)]
    print(f"throughput on/off: median {statistics.median(on) / statistics.median(off):.3f}, "
          f"geometric mean of pairs {math.exp(statistics.fmean(math.log(r) for r in paired)):.3f} "
          f"(pairs: {', '.join(f'{r:.3f}' for r in paired)})")
    cpu_on = statistics.median(r["cpu"] for r in results["on"])
    cpu_off = statistics.median(r["cpu"] for r in results["off"])
    print(f"server CPU on/off (median): {cpu_on:.0f}% / {cpu_off:.0f}% = {cpu_on / cpu_off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
