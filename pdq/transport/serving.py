"""What every pdq gRPC server shares: health, reflection, port binding, graceful stop."""

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NoReturn

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdq.observability import liveness
from pdq.model.arch import UnsupportedModelError
from pdq.transport.mtls import InternalTLS
from pdq.transport.rpc_guard import GuardInterceptor

log = logging.getLogger("pdq")

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
# Servers accept the clients' keepalive pings above (else they GOAWAY with too_many_pings).
# gRPC core queues the calls that arrive faster than the asyncio server takes them (one per turn
# of its event loop); by default it cancels them past 1,000 queued or 30 s queued, so a burst of
# thousands of streams opened at once to a busy gateway would lose many to a bare CANCELLED.
# The queue holds only what the clients sent; a call waits there until taken, within its own
# deadline; past the hard limit a call gets RESOURCE_EXHAUSTED.
SERVER_OPTIONS = GRPC_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.server.max_pending_requests", 20_000),
    ("grpc.server.max_pending_requests_hard_limit", 50_000),
    ("grpc.server_max_unrequested_time_in_server", 600),
]


class Server:
    """A grpc.aio server with health and reflection; `port` is the bound port after `start()`."""

    def __init__(self, host: str, port: int, service_names: Iterable[str], tls: tuple[str, str] | None = None,
                 mtls: "InternalTLS | None" = None):
        """tls: (certificate chain PEM path, private key PEM path) to serve TLS instead of plaintext;
        mtls: serve mutual TLS (an internal role's port, `pdq.transport.mtls`)."""
        from pdq.observability import telemetry_grpc

        self.ready = False  # True from the end of start() to the beginning of stop(): see pdq.transport.rpc_guard
        interceptors = [*telemetry_grpc.server_interceptors(), GuardInterceptor(lambda: self.ready)]
        self.grpc = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.grpc)
        if tls:
            with open(tls[0], "rb") as cert, open(tls[1], "rb") as key:
                creds = grpc.ssl_server_credentials([(key.read(), cert.read())])
            self.port = self.grpc.add_secure_port(f"{host}:{port}", creds)
        elif mtls:
            self.port = self.grpc.add_secure_port(f"{host}:{port}", mtls.server_credentials())
        else:
            self.port = self.grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot bind {host}:{port}")
        self.host = host
        self.on_start: list[Callable[[], Awaitable[None]]] = []  # run before reporting SERVING
        self.on_stop: list[Callable[[], Awaitable[None]]] = []  # run after NOT_SERVING, before stop

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [""] + self.service_names:
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def start(self) -> None:
        await self.set_serving(False)  # the health servicer says SERVING until told otherwise
        await self.grpc.start()
        for hook in self.on_start:
            await hook()
        self.ready = True
        await self.set_serving(True)

    async def stop(self, grace_s: float) -> None:
        self.ready = False
        await self.set_serving(False)
        for hook in self.on_stop:
            await hook()
        await self.grpc.stop(grace_s)


class StartupError(RuntimeError):
    """A process cannot start for a reason its operator fixes (e.g. a port in use): logged as one
    line saying what to do, no traceback."""


async def run_until_signal(server: Server, grace_s: float, ready: Callable[[], Any] | None = None) -> int:
    """Starts the server and serves until SIGINT/SIGTERM, or until a loop it needs cannot go on
    (`pdq.observability.liveness.fatal`), then stops gracefully. -> the exit status: 0, or 1 after a fatal."""
    stop = asyncio.Event()
    failed: list[str] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def on_fatal(reason: str) -> None:  # from any thread
        def now() -> None:
            failed.append(reason)
            server.ready = False
            stop.set()
        loop.call_soon_threadsafe(now)

    liveness.on_fatal(on_fatal)
    try:
        await server.start()
    except BaseException:  # e.g. Redis unreachable: close the port before the error goes up
        await server.grpc.stop(0)
        raise
    if ready:
        ready()
    await stop.wait()
    if failed:
        log.critical("stopping: %s", failed[0])
    log.info("stopping (grace %.1fs)", grace_s)
    await server.stop(grace_s)
    return 1 if failed else 0


def setup_logging(role: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


def redact(url: str) -> str:
    """A Redis URL without its password, for logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def run_service(role: str, config_cls: type, build_server: Callable[[Any], Server], argv: list[str] | None = None) -> None:
    """The `main()` of every pdq process: flags/env -> config -> build_server -> serve to SIGTERM."""
    import argparse

    from pdq.config import add_arguments, from_arguments

    parser = argparse.ArgumentParser(prog=f"pdq {role}", description=f"Run the pdq {role}.")
    add_arguments(parser, config_cls)
    try:
        config = from_arguments(config_cls, parser.parse_args(argv))
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(role)
    from pdq.observability import metrics, telemetry

    telemetry.setup(role, getattr(config, "worker_id", "") or "")
    metrics.serve(config.metrics_port, config.host)

    async def run() -> int:
        server = build_server(config)
        return await run_until_signal(server, config.grace_s,
                                      lambda: log.info("%s serving on %s:%d", role, config.host, server.port))

    try:
        code = asyncio.run(run())
    except redis.exceptions.ConnectionError as exc:  # at start: say what to fix, not a traceback
        log.error("%s cannot reach Redis at %s: %s (set --redis-url or PDQ_REDIS_URL)",
                  role, redact(config.redis_url), exc)
        raise SystemExit(1) from None
    except StartupError as exc:
        log.error("%s cannot start: %s", role, exc)
        raise SystemExit(1) from None
    except UnsupportedModelError as exc:  # a checkpoint this runtime cannot run: one line, what is unsupported
        log.error("%s cannot run the model %s: %s", role, getattr(config, "model", "?"), exc)
        raise SystemExit(1) from None
    finally:
        telemetry.shutdown()  # export the spans still buffered
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Ends a served process that has stopped cleanly: what it logged and printed flushed, then
    out without the interpreter's teardown. Finalizing gRPC's core, torch and the metrics
    endpoint (whose thread polls every 0.5 s) took 1-2 s of every stop and every restart, with
    nothing left to do: the servers have stopped, the loops have handed back their work and the
    spans are exported."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
