"""Every process serves Prometheus /metrics; a request moves the histograms of each hop."""

import time

import grpc
import pytest

from tests.oracles import scrape, value


def scrape_all(cluster) -> dict:
    return {c.name: scrape(c.metrics_url(cluster.host)) for c in cluster.children}


def test_every_process_serves_metrics(traced_cluster):
    for child in traced_cluster.children:
        assert child.metrics_port > 0
        samples = scrape(child.metrics_url(traced_cluster.host))
        assert any(name.startswith("python_") or name.startswith("process_") for name, _ in samples)


def test_histograms_move(traced_cluster, client):
    req = {"tier": "interactive", "tenant": "default"}
    before = scrape_all(traced_cluster)
    client.generate("metrics please", max_tokens=8, ignore_eos=True)
    with pytest.raises(grpc.RpcError):
        client.generate("x", max_tokens=100_000)

    def moved(name: str, process: str, by: float = 1, **labels) -> bool:
        return value(after[process], name, **labels) - value(before[process], name, **labels) >= by

    deadline = time.monotonic() + 10
    while True:  # the workers update after their step; give them a moment
        after = scrape_all(traced_cluster)
        if moved("pdq_e2e_request_latency_seconds_count", "decode-0", **req) or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    assert moved("pdq_grpc_server_handled_total", "gateway", service="pdq.v1.Generation", method="Generate", code="OK")
    assert moved("pdq_rejections_total", "gateway", reason="MAX_TOKENS_TOO_LARGE")
    assert moved("pdq_queue_time_seconds_count", "scheduler", **req)
    assert moved("pdq_batch_size_count", "scheduler", stage="dispatch")
    assert value(after["scheduler"], "pdq_live_workers", role="decode") == 1
    assert moved("pdq_time_to_first_token_seconds_count", "prefill-0", **req)
    assert moved("pdq_prompt_tokens_total", "prefill-0", by=3, **req)
    assert moved("pdq_batch_tokens_count", "prefill-0", stage="prefill")
    assert moved("pdq_kv_transfer_seconds_count", "prefill-0", outcome="ok", transport="tcp")
    assert moved("pdq_inter_token_latency_seconds_count", "decode-0", by=7, **req)  # 8 tokens, the first from prefill
    assert moved("pdq_inter_token_latency_seconds_bucket", "decode-0", by=7, le="+Inf", **req)
    assert moved("pdq_generated_tokens_total", "decode-0", by=7, **req)
    assert moved("pdq_e2e_request_latency_seconds_count", "decode-0", **req)
    assert moved("pdq_batch_size_count", "decode-0", by=7, stage="decode")
    assert value(after["decode-0"], "pdq_kv_pool_capacity_tokens", stage="decode") > 0
    assert value(after["decode-0"], "pdq_decode_padding_ratio", strategy="continuous") == 0


def test_the_queue_gauges_count_waiting_requests_and_their_tokens(traced_cluster, client):
    """What an autoscaler reads (deploy/kubernetes/autoscaling.yaml): queued requests and tokens
    (prompt + max_tokens) per tier and tenant, on the scheduler."""
    from pdq.client import OperatorClient

    labels = {"tier": "batch", "tenant": "default"}
    with OperatorClient(traced_cluster.target) as op:
        op.pause(tier="batch")
        try:
            rids = [client.submit([5, 6, 7, 8], max_tokens=12, tier="batch") for _ in range(3)]
            deadline = time.monotonic() + 10
            while True:  # the scheduler refreshes its queue gauges once a second
                got = scrape(next(c for c in traced_cluster.children if c.name == "scheduler")
                             .metrics_url(traced_cluster.host))
                if value(got, "pdq_queue_depth", **labels) == 3 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert value(got, "pdq_queue_depth", **labels) == 3
            assert value(got, "pdq_queue_tokens", **labels) == 3 * (4 + 12)
        finally:
            op.pause(tier="batch", resume=True)
    for rid in rids:
        assert client.get_result(rid, wait_ms=30_000).state == "COMPLETED"
