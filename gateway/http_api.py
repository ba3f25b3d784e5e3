"""The OpenAI-compatible HTTP door of the gateway (aiohttp, in the gateway's own event loop):
`POST /v1/completions`, `POST /v1/chat/completions` (server-sent events with `stream: true`),
`GET /v1/models`, `GET /health`.

A second door into the same `GenerationService` as gRPC: the same keys (`Authorization: Bearer`)
and tenancy, validation, scheduler, fair share and traces; `Idempotency-Key` (or vLLM's
`request_id` field) is the client request id. A client that disconnects before its request ends
cancels it at every hop, as a gRPC client's cancel does. Refusals are OpenAI error objects with
the HTTP status of pdq's gRPC code (429 with `Retry-After`).
"""

import asyncio
import contextlib
import json
import logging
import math
import ssl
import time

import grpc
from aiohttp import web

from gateway.chat_request import ChatTemplate, chat
from gateway.chat_stream import ChatDeltas
from gateway.openai_request import ApiError, Parsed, completion
from gateway.tool_calls import ToolChoice, calls_of
from pdq.observability import metrics, telemetry
from pdq.transport.serving import StartupError
from pdq.transport.status import StatusError
from pdq.v1 import generation_pb2 as gen_pb

log = logging.getLogger("pdq.gateway")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error"}
FINISH = {gen_pb.FINISH_REASON_LENGTH: "length", gen_pb.FINISH_REASON_EOS: "stop", gen_pb.FINISH_REASON_STOP: "stop"}
MAX_BODY_BYTES = 8 << 20


class HttpCall:
    """What `GenerationService` reads of a gRPC call, for an HTTP request: its key, and no
    deadline of its own (an HTTP client's timeout is its disconnect)."""

    def __init__(self, request: web.Request):
        self._metadata = (("authorization", request.headers.get("Authorization", "")),)

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> None:
        return None


def error_response(exc: ApiError) -> web.Response:
    body = {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}}
    headers = {}
    if exc.status in (429, 503):  # when to try again
        headers["Retry-After"] = str(max(1, math.ceil(getattr(exc, "retry_ms", 0) / 1000)))
    return web.json_response(body, status=exc.status, headers=headers)


def from_status(exc: StatusError) -> ApiError:
    """pdq's status -> the HTTP door's error, with the retry hint the status carried."""
    status = HTTP_STATUS.get(exc.code, 500)
    err = ApiError(status, exc.message, param=exc.field or None, kind=ERROR_TYPE.get(status, "server_error"),
                   code=exc.reason or exc.code.name.lower())
    pushback = dict(exc.trailing).get("grpc-retry-pushback-ms")
    err.retry_ms = exc.retry_ms or (int(pushback) if pushback and str(pushback).isdigit() else 0)
    return err


def usage_json(usage: gen_pb.Usage, completion_tokens: int | None = None) -> dict:
    """OpenAI's usage: the prompt once, the completion tokens of every choice."""
    done = usage.completion_tokens if completion_tokens is None else completion_tokens
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": done, "total_tokens": usage.prompt_tokens + done}


class OpenAIDoor:
    """The HTTP routes over a `GenerationService` (`service`), serving model `served`."""

    def __init__(self, service, served: str, template: ChatTemplate):
        self.service = service
        self.served = served
        self.template = template
        self.started = int(time.time())
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        self.app.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                             web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions)])
        self._runner: web.AppRunner | None = None
        self._tokens: dict[int, str] = {}  # token id -> its text alone (logprobs)

    async def start(self, host: str, port: int, tls: tuple[str, str] | None = None) -> None:
        ctx = None
        if tls:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(*tls)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels the request
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host, port, ssl_context=ctx).start()
        except OSError as exc:
            await self._runner.cleanup()
            raise StartupError(f"the HTTP API cannot listen on {host}:{port} ({exc.strerror}): give another "
                               "--http-port (pdq up --http-port P), or 0 to serve gRPC only") from None
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if tls else "http", host, port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        started = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except ApiError as exc:
            status = exc.status
            return error_response(exc)
        except StatusError as exc:
            err = from_status(exc)
            status = err.status
            return error_response(err)
        except web.HTTPException as exc:
            status = exc.status
            return error_response(ApiError(exc.status, exc.reason, kind=ERROR_TYPE.get(exc.status, "invalid_request_error")))
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499
            raise
        except Exception as exc:  # a bug: said as one, and logged with its stack
            log.exception("HTTP %s %s failed", request.method, request.path)
            return error_response(ApiError(500, f"internal error: {exc!r}", kind="server_error"))
        finally:
            # by route (its canonical path), not the raw path: a label per unknown path would grow without end
            route = request.match_info.route.resource
            metrics.HTTP_SECONDS.labels(route.canonical if route is not None else "other",
                                        str(status)).observe(time.perf_counter() - started)

    # -- routes ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        self.service.keys.authenticate(HttpCall(request))
        return web.json_response({"object": "list", "data": [
            {"id": self.served, "object": "model", "created": self.started, "owned_by": "pdq"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = completion(await self._body(request), self.served, self.service.limits.tiers)
        echo = ""
        if parsed.echo:
            echo = parsed.request.prompt or self.service.tokenizer.decode(list(parsed.request.prompt_token_ids))
        return await self._serve(request, parsed, "text_completion", "cmpl-", echo)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = chat(await self._body(request), self.served, self.service.limits.tiers)
        parsed, text = req.parsed, self.template.render_request(req)
        ids = await asyncio.to_thread(lambda: self.service.tokenizer.encode(text, add_special_tokens=False).ids)
        limit = self.service.limits.max_model_len
        if len(ids) >= limit:
            raise ApiError(400, f"messages: the chat is {len(ids)} tokens; this model takes at most {limit - 1}",
                           param="messages", code="context_length_exceeded")
        parsed.request.prompt_token_ids.extend(ids)
        if not parsed.request.sampling.max_tokens:  # as OpenAI's: whatever room the context leaves
            parsed.request.sampling.max_tokens = limit - len(ids)
        return await self._serve(request, parsed, "chat.completion", "chatcmpl-", req.echo, req.tools)

    # -- the request's life ----------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    async def _serve(self, request: web.Request, parsed: Parsed, kind: str, prefix: str, echo: str = "",
                     tools: ToolChoice | None = None) -> web.StreamResponse:
        """echo: text each choice starts with; tools: how a chat's output becomes tool calls."""
        call = HttpCall(request)
        principal = self.service.keys.authenticate(call)
        idempotency = request.headers.get("Idempotency-Key")
        if idempotency and not parsed.request.request_id:
            parsed.request.request_id = idempotency
        # the caller's W3C trace context, if it sent one: the request's trace goes on from it
        span = telemetry.start(f"POST {request.path}", request.headers.get("traceparent") or None,
                               kind=telemetry.SpanKind.SERVER,
                               attributes={"http.request.method": "POST", "url.path": request.path})
        try:
            with telemetry.use(span):
                # nobody watches a whole response's tokens arrive: the worker may write them in groups
                rids = await self.service.submit_n(parsed.request, call, principal, interval=1 if parsed.stream else 16)
                if not parsed.stream:
                    outs = await self.service.collect_n(rids, call)
                    return web.json_response(self._whole(outs, kind, prefix + rids[0], echo, tools))
                return await self._stream(request, call, rids, parsed, kind, prefix + rids[0], echo, tools)
        except StatusError as exc:
            telemetry.end(span, "refused", exc.message)
            span = None
            raise
        finally:
            telemetry.end(span)

    def _token(self, token_id: int) -> str:
        text = self._tokens.get(token_id)
        if text is None:
            text = self._tokens[token_id] = self.service.tokenizer.decode([token_id])
        return text

    def _logprobs(self, lps, chat_kind: bool, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens' `TokenLogprob`s (None when none were asked)."""
        if not lps:
            return None
        if chat_kind:
            def one(token_id: int, logprob: float) -> dict:
                text = self._token(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(t.token_id, t.logprob)
                                                                                   for t in lp.top]}
                                for lp in lps]}
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token(t.token_id): t.logprob for t in lp.top} for lp in lps],
                "text_offset": offsets}

    def _whole(self, outs: list[gen_pb.GenerateResponse], kind: str, cid: str, echo: str,
               tools: ToolChoice | None) -> dict:
        chat_kind = kind == "chat.completion"
        choices = []
        for i, out in enumerate(outs):
            reason = FINISH.get(out.finish_reason, "stop")
            logprobs = self._logprobs(out.logprobs, chat_kind)
            if not chat_kind:
                choices.append({"index": i, "text": echo + out.text, "logprobs": logprobs, "finish_reason": reason})
                continue
            message: dict = {"role": "assistant", "content": echo + out.text}
            if tools is not None:
                content, calls = calls_of(tools, out.text)
                message["content"] = None if content is None else echo + content
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if tools.mode in ("auto", "required") else reason
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return {"id": cid, "object": kind, "created": int(time.time()), "model": self.served, "choices": choices,
                "usage": usage_json(outs[0].usage, sum(o.usage.completion_tokens for o in outs))}

    async def _stream(self, request: web.Request, call: HttpCall, rids: list[str], parsed: Parsed, kind: str,
                      cid: str, echo: str, tools: ToolChoice | None) -> web.StreamResponse:
        """Server-sent events of the request's choices as their tokens come (each chunk one
        choice's; a chat choice's deltas from `ChatDeltas`), then each one's finish, the usage if
        asked, and [DONE]."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created, chat_kind = int(time.time()), kind == "chat.completion"
        obj = "chat.completion.chunk" if chat_kind else "text_completion"

        async def send(choices: list, usage: dict | None = None) -> None:
            chunk = {"id": cid, "object": obj, "created": created, "model": self.served, "choices": choices}
            if usage is not None:
                chunk["usage"] = usage
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        sent = [0] * len(rids)  # characters of text sent per choice (completions' text_offset)
        deltas = [ChatDeltas(tools) for _ in rids] if chat_kind else []

        async def text(i: int, text: str, reason: str | None, lps=()) -> None:
            """Choice i's text (and its tokens' logprobs, with the first of its chunks)."""
            logprobs = self._logprobs(lps, chat_kind, sent[i])
            sent[i] += len(text)
            if not chat_kind:
                return await send([{"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}])
            out = deltas[i].add(text) if text or reason is None else []
            if reason is not None:
                held, reason = deltas[i].end(reason)
                out += held + [deltas[i].delta({})]  # the last chunk: its finish reason
            for k, delta in enumerate(out or ([{}] if logprobs else [])):
                await send([{"index": i, "delta": delta, "logprobs": logprobs if k == 0 else None,
                             "finish_reason": reason if k == len(out) - 1 else None}])

        usage, completion_tokens, failed = None, 0, None
        # aclosing: this handler cancelled (the client gone) closes the streams, which cancels the requests
        async with contextlib.aclosing(self.service.streams(rids, call)) as messages:
            if echo:
                for i in range(len(rids)):
                    if chat_kind:
                        await send([{"index": i, "delta": d, "logprobs": None, "finish_reason": None}
                                    for d in deltas[i].start(echo)])
                    else:
                        await text(i, echo, None)
            async for i, msg in messages:
                if isinstance(msg, StatusError):
                    failed = failed or msg
                elif isinstance(msg, Exception):  # a bug: the call ends with it (logged by the door)
                    raise msg
                elif msg.HasField("usage") or msg.finish_reason:
                    await text(i, "", FINISH.get(msg.finish_reason, "stop"))
                    usage = msg.usage
                    completion_tokens += msg.usage.completion_tokens
                elif msg.HasField("index"):
                    await text(i, msg.text, None, msg.logprobs)
            if failed is not None:  # after the headers: the error as the stream's last event
                err = from_status(failed)
                await resp.write(b"data: " + json.dumps({"error": {"message": err.message, "type": err.kind,
                                                                   "param": err.param, "code": err.code}}).encode()
                                 + b"\n\n")
            elif parsed.include_usage and usage is not None:
                await send([], usage_json(usage, completion_tokens))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        return resp
