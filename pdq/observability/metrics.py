"""Prometheus metrics of every pdq process, and the `/metrics` HTTP server each one runs.

Every metric is defined here, in the default registry, with at least one label, so a process
shows samples only of what it updates: the gateway its RPCs and rejections, the scheduler
queue time, depth and dispatch batches, the prefill worker TTFT, prompt tokens, passes and
KV hand-offs, the decode worker inter-token latency, e2e latency, steps, padding and KV use.
Request-level latencies carry `tier` and `tenant`. Units are seconds, bytes, tokens.

The model loops update metrics once per step (`decode_step`, `prefill_pass`), never once per
token: inter-token latencies of a whole step go into `ITL` in one call.
"""

import bisect
import logging
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger("pdq.metrics")

REQUEST_LABELS = ("tier", "tenant")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class BulkHistogram:
    """A labelled histogram fed many observations per call under one lock (the decode loop's
    inter-token latencies: one call per step, not one per token). Exposed like `Histogram`."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str], buckets: Iterable[float],
                 registry=REGISTRY):
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = sorted(float(b) for b in buckets)
        self._rows: dict[tuple[str, ...], list[float]] = {}  # labels -> counts per bucket (+Inf last), then sum
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def observe_many(self, samples: Iterable[tuple[tuple[str, ...], float]]) -> None:
        """samples: (label values, seconds) pairs."""
        width = len(self.bounds) + 1
        with self._lock:
            for labels, value in samples:
                row = self._rows.get(labels)
                if row is None:
                    row = self._rows[labels] = [0.0] * (width + 1)
                row[bisect.bisect_left(self.bounds, value)] += 1
                row[width] += value

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            rows = {k: list(v) for k, v in self._rows.items()}
        for labels, row in rows.items():
            cumulative, buckets = 0.0, []
            for bound, count in zip(self.bounds + [float("inf")], row):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric(list(labels), buckets, row[-1])
        yield family


# -- requests (labels tier, tenant) -----------------------------------------------------------

QUEUE_TIME = Histogram("pdq_queue_time_seconds", "Time from arrival (or requeue) to dispatch to a prefill worker.",
                       REQUEST_LABELS, buckets=LATENCY_BUCKETS)
TTFT = Histogram("pdq_time_to_first_token_seconds", "Time from arrival to the first token written.",
                 REQUEST_LABELS, buckets=LATENCY_BUCKETS)
ITL = BulkHistogram("pdq_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                    REQUEST_LABELS, ITL_BUCKETS)
E2E = Histogram("pdq_e2e_request_latency_seconds", "Time from arrival to the last token of a completed request.",
                REQUEST_LABELS, buckets=LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("pdq_prompt_tokens", "Prompt tokens prefilled.", REQUEST_LABELS)
GENERATED_TOKENS = Counter("pdq_generated_tokens", "Tokens generated (the first one by prefill).", REQUEST_LABELS)

# -- request outcomes -------------------------------------------------------------------------

REJECTIONS = Counter("pdq_rejections", "Requests refused at the gateway, by reason "
                     "(validation reason such as PROMPT_TOO_LONG, UNAUTHENTICATED, QUEUE_FULL).", ("reason",))
CANCELLATIONS = Counter("pdq_cancellations", "Cancel requests, by source (client, disconnect, operator).", ("source",))
TIMEOUTS = Counter("pdq_timeouts", "Requests ended by their deadline, by stage (gateway, scheduler, prefill, decode).",
                   ("stage",))
PREEMPTIONS = Counter("pdq_preemptions", "Running sequences a decode worker preempted by recompute to make room for a "
                      "better tier's request, by the preempted request's tier.", ("tier",))
REQUEUES = Counter("pdq_requeues", "Attempts given back to the scheduler (retries, migrations), by stage and "
                   "outcome (QUEUED again, or FAILED with attempts spent).", ("stage", "outcome"))

# -- batching and KV ----------------------------------------------------------------------------

BATCH_SIZE = Histogram("pdq_batch_size", "Sequences per batch: dispatch (per prefill batch), prefill "
                       "(per forward pass), decode (per step, padded seats included).", ("stage",), buckets=BATCH_BUCKETS)
BATCH_TOKENS = Histogram("pdq_batch_tokens", "Tokens per batch: prompt tokens per dispatch and per prefill pass, "
                         "tokens generated per decode step.", ("stage",), buckets=TOKEN_BUCKETS)
TOKEN_BUDGET_USE = Histogram("pdq_token_budget_usage_ratio", "Share of the per-batch token budget used.",
                             ("stage",), buckets=RATIO_BUCKETS)
STEP_SECONDS = Histogram("pdq_step_duration_seconds", "Wall time of one model step (prefill pass, decode step).",
                         ("stage",), buckets=LATENCY_BUCKETS)
SEQ_STEPS = Counter("pdq_decode_seq_steps", "Sequence-steps computed by the decode loop; kind=wasted counts seats "
                    "kept for finished sequences (request-level strategies' padding).", ("strategy", "kind"))
PADDING = Gauge("pdq_decode_padding_ratio", "Wasted over computed sequence-steps since start.", ("strategy",))


class KVPools:
    """The KV pools' gauges (`pdq_kv_pool_*`, label `stage`), read from each watched runner when
    /metrics is scraped: a decode step costs nothing for them (publishing five gauges every
    step took ~30 us of the model thread's time)."""

    GAUGES = (("pdq_kv_pool_used_tokens", "KV positions in blocks held by sequences.", "tokens_used"),
              ("pdq_kv_pool_capacity_tokens", "KV positions of the pool.", "tokens_capacity"),
              ("pdq_kv_pool_used_blocks", "KV blocks held by sequences.", "blocks_used"),
              ("pdq_kv_pool_cached_blocks", "Free KV blocks still holding a reusable prefix.", "blocks_cached"),
              ("pdq_kv_pool_usage_ratio", "Share of KV blocks held by sequences.", "fraction"))

    def __init__(self, registry=REGISTRY):
        # stage -> the runner's weak reference (anything with usage() -> KVUsage); weak, so a
        # runner that is gone (a test's, a stopped loop's) takes its pool with it
        self._runners: dict[str, weakref.ref] = {}
        if registry is not None:
            registry.register(self)

    def watch(self, stage: str, runner: Any) -> None:
        """Reports `runner`'s pool as `stage` from now on (in place of any runner before; None:
        a loop built without a runner, as some tests build one, reports nothing)."""
        if runner is not None:
            self._runners[stage] = weakref.ref(runner)

    def _families(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(name, doc, labels=["stage"]) for name, doc, _ in self.GAUGES]

    def describe(self):
        return self._families()

    def collect(self):
        families = self._families()
        for stage, ref in list(self._runners.items()):
            runner = ref()
            if runner is None:
                continue
            try:
                usage = runner.usage()  # under the pool's own lock: safe beside the model thread
            except Exception as exc:  # a scrape goes on without this pool: the other metrics still answer
                log.warning("KV pool gauges of %s not read: %s", stage, exc)
                continue
            for family, (_, _, field) in zip(families, self.GAUGES):
                family.add_metric([stage], getattr(usage, field))
        yield from families


KV_POOLS = KVPools()
PREFIX_QUERIED = Counter("pdq_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.", ("stage",))
PREFIX_HITS = Counter("pdq_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (their prefill skipped).",
                      ("stage",))
KV_TRANSFER = Histogram("pdq_kv_transfer_seconds", "Duration of a KV hand-off, prefill to decode worker.",
                        ("outcome", "transport"), buckets=LATENCY_BUCKETS)
KV_TRANSFER_BYTES = Counter("pdq_kv_transfer_bytes", "KV cache bytes handed off.", ("outcome", "transport"))
KV_SKIPPED_TOKENS = Counter("pdq_kv_transfer_skipped_tokens", "Prompt positions whose K/V a hand-off left out: the "
                            "decode worker's prefix cache held them.")
KV_PREFIX_MISSES = Counter("pdq_kv_transfer_prefix_misses", "Hand-offs sent whole again: the decode worker no longer "
                           "held the prefix its heartbeat named (PREFIX_MISSING).")

# -- scheduler ----------------------------------------------------------------------------------

QUEUE_DEPTH = Gauge("pdq_queue_depth", "Queued requests.", REQUEST_LABELS)
QUEUE_TOKENS = Gauge("pdq_queue_tokens", "Tokens of the queued requests (prompt + max_tokens): the work waiting, what "
                     "prefill and decode capacity scale on.", REQUEST_LABELS)
LIVE_WORKERS = Gauge("pdq_live_workers", "Workers with a fresh heartbeat.", ("role",))
SCHEDULER_LEADER = Gauge("pdq_scheduler_leader", "1 while this scheduler holds the dispatch lease (it dispatches "
                         "and sweeps), 0 on standby (it serves submits and cancels).")

# -- gRPC (every process) -----------------------------------------------------------------------

LOOP_ALIVE = Gauge("pdq_loop_alive", "1 while a long-lived loop runs (model loops, listeners, follower, dispatcher, "
                   "janitor, heartbeats); 0 once it stopped or gave up.", ("loop",))
LOOP_PROGRESS = Gauge("pdq_loop_last_progress_timestamp_seconds", "When a long-lived loop last completed a round "
                      "(Unix seconds): a stale value with pdq_loop_alive 1 is a stuck loop.", ("loop",))
LOOP_ERRORS = Counter("pdq_loop_errors", "Errors a long-lived loop met and rode through (logged, backed off, "
                      "resumed).", ("loop",))
RPC_STARTED = Counter("pdq_grpc_server_started", "RPCs started.", ("service", "method"))
RPC_HANDLED = Counter("pdq_grpc_server_handled", "RPCs completed, by status code.", ("service", "method", "code"))
RPC_UNEXPECTED = Counter("pdq_rpc_unexpected_errors", "RPCs that raised an unexpected error (a bug: logged with its "
                         "traceback, answered UNAVAILABLE).", ("method",))
RPC_SECONDS = Histogram("pdq_grpc_server_handling_seconds", "RPC duration (streams: until the last message).",
                        ("service", "method"), buckets=LATENCY_BUCKETS)
HTTP_SECONDS = Histogram("pdq_http_server_handling_seconds", "HTTP request duration on the gateway's OpenAI-compatible "
                         "door (streams: until the last event), by route and status.", ("route", "status"),
                         buckets=LATENCY_BUCKETS)


# -- updates from the model loops (once per step) -------------------------------------------------

_prefix_seen: dict[str, tuple[int, int]] = {}  # stage -> the block manager's counters last published


def prefix_cache(stage: str, runner: Any) -> None:
    """Publishes what a runner's prefix cache counted since the last call (its occupancy is
    `KV_POOLS`', read at scrape time)."""
    blocks = runner.pool.blocks
    queried, hits = _prefix_seen.get(stage, (0, 0))
    if blocks.queried_tokens >= queried:
        PREFIX_QUERIED.labels(stage).inc(blocks.queried_tokens - queried)
        PREFIX_HITS.labels(stage).inc(blocks.hit_tokens - hits)
    _prefix_seen[stage] = (blocks.queried_tokens, blocks.hit_tokens)


def prefill_pass(seqs: int, tokens: int, budget: int, seconds: float) -> None:
    BATCH_SIZE.labels("prefill").observe(seqs)
    BATCH_TOKENS.labels("prefill").observe(tokens)
    TOKEN_BUDGET_USE.labels("prefill").observe(min(1.0, tokens / budget) if budget else 0.0)
    STEP_SECONDS.labels("prefill").observe(seconds)


class DecodeStepStats:
    """Cumulative decode-loop counters turned into metric increments once per step."""

    def __init__(self, strategy: str):
        self.strategy = strategy
        self._seq_steps = 0
        self._wasted = 0
        self._computed_counter = SEQ_STEPS.labels(strategy, "computed")
        self._wasted_counter = SEQ_STEPS.labels(strategy, "wasted")
        self._padding = PADDING.labels(strategy)
        self._batch = BATCH_SIZE.labels("decode")
        self._tokens = BATCH_TOKENS.labels("decode")
        self._step = STEP_SECONDS.labels("decode")
        self._generated: dict[tuple[str, str], Counter] = {}

    def step(self, seq_steps: int, wasted: int, batch: int, seconds: float,
             itl: list[tuple[tuple[str, str], float]]) -> None:
        """seq_steps, wasted: the loop's cumulative counters; itl: (tier, tenant) -> gap, per token."""
        if seq_steps > self._seq_steps:
            self._computed_counter.inc(seq_steps - self._seq_steps)
            self._seq_steps = seq_steps
        if wasted > self._wasted:
            self._wasted_counter.inc(wasted - self._wasted)
            self._wasted = wasted
        self._padding.set(self._wasted / self._seq_steps if self._seq_steps else 0.0)
        self._batch.observe(batch)
        self._tokens.observe(len(itl))
        self._step.observe(seconds)
        if itl:
            ITL.observe_many(itl)
            per_labels: dict[tuple[str, str], int] = {}
            for labels, _ in itl:
                per_labels[labels] = per_labels.get(labels, 0) + 1
            for labels, n in per_labels.items():
                counter = self._generated.get(labels)
                if counter is None:
                    counter = self._generated[labels] = GENERATED_TOKENS.labels(*labels)
                counter.inc(n)


def cancel_source(reason: str) -> str:
    """A bounded label for a cancel reason ("client", "client disconnected", "operator ...")."""
    low = (reason or "client").lower()
    if "disconnect" in low:
        return "disconnect"
    if low.startswith("operator") or "admin" in low:
        return "operator"
    if low.startswith("client"):
        return "client"
    return "other"


# -- the /metrics server ----------------------------------------------------------------------------


def serve(port: int, host: str = "127.0.0.1") -> int | None:
    """Serves /metrics on host:port (0 = any free port) in a daemon thread, for the life of the
    process. -> the bound port, None when port < 0 (off)."""
    if port < 0:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
