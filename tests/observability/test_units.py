"""Fast checks of the pure parts: when tracing is on, W3C context round trips, and the bulk
histogram the decode loop feeds once per step."""

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from pdq.observability import metrics, telemetry, telemetry_grpc


def test_tracing_is_on_only_with_an_exporter(monkeypatch):
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert not telemetry.wanted()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert telemetry.wanted()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not telemetry.wanted()
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not telemetry.wanted()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert telemetry.wanted()


def test_off_means_no_spans_and_no_interceptors():
    assert not telemetry.enabled()  # no exporter configured in the test process
    assert telemetry.start("x", "00-" + "a" * 32 + "-" + "b" * 16 + "-01") is None
    assert telemetry.current() is None
    assert telemetry_grpc.client_interceptors() is None
    telemetry.end(None, "event", "error")  # no-ops
    telemetry.add_event(None, "event")


def test_traceparent_round_trip():
    value = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ctx = telemetry.span_context_of(value)
    assert format(ctx.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(ctx.span_id, "016x") == "b7ad6b7169203331" and ctx.trace_flags.sampled
    assert telemetry.context_of("") is None and telemetry.context_of("garbage") is None


def test_bulk_histogram_exposes_what_a_histogram_would():
    buckets = (0.01, 0.1, 1.0)
    samples = [0.005, 0.01, 0.05, 0.1, 0.5, 2.0, 0.02]
    ref_registry, bulk_registry = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("itl_seconds", "doc", ("tier",), buckets=buckets, registry=ref_registry)
    for v in samples:
        ref.labels("a").observe(v)
    bulk = metrics.BulkHistogram("itl_seconds", "doc", ("tier",), buckets, registry=bulk_registry)
    bulk.observe_many([(("a",), v) for v in samples[:3]])
    bulk.observe_many([(("a",), v) for v in samples[3:]])

    def lines(registry):
        return sorted(line for line in generate_latest(registry).decode().splitlines()
                      if line.startswith("itl_seconds") and "_created" not in line)

    assert lines(bulk_registry) == lines(ref_registry)


def test_kv_pool_gauges_are_read_from_the_runner_when_scraped():
    from pdq.engine.kv_pool import KVUsage

    class Runner:
        def __init__(self):
            self.used = 0

        def usage(self) -> KVUsage:
            return KVUsage(seqs=1, blocks_used=self.used, blocks_total=64, blocks_cached=3, block_size=16,
                           tokens_cached=0)

    registry = CollectorRegistry()
    pools = metrics.KVPools(registry)
    runner = Runner()
    pools.watch("decode", runner)

    def gauge(name: str) -> float | None:
        return registry.get_sample_value(name, {"stage": "decode"})

    assert gauge("pdq_kv_pool_capacity_tokens") == 1024
    assert gauge("pdq_kv_pool_used_blocks") == 0
    runner.used = 16  # no call in between: the next scrape reads the pool as it is then
    assert gauge("pdq_kv_pool_used_blocks") == 16
    assert gauge("pdq_kv_pool_used_tokens") == 256
    assert gauge("pdq_kv_pool_usage_ratio") == 0.25
    assert gauge("pdq_kv_pool_cached_blocks") == 3
    del runner  # a runner that is gone is no longer reported
    assert gauge("pdq_kv_pool_used_blocks") is None

    class Broken:
        def usage(self):
            raise RuntimeError("pool gone")

    broken = Broken()
    pools.watch("prefill", broken)
    other = Runner()
    pools.watch("decode", other)
    # a pool that cannot be read leaves its gauges out; the scrape and the others go on
    assert registry.get_sample_value("pdq_kv_pool_capacity_tokens", {"stage": "prefill"}) is None
    assert gauge("pdq_kv_pool_capacity_tokens") == 1024


def test_cancel_sources_are_bounded():
    assert metrics.cancel_source("client") == "client"
    assert metrics.cancel_source("client disconnected") == "disconnect"
    assert metrics.cancel_source("operator alice") == "operator"
    assert metrics.cancel_source("anything else") == "other"
