"""Which async HTTP stack serves the OpenAI door's traffic cheapest: aiohttp's server or
Starlette on uvicorn, each streaming server-sent events as the door does, measured alternately
in one run. Prints one JSON line per round: events/s and the server process's CPU seconds per
1,000 events.

    .venv/bin/python scripts/http_stack_ab.py [ROUNDS] [STREAMS] [EVENTS]    # needs uvicorn, starlette

The server runs in a child process (one core's worth of event loop, as the gateway's); the client
is one aiohttp session in this process, STREAMS streams at once of EVENTS events each (a chunk
of ~200 bytes of JSON, as a completion chunk)."""
import asyncio
import json
import multiprocessing
import os
import sys
import time

CHUNK = json.dumps({"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 0, "model": "builtin",
                    "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}]}).encode()


def serve_aiohttp(port: int, events: int) -> None:
    from aiohttp import web

    async def handler(request):
        await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(events):
            await resp.write(b"data: " + CHUNK + b"\n\n")
            await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.add_routes([web.post("/v1/completions", handler)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_starlette(port: int, events: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def handler(request):
        await request.json()

        async def body():
            for _ in range(events):
                yield b"data: " + CHUNK + b"\n\n"
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", handler, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


async def offer(port: int, streams: int) -> int:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams)) as http:
        async def one() -> int:
            n = 0
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}) as resp:
                async for line in resp.content:
                    n += line.startswith(b"data: {")
            return n

        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, target, streams: int, events: int) -> dict:
    from pdq.ops.redis_server import free_port

    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(target=target, args=(port, events), daemon=True)
    proc.start()
    deadline = time.monotonic() + 30
    while True:  # up when it answers
        try:
            asyncio.run(offer(port, 1))
            break
        except OSError:
            assert time.monotonic() < deadline, f"{name} did not start"
            time.sleep(0.1)
    cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
    got = asyncio.run(offer(port, streams))
    dt, cpu = time.perf_counter() - t0, cpu_s(proc.pid) - cpu0
    proc.terminate()
    proc.join()
    assert got == streams * events, (name, got)
    return {"stack": name, "events_per_s": round(got / dt), "server_cpu_ms_per_1k_events": round(1e6 * cpu / got, 1)}


if __name__ == "__main__":
    rounds, streams, events = (int(a) for a in (sys.argv[1:] + ["3", "64", "500"][len(sys.argv) - 1:]))
    for r in range(rounds):
        order = [("aiohttp", serve_aiohttp), ("starlette+uvicorn", serve_starlette)]
        for name, target in order if r % 2 == 0 else order[::-1]:
            print(json.dumps({"round": r, **measure(name, target, streams, events)}), flush=True)
