"""The seeded plan of a chaos run, made before anything starts (pure: the same seed and options
give the same plan): what each request does, and when which fault strikes.

Requests are greedy (temperature 0) with ignore_eos over a fixed set of distinct prompts, so each
one's output is known in advance (`reference`). Faults are placed by load progress, not by the
clock: fault k fires once `trigger` requests have started, spread evenly over the run with a
seeded jitter, so a slow machine gets the same faults among the same requests.
"""

import random
from dataclasses import dataclass

from pdq.chaos.options import ChaosOptions

KINDS = ("stream", "submit_get", "submit_stream")
# stream: GenerateStream, resumed with StreamResult when it breaks; submit_get: Submit, then
# GetResult long-polls; submit_stream: Submit, then StreamResult (resumed when it breaks).
MAX_TOKENS = (1, 2, 4, 8, 16, 16, 32, 48, 64, 128)
DECODE_CANCEL_MAX_TOKENS = 64  # long enough that a cancel after a few tokens lands while decoding
GENEROUS_TIMEOUT_MS = 600_000  # a deadline no fault pushes a request past
MOVED_TO_MS = 600_000  # where the operator moves a tight deadline (SetDeadline timeout_ms)
MOVED_MAX_TOKENS = 384  # a request whose deadline moves runs well past its first deadline
MOVED_PROMPTS = 4  # ... with one of the first prompts (only their references are that long)
CANCEL_STATES = ("queued", "prefill", "decode")
FAULT_KINDS = ("kill_prefill", "kill_decode", "kill_scheduler", "kill_gateway", "redis_restart", "conn_drop",
               "kv_corrupt")
WORKERS_PER_ROLE = 2
FIRST, LAST = 0.05, 0.9  # faults strike between these fractions of the requests started

_ADJ = ("quiet", "bright", "ancient", "rapid", "gentle", "hollow", "golden", "narrow")
_NOUN = ("river", "engine", "garden", "lantern", "harbor", "market", "signal", "forest")
_VERB = ("carries", "remembers", "follows", "watches")


def prompts() -> tuple[str, ...]:
    """The fixed distinct prompts (32), the same for every seed."""
    return tuple(f"The {_ADJ[i % 8]} {_NOUN[(i // 8 + i) % 8]} {_VERB[i // 8]} the {_NOUN[i % 8]} at number {i}"
                 for i in range(32))


@dataclass(frozen=True)
class RequestPlan:
    index: int
    client_id: str  # its request_id (idempotency key): every call of it uses this
    kind: str  # one of KINDS
    prompt: int  # index into prompts()
    max_tokens: int
    deadline: str  # none | generous | tight (may time out) | moved (tight, then the operator extends it)
    timeout_ms: int  # what it is submitted with (0 = none)
    cancel: str = ""  # "" | queued | prefill | decode: the state the load cancels it in
    cancel_after: int = 0  # decode cancels: tokens seen first
    disconnect: bool = False  # a stream's decode cancel closes the stream instead of calling Cancel
    duplicate: bool = False  # submitted again with the same client id (must return the same request)


@dataclass(frozen=True)
class FaultPlan:
    kind: str  # one of FAULT_KINDS
    trigger: int  # fires once this many requests have started
    target: int = 0  # which worker of its role
    delay_s: float = 0.0  # kills: restart after this long; redis_restart: down this long


def longest(prompt: int) -> int:
    """The most tokens any request asks of a prompt (what its reference needs)."""
    return MOVED_MAX_TOKENS if prompt < MOVED_PROMPTS else max(*MAX_TOKENS, DECODE_CANCEL_MAX_TOKENS)


def plan_requests(opts: ChaosOptions) -> list[RequestPlan]:
    rng = random.Random(f"requests-{opts.seed}")
    n = opts.requests
    cancelled = dict(zip(rng.sample(range(n), opts.cancels), [CANCEL_STATES[i % 3] for i in range(opts.cancels)]))
    out = []
    for i in range(n):
        cancel = cancelled.get(i, "")
        kind = rng.choice(KINDS if cancel in ("", "decode") else KINDS[1:])  # queued/prefill cancels need a Submit
        max_tokens = DECODE_CANCEL_MAX_TOKENS if cancel == "decode" else rng.choice(MAX_TOKENS)
        roll = rng.random()
        prompt = rng.randrange(len(prompts()))
        deadline, timeout_ms = "none", 0
        if not cancel:  # a cancel's end is the cancel's: keep deadlines off it
            if roll < 0.15:
                deadline, timeout_ms = "generous", GENEROUS_TIMEOUT_MS
            elif roll < 0.23:
                deadline, timeout_ms = "tight", rng.randrange(20, 400)
            elif roll < 0.33:
                deadline, timeout_ms = "moved", rng.randrange(1000, 2000)
                max_tokens, prompt = MOVED_MAX_TOKENS, prompt % MOVED_PROMPTS
        out.append(RequestPlan(
            index=i, client_id=f"chaos-{opts.seed}-{i}", kind=kind, prompt=prompt,
            max_tokens=max_tokens, deadline=deadline, timeout_ms=timeout_ms, cancel=cancel,
            cancel_after=rng.randrange(1, 6) if cancel == "decode" else 0,
            disconnect=cancel == "decode" and kind == "stream" and rng.random() < 0.5,
            duplicate=rng.random() < 0.1))
    return out


def plan_faults(opts: ChaosOptions) -> list[FaultPlan]:
    rng = random.Random(f"faults-{opts.seed}")
    kinds = ([("kill_prefill", "kill_decode")[(i + opts.seed) % 2] for i in range(opts.worker_kills)]
             + ["kill_scheduler"] * opts.scheduler_kills + ["kill_gateway"] * opts.gateway_kills
             + ["redis_restart"] * opts.redis_restarts + ["conn_drop"] * opts.conn_drops
             + ["kv_corrupt"] * opts.corrupt_handoffs)
    rng.shuffle(kinds)
    out = []
    for k, kind in enumerate(kinds):
        at = FIRST + (LAST - FIRST) * (k + rng.uniform(0.2, 0.8)) / len(kinds)
        delay = rng.uniform(0.5, opts.redis_down_s) if kind == "redis_restart" else rng.uniform(0.2, 2.0)
        out.append(FaultPlan(kind, int(at * opts.requests), target=rng.randrange(WORKERS_PER_ROLE),
                             delay_s=round(delay, 2) if kind != "conn_drop" and kind != "kv_corrupt" else 0.0))
    return out
