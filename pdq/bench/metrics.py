"""From a `RunRecord` to the numbers users compare: pure functions, no IO.

- throughput: output tokens (as received) and completed requests per second of the run's
  duration (first due time to last end); and output tokens per CPU-second, when known;
- TTFT, e2e: per request, from its due time; ITL: every gap between consecutive tokens of a
  request, pooled over all requests; p50/p90/p99 with linear interpolation (numpy's default);
- goodput: completed requests per second that met the SLO: TTFT <= slo_ttft and TPOT (a
  request's mean inter-token time) <= slo_itl; without an SLO every completed request counts;
- per tenant: its share of output tokens, over the whole run and while every tenant still had
  work ("contended": until the first tenant got its last token), next to its fair share
  (weight / sum of weights).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdq.bench.record import RequestRecord, RunRecord

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics; None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_ms(values_s: Sequence[float]) -> dict:
    """{"p50", "p90", "p99", "mean"} in milliseconds (None when there are no values)."""
    out = {f"p{q}": _ms(percentile(values_s, q)) for q in QUANTILES}
    out["mean"] = _ms(sum(values_s) / len(values_s)) if values_s else None
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@dataclass(frozen=True)
class Slo:
    """Service-level objective in milliseconds; None = no bound."""

    ttft_ms: float | None = None
    itl_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > self.ttft_ms):
            return False
        return self.itl_ms is None or r.tpot is None or r.tpot * 1000 <= self.itl_ms

    def to_json(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms}


def _rate(count: float, duration: float) -> float:
    return round(count / duration, 3) if duration > 0 else 0.0


def summarize(run: RunRecord, slo: Slo = Slo()) -> dict:
    """One entry of the `--json` "runs" list (see BENCHMARKS.md for the schema)."""
    recs = run.requests
    done = [r for r in recs if r.ok]
    duration = run.duration
    tokens = sum(r.output_tokens for r in recs)
    good = [r for r in done if slo.met_by(r)]
    entry = {
        "name": run.name,
        "strategy": run.strategy,
        "workload": run.workload.name,
        "offered": run.arrivals.offered(),
        "arrivals": run.arrivals.label,
        "requests": len(recs),
        "completed": len(done),
        "errors": len(recs) - len(done),
        "length_mismatches": sum(1 for r in done if r.output_tokens != r.request.max_tokens),
        "duration_s": round(duration, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": _rate(tokens, duration),
        "requests_per_s": _rate(len(done), duration),
        "ttft_ms": latency_ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": latency_ms([gap for r in done for gap in r.itls]),
        "tpot_ms": latency_ms([r.tpot for r in done if r.tpot is not None]),
        "e2e_ms": latency_ms([r.e2e for r in done]),
        "goodput": _rate(len(good), duration),
        "goodput_output_tokens_per_s": _rate(sum(r.output_tokens for r in good), duration),
        "goodput_fraction": round(len(good) / len(recs), 4) if recs else 0.0,
        "slo": slo.to_json(),
        "client_cpu_pct": (round(100 * run.client_cpu_s / duration, 1)
                           if run.client_cpu_s is not None and duration > 0 else None),
        "output_tokens_per_cpu_s": tokens_per_cpu_s(run, tokens),
        "server_cpu_pct": ({name: round(100 * cpu / duration, 1) for name, cpu in run.server_cpu_s.items()}
                           if run.server_cpu_s and duration > 0 else None),
        "tenants": tenant_shares(run),
        "kinds": kind_latencies(run),
        "errors_sample": sorted({r.error for r in recs if r.error})[:5],
        **run.notes,
    }
    return entry


def tokens_per_cpu_s(run: RunRecord, tokens: int) -> float | None:
    """Output tokens per CPU-second of everything that worked for them: every process of a
    spawned cluster plus the benchmark process (or, for a baseline, its own process). Less
    sensitive than tokens/s to other load on a shared machine. None when the CPU is not known
    (e.g. a --target cluster)."""
    if run.client_cpu_s is None or run.server_cpu_s is None:
        return None
    cpu = run.client_cpu_s + sum(run.server_cpu_s.values())
    return round(tokens / cpu, 2) if cpu > 0 else None


def tenant_shares(run: RunRecord) -> dict:
    """{tenant: {weight, fair_share, requests, completed, output_tokens, share, share_contended,
    output_tokens_per_s, ttft_ms}}; empty for a single-tenant workload."""
    tenants = [t for t in run.workload.tenants if any(r.request.tenant == t.name for r in run.requests)]
    if len(run.workload.tenants) < 2:
        return {}
    by_tenant = {t.name: [r for r in run.requests if r.request.tenant == t.name] for t in tenants}
    last_token = {name: max((x for r in recs for x in r.token_times), default=math.inf)
                  for name, recs in by_tenant.items()}
    contended_until = min(last_token.values(), default=math.inf)
    total = sum(r.output_tokens for r in run.requests)
    total_contended = sum(1 for r in run.requests for x in r.token_times if x <= contended_until)
    weights = sum(t.weight for t in tenants)
    out = {}
    for t in tenants:
        recs = by_tenant[t.name]
        n_tokens = sum(r.output_tokens for r in recs)
        n_contended = sum(1 for r in recs for x in r.token_times if x <= contended_until)
        out[t.name] = {
            "weight": t.weight,
            "rate_share": t.rate_share,
            "fair_share": round(t.weight / weights, 4),
            "requests": len(recs),
            "completed": sum(1 for r in recs if r.ok),
            "output_tokens": n_tokens,
            "share": round(n_tokens / total, 4) if total else 0.0,
            "share_contended": round(n_contended / total_contended, 4) if total_contended else 0.0,
            "output_tokens_per_s": _rate(n_tokens, run.duration),
            "ttft_ms": latency_ms([r.ttft for r in recs if r.ok and r.ttft is not None]),
        }
    return out


def kind_latencies(run: RunRecord) -> dict:
    """{kind: {requests, ttft_ms, e2e_ms}} when the workload has more than one kind of request."""
    kinds = sorted({r.request.kind for r in run.requests})
    if len(kinds) < 2:
        return {}
    out = {}
    for kind in kinds:
        done = [r for r in run.requests if r.request.kind == kind and r.ok]
        out[kind or "other"] = {"requests": sum(1 for r in run.requests if r.request.kind == kind),
                                "ttft_ms": latency_ms([r.ttft for r in done if r.ttft is not None]),
                                "e2e_ms": latency_ms([r.e2e for r in done])}
    return out
