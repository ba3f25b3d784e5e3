"""A small Python client of the public API (the CLI uses it).

    from pdq.client import Client
    with Client("127.0.0.1:50051") as c:
        print(c.generate("Hello", max_tokens=16).text)
        for chunk in c.generate_stream("Hello"):
            print(chunk.text, end="", flush=True)
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc

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

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason,
                "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
                "timings": self.timings}


def _timings(t: gen_pb.Timings) -> dict:
    return {"queue_ms": round(t.queue_ms, 1), "ttft_ms": round(t.ttft_ms, 1), "e2e_ms": round(t.e2e_ms, 1)}


class Client:
    def __init__(self, target: str = "127.0.0.1:50051", api_key: str | None = None, tls_ca: str | None = None):
        """api_key: else $PDQ_API_KEY, else the dev key of a local `pdq up` on that port.
        tls_ca: PEM file of the CA to trust for a TLS gateway (else $PDQ_TLS_CA; unset = plaintext)."""
        from pdq.devkeys import find_dev_key

        api_key = api_key or os.environ.get("PDQ_API_KEY") or find_dev_key(target)
        tls_ca = tls_ca or os.environ.get("PDQ_TLS_CA")
        if tls_ca:
            with open(tls_ca, "rb") as f:
                self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(f.read()))
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = gen_grpc.GenerationStub(self.channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else []

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def request(prompt: str | list[int], *, max_tokens: int = 0, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 0.0, seed: int | None = None, stop: list[str] | None = None,
                ignore_eos: bool = False, request_id: str = "", tier: str = "", timeout_ms: int = 0) -> gen_pb.GenerateRequest:
        sampling = gen_pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                         stop=stop or [], ignore_eos=ignore_eos)
        if seed is not None:
            sampling.seed = seed
        req = gen_pb.GenerateRequest(sampling=sampling, request_id=request_id, tier=tier, timeout_ms=timeout_ms)
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.extend(prompt)
        return req

    def generate(self, prompt: str | list[int], timeout: float | None = None, **kw) -> Result:
        """Unary Generate. Raises grpc.RpcError with the server's status on failure."""
        r = self.stub.Generate(self.request(prompt, **kw), timeout=timeout, metadata=self.metadata)
        return Result(r.request_id, r.text, list(r.token_ids), finish_name(r.finish_reason),
                      r.usage.prompt_tokens, r.usage.completion_tokens, _timings(r.timings))

    def generate_stream(self, prompt: str | list[int], timeout: float | None = None,
                        **kw) -> Iterator[gen_pb.GenerateStreamResponse]:
        """Streams GenerateStreamResponse messages; closing the iterator cancels the request."""
        call = self.stub.GenerateStream(self.request(prompt, **kw), timeout=timeout, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def cancel(self, request_id: str) -> str:
        return self.stub.Cancel(gen_pb.CancelRequest(request_id=request_id), metadata=self.metadata).state

    def submit(self, prompt: str | list[int], **kw) -> str:
        """Submit: the request id at once; fetch the result later with get_result/stream_result."""
        return self.stub.Submit(self.request(prompt, **kw), metadata=self.metadata).request_id

    def get_result(self, request_id: str, wait_ms: int = 0) -> gen_pb.GetResultResponse:
        """The state, and the result once done; waits up to wait_ms for the end."""
        return self.stub.GetResult(gen_pb.GetResultRequest(request_id=request_id, wait_ms=wait_ms),
                                   metadata=self.metadata)

    def stream_result(self, request_id: str, offset: int = 0) -> Iterator[gen_pb.GenerateStreamResponse]:
        """Follows a request's tokens from index `offset` (resume a broken stream)."""
        call = self.stub.StreamResult(gen_pb.StreamResultRequest(request_id=request_id, offset=offset),
                                      metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()
