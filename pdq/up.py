"""`pdq up`: a whole cluster on one machine, for development and demos.

Starts a private Redis server (unless --redis-url is given), the scheduler, N prefill workers,
M decode workers and the gateway as separate processes, waits until every one reports SERVING
on grpc.health.v1, and stops them all on Ctrl-C / SIGTERM (children also die with this
process, so nothing is left behind).
"""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.devkeys import remove_dev_keys, write_dev_keys
from pdq.redis_server import RedisServer, die_with_parent, free_port


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


@dataclass
class Child:
    name: str
    port: int
    process: subprocess.Popen
    metrics_port: int = -1  # its Prometheus /metrics port (-1 = none)

    def metrics_url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.metrics_port}/metrics"


@dataclass
class Cluster:
    prefill: int = 1
    decode: int = 1
    model: str = "builtin"
    redis_url: str | None = None
    port: int = 50051
    host: str = "127.0.0.1"
    durable: bool = False
    auth: bool = True  # write dev API keys (pdq.devkeys) and start the gateway with them
    extra_env: dict = field(default_factory=dict)
    # /metrics ports: 0 = a free port per process; N = gateway N, scheduler N+1, prefill-i N+10+i,
    # decode-i N+20+i (what deploy/prometheus.yml scrapes); -1 = no metrics endpoints
    metrics_port: int = field(default_factory=lambda: int(os.environ.get("PDQ_UP_METRICS_PORT") or 0))
    client_key: str = ""
    admin_key: str = ""
    children: list[Child] = field(default_factory=list)
    redis: RedisServer | None = None

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 600.0) -> "Cluster":
        from pdq.model.loader import resolve_model

        try:
            say(f"pdq: preparing model {self.model!r} ...")
            model_dir = str(resolve_model(self.model))  # build/cache once, before the workers load it
            if self.redis_url is None:
                self.redis = RedisServer(durable=self.durable).start()
                self.redis_url = self.redis.url
                say(f"pdq: private Redis at {self.redis_url}")
            if self.port == 0:
                self.port = free_port(self.host)
            env = dict(os.environ, PDQ_REDIS_URL=self.redis_url, PDQ_MODEL=model_dir, **self.extra_env)
            if self.auth:
                auth_file, self.client_key, self.admin_key = write_dev_keys(self.port)
                env["PDQ_AUTH_FILE"] = str(auth_file)
            sched_port = free_port(self.host)
            self._spawn("scheduler", "scheduler", sched_port, env, metrics_offset=1)
            for i in range(self.prefill):
                self._spawn(f"prefill-{i}", "prefill_worker", free_port(self.host), env,
                            ["--worker-id", f"prefill-{i}-{os.getpid()}"], metrics_offset=10 + i)
            for i in range(self.decode):
                self._spawn(f"decode-{i}", "decode_worker", free_port(self.host), env,
                            ["--worker-id", f"decode-{i}-{os.getpid()}"], metrics_offset=20 + i)
            self._spawn("gateway", "gateway", self.port, env, ["--scheduler-address", f"{self.host}:{sched_port}"],
                        metrics_offset=0)
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, module: str, port: int, env: dict, extra: list[str] = (), metrics_offset: int = 0) -> None:
        metrics_port = (-1 if self.metrics_port < 0 else free_port(self.host) if self.metrics_port == 0
                        else self.metrics_port + metrics_offset)
        args = [sys.executable, "-m", module, "--host", self.host, "--port", str(port),
                "--metrics-port", str(metrics_port), *extra]
        proc = subprocess.Popen(args, env=env, preexec_fn=die_with_parent)
        self.children.append(Child(name, port, proc, metrics_port))

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            with grpc.insecure_channel(f"{self.host}:{child.port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while True:
                    if child.process.poll() is not None:
                        raise RuntimeError(f"{child.name} exited with code {child.process.returncode} during start-up")
                    try:
                        if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{child.name} not healthy after {timeout_s:.0f}s")
                    time.sleep(0.1)

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.process.poll() is not None), None)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to every child (gateway first), then SIGKILL after grace_s; Redis last."""
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
        if self.auth and self.client_key:
            remove_dev_keys(self.port)
            self.client_key = self.admin_key = ""
        if self.redis:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run(cluster: Cluster) -> int:
    """Foreground `pdq up`: start, print how to call, wait for Ctrl-C/SIGTERM or a crash."""
    stopping = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    try:
        cluster.start()
    except (RuntimeError, TimeoutError, FileNotFoundError, ValueError) as exc:
        say(f"pdq up: {exc}")
        return 1
    say(f"pdq: cluster healthy in {time.monotonic() - started:.1f}s "
        f"({cluster.prefill} prefill, {cluster.decode} decode worker(s))")
    print(f"gateway: {cluster.target}", flush=True)
    if cluster.auth:
        say(f"API keys (the CLI finds them by itself for this port):\n"
            f"  client (tenant default): {cluster.client_key}\n  admin  (tenant ops):     {cluster.admin_key}")
    say(f"try:  .venv/bin/pdq generate \"Hello\" --target {cluster.target}")
    if cluster.metrics_port >= 0:
        say("metrics: " + "  ".join(f"{c.name} {c.metrics_url(cluster.host)}" for c in cluster.children))
    say("stop: Ctrl-C")
    code = 0
    while not stopping:
        dead = cluster.dead_child()
        if dead:
            say(f"pdq up: {dead.name} exited with code {dead.process.returncode}; stopping the cluster")
            code = 1
            break
        time.sleep(0.2)
    say("pdq: stopping ...")
    cluster.stop()
    say("pdq: stopped")
    return code
