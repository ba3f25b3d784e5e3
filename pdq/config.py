"""Typed configuration: one frozen dataclass per process, filled from flags and `PDQ_*` env vars.

Every field `foo_bar` is the flag `--foo-bar` and the env var `PDQ_FOO_BAR`; a flag beats the
env var, which beats the default. Validation lives in each class's `__post_init__`.
"""

import argparse
import dataclasses
import os
import socket
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdq.ops.memory import DEFAULT_HEAP_RESERVE_MB
from pdq.state.redis_url import check_redis_url

DTYPE_NAMES = ("float32", "float16", "bfloat16")  # a worker's --dtype (PDQ_DTYPE) choices

T = TypeVar("T")

TIERS = ("interactive", "batch")
# Scheduling policies by layer, chosen by name (implemented in scheduler/policies/).
TIER_POLICIES = ("aging", "strict")
FAIR_POLICIES = ("vtc", "fifo")
ORDER_POLICIES = ("fcfs", "sjf", "edf")
STRATEGIES = ("continuous", "dynamic", "static")
KV_TRANSPORTS = ("grpc", "tcp")
UP_CONTROL_POLICY_HELP = ("CPU policy of Redis, the scheduler and the gateway (pdq.ops.cpu): batch (default) lets them run "
                          "when a core frees up instead of preempting the model's threads when they wake; normal: as "
                          "any process")
UP_COLOCATE_HELP = ("each decode worker also prefills, in the same process (decode_worker --colocate): one model and "
                    "KV pool, prompt chunks and decode rows in one forward pass, no KV transfer, no prefill-only "
                    "workers. The most tokens/s where the roles share one machine's cores")
UP_SEPARATE_HELP = ("prefill workers (--prefill) and decode workers as separate processes, the KV cache handed from "
                    "one to the other (P/D disaggregation, as when each role has machines of its own); on one "
                    "machine, fewer tokens/s than colocated")


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(kind: Any, text: str) -> Any:
    if kind in (bool, "bool"):
        return _parse_bool(text)
    if kind in (int, "int"):
        return int(text)
    if kind in (float, "float"):
        return float(text)
    return text


def field_default(f: dataclasses.Field) -> Any:
    """A config field's default value."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one flag per field of dataclass `cls`; unset flags fall back to env, then default."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        helptext = f.metadata.get("help", "")
        env = "PDQ_" + f.name.upper()
        default = field_default(f)
        parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(),
                            help=f"{helptext} (env {env}; default {default!r})")
        if f.type in (bool, "bool") and default is True:  # --no-X: the same as --X false
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_const", const="false",
                                help=f"the same as {flag} false")


def from_arguments(cls: type[T], args: argparse.Namespace | None = None, **overrides: Any) -> T:
    """Builds `cls` from parsed flags, then `PDQ_*` env vars, then field defaults."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = getattr(args, f.name, None) if args is not None else None
        if raw is None:
            raw = os.environ.get("PDQ_" + f.name.upper())
        if raw is not None:
            try:
                values[f.name] = _convert(f.type, raw) if isinstance(raw, str) else raw
            except ValueError as exc:
                raise ValueError(f"--{f.name.replace('_', '-')}: {exc}") from None
    values.update(overrides)
    return cls(**values)


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class StoreConfig:
    """Where the shared state lives."""

    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={
        "help": "Redis URL: redis://, rediss:// or unix:// (one server), or redis+sentinel://[[user]:password@]"
                "host[:port][,host[:port]...]/service[/db] (the primary Redis Sentinel names, followed through "
                "failovers; rediss+sentinel:// over TLS)"})
    redis_max_connections: int = field(default=64, metadata={"help": "most Redis connections of this process's pool "
                                                                     "(a call finding all busy waits for one)"})
    redis_outage_s: float = field(default=30.0, metadata={
        "help": "a Redis outage up to this long is ridden through: commands are retried (backoff with jitter) and "
                "requests wait; past it, calls fail UNAVAILABLE and a model loop takes its worker down to be restarted"})
    key_prefix: str = field(default="pdq", metadata={"help": "prefix of every Redis key"})
    tiers: str = field(default=",".join(TIERS), metadata={"help": "priority tiers, best first, comma-separated (the same on every role)"})
    max_attempts: int = field(default=3, metadata={"help": "failed attempts (a failed KV hand-off, an error on a worker) "
                                                           "before a request FAILS"})
    max_lost_attempts: int = field(default=20, metadata={
        "help": "attempts lost to infrastructure (a worker killed, reaped or shutting down, a prefill lease expired) "
                "before a request FAILS; they do not count towards max_attempts"})
    retry_backoff_ms: int = field(default=500, metadata={
        "help": "a request whose attempt failed waits this long before its next dispatch, doubling per failure"})
    retry_backoff_max_ms: int = field(default=10_000, metadata={"help": "longest wait of retry_backoff_ms"})
    metrics_port: int = field(default=0, metadata={"help": "port of the Prometheus /metrics endpoint, on the process's "
                                                           "host (0 = any free port, logged; -1 = off)"})
    worker_timeout_s: float = field(default=10.0, metadata={
        "help": "a worker silent this long is gone: the scheduler requeues its requests, the operator API stops "
                "listing it, workers heartbeat well within it (the same on every role)"})
    internal_ca: str = field(default="", metadata={"help": "CA (PEM) of mutual TLS between pdq's roles (with "
                                                          "--internal-cert/--internal-key, the same on every role)"})
    internal_cert: str = field(default="", metadata={"help": "this role's certificate (PEM), signed by --internal-ca"})
    internal_key: str = field(default="", metadata={"help": "private key (PEM) of --internal-cert"})
    internal_tls_name: str = field(default="pdq-internal", metadata={
        "help": "name internal certificates carry (subjectAltName), checked instead of the dialled address"})

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url)
        _positive("max_attempts", self.max_attempts)
        _positive("max_lost_attempts", self.max_lost_attempts)
        if not 0 <= self.retry_backoff_ms <= self.retry_backoff_max_ms:
            raise ValueError(f"retry_backoff_ms ({self.retry_backoff_ms}) must be in [0, retry_backoff_max_ms "
                             f"({self.retry_backoff_max_ms})]")
        _positive("redis_max_connections", self.redis_max_connections)
        _positive("redis_outage_s", self.redis_outage_s)
        _positive("worker_timeout_s", self.worker_timeout_s)
        names = self.tier_names
        if not names or len(set(names)) != len(names) or any(not n or any(c in n for c in " :{}") for n in names):
            raise ValueError(f"tiers must be distinct non-empty names without spaces, colons or braces, got {self.tiers!r}")
        if not self.key_prefix or any(c in self.key_prefix for c in " {}"):
            raise ValueError(f"key_prefix must be non-empty without spaces or braces, got {self.key_prefix!r}")
        if len({bool(self.internal_ca), bool(self.internal_cert), bool(self.internal_key)}) > 1:
            raise ValueError("internal_ca, internal_cert and internal_key go together (mutual TLS between roles)")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be -1 (off), 0 (any free port) or a port, got {self.metrics_port}")
        for name in ("port", "kv_port"):  # the listening ports of the role (kv_port: decode workers)
            if not 0 <= getattr(self, name, 0) <= 65535:
                raise ValueError(f"{name} must be 0 (any free port) or 1..65535, got {getattr(self, name)}")

    def redis(self, aio: bool = True) -> Any:
        """A Redis client of this process (`pdq.state.redisconn`): bounded pool, outages ridden through."""
        from pdq.state import redisconn

        connect = redisconn.connect_async if aio else redisconn.connect
        return connect(self.redis_url, max_connections=self.redis_max_connections, outage_s=self.redis_outage_s)

    @property
    def tier_names(self) -> list[str]:
        """The tiers, best first."""
        return [t.strip() for t in self.tiers.split(",")]


@dataclass(frozen=True)
class GatewayConfig(StoreConfig):
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50051, metadata={"help": "port of the public API (0 = any free port)"})
    scheduler_address: str = field(default="127.0.0.1:50052", metadata={
        "help": "scheduler host:port, or several comma-separated (the replicas of `pdq scheduler`: calls go to the one "
                "that answered last, and to the next when it is unreachable)"})
    model: str = field(default="builtin", metadata={"help": "builtin, builtin:SIZE, null[:STEP_MS] or a checkpoint dir (for the tokenizer)"})
    max_model_len: int = field(default=2048, metadata={"help": "prompt + max_tokens limit, capped by the model"})
    default_max_tokens: int = field(default=16, metadata={"help": "max_tokens when a request sets none"})
    auth_file: str = field(default="", metadata={"help": "API key file (YAML or JSON); empty = open, tenant 'default'"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate chain: serve TLS (with --tls-key)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    grace_s: float = field(default=5.0, metadata={"help": "seconds to finish calls on shutdown"})
    http_port: int = field(default=0, metadata={"help": "port of the OpenAI-compatible HTTP API (/v1/completions, "
                                                        "/v1/chat/completions, /v1/models, /health); 0 = off"})
    served_model_name: str = field(default="", metadata={"help": "the model's name in the HTTP API's `model` field "
                                                                  "(default: --model)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be 0 (off) or a port, got {self.http_port}")
        _positive("max_model_len", self.max_model_len)
        _positive("default_max_tokens", self.default_max_tokens)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        for address in self.scheduler_addresses:
            if not address or ":" not in address:
                raise ValueError(f"scheduler_address: each address must be host:port, got {self.scheduler_address!r}")

    @property
    def scheduler_addresses(self) -> list[str]:
        """The scheduler replicas, in the order the gateway tries them."""
        return [a.strip() for a in self.scheduler_address.split(",")]


@dataclass(frozen=True)
class SchedulerConfig(StoreConfig):
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50052, metadata={"help": "port of the internal Scheduler service"})
    max_batch_size: int = field(default=32, metadata={"help": "requests per prefill batch"})
    max_batched_tokens: int = field(default=4096, metadata={"help": "prompt tokens per prefill batch"})
    tier_policy: str = field(default="aging", metadata={"help": "between tiers: aging (a waiting request climbs one tier per aging_ms) or strict"})
    aging_ms: int = field(default=10000, metadata={"help": "wait that lifts a request one tier (tier_policy aging)"})
    fair_policy: str = field(default="vtc", metadata={"help": "between tenants of a tier: vtc (token-fair virtual counters) or fifo"})
    order_policy: str = field(default="fcfs", metadata={"help": "inside a tenant: fcfs, sjf (shortest prompt+max_tokens) or edf (earliest deadline)"})
    default_weight: float = field(default=1.0, metadata={"help": "fair-share weight of a tenant without one in its policy"})
    reserve_slots: int = field(default=1, metadata={"help": "decode slots kept free for tenants below their fair share while others are active (0 = off)"})
    preempt_lower_tiers: bool = field(default=False, metadata={"help": "a request finding every decode worker full has a running request of a lower tier preempted by recompute (it resumes later from its tokens)"})
    share_window_s: float = field(default=10.0, metadata={"help": "a tenant served this recently still counts as active for reserve_slots"})
    max_queued: int = field(default=10000, metadata={"help": "queued requests over all tenants"})
    max_queued_tokens: int = field(default=20_000_000, metadata={"help": "queued tokens (prompt + max_tokens) over all tenants"})
    tenant_max_queued: int = field(default=10000, metadata={"help": "queued requests per tenant (default of the tenant policy)"})
    tenant_max_queued_tokens: int = field(default=20_000_000, metadata={"help": "queued tokens per tenant (default of the tenant policy)"})
    retry_after_min_ms: int = field(default=100, metadata={"help": "shortest retry hint given with RESOURCE_EXHAUSTED"})
    retry_after_max_ms: int = field(default=30000, metadata={"help": "longest retry hint given with RESOURCE_EXHAUSTED"})
    prefill_lease_s: float = field(default=60.0, metadata={"help": "a claimed request not handed to its decode worker by then is requeued"})
    quarantine_after: int = field(default=3, metadata={
        "help": "a worker whose KV hand-offs failed this many times in a row, with at least two different workers on "
                "the other side, is quarantined (no new work while others can take it)"})
    quarantine_s: float = field(default=30.0, metadata={"help": "how long a first quarantine lasts; each repeat within "
                                                                  "an hour doubles it"})
    quarantine_max_s: float = field(default=600.0, metadata={"help": "longest quarantine"})
    prefix_routing: bool = field(default=True, metadata={
        "help": "place a prefill batch on the worker whose prefix cache holds the longest prefix of its prompts, weighed "
                "against the prompt tokens in flight there, and a request's separate decode worker by the share of its "
                "prompt cached there, its free slots and the prefix's home worker (--no-prefix-routing: the least "
                "loaded worker, the most free slots)"})
    prefix_weight: float = field(default=4.0, metadata={
        "help": "prefix_routing: prompt tokens in flight on a worker that one cached prefix token there outweighs (in-flight "
                "prompts count whole, though the cache serves most of them)"})
    dispatch_interval_ms: int = field(default=100, metadata={"help": "fallback poll period of the dispatcher (submits, freed "
                                                                      "slots, finished batches and requeues wake it at once)"})
    result_ttl_s: int = field(default=3600, metadata={"help": "how long finished requests stay in Redis"})
    grace_s: float = field(default=5.0, metadata={"help": "seconds to finish calls on shutdown"})
    scheduler_id: str = field(default="", metadata={"help": "unique scheduler name for the dispatch lease (default "
                                                            "scheduler-hostname-pid); a restarted scheduler with the "
                                                            "same name takes its lease back at once"})
    submit_wait_replicas: int = field(default=0, metadata={
        "help": "answer a submit only once this many Redis replicas have it (Redis WAIT on the submit's connection), "
                "so a failover cannot lose an acknowledged request; fewer within submit_wait_ms: UNAVAILABLE (the "
                "request is queued on the primary; a retry with the same request_id is safe); 0 = off"})
    submit_wait_ms: int = field(default=1000, metadata={"help": "how long a submit waits for submit_wait_replicas"})
    leader_lease_s: float = field(default=2.0, metadata={
        "help": "the dispatch lease: every scheduler serves submits, one at a time dispatches and sweeps; it renews "
                "its lease every quarter of this, and a standby takes over this long after the leader stops renewing"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_batch_size", "max_batched_tokens", "aging_ms", "default_weight", "max_queued",
                     "max_queued_tokens", "tenant_max_queued", "tenant_max_queued_tokens", "retry_after_min_ms",
                     "prefill_lease_s", "dispatch_interval_ms", "result_ttl_s",
                     "share_window_s", "quarantine_after", "quarantine_s", "leader_lease_s", "prefix_weight"):
            _positive(name, getattr(self, name))
        if self.reserve_slots < 0:
            raise ValueError(f"reserve_slots must be >= 0, got {self.reserve_slots}")
        if self.submit_wait_replicas < 0 or self.submit_wait_ms <= 0:
            raise ValueError(f"submit_wait_replicas must be >= 0 and submit_wait_ms > 0, got "
                             f"{self.submit_wait_replicas} and {self.submit_wait_ms}")
        if self.quarantine_max_s < self.quarantine_s:
            raise ValueError(f"quarantine_max_s ({self.quarantine_max_s}) must be >= quarantine_s ({self.quarantine_s})")
        if self.retry_after_max_ms < self.retry_after_min_ms:
            raise ValueError(f"retry_after_max_ms ({self.retry_after_max_ms}) must be >= retry_after_min_ms ({self.retry_after_min_ms})")
        for name, allowed in (("tier_policy", TIER_POLICIES), ("fair_policy", FAIR_POLICIES),
                              ("order_policy", ORDER_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    @property
    def leader_id(self) -> str:
        """This scheduler's name in the dispatch lease."""
        return self.scheduler_id or f"scheduler-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig(StoreConfig):
    """Shared by prefill and decode workers."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=0, metadata={"help": "port to listen on (0 = any free port)"})
    advertise_address: str = field(default="", metadata={"help": "host:port other hosts reach this worker at (default host:port)"})
    worker_id: str = field(default="", metadata={"help": "unique worker name (default role-hostname-pid)"})
    model: str = field(default="builtin", metadata={"help": "builtin, builtin:SIZE, a checkpoint dir, or null[:STEP_MS]: no compute, tokens chosen from each row's token and position, STEP_MS ms per forward pass (pdq.model.null; default 0), to measure the serving path alone"})
    device: str = field(default="", metadata={"help": "cpu, cuda, cuda:N (default: cuda when present)"})
    dtype: str = field(default="", metadata={"help": "float32, float16, bfloat16 (default: bfloat16 on a CPU with bfloat16 matrix instructions (amx_bf16 or avx512_bf16), float32 on other CPUs, the checkpoint's 16-bit dtype or bfloat16 on cuda)"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = torch default)"})
    pin_threads: bool = field(default=False, metadata={"help": "on CPU, when torch's threads are as many as this worker's CPUs: pin the model thread and torch's threads one per CPU (pdq.ops.cpu.pin_model_threads); only for a worker alone on its cores (pdq up sets it for a lone colocated worker)"})
    max_seq_len: int = field(default=2048, metadata={"help": "longest sequence (prompt + output) in tokens"})
    kv_output_grant_tokens: int = field(default=256, metadata={
        "help": "KV positions a decode slot grants up front for a request's output, beyond its prompt (at most its "
                "max_tokens); a longer output takes blocks as it grows, and when they run out the least important "
                "running sequence (lowest tier, then the tenant holding the most sequences here, then the newest) is "
                "preempted by recompute; 0 = its whole max_tokens up front (never preempted for memory)"})
    kv_block_size: int = field(default=16, metadata={"help": "positions per KV block: a sequence holds the blocks it uses, and the prefix cache shares whole blocks"})
    prefix_cache: bool = field(default=True, metadata={"help": "automatic prefix caching: a prompt whose leading blocks another request computed shares them and skips their prefill (--no-prefix-cache: off)"})
    heap_reserve_mb: int = field(default=DEFAULT_HEAP_RESERVE_MB, metadata={"help": "MB of heap to fault in at start-up, after the warm-up pass, and keep (pdq.ops.memory.reserve_heap): the first bursts' passes then take no page faults (0 = none)"})
    heartbeat_s: float = field(default=1.0, metadata={"help": "registry heartbeat period"})
    result_ttl_s: int = field(default=3600, metadata={"help": "how long finished requests stay in Redis"})
    grace_s: float = field(default=5.0, metadata={"help": "seconds to finish work on shutdown"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("max_seq_len", self.max_seq_len)
        if self.kv_output_grant_tokens < 0:
            raise ValueError(f"kv_output_grant_tokens must be >= 0, got {self.kv_output_grant_tokens}")
        _positive("kv_block_size", self.kv_block_size)
        _positive("heartbeat_s", self.heartbeat_s)
        if self.heap_reserve_mb < 0:
            raise ValueError(f"heap_reserve_mb must be >= 0, got {self.heap_reserve_mb}")
        if self.heartbeat_s * 2 > self.worker_timeout_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be at most half of worker_timeout_s "
                             f"({self.worker_timeout_s}), or a live worker would be taken for dead")
        if self.dtype and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")

    def name(self, role: str) -> str:
        return self.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    port: int = field(default=50061, metadata={"help": "port to listen on (0 = any free port)"})
    max_batched_tokens: int = field(default=2048, metadata={"help": "prompt tokens per forward pass"})
    prefill_chunk: int = field(default=512, metadata={"help": "longest prompt chunk per forward pass"})
    kv_chunk_bytes: int = field(default=1 << 20, metadata={"help": "bytes per KV hand-off message"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("max_batched_tokens", self.max_batched_tokens)
        _positive("prefill_chunk", self.prefill_chunk)
        _positive("kv_chunk_bytes", self.kv_chunk_bytes)


@dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    port: int = field(default=50071, metadata={"help": "port to listen on (0 = any free port)"})
    kv_budget_tokens: int = field(default=65536, metadata={"help": "KV pool size in tokens"})
    max_batch_size: int = field(default=64, metadata={"help": "running sequences per step"})
    reservation_timeout_s: float = field(default=30.0, metadata={"help": "unused KV reservations expire after this"})
    burst_threads: int = field(default=0, metadata={"help": "torch CPU threads while none of its reserved requests is being prefilled (0 = threads); for a decode worker sharing cores with a prefill worker"})
    yield_to_prefill_ms: float = field(default=0.0, metadata={"help": "while a request reserved here is being prefilled, start decode steps at least this many ms apart, leaving the cores to prefill (0 = off); for a decode worker sharing cores with a prefill worker"})
    strategy: str = field(default="continuous", metadata={"help": "batching: continuous, dynamic or static"})
    strategy_batch_size: int = field(default=8, metadata={"help": "batch size of the static and dynamic strategies"})
    dynamic_window_ms: float = field(default=50.0, metadata={"help": "dynamic strategy: longest wait for a fuller batch"})
    static_flush_ms: float = field(default=2000.0, metadata={"help": "static strategy: run a short batch after this wait"})
    strategy_bucket: bool = field(default=False, metadata={"help": "static and dynamic strategies: length bucketing, a batch is the oldest waiting sequence and those nearest to it in prompt + max_tokens"})
    kv_transport: str = field(default="tcp", metadata={"help": "KV hand-offs in: tcp (a TCP data plane, several times faster than gRPC; PushKV still works) or grpc (PushKV only)"})
    kv_port: int = field(default=0, metadata={"help": "tcp data plane port (0 = any free port); advertised with the host of advertise_address"})
    colocate: bool = field(default=False, metadata={"help": "also serve the prefill worker role in this process: one model, one KV pool, "
                                                            "prompt chunks and decode rows in one forward pass, hand-offs to itself "
                                                            "kept in place (for a machine prefill and decode would share)"})
    step_tokens: int = field(default=1024, metadata={"help": "with colocate: tokens per forward pass, every decode row first, then prompt chunks"})
    prefill_chunk: int = field(default=512, metadata={"help": "with colocate: longest prompt chunk per forward pass"})
    gather_ms: float = field(default=100.0, metadata={"help": "with colocate: with nothing running, a first forward pass waits up to this long "
                                                               "for the batches the scheduler says are coming (PrefillBatch.more_coming), "
                                                               "until they fill step_tokens; a lone request never waits; 0: never"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("kv_budget_tokens", self.kv_budget_tokens)
        if not 0 <= self.gather_ms <= 10_000:
            raise ValueError(f"gather_ms must be in [0, 10000], got {self.gather_ms}")
        _positive("step_tokens", self.step_tokens)
        _positive("prefill_chunk", self.prefill_chunk)
        _positive("strategy_batch_size", self.strategy_batch_size)
        if not 0 <= self.yield_to_prefill_ms <= 10_000:
            raise ValueError(f"yield_to_prefill_ms must be in [0, 10000], got {self.yield_to_prefill_ms}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        _positive("max_batch_size", self.max_batch_size)
        if self.kv_budget_tokens < self.max_seq_len:
            raise ValueError(f"kv_budget_tokens ({self.kv_budget_tokens}) must hold one max_seq_len ({self.max_seq_len})")

    def prefill_config(self) -> PrefillConfig:
        """The prefill role of a colocated worker: the same store, model and address."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(WorkerConfig)}
        shared["worker_id"] = self.worker_id and self.worker_id + "-prefill"  # its own registry entry
        return PrefillConfig(**shared, max_batched_tokens=self.step_tokens, prefill_chunk=self.prefill_chunk)
