"""The transport's own ceiling for `pdq bench --capacity`: a bare process that serves
`pdq.v1.Generation/GenerateStream` and answers each call at once with the messages pdq's gateway
sends for it (a first message with the request id, one message per output token, a last one with
the finish reason, usage and timings), with no authentication, Redis, scheduler or worker behind
it. Swept by the same client under the same rules as the cluster, it measures what Python gRPC
carries of this call shape on this machine, client included: the capacity goal's "limit of that
component", measured in the same run, against which pdq's figures are a share.

Run as a module it is that server: `python -m pdq.bench.stream_ceiling PORT`.
"""

import asyncio
import sys

import grpc

from pdq.transport.serving import SERVER_OPTIONS
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc

REQUEST_ID = "0" * 32  # the length of the ids pdq gives requests
TOKEN_ID = 65


class CeilingGeneration(gen_grpc.GenerationServicer):
    """GenerateStream only; every other method is the generated servicer's UNIMPLEMENTED."""

    async def GenerateStream(self, request: gen_pb.GenerateRequest, context):
        n = request.sampling.max_tokens or 16
        yield gen_pb.GenerateStreamResponse(request_id=REQUEST_ID)
        for i in range(n):
            yield gen_pb.GenerateStreamResponse(request_id=REQUEST_ID, index=i, token_id=TOKEN_ID,
                                                token_ids=[TOKEN_ID], text="A")
        prompt = len(request.prompt_token_ids) or len(request.prompt)
        yield gen_pb.GenerateStreamResponse(
            request_id=REQUEST_ID, finish_reason=gen_pb.FINISH_REASON_LENGTH,
            usage=gen_pb.Usage(prompt_tokens=prompt, completion_tokens=n),
            timings=gen_pb.Timings(queue_ms=0.1, ttft_ms=0.2, e2e_ms=0.3))


async def serve(port: int) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    gen_grpc.add_GenerationServicer_to_server(CeilingGeneration(), server)
    if not server.add_insecure_port(f"127.0.0.1:{port}"):
        raise OSError(f"cannot bind 127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
