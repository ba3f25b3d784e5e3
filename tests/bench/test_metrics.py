"""Percentiles, throughput, goodput under an SLO, per-tenant shares: hand-computed cases."""

import numpy as np
import pytest

from pdq.bench.metrics import Slo, latency_ms, percentile, summarize
from pdq.bench.workload import Tenant
from tests.bench.conftest import make_record, make_run


@pytest.mark.parametrize("values", [[1.0], [3.0, 1.0], [5, 1, 4, 2, 3], list(np.random.default_rng(0).random(101))])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_is_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert latency_ms([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert latency_ms([0.001, 0.003]) == {"p50": 2.0, "p90": 2.8, "p99": 2.98, "mean": 2.0}


def test_throughput_latencies_and_goodput():
    recs = [make_record(0.0, [0.1, 0.2, 0.3]),           # TTFT 100 ms, TPOT 100 ms, e2e 300 ms
            make_record(0.0, [0.5, 0.55, 0.6, 0.65]),    # TTFT 500 ms, TPOT 50 ms
            make_record(1.0, [1.05, 2.05], end=2.0 + 1)]  # TTFT 50 ms, TPOT 1000 ms, e2e 2 s
    run = make_run(recs, client_cpu_s=0.3)
    s = summarize(run)
    assert s["duration_s"] == 3.0 and s["output_tokens"] == 9
    assert s["output_tokens_per_s"] == 3.0 and s["requests_per_s"] == 1.0
    assert s["ttft_ms"]["p50"] == 100.0 and s["e2e_ms"]["p50"] == 650.0
    assert s["itl_ms"]["p50"] == pytest.approx(75.0)  # gaps: .05 .05 .05 | .1 .1 1.0
    assert s["goodput"] == 1.0 and s["goodput_fraction"] == 1.0  # no SLO: every completed request
    assert s["client_cpu_pct"] == 10.0 and s["errors"] == 0 and s["length_mismatches"] == 0

    slo = summarize(run, Slo(ttft_ms=200))  # the 500 ms TTFT misses
    assert slo["goodput"] == pytest.approx(2 / 3, abs=1e-3) and slo["goodput_fraction"] == pytest.approx(0.6667)
    both = summarize(run, Slo(ttft_ms=200, itl_ms=150))  # the 1 s TPOT misses too
    assert both["goodput"] == pytest.approx(1 / 3, abs=1e-3)
    assert both["goodput_output_tokens_per_s"] == 1.0 and both["slo"] == {"ttft_ms": 200, "itl_ms": 150}


def test_failed_and_short_requests_are_counted_not_timed():
    recs = [make_record(0.0, [0.1, 0.2]),
            make_record(0.0, [0.3], end=0.4, error="UNAVAILABLE: gone"),
            make_record(0.0, [0.1, 0.2], max_tokens=5)]
    s = summarize(make_run(recs))
    assert s["completed"] == 2 and s["errors"] == 1 and s["errors_sample"] == ["UNAVAILABLE: gone"]
    assert s["length_mismatches"] == 1
    assert s["output_tokens"] == 5  # tokens received count, even of a failed request
    assert s["goodput_fraction"] == pytest.approx(2 / 3, abs=1e-3)


def test_tenant_shares():
    tenants = (Tenant("a", weight=1.0, rate_share=3.0), Tenant("b", weight=3.0))
    recs = [make_record(0.0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], tenant="a"),  # 6 tokens, 3 of them by t=0.3
            make_record(0.0, [0.15, 0.3], tenant="b")]                    # b is done at 0.3
    s = summarize(make_run(recs, tenants=tenants))
    a, b = s["tenants"]["a"], s["tenants"]["b"]
    assert (a["share"], b["share"]) == (0.75, 0.25)
    assert (a["share_contended"], b["share_contended"]) == (0.6, 0.4)
    assert (a["fair_share"], b["fair_share"]) == (0.25, 0.75)
    assert a["output_tokens"] == 6 and a["requests"] == 1 and b["ttft_ms"]["p50"] == 150.0
    assert summarize(make_run(recs[:1]))["tenants"] == {}  # one tenant: no table


def test_kinds_split_latencies():
    recs = [make_record(0.0, [1.0], kind="long"), make_record(0.0, [0.1], kind="short"),
            make_record(0.0, [0.3], kind="short")]
    kinds = summarize(make_run(recs))["kinds"]
    assert kinds["long"]["ttft_ms"]["p50"] == 1000.0 and kinds["short"]["requests"] == 2
    assert kinds["short"]["ttft_ms"]["p50"] == 200.0
