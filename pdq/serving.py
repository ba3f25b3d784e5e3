"""What every pdq gRPC server shares: health, reflection, port binding, graceful stop."""

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("pdq")

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class Server:
    """A grpc.aio server with health and reflection; `port` is the bound port after `start()`."""

    def __init__(self, host: str, port: int, service_names: Iterable[str]):
        self.grpc = grpc.aio.server(options=GRPC_OPTIONS)
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.grpc)
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
        await self.set_serving(True)

    async def stop(self, grace_s: float) -> None:
        await self.set_serving(False)
        for hook in self.on_stop:
            await hook()
        await self.grpc.stop(grace_s)


async def run_until_signal(server: Server, grace_s: float, ready: Callable[[], Any] | None = None) -> None:
    """Starts the server and serves until SIGINT/SIGTERM, then stops gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    if ready:
        ready()
    await stop.wait()
    log.info("stopping (grace %.1fs)", grace_s)
    await server.stop(grace_s)


def setup_logging(role: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


class StatusError(Exception):
    """Raised by code below a servicer to end the call with this status and message."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing = trailing  # trailing metadata, e.g. grpc-retry-pushback-ms


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

    async def run() -> None:
        server = build_server(config)
        await run_until_signal(server, config.grace_s,
                               lambda: log.info("%s serving on %s:%d", role, config.host, server.port))

    asyncio.run(run())
