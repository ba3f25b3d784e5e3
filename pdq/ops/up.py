"""`pdq up`: a whole cluster on one machine, for development and demos.

Starts a private Redis server (unless --redis-url is given), the scheduler (or several: one
leads, the others stand by), N prefill workers,
M decode workers (or, colocated, M workers serving both roles) and the gateway as separate
processes, waits until every one reports SERVING on grpc.health.v1, then supervises them (a
process that exits is started again the same way: same port, same worker id; pdq.ops.supervisor)
until Ctrl-C / SIGTERM stops them all (children also die with this process, so nothing is left
behind).

`Cluster` is also what the tests and benchmarks start; it supervises only when asked
(`supervise()`, called often from the thread that started it), so a test that kills a process
sees it stay dead unless it supervises.
"""

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.ops.devkeys import remove_dev_keys, write_dev_keys
from pdq.ops.child import spawn
from pdq.transport.mtls import InternalTLS, dev_certificates, sync_channel
from pdq.ops.redis_server import RedisServer, free_port, release_port
from pdq.ops.supervisor import Child, RestartPolicy, Supervisor

__all__ = ["Child", "Cluster", "RestartPolicy", "cpu_share_env", "run"]


# Decode steps start at least this far apart while prefill runs on the same cores: prefill gets
# the cores, so the first token comes sooner, at the cost of inter-token latency (a running
# request's next token may wait this long while a prompt is prefilled); the work is the same, in
# another order, so throughput does not change.
YIELD_TO_PREFILL_MS = "150"

# How long an idle OpenMP thread spins before it sleeps (libgomp's GOMP_SPINCOUNT), for every
# local worker and the benchmark's baselines. On a small machine PASSIVE (sleep at once) makes a
# forward pass wait for a sleeping thread at every parallel region, while libgomp's default
# (300,000 rounds) keeps idle threads spinning on cores that the gateway, the scheduler and the
# other workers need, so a light tenant's TTFT under a flood grows several-fold. 10,000 rounds
# keeps the threads awake across the short gaps between a pass's parallel regions and lets them
# sleep through the longer ones, which gives the cores back to the rest.
OMP_SPIN_COUNT = "10000"


def cpu_share_env(workers: int, env: dict) -> dict:
    """What lets local workers share this machine's cores instead of fighting for them.

    Each worker gets cores // workers torch threads (at least 1) unless PDQ_THREADS is set; a
    decode worker gets all of them while nothing is being prefilled for it (PDQ_BURST_THREADS)
    and, while something is, spaces its steps PDQ_YIELD_TO_PREFILL_MS apart so that prefill
    has the cores (prefill first, as one engine runs a prompt's pass before its next decode
    step). (`Cluster` gives prefill workers cores // prefill workers: they go first, decode
    workers run nicer.) Idle OpenMP threads spin OMP_SPIN_COUNT rounds, then sleep, unless
    OMP_WAIT_POLICY or GOMP_SPINCOUNT is set (see OMP_SPIN_COUNT). A worker alone on the
    machine pins its threads one per core (PDQ_PIN_THREADS; pdq.ops.cpu.pin_model_threads).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out = {}
    if "PDQ_THREADS" not in env:
        out["PDQ_THREADS"] = str(max(1, cores // max(1, workers)))
        if "PDQ_BURST_THREADS" not in env:  # a decode worker takes every core while nothing is prefilled for it
            out["PDQ_BURST_THREADS"] = str(cores)
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        out["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT
    if workers > 1 and "PDQ_YIELD_TO_PREFILL_MS" not in env:
        out["PDQ_YIELD_TO_PREFILL_MS"] = YIELD_TO_PREFILL_MS
    if workers == 1 and "PDQ_PIN_THREADS" not in env:
        out["PDQ_PIN_THREADS"] = "true"
    return out


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


@dataclass
class Cluster:
    prefill: int = 1
    decode: int = 1
    # Scheduler replicas: "scheduler", "scheduler-1", ...; the first to start leads (dispatches),
    # the others serve submits and take over when it dies (scheduler.leader).
    schedulers: int = 1
    model: str = "builtin"
    redis_url: str | None = None
    port: int = 50051
    host: str = "127.0.0.1"
    durable: bool = False
    auth: bool = True  # write dev API keys (pdq.ops.devkeys) and start the gateway with them
    mtls: bool = False  # mutual TLS between the roles, with a throwaway CA (pdq.transport.mtls.dev_certificates)
    # Each decode worker also prefills, in one process (decode_worker --colocate): one model and
    # KV pool, prompt chunks and decode rows in one forward pass; no prefill-only workers start.
    colocate: bool = False
    extra_env: dict = field(default_factory=dict)
    # Decode workers run this much nicer than the rest: when the machine's cores are all busy,
    # the scheduler, gateway and prefill (the time to first token) go first, decode steps wait.
    # None: 5, and 0 for colocated workers (they prefill too, and a nicer model process would
    # give its cores up to every burst of the gateway and the clients, losing throughput).
    decode_nice: int | None = field(default_factory=lambda: int(os.environ["PDQ_UP_DECODE_NICE"])
                                    if os.environ.get("PDQ_UP_DECODE_NICE") else None)
    # CPU policy (pdq.ops.cpu) of the processes that do not run the model: Redis, the scheduler and
    # the gateway. "batch": they do not preempt the model's threads when they wake, and run when a
    # core frees up (see pdq.ops.cpu); "normal": as any process.
    control_policy: str = field(default_factory=lambda: os.environ.get("PDQ_UP_CONTROL_POLICY") or "batch")
    # /metrics ports: 0 = a free port per process; N = gateway N, scheduler N+1, prefill-i N+10+i,
    # decode-i N+20+i (what deploy/prometheus.yml scrapes); -1 = no metrics endpoints
    metrics_port: int = field(default_factory=lambda: int(os.environ.get("PDQ_UP_METRICS_PORT") or 0))
    http_port: int = 0  # the gateway's OpenAI-compatible HTTP API (0 = off)
    client_key: str = ""
    admin_key: str = ""
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # how `supervise` restarts what exits
    children: list[Child] = field(default_factory=list)
    redis: RedisServer | None = None
    redis_child: Child | None = None  # the private Redis server, as supervised (name "redis")
    _supervisor: Supervisor = field(default_factory=lambda: Supervisor(log=say), repr=False)
    _env: dict = field(default_factory=dict, repr=False)  # the children's environment
    _tls: InternalTLS | None = field(default=None, repr=False)  # set with mtls: how to reach internal ports
    _certs: str = field(default="", repr=False)  # the throwaway CA's directory, removed at stop
    _prefill_threads: str = field(default="", repr=False)  # PDQ_THREADS of prefill workers ("" = as the rest)
    _held: list[int] = field(default_factory=list, repr=False)  # ports held for its children (`_port`)

    @property
    def worker_nice(self) -> int:
        """How much nicer decode (and colocated) workers run than the rest."""
        return self.decode_nice if self.decode_nice is not None else 0 if self.colocate else 5

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API's base URL ("" when it is off)."""
        return f"http://{self.host}:{self.http_port}/v1" if self.http_port else ""

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 600.0) -> "Cluster":
        from pdq.model.loader import resolve_model

        try:
            say(f"pdq: preparing model {self.model!r} ...")
            model_dir = str(resolve_model(self.model))  # build/cache once, before the workers load it
            self._supervisor.policy, self._supervisor.stopping = self.restart, False
            if self.redis_url is None:
                self.redis = RedisServer(durable=self.durable, cpu_policy=self.control_policy).start()
                self.redis_url = self.redis.url
                self.redis_child = Child("redis", self.redis.port, self.redis.process, launch=self.redis.launch,
                                         note="" if self.durable else "its data is lost (not --durable)")
                self._supervisor.watch(self.redis_child)
                say(f"pdq: private Redis at {self.redis_url}")
            if self.port == 0:
                self.port = self._port()
            env = self._env = dict(os.environ, PDQ_REDIS_URL=self.redis_url, PDQ_MODEL=model_dir, **self.extra_env)
            prefill = 0 if self.colocate else self.prefill  # colocated workers prefill themselves
            if self.colocate:
                env["PDQ_COLOCATE"] = "true"
            self._prefill_threads = cpu_share_env(prefill, env).get("PDQ_THREADS", "")
            env.update(cpu_share_env(prefill + self.decode, env))
            if self.mtls:
                self._certs = tempfile.mkdtemp(prefix="pdq-mtls-")
                ca, cert, key = dev_certificates(Path(self._certs))
                env.update(PDQ_INTERNAL_CA=str(ca), PDQ_INTERNAL_CERT=str(cert), PDQ_INTERNAL_KEY=str(key))
                self._tls = InternalTLS(ca.read_bytes(), cert.read_bytes(), key.read_bytes())
            if self.auth:
                auth_file, self.client_key, self.admin_key = write_dev_keys(self.port)
                env["PDQ_AUTH_FILE"] = str(auth_file)
            sched_ports = []
            for i in range(self.schedulers):  # the first is up (and leads) before the next starts
                sched_ports.append(self._port())
                name = "scheduler" if i == 0 else f"scheduler-{i}"
                self._spawn(name, "scheduler", sched_ports[-1], env, ["--scheduler-id", f"{name}-{os.getpid()}"],
                            metrics_offset=1 + i)
                if i == 0 and self.schedulers > 1:
                    self._wait_child(self.children[-1], time.monotonic() + timeout_s, timeout_s)
            for i in range(prefill):
                self._spawn(f"prefill-{i}", "prefill_worker", self._port(), env,
                            ["--worker-id", f"prefill-{i}-{os.getpid()}"], metrics_offset=10 + i)
            for i in range(self.decode):
                self._spawn(f"decode-{i}", "decode_worker", self._port(), env,
                            ["--worker-id", f"decode-{i}-{os.getpid()}"], metrics_offset=20 + i)
            self._spawn("gateway", "gateway", self.port, env, ["--scheduler-address",
                                                                 ",".join(f"{self.host}:{p}" for p in sched_ports),
                                                                 "--http-port", str(self.http_port),
                                                                 "--served-model-name", self.model],
                        metrics_offset=0)
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _port(self) -> int:
        """A port for a child, held until the cluster stops (`free_port(hold=True)`): no other
        process takes it while the child starts or restarts on it."""
        port = free_port(self.host, hold=True)
        self._held.append(port)
        return port

    def _spawn(self, name: str, module: str, port: int, env: dict, extra: list[str] = (), metrics_offset: int = 0) -> None:
        metrics_port = (-1 if self.metrics_port < 0 else self._port() if self.metrics_port == 0
                        else self.metrics_port + metrics_offset)
        args = [sys.executable, "-m", module, "--host", self.host, "--port", str(port),
                "--metrics-port", str(metrics_port), *extra]
        if module == "prefill_worker" and self._prefill_threads:
            env = dict(env, PDQ_THREADS=self._prefill_threads)
        model = module in ("prefill_worker", "decode_worker")
        launch = functools.partial(spawn, args, nice=self.worker_nice if module == "decode_worker" else 0,
                                   cpu_policy="normal" if model else self.control_policy, env=env)
        child = Child(name, port, launch(), metrics_port, launch=launch)
        self.children.append(child)
        self._supervisor.watch(child)

    def add_worker(self, role: str, *extra_args: str, timeout_s: float = 300.0) -> Child:
        """Starts one more `prefill` or `decode` worker on the running cluster, the way a worker
        started by hand on another host joins (it registers itself; nothing else restarts), and
        waits until it is SERVING. `extra_args` are its own flags, e.g. "--max-batch-size", "4"."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        i = sum(c.name.startswith(role + "-") for c in self.children)
        env = dict(self._env, PDQ_PIN_THREADS="false")  # it shares the cores from now on
        self._spawn(f"{role}-{i}", f"{role}_worker", self._port(), env,
                    ["--worker-id", f"{role}-{i}-{os.getpid()}", *extra_args], metrics_offset=(10 if role == "prefill" else 20) + i)
        child = self.children[-1]
        self._wait_child(child, time.monotonic() + timeout_s, timeout_s)
        return child

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            self._wait_child(child, deadline, timeout_s)

    def _wait_child(self, child: Child, deadline: float, timeout_s: float) -> None:
        tls = None if child.name == "gateway" else self._tls  # the gateway's port is the public one
        with sync_channel(f"{self.host}:{child.port}", tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if child.process.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with code {child.process.returncode} during start-up")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{child.name} not healthy after {timeout_s:.0f}s")
                time.sleep(0.1)

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.process.poll() is not None), None)

    def child(self, name: str) -> Child:
        """The process called `name`: "gateway", "scheduler" (and "scheduler-1", ... with
        several), "prefill-0", "decode-1", ...,
        or "redis" (the private Redis server)."""
        for child in ([self.redis_child] if self.redis_child else []) + self.children:
            if child.name == name:
                return child
        raise KeyError(f"no process {name!r} in this cluster")

    def supervise(self) -> list[Child]:
        """One round of supervision (never blocks): the processes that exited are started again
        the same way (same port, same worker id; a durable Redis on its AOF), after the backoff
        of `restart`, each logged on stderr. Call it every ~0.1-0.2 s from the thread that
        started the cluster (a child dies with the thread that spawned it). -> the processes
        started again in this round."""
        return self._supervisor.poll()

    def supervise_until(self, done: Callable[[], object], timeout_s: float = 120.0, what: str = "") -> object:
        """Supervises until `done()` is true (-> its value); TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not (value := done()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not {what or done} after {timeout_s:.0f}s of supervision")
            self.supervise()
            time.sleep(0.05)
        return value

    def kill(self, name: str, sig: int = signal.SIGKILL, down_s: float = 0.0) -> Child:
        """Sends `sig` (SIGKILL: and waits until it is gone) to the process called `name` (see
        `child`). Under supervision it is started again `down_s` after its exit is noticed, with
        no backoff (a kill is not a crash loop)."""
        child = self.child(name)
        self._supervisor.kill(child, sig, down_s)
        return child

    @property
    def restarts(self) -> dict[str, int]:
        """How many times supervision started each process again, by name."""
        return {c.name: c.restarts for c in self._supervisor.children}

    def serving(self, name: str, timeout_s: float = 1.0) -> bool:
        """Whether the process called `name` answers: SERVING on grpc.health.v1 (Redis: PING)."""
        child = self.child(name)
        if child.down:
            return False
        if child is self.redis_child:
            import redis

            client = redis.Redis(host=self.redis.host, port=child.port, socket_timeout=timeout_s,
                                 socket_connect_timeout=timeout_s)
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False
            finally:
                client.close()
        tls = None if child.name == "gateway" else self._tls
        with sync_channel(f"{self.host}:{child.port}", tls) as channel:
            try:
                return (health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
                        .status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.RpcError:
                return False

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to every child (gateway first), then SIGKILL after grace_s; Redis last.
        Nothing is restarted from here on."""
        self._supervisor.stopping = True
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        self.children.clear()
        for port in self._held:
            release_port(port)
        self._held.clear()
        if self.auth and self.client_key:
            remove_dev_keys(self.port)
            self.client_key = self.admin_key = ""
        if self.redis:
            self.redis.stop()
            self.redis = None
        self.redis_child = None
        self._supervisor.children.clear()
        if self._certs:
            shutil.rmtree(self._certs, ignore_errors=True)
            self._certs = ""

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run(cluster: Cluster) -> int:
    """Foreground `pdq up`: start, print how to call, then supervise the cluster (restart what
    exits) until Ctrl-C/SIGTERM. -> 0 once stopped; 1 if it could not start; 128 + the signal
    (130 for Ctrl-C) if stopped while starting."""
    stopping: list[int] = []
    starting = True

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)
        if starting and len(stopping) == 1:  # abandon the start-up (it cleans up after itself)
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    try:
        cluster.start()
        starting = False
    except KeyboardInterrupt:
        starting = False
        cluster.stop()  # (start stopped what it had started, unless the signal came just after)
        say("pdq up: interrupted while starting; stopped")
        return 128 + stopping[0]  # as a shell reports a command killed by that signal
    except (RuntimeError, TimeoutError, FileNotFoundError, ValueError) as exc:
        starting = False
        say(f"pdq up: {exc}")
        return 1
    say(f"pdq: cluster healthy in {time.monotonic() - started:.1f}s "
        + (f"({cluster.decode} colocated prefill+decode worker(s); --separate for P/D disaggregation)"
           if cluster.colocate else f"({cluster.prefill} prefill, {cluster.decode} decode worker(s))"))
    print(f"gateway: {cluster.target}", flush=True)
    if cluster.auth:
        say(f"API keys (the CLI finds them by itself for this port):\n"
            f"  client (tenant default): {cluster.client_key}\n  admin  (tenant ops):     {cluster.admin_key}")
    say(f"try:  .venv/bin/pdq generate \"Hello\" --target {cluster.target}")
    if cluster.http_port:
        say(f"OpenAI-compatible API: {cluster.base_url}  (key: the client key above)")
    if cluster.metrics_port >= 0:
        say("metrics: " + "  ".join(f"{c.name} {c.metrics_url(cluster.host)}" for c in cluster.children))
    say("stop: Ctrl-C (a process that exits is restarted)")
    while not stopping:
        cluster.supervise()
        time.sleep(0.2)
    say("pdq: stopping ...")
    cluster.stop()
    say("pdq: stopped")
    return 0
