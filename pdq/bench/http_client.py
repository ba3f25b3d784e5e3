"""Offering a request to an OpenAI-compatible HTTP server (pdq's HTTP door, vLLM, SGLang, TGI...):
`POST {base}/completions` with the prompt's token ids, greedy, `ignore_eos`, streamed as server-sent
events, every chunk's arrival recorded as the gRPC client's messages are (`pdq.bench.service`).

A chunk carries the tokens of one stream message; the final usage (`stream_options.include_usage`)
says how many tokens came in all, and tokens a chunk carried beyond one each arrive with it.
Connections are opened before the clock starts (`connect`), as a serving client's pool would be.
"""

import asyncio
import json
import time

import aiohttp

from pdq.bench.record import RequestRecord
from pdq.bench.workload import BenchRequest


def session(requests: int) -> aiohttp.ClientSession:
    """One connection pool for a run: as many connections as requests in flight."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(1, requests), force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=None))


def headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def connect(http: aiohttp.ClientSession, base: str, api_key: str | None, n: int) -> None:
    """Opens up to `n` kept-alive connections (n concurrent `GET /models`), so that no request
    of the run pays for its TCP set-up; a failure here is left for the requests to report."""
    async def one() -> None:
        async with http.get(f"{base}/models", headers=headers(api_key)) as resp:
            await resp.read()

    await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)


async def stream_one_http(http: aiohttp.ClientSession, base: str, model: str, api_key: str | None,
                          req: BenchRequest, rec: RequestRecord, t0: float, timeout_s: float) -> RequestRecord:
    """Runs one request to its end, filling `rec` (times relative to t0). Never raises for an
    HTTP error: it becomes the record's error."""
    clock = time.perf_counter
    times = rec.token_times
    body = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.post(f"{base}/completions", json=body, headers=headers(api_key),
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                text = await resp.text()
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text[:300]
                rec.error = f"HTTP {resp.status}: {message}"
            else:
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    now = clock() - t0
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                        break
                    for choice in chunk.get("choices") or ():
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
                        elif "text" in choice:
                            times.append(now)
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens", 0) > len(times):  # chunks that held several
                        times.extend([times[-1] if times else now] * (usage["completion_tokens"] - len(times)))
    except (aiohttp.ClientError, TimeoutError) as exc:
        rec.error = f"HTTP: {exc!r}"
    rec.end = clock() - t0
    return rec
