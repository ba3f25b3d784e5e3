"""A Redis primary, its replicas and Redis Sentinels on loopback, for failover tests and drills.

All are the same `redis-server` binary (`pdq.ops.redis_server.find_redis_server`; Sentinels run it
with `--sentinel`), each a child process on a free port that dies with the process that started
it. `SentinelGroup.url` is the redis+sentinel:// URL pdq takes (`pdq.state.redis_url`); with `tls`
(`TLSFiles`), the Sentinels listen on TLS alone and watch the primary's TLS port, and the URL is
rediss+sentinel://.
"""

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import quote

import redis

from pdq.ops.child import spawn, stop
from pdq.ops.redis_server import RedisServer, find_redis_server, free_port

HOST = "127.0.0.1"
NODE_ARGS = ("--repl-diskless-sync-delay", "0")  # a replica syncs at once, not after 5 s waiting for others


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a TLS setup: the CA that signed the servers' certificate, and the servers'
    certificate and key (one pair for every node and Sentinel of a group, valid for 127.0.0.1)."""

    ca: str
    cert: str
    key: str

    def server_args(self) -> tuple[str, ...]:
        """redis-server options for TLS with these files (clients need no certificate of their own),
        and replication over TLS."""
        return ("--tls-cert-file", self.cert, "--tls-key-file", self.key, "--tls-ca-cert-file", self.ca,
                "--tls-auth-clients", "no", "--tls-replication", "yes")

    def config_lines(self) -> list[str]:
        """`server_args` as lines of a config file."""
        args = self.server_args()
        return [f"{name.removeprefix('--')} {value}" for name, value in zip(args[::2], args[1::2])]

    def client_kwargs(self) -> dict:
        return {"ssl": True, "ssl_ca_certs": self.ca}


class SentinelServer:
    """One Sentinel, monitoring `service` at `primary_port` with `quorum`. It starts knowing the
    replicas and its peers (`(port, myid)` each), as it would learn them (from the primary's INFO
    and hello channel, after a few seconds) and keep them in its config file."""

    def __init__(self, directory: str, port: int, myid: str, service: str, primary_port: int, quorum: int,
                 down_after_ms: int, failover_timeout_ms: int, replica_ports: list[int], peers: list[tuple[int, str]],
                 password: str = "", tls: TLSFiles | None = None):
        self.port, self.myid = port, myid
        self.config = os.path.join(directory, f"sentinel-{port}.conf")
        # over TLS it listens on TLS alone, and speaks TLS to the nodes (tls-replication)
        listen = ["port 0", f"tls-port {port}", *tls.config_lines()] if tls else [f"port {port}"]
        lines = [*listen, f"bind {HOST}", f"dir {directory}",
                 f"logfile {os.path.join(directory, f'sentinel-{port}.log')}", f"sentinel myid {myid}",
                 f"sentinel monitor {service} {HOST} {primary_port} {quorum}",
                 f"sentinel down-after-milliseconds {service} {down_after_ms}",
                 f"sentinel failover-timeout {service} {failover_timeout_ms}", f"sentinel parallel-syncs {service} 1",
                 *(f"sentinel known-replica {service} {HOST} {p}" for p in replica_ports),
                 *(f"sentinel known-sentinel {service} {HOST} {p} {i}" for p, i in peers),
                 # its own password, and the one it gives its peers (all Sentinels of a group share it)
                 *((f"requirepass {password}", f"sentinel sentinel-pass {password}") if password else ())]
        with open(self.config, "w") as f:  # Sentinel rewrites it with what it learns
            f.write("\n".join(lines) + "\n")
        self.process = spawn([find_redis_server(tls=tls is not None), self.config, "--sentinel"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.client = redis.Redis(HOST, self.port, socket_timeout=2, socket_connect_timeout=0.5, decode_responses=True,
                                  password=password or None, **(tls.client_kwargs() if tls else {}))

    def stop(self) -> None:
        self.client.close()
        stop(self.process, 5)


class SentinelGroup:
    """A primary, `replicas` replicas (in sync before `start` returns) and `sentinels` Sentinels
    that agree on them (each has seen the replicas and the other Sentinels), monitoring them as
    `service`. `down_after_ms`: how long a silent primary takes to be judged down; a failover
    then takes about a second more on loopback."""

    def __init__(self, replicas: int = 1, sentinels: int = 3, quorum: int = 2, down_after_ms: int = 500,
                 failover_timeout_ms: int = 2000, service: str = "pdq", sentinel_password: str = "",
                 tls: TLSFiles | None = None):
        self.service = service
        self.tls = tls  # the nodes take TLS on a port of their own (`tls_ports`), the Sentinels on TLS alone
        self.tls_ports: dict[int, int] = {}  # a node's plain port -> its TLS port
        self.sentinel_password = sentinel_password  # the Sentinels' own (requirepass), in `url`'s query
        self.directory = tempfile.mkdtemp(prefix="pdq-sentinel-")
        self.replicas, self.quorum = replicas, quorum
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.nodes: list[RedisServer] = []  # the primary first, as started
        self.sentinels: list[SentinelServer] = []
        self._sentinel_count = sentinels

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        query = [f"sentinel_password={self.sentinel_password}"] if self.sentinel_password else []
        if self.tls:
            query.append(f"ssl_ca_certs={quote(self.tls.ca, safe='/')}")
        scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
        return f"{scheme}://{hosts}/{self.service}/0{'?' + '&'.join(query) if query else ''}"

    def start(self, timeout_s: float = 20.0) -> "SentinelGroup":
        deadline = time.monotonic() + timeout_s
        primary = self._node("primary")
        for i in range(self.replicas):
            self._node(f"replica-{i}", "--replicaof", HOST, str(self._watched(primary)))
        # After a sync the primary streams writes to a replica only from its first ack (up to 1 s later):
        # a write the replicas acknowledged (WAIT) says they are streaming.
        self._wait(lambda: self._streaming(primary), deadline, "the replicas to sync")
        ids = [(free_port(), secrets.token_hex(20)) for _ in range(self._sentinel_count)]
        for port, myid in ids:
            self.sentinels.append(SentinelServer(self.directory, port, myid, self.service, self._watched(primary),
                                                 self.quorum, self.down_after_ms, self.failover_timeout_ms,
                                                 [self._watched(n) for n in self.nodes[1:]],
                                                 [p for p in ids if p[0] != port], self.sentinel_password, self.tls))
        for s in self.sentinels:
            self._wait(lambda: self._agreed(s), deadline, f"Sentinel on port {s.port} to see the group")
        return self

    def _node(self, name: str, *args: str) -> RedisServer:
        """Starts a node; over TLS it also listens on a TLS port (its plain one stays, for this
        group's own checks) and replicates over TLS."""
        node = RedisServer(self._dir(name), extra_args=(*NODE_ARGS, *args),
                           tls_args=self.tls.server_args() if self.tls else ()).start()
        self.nodes.append(node)
        self.tls_ports[node.port] = node.tls_port
        return node

    def _watched(self, node: RedisServer) -> int:
        """The port of `node` that the Sentinels watch and name to clients: its TLS one over TLS."""
        return self.tls_ports.get(node.port) or node.port

    def _streaming(self, primary: RedisServer) -> bool:
        with redis.Redis(HOST, primary.port, socket_timeout=2) as client:
            client.set("pdq-sentinel-group:probe", "1")
            return client.wait(self.replicas, 100) >= self.replicas

    def _agreed(self, s: SentinelServer) -> bool:
        state = s.client.sentinel_master(self.service)
        return state["num-slaves"] >= self.replicas and state["num-other-sentinels"] >= len(self.sentinels) - 1

    @staticmethod
    def _wait(check, deadline: float, what: str) -> None:
        while True:
            try:
                if check():
                    return
            except (redis.RedisError, OSError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def _dir(self, name: str) -> str:
        os.makedirs(path := os.path.join(self.directory, name))
        return path

    @staticmethod
    def replication(node: RedisServer) -> dict:
        """INFO replication of `node`."""
        with redis.Redis(HOST, node.port, socket_timeout=2, socket_connect_timeout=0.5) as client:
            return client.info("replication")

    def primary_port(self) -> int:
        """The primary's port as the first Sentinel that answers names it."""
        for s in self.sentinels:
            try:
                return int(s.client.sentinel_get_master_addr_by_name(self.service)[1])
            except (redis.RedisError, OSError):
                continue
        raise RuntimeError("no Sentinel answers")

    def node(self, port: int) -> RedisServer:
        (found,) = [n for n in self.nodes if port in (n.port, self.tls_ports.get(n.port))]
        return found

    def kill_primary(self) -> RedisServer:
        """SIGKILLs the primary (as named by the Sentinels now). -> it"""
        node = self.node(self.primary_port())
        node.process.send_signal(signal.SIGKILL)
        node.process.wait()
        return node

    def wait_for_failover(self, old_port: int, timeout_s: float = 15.0) -> RedisServer:
        """Waits until a quorum's choice of primary is a node other than `old_port` that says it
        is a primary. -> that node"""
        deadline = time.monotonic() + timeout_s
        chosen: list[RedisServer] = []

        old = self.node(old_port)

        def promoted() -> bool:
            port = self.primary_port()
            if self.node(port) is not old and self.replication(self.node(port))["role"] == "master":
                chosen.append(self.node(port))
                return True
            return False
        self._wait(promoted, deadline, f"a failover away from port {old_port}")
        return chosen[0]

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "SentinelGroup":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
