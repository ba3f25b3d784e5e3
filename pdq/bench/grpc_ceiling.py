"""The transport's own ceiling for `pdq bench --handoff`: the same hand-off bytes over a bare
grpc.aio client-streaming call to a bare server process that only counts them (no checks, no
KV pool, no interceptors). pdq's hand-off / this = how close pdq comes to what Python gRPC does
on this machine, measured side by side in one run.

Run as a module it is that server: `python -m pdq.bench.grpc_ceiling PORT`.
"""

import asyncio
import statistics
import sys
import time

import grpc

from pdq.transport.serving import GRPC_OPTIONS, SERVER_OPTIONS

METHOD = "/pdq.bench.Ceiling/Push"


async def _serve(port: int) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)

    async def push(frames, context) -> bytes:
        n = 0
        async for frame in frames:
            n += len(frame)
        return n.to_bytes(8, "little")

    handler = grpc.stream_unary_rpc_method_handler(push)  # raw bytes both ways
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdq.bench.Ceiling", {"Push": handler}),))
    if not server.add_insecure_port(f"127.0.0.1:{port}"):
        raise OSError(f"cannot bind 127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def measure(address: str, frames: list[bytes], repeats: int) -> list[float]:
    """Seconds per call, sending `frames` as one stream, after one warm-up call."""
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        push = channel.stream_unary(METHOD)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            got = int.from_bytes(await push(iter(frames), timeout=60), "little")
            if i:
                times.append(time.perf_counter() - t0)
            if got != sum(len(f) for f in frames):
                raise RuntimeError("the ceiling server lost bytes")
    return times


def median_gbps(n_bytes: int, times: list[float]) -> float:
    return round(n_bytes / statistics.median(times) / 1e9, 3)


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1])))
