"""A small Python client of the public API (the CLI uses it), and its asyncio twin.

    from pdq.client import Client
    with Client("127.0.0.1:50051") as c:
        print(c.generate("Hello", max_tokens=16).text)
        for chunk in c.generate_stream("Hello"):
            print(chunk.text, end="", flush=True)

    from pdq.client import AsyncClient
    async with AsyncClient("127.0.0.1:50051") as c:  # many concurrent calls on one event loop
        async for chunk in c.generate_stream("Hello"):
            print(chunk.text, end="", flush=True)
"""

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc
from pdq.v1 import operator_pb2 as op_pb

FINISH_NAMES = {v: k for k, v in gen_pb.FinishReason.items()}


def finish_name(value: int) -> str:
    """FINISH_REASON_LENGTH -> "length"."""
    return FINISH_NAMES.get(value, "FINISH_REASON_UNSPECIFIED").removeprefix("FINISH_REASON_").lower()


@dataclass
class Result:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: dict = field(default_factory=dict)
    logprobs: list = field(default_factory=list)  # TokenLogprob per token, when asked for
    choices: list["Result"] = field(default_factory=list)  # with n > 1: every completion (the above: choice 0)

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason,
                "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
                "timings": self.timings,
                **({"logprobs": [{"token_id": lp.token_id, "logprob": lp.logprob,
                                  "top": [{"token_id": t.token_id, "logprob": t.logprob} for t in lp.top]}
                                 for lp in self.logprobs]} if self.logprobs else {}),
                **({"choices": [c.to_json() for c in self.choices]} if self.choices else {})}


def _timings(t: gen_pb.Timings) -> dict:
    return {"queue_ms": round(t.queue_ms, 1), "ttft_ms": round(t.ttft_ms, 1), "e2e_ms": round(t.e2e_ms, 1)}


def _result(r: gen_pb.GenerateResponse) -> Result:
    out = Result(r.request_id, r.text, list(r.token_ids), finish_name(r.finish_reason),
                 r.usage.prompt_tokens, r.usage.completion_tokens, _timings(r.timings), list(r.logprobs))
    out.choices = [Result(c.request_id, c.text, list(c.token_ids), finish_name(c.finish_reason), r.usage.prompt_tokens,
                          len(c.token_ids), logprobs=list(c.logprobs)) for c in r.choices]
    return out


def connect(target: str, api_key: str | None, tls_ca: str | None, admin: bool = False,
            aio: bool = False) -> tuple[grpc.Channel, list]:
    """A channel to the gateway (a grpc.aio one if `aio`) and the call metadata carrying the API
    key: `api_key`, else $PDQ_API_KEY, else the dev key (the admin one if `admin`) of a local
    `pdq up` on that port."""
    from pdq.ops.devkeys import find_dev_key

    api_key = api_key or os.environ.get("PDQ_API_KEY") or find_dev_key(target, admin=admin)
    tls_ca = tls_ca or os.environ.get("PDQ_TLS_CA")
    grpc_ = grpc.aio if aio else grpc
    if tls_ca:
        with open(tls_ca, "rb") as f:
            channel = grpc_.secure_channel(target, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc_.insecure_channel(target)
    return channel, [("authorization", f"Bearer {api_key}")] if api_key else []


class _Connection:
    """A channel to the gateway, closed on leaving a `with` block."""

    channel: grpc.Channel

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancels the calls in flight (a blocked call raises CANCELLED; their requests are
        cancelled as when a client disconnects) and closes the channel; returns at once, and
        again if called twice."""
        self.channel.close()


class Client(_Connection):
    def __init__(self, target: str = "127.0.0.1:50051", api_key: str | None = None, tls_ca: str | None = None):
        """api_key: else $PDQ_API_KEY, else the dev key of a local `pdq up` on that port.
        tls_ca: PEM file of the CA to trust for a TLS gateway (else $PDQ_TLS_CA; unset = plaintext)."""
        self.channel, self.metadata = connect(target, api_key, tls_ca)
        self.stub = gen_grpc.GenerationStub(self.channel)

    @staticmethod
    def request(prompt: str | list[int], *, max_tokens: int = 0, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 0.0, seed: int | None = None, stop: list[str] | None = None,
                ignore_eos: bool = False, request_id: str = "", tier: str = "", timeout_ms: int = 0,
                stream_interval: int = 0, stop_token_ids: list[int] | None = None, min_p: float = 0.0,
                presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 0.0,
                logit_bias: dict[int, float] | None = None, logprobs: int | None = None, json_schema: str = "",
                regex: str = "", min_tokens: int = 0, n: int = 0) -> gen_pb.GenerateRequest:
        sampling = gen_pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                         stop=stop or [], ignore_eos=ignore_eos, stop_token_ids=stop_token_ids or [],
                                         min_p=min_p, presence_penalty=presence_penalty,
                                         frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                                         logit_bias=logit_bias or {}, json_schema=json_schema, regex=regex,
                                         min_tokens=min_tokens)
        if seed is not None:
            sampling.seed = seed
        if logprobs is not None:
            sampling.logprobs = logprobs
        req = gen_pb.GenerateRequest(sampling=sampling, request_id=request_id, tier=tier, timeout_ms=timeout_ms,
                                     stream_interval=stream_interval, n=n)
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.extend(prompt)
        return req

    def generate(self, prompt: str | list[int], timeout: float | None = None, **kw) -> Result:
        """Unary Generate. Raises grpc.RpcError with the server's status on failure."""
        return _result(self.stub.Generate(self.request(prompt, **kw), timeout=timeout, metadata=self.metadata))

    def generate_stream(self, prompt: str | list[int], timeout: float | None = None,
                        **kw) -> Iterator[gen_pb.GenerateStreamResponse]:
        """Streams GenerateStreamResponse messages; closing the iterator cancels the request.
        With stream_interval=N, a message after the first token carries the tokens of up to N
        decode steps (token_ids)."""
        call = self.stub.GenerateStream(self.request(prompt, **kw), timeout=timeout, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def cancel(self, request_id: str, timeout: float | None = None) -> str:
        """Cancels one of the caller's requests. -> its state after the call."""
        return self.stub.Cancel(gen_pb.CancelRequest(request_id=request_id), timeout=timeout,
                                metadata=self.metadata).state

    def submit(self, prompt: str | list[int], timeout: float | None = None, **kw) -> str:
        """Submit: the request id at once; fetch the result later with get_result/stream_result."""
        return self.stub.Submit(self.request(prompt, **kw), timeout=timeout, metadata=self.metadata).request_id

    def get_result(self, request_id: str, wait_ms: int = 0, timeout: float | None = None) -> gen_pb.GetResultResponse:
        """The state, and the result once done; waits up to wait_ms for the end."""
        return self.stub.GetResult(gen_pb.GetResultRequest(request_id=request_id, wait_ms=wait_ms), timeout=timeout,
                                   metadata=self.metadata)

    def stream_result(self, request_id: str, offset: int = 0,
                      timeout: float | None = None) -> Iterator[gen_pb.GenerateStreamResponse]:
        """Follows a request's tokens from index `offset` (resume a broken stream). Closing the
        iterator ends the call, not the request."""
        call = self.stub.StreamResult(gen_pb.StreamResultRequest(request_id=request_id, offset=offset),
                                      timeout=timeout, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()


def _closed() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "the client was closed")


class AsyncClient:
    """`Client`'s calls for asyncio programs, over grpc.aio: one event loop carries many
    concurrent calls, each a coroutine (or async iterator) instead of a blocked thread. Create
    and use it inside the running event loop; errors are grpc.aio.AioRpcError (a grpc.RpcError)."""

    request = staticmethod(Client.request)

    def __init__(self, target: str = "127.0.0.1:50051", api_key: str | None = None, tls_ca: str | None = None):
        self.channel, self.metadata = connect(target, api_key, tls_ca, aio=True)
        self.stub = gen_grpc.GenerationStub(self.channel)
        self._closed = False

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancels the calls in flight (each raises AioRpcError CANCELLED "the client was closed";
        their requests are cancelled as when a client disconnects) and closes the channel,
        without waiting for the server; safe to call twice."""
        self._closed = True
        await self.channel.close(grace=None)

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """grpc.aio ends the calls a closing channel cancels with asyncio.CancelledError, which
        would look like the caller's task being cancelled, and a call that starts after with
        UsageError: both become AioRpcError CANCELLED "the client was closed". A cancellation
        of the caller's own task goes through as it is."""
        try:
            yield
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                raise _closed() from None
            raise
        except grpc.aio.UsageError:  # a call that was about to start when the channel closed
            if self._closed:
                raise _closed() from None
            raise

    async def generate(self, prompt: str | list[int], timeout: float | None = None, **kw) -> Result:
        """Unary Generate (keywords as `Client.request`)."""
        with self._call():
            return _result(await self.stub.Generate(Client.request(prompt, **kw), timeout=timeout,
                                                    metadata=self.metadata))

    async def generate_stream(self, prompt: str | list[int], timeout: float | None = None,
                              **kw) -> AsyncIterator[gen_pb.GenerateStreamResponse]:
        """Streams GenerateStreamResponse messages; closing the iterator cancels the request."""
        call = self.stub.GenerateStream(Client.request(prompt, **kw), timeout=timeout, metadata=self.metadata)
        try:
            with self._call():
                async for msg in call:
                    yield msg
        finally:
            call.cancel()

    async def submit(self, prompt: str | list[int], timeout: float | None = None, **kw) -> str:
        """Submit: the request id at once (keywords as `Client.request`)."""
        with self._call():
            return (await self.stub.Submit(Client.request(prompt, **kw), timeout=timeout,
                                           metadata=self.metadata)).request_id

    async def cancel(self, request_id: str, timeout: float | None = None) -> str:
        """Cancels one of the caller's requests. -> its state after the call."""
        with self._call():
            return (await self.stub.Cancel(gen_pb.CancelRequest(request_id=request_id), timeout=timeout,
                                           metadata=self.metadata)).state

    async def get_result(self, request_id: str, wait_ms: int = 0,
                         timeout: float | None = None) -> gen_pb.GetResultResponse:
        """The state, and the result once done; waits up to wait_ms for the end."""
        with self._call():
            return await self.stub.GetResult(gen_pb.GetResultRequest(request_id=request_id, wait_ms=wait_ms),
                                             timeout=timeout, metadata=self.metadata)

    async def stream_result(self, request_id: str, offset: int = 0,
                            timeout: float | None = None) -> AsyncIterator[gen_pb.GenerateStreamResponse]:
        """Follows a request's tokens from index `offset` (resume a broken stream). Closing the
        iterator ends the call, not the request."""
        call = self.stub.StreamResult(gen_pb.StreamResultRequest(request_id=request_id, offset=offset),
                                      timeout=timeout, metadata=self.metadata)
        try:
            with self._call():
                async for msg in call:
                    yield msg
        finally:
            call.cancel()


class OperatorClient(_Connection):
    """The Operator API (admin keys only); methods return the response messages of
    `pdq.v1.operator_pb2` and raise grpc.RpcError with the server's status.

        with OperatorClient("127.0.0.1:50051") as op:
            for r in op.list_requests(state="QUEUED").requests:
                op.cancel(r.request_id)
    """

    def __init__(self, target: str = "127.0.0.1:50051", api_key: str | None = None, tls_ca: str | None = None):
        """api_key: else $PDQ_API_KEY, else the admin dev key of a local `pdq up` on that port."""
        from pdq.v1 import operator_pb2_grpc as op_grpc

        self.channel, self.metadata = connect(target, api_key, tls_ca, admin=True)
        self.stub = op_grpc.OperatorStub(self.channel)

    def _call(self, method: str, message):
        return getattr(self.stub, method)(message, metadata=self.metadata, timeout=30.0)

    def cancel(self, request_id: str) -> str:
        """Cancels any tenant's request. -> its state after the call."""
        return self._call("CancelRequest", op_pb.OperatorCancelRequest(request_id=request_id)).state

    def cancel_tenant(self, tenant: str) -> int:
        """Cancels every live request of a tenant. -> how many."""
        return self._call("CancelTenant", op_pb.CancelTenantRequest(tenant=tenant)).cancelled

    def set_deadline(self, request_id: str, timeout_ms: int) -> "op_pb.RequestInfo":
        """Moves a live request's deadline to `timeout_ms` from now."""
        return self._call("SetDeadline", op_pb.SetDeadlineRequest(request_id=request_id, timeout_ms=timeout_ms))

    def get_request(self, request_id: str) -> "op_pb.RequestInfo":
        return self._call("GetRequest", op_pb.GetRequestRequest(request_id=request_id))

    def list_requests(self, tenant: str = "", state: str = "", tier: str = "", page_size: int = 0,
                      page_token: str = "") -> "op_pb.ListRequestsResponse":
        """One page, newest first; pass `next_page_token` back for the next one."""
        return self._call("ListRequests", op_pb.ListRequestsRequest(tenant=tenant, state=state, tier=tier,
                                                                    page_size=page_size, page_token=page_token))

    def iter_requests(self, limit: int = 0, **filters) -> Iterator["op_pb.RequestInfo"]:
        """Every matching request, newest first, page after page (at most `limit`; 0 = all)."""
        token, n = "", 0
        while True:
            page = self.list_requests(page_token=token, page_size=min(limit or 1000, 1000), **filters)
            for info in page.requests:
                yield info
                n += 1
                if limit and n >= limit:
                    return
            token = page.next_page_token
            if not token:
                return

    def list_workers(self) -> list:
        return list(self._call("ListWorkers", op_pb.ListWorkersRequest()).workers)

    def drain(self, worker_id: str, undo: bool = False) -> "op_pb.WorkerInfo":
        """Drains a worker (no new work; it finishes what it runs), or with undo=True ends the drain."""
        return self._call("UndrainWorker" if undo else "DrainWorker", op_pb.DrainWorkerRequest(worker_id=worker_id))

    def pause(self, tier: str = "", tenant: str = "", resume: bool = False) -> "op_pb.PauseQueueResponse":
        """Pauses (or with resume=True resumes) dispatching a tier's or a tenant's queued requests."""
        return self._call("ResumeQueue" if resume else "PauseQueue", op_pb.PauseQueueRequest(tier=tier, tenant=tenant))

    def set_tenant_policy(self, tenant: str, weight: float = 0.0, tier: str = "", max_queued: int = 0,
                          max_queued_tokens: int = 0) -> "op_pb.TenantPolicy":
        """Sets a tenant's whole policy (0 / "" = the scheduler's default for that field)."""
        return self._call("SetTenantPolicy", op_pb.TenantPolicy(tenant=tenant, weight=weight, tier=tier,
                                                                max_queued=max_queued,
                                                                max_queued_tokens=max_queued_tokens))

    def list_tenants(self) -> list:
        return list(self._call("ListTenants", op_pb.ListTenantsRequest()).tenants)

    def stats(self) -> "op_pb.Stats":
        return self._call("GetStats", op_pb.GetStatsRequest())
