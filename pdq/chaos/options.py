"""`pdq chaos` flags and their validated form. Importing this module stays light (no torch, no grpc)."""

import argparse
from dataclasses import dataclass, fields

# The goal run, and the short run `make test` does.
FULL = dict(requests=5000, concurrency=32, worker_kills=10, redis_restarts=2, redis_down_s=5.0, conn_drops=20,
            scheduler_kills=1, gateway_kills=1, cancels=200, corrupt_handoffs=50)
SHORT = dict(requests=240, concurrency=16, worker_kills=2, redis_restarts=1, redis_down_s=2.0, conn_drops=2,
             scheduler_kills=1, gateway_kills=1, cancels=24, corrupt_handoffs=3)
FAULT_FLAGS = ("worker_kills", "redis_restarts", "conn_drops", "scheduler_kills", "gateway_kills", "corrupt_handoffs")


@dataclass(frozen=True)
class ChaosOptions:
    requests: int = FULL["requests"]
    concurrency: int = FULL["concurrency"]
    seed: int = 1
    worker_kills: int = FULL["worker_kills"]  # SIGKILL + restart of a prefill or decode worker (half each)
    redis_restarts: int = FULL["redis_restarts"]  # SIGKILL of Redis, restarted on its AOF
    redis_down_s: float = FULL["redis_down_s"]  # longest a killed Redis stays down
    conn_drops: int = FULL["conn_drops"]  # CLIENT KILL of every client connection (normal and pubsub)
    scheduler_kills: int = FULL["scheduler_kills"]
    gateway_kills: int = FULL["gateway_kills"]
    cancels: int = FULL["cancels"]  # requests the load cancels (queued, prefilling, decoding)
    corrupt_handoffs: int = FULL["corrupt_handoffs"]  # KV hand-offs a prefill worker corrupts (SIGUSR1)
    model: str = "builtin:tiny"
    out: str = ""  # directory of the result, the logs and Redis's AOF ("" = a new temporary one)
    stall_s: float = 30.0  # no progress this long while requests are outstanding is a stall
    request_bound_s: float = 300.0  # a request not ended this long after it started is given up (a stall)
    drain_s: float = 60.0  # after the load, how long every accepted request has to reach its end
    settle_s: float = 30.0  # then how long counters, leases, held sets and KV slots have to come back to zero
    keep_redis: bool = False  # keep Redis's AOF in the output directory
    env: tuple[str, ...] = ()  # KEY=VALUE for every role's environment, over the chaos cluster's own

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        for name in (*FAULT_FLAGS, "cancels"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.cancels > self.requests:
            raise ValueError(f"--cancels ({self.cancels}) must be at most --requests ({self.requests})")
        if not 0 < self.redis_down_s <= 25:  # within the roles' --redis-outage-s (30 s): an outage they ride through
            raise ValueError(f"--redis-down-s must be in (0, 25], got {self.redis_down_s}")
        for item in self.env:
            if "=" not in item or not item.partition("=")[0]:
                raise ValueError(f"--env must be KEY=VALUE, got {item!r}")
        for name in ("stall_s", "request_bound_s", "drain_s", "settle_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")

    @property
    def faults(self) -> int:
        return sum(getattr(self, name) for name in FAULT_FLAGS)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ChaosOptions":
        """Flags given beat the preset (--short, else the goal run), which beats the defaults."""
        preset = dict(SHORT if getattr(args, "short", False) else FULL)
        if getattr(args, "no_faults", False):
            preset.update({name: 0 for name in FAULT_FLAGS})
        values = {}
        for f in fields(cls):
            given = getattr(args, f.name, None)
            if given is not None:
                values[f.name] = tuple(given) if f.name == "env" else given
            elif f.name in preset:
                values[f.name] = preset[f.name]
        return cls(**values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    scale = p.add_argument_group("scale (defaults: the goal run; --short: the short run of `make test`)")
    scale.add_argument("--short", action="store_true",
                       help=f"the short preset: {', '.join(f'{k}={v}' for k, v in SHORT.items())}")
    scale.add_argument("--requests", type=int, help=f"requests of the load (default {FULL['requests']})")
    scale.add_argument("--concurrency", type=int, help=f"requests in flight at most (default {FULL['concurrency']})")
    scale.add_argument("--seed", type=int, help="seed of the load and the fault schedule (default 1)")
    scale.add_argument("--cancels", type=int, help=f"requests the load cancels (default {FULL['cancels']})")
    faults = p.add_argument_group("faults (spread over the run; 0 turns one off)")
    faults.add_argument("--no-faults", action="store_true",
                        help="no fault unless a flag below asks for it: the same load on a healthy cluster")
    faults.add_argument("--worker-kills", type=int,
                        help="SIGKILL + restart of a worker, prefill and decode alike "
                             f"(default {FULL['worker_kills']})")
    faults.add_argument("--redis-restarts", type=int,
                        help=f"SIGKILL of Redis, restarted on its AOF (default {FULL['redis_restarts']})")
    faults.add_argument("--redis-down-s", type=float,
                        help=f"longest a killed Redis stays down, seconds (default {FULL['redis_down_s']})")
    faults.add_argument("--conn-drops", type=int,
                        help=f"every Redis client connection dropped, Redis up (default {FULL['conn_drops']})")
    faults.add_argument("--scheduler-kills", type=int, help=f"default {FULL['scheduler_kills']}")
    faults.add_argument("--gateway-kills", type=int, help=f"default {FULL['gateway_kills']}")
    faults.add_argument("--corrupt-handoffs", type=int,
                        help=f"KV hand-offs a prefill worker corrupts (default {FULL['corrupt_handoffs']})")
    run = p.add_argument_group("the run")
    run.add_argument("--model", help="the workers' model (default builtin:tiny)")
    run.add_argument("--out", help="directory of chaos.json, the processes' logs and Redis's AOF "
                                   "(default: a new temporary directory, printed)")
    run.add_argument("--stall-s", type=float, help="no progress this long while requests are outstanding is a "
                                                   "stall (default 30)")
    run.add_argument("--request-bound-s", type=float,
                     help="a request not ended this long after it started is given up as stalled (default 300)")
    run.add_argument("--drain-s", type=float,
                     help="after the load, how long every accepted request has to end (default 60)")
    run.add_argument("--settle-s", type=float,
                     help="then how long queues, counters, leases and KV slots have to come back to zero (default 30)")
    run.add_argument("--keep-redis", action="store_true", default=None, help="keep Redis's AOF in --out")
    run.add_argument("--env", action="append", metavar="KEY=VALUE",
                     help="extra environment of every role, over the chaos cluster's own (e.g. PDQ_MAX_ATTEMPTS=5); "
                          "repeatable")
