"""The chaos cluster: every role its own process, each with a fixed worker id and fixed ports, so
one that is killed comes back under the same id and address, on a durable private Redis
(AOF, appendfsync always) on a fixed port, so Redis too can be killed and restarted on its AOF.

Timeouts are short so that faults heal fast: a worker silent 3 s is reaped, workers heartbeat
every 0.5 s, a prefill lease lasts 5 s, an unused KV reservation 5 s. Roles run open (no API
keys): every caller is tenant `default` with the admin role, so the load can call the Operator API.

Every process is started from the thread that runs the event loop (the main thread): a child
dies when the *thread* that spawned it exits (`pdq.ops.child`). The cluster supervises its
children: one that exits without being killed by the harness is noted (`exits`) and restarted.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.chaos import reference
from pdq.ops.child import spawn
from pdq.ops.redis_server import RedisServer, free_port, release_port

HOST = "127.0.0.1"
# Every role: what makes faults heal within seconds (see the module doc).
ROLE_ENV = {
    "PDQ_WORKER_TIMEOUT_S": "3", "PDQ_HEARTBEAT_S": "0.5", "PDQ_REDIS_OUTAGE_S": "30", "PDQ_PREFILL_LEASE_S": "5",
    "PDQ_RESERVATION_TIMEOUT_S": "5", "PDQ_GRACE_S": "1", "PDQ_KV_TRANSPORT": "tcp", "PDQ_METRICS_PORT": "-1",
    # many processes on few shared cores: one torch thread each, idle threads sleep at once
    "PDQ_THREADS": "1", "PDQ_HEAP_RESERVE_MB": "0", "OMP_WAIT_POLICY": "PASSIVE",
    "PDQ_MAX_SEQ_LEN": "512", "PDQ_KV_BUDGET_TOKENS": "16384",
    "PDQ_DTYPE": reference.DTYPE,  # what the garbled check compares with
}
# Not inherited from the caller's environment: the roles run open, with only the faults the harness injects.
DROPPED_ENV = ("PDQ_AUTH_FILE", "PDQ_FAULTS", "PDQ_THREADS", "PDQ_BURST_THREADS", "PDQ_YIELD_TO_PREFILL_MS",
               "PDQ_PIN_THREADS", "GOMP_SPINCOUNT", "PDQ_COLOCATE", "PDQ_INTERNAL_CA", "PDQ_INTERNAL_CERT",
               "PDQ_INTERNAL_KEY")
# KV slots (running sequences) per decode worker: fewer than the load's concurrency, so requests
# queue and a cancel right after Submit finds its request QUEUED.
DECODE_SLOTS = 6
# Prefill workers corrupt a hand-off when signalled (pdq.ops.faults), and hold each hand-off 25 ms in
# TRANSFERRING, so that a cancel polling for the prefill phase can land in it.
PREFILL_FAULTS = "kv_corrupt_on_signal,kv_delay_ms=25"
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass
class Exit:
    """A process that exited without the harness killing it."""

    name: str
    code: int
    t: float
    log_tail: str


@dataclass
class Role:
    """One process of the cluster: a role (or Redis) under a fixed name, port and arguments."""

    name: str  # scheduler, gateway, prefill-0, decode-1, redis
    port: int
    args: list[str]
    env: dict
    log: Path
    process: subprocess.Popen | None = None
    starts: int = 0
    down: bool = False  # killed by the harness, not restarted yet
    channel: grpc.aio.Channel | None = field(default=None, repr=False)

    @property
    def role(self) -> str:
        return self.name.split("-")[0]

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, t: float) -> None:
        with open(self.log, "ab") as log:
            log.write(f"\n=== chaos: start {self.starts + 1} of {self.name} at t={t:.2f}s ===\n".encode())
            log.flush()
            self.process = spawn(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1
        self.down = False

    async def kill(self) -> None:
        """SIGKILL, and wait until it is gone (so its ports are free for the restart)."""
        self.down = True
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
        while self.process is not None and self.process.poll() is None:
            await asyncio.sleep(0.01)

    async def serving(self) -> bool:
        """Whether it answers SERVING on grpc.health.v1 now."""
        if self.channel is None:
            self.channel = grpc.aio.insecure_channel(f"{HOST}:{self.port}", options=CHANNEL_OPTIONS)
        try:
            resp = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class RedisRole(Role):
    """The durable private Redis, on a fixed port and directory, so a restart reloads its AOF."""

    def __init__(self, directory: Path, log: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.server = RedisServer(directory=str(directory), port=free_port(HOST), durable=True)
        super().__init__("redis", self.server.port, [], {}, log)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, t: float) -> None:
        self.server.start()  # returns once it answers PING (its AOF loaded)
        self.process = self.server.process
        self.starts += 1
        self.down = False

    async def serving(self) -> bool:
        client = aioredis.Redis(host=HOST, port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            return bool(await client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            await client.aclose()

    def tail(self, lines: int = 30) -> str:
        path = Path(self.server.directory) / "redis.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ChaosCluster:
    """Redis, 2 schedulers (one leads, one stands by), 2 prefill and 2 decode workers and the
    gateway (P/D disaggregated)."""

    def __init__(self, out: Path, model_dir: str, clock, prefill: int = 2, decode: int = 2,
                 extra_env: dict | None = None, schedulers: int = 2):
        self.out = out
        self.clock = clock  # seconds since the run started
        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.redis = RedisRole(out / "redis", logs / "redis.log")
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        env.update(ROLE_ENV, PDQ_REDIS_URL=self.redis.url, PDQ_MODEL=model_dir, **(extra_env or {}))
        py = [sys.executable, "-m"]
        common = ["--host", HOST]
        self._held: list[int] = []  # every role's ports, held until stop: a restarted role finds its port free

        def port_() -> int:
            self._held.append(free_port(HOST, hold=True))
            return self._held[-1]

        sched_ports, gw_port = [port_() for _ in range(schedulers)], port_()
        roles = [Role(f"scheduler-{i}", port, py + ["scheduler", *common, "--port", str(port),
                                                    "--scheduler-id", f"chaos-scheduler-{i}"], env,
                      logs / f"scheduler-{i}.log") for i, port in enumerate(sched_ports)]
        for i in range(prefill):
            port = port_()
            roles.append(Role(f"prefill-{i}", port, py + ["prefill_worker", *common, "--port", str(port),
                                                          "--worker-id", f"chaos-prefill-{i}"],
                              dict(env, PDQ_FAULTS=PREFILL_FAULTS), logs / f"prefill-{i}.log"))
        for i in range(decode):
            port, kv_port = port_(), port_()
            roles.append(Role(f"decode-{i}", port, py + ["decode_worker", *common, "--port", str(port),
                                                         "--kv-port", str(kv_port), "--worker-id", f"chaos-decode-{i}",
                                                         "--max-batch-size", str(DECODE_SLOTS)],
                              env, logs / f"decode-{i}.log"))
        roles.append(Role("gateway", gw_port, py + ["gateway", *common, "--port", str(gw_port),
                                                    "--scheduler-address",
                                                    ",".join(f"{HOST}:{port}" for port in sched_ports)],
                          env, logs / "gateway.log"))
        self.roles = roles
        self.exits: list[Exit] = []
        self._supervisor: asyncio.Task | None = None

    @property
    def everything(self) -> list[Role]:
        return [self.redis, *self.roles]

    @property
    def target(self) -> str:
        return f"{HOST}:{self.get('gateway').port}"

    def get(self, name: str) -> Role:
        return next(r for r in self.everything if r.name == name)

    def of_role(self, role: str) -> list[Role]:
        return [r for r in self.roles if r.role == role]

    async def leader(self) -> str:
        """The id of the scheduler holding the dispatch lease ("" when none does)."""
        client = aioredis.Redis(host=HOST, port=self.redis.port)
        try:
            held = await client.get("pdq:leader")
        finally:
            await client.aclose()
        return held.decode().split(" ", 1)[1] if held else ""

    async def start(self, timeout_s: float = 300.0) -> None:
        self.redis.start(self.clock())
        for role in self.roles:
            role.start(self.clock())
        if not await self.wait_serving(timeout_s):
            bad = [r.name for r in self.everything if not r.alive()]
            raise RuntimeError(f"the chaos cluster did not come up in {timeout_s:.0f}s (exited: {bad or 'none'}); "
                               f"logs in {self.out / 'logs'}")
        self._supervisor = asyncio.create_task(self._supervise())

    async def wait_serving(self, timeout_s: float, roles: list[Role] | None = None) -> bool:
        """Waits until every role (or those given) is up and SERVING. -> whether they are."""
        deadline = time.monotonic() + timeout_s
        pending = list(roles or self.everything)
        while pending:
            pending = [r for r in pending if r.down or not r.alive() or not await r.serving()]
            if not pending:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def _supervise(self) -> None:
        """Restarts a process that exited on its own (the harness's kills are not its business)."""
        while True:
            await asyncio.sleep(0.2)
            for role in self.everything:
                if not role.down and role.process is not None and role.process.poll() is not None:
                    self.exits.append(Exit(role.name, role.process.returncode, round(self.clock(), 2), role.tail()))
                    role.start(self.clock())

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        for role in reversed(self.roles):
            if role.alive():
                role.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for role in self.roles:
            while role.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if role.alive():
                role.process.kill()
                role.process.wait()
            if role.channel is not None:
                await role.channel.close()
        for port in self._held:
            release_port(port)
        self._held.clear()
        if self.redis.alive():
            self.redis.server.stop()
