"""The gRPC load generator against a fake gateway: what counts as a token, keys, errors, loops."""

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from pdq.ops import cpu
from pdq.bench.arrivals import Arrivals
from pdq.bench.metrics import summarize
from pdq.bench.service import run_service
from pdq.bench.workload import BenchRequest, Tenant, Workload
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc


class FakeGateway(gen_grpc.GenerationServicer):
    """Streams max_tokens tokens 5 ms apart after an empty first message (stream_interval of them
    to a message; one token without token_ids, as servers before that field); a prompt starting
    with id 13 is refused with RESOURCE_EXHAUSTED."""

    def __init__(self):
        self.keys: list[str] = []
        self.active = self.max_active = 0
        self.lock = threading.Lock()

    def GenerateStream(self, request, context):
        self.keys.append(dict(context.invocation_metadata()).get("authorization", ""))
        if request.prompt_token_ids[0] == 13:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        assert request.sampling.ignore_eos and request.sampling.temperature == 0
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            yield gen_pb.GenerateStreamResponse(request_id="r")
            time.sleep(0.02)
            step = max(1, request.stream_interval)  # (no first-token-alone rule here)
            for i in range(0, request.sampling.max_tokens, step):
                ids = [7] * min(step, request.sampling.max_tokens - i)
                yield gen_pb.GenerateStreamResponse(request_id="r", index=i, token_id=7,
                                                    token_ids=ids if step > 1 else [], text="")
                time.sleep(0.005)
            yield gen_pb.GenerateStreamResponse(request_id="r", finish_reason=gen_pb.FINISH_REASON_LENGTH)
        finally:
            with self.lock:
                self.active -= 1


@pytest.fixture
def gateway():
    fake = FakeGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    gen_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(0)


def workload(n: int, first_id: int = 5) -> Workload:
    tenants = (Tenant("a"), Tenant("b"))
    reqs = tuple(BenchRequest(i, (first_id if i == 0 else 5, 6), 3 + i % 3, tenant="ab"[i % 2]) for i in range(n))
    return Workload("test", 0, reqs, tenants)


def test_all_at_once_counts_only_token_messages_and_sends_each_tenants_key(gateway, monkeypatch, tmp_path):
    monkeypatch.delenv("PDQ_API_KEY", raising=False)
    monkeypatch.setenv("PDQ_CACHE_DIR", str(tmp_path))  # no dev key of a local `pdq up` either
    fake, target = gateway
    done = []
    run = run_service(target, "continuous", "continuous", workload(6), Arrivals(), api_keys={"a": "ka"},
                      on_done=done.append)
    assert len(done) == 6
    for rec in run.requests:
        assert rec.ok and rec.finish_reason == "length" and rec.output_tokens == rec.request.max_tokens
        assert rec.ttft >= 0.02 and rec.e2e >= rec.token_times[-1] - rec.due
    assert sorted(fake.keys) == ["", "", "", "Bearer ka", "Bearer ka", "Bearer ka"]
    s = summarize(run)
    assert s["errors"] == 0 and s["length_mismatches"] == 0 and s["client_cpu_pct"] is not None


def test_a_message_of_several_tokens_counts_each_arriving_with_it(gateway):
    _, target = gateway
    run = run_service(target, "continuous", "continuous", workload(4), Arrivals(), stream_interval=2)
    for rec in run.requests:
        assert rec.ok and rec.output_tokens == rec.request.max_tokens
        times = rec.token_times
        assert times[0] == times[1] and times[1] < times[2]  # tokens 0 and 1 came in one message


def test_clients_run_under_the_asked_cpu_policy_for_the_run_only(gateway):
    _, target = gateway
    seen = []
    run = run_service(target, "x", "x", workload(2), Arrivals(), client_policy="batch",
                      on_done=lambda rec: seen.append(cpu.current()))  # called on the clients' event loop
    assert seen == ["batch", "batch"] and all(r.ok for r in run.requests)
    assert cpu.current() == "normal"


def test_errors_are_recorded_not_raised(gateway):
    _, target = gateway
    run = run_service(target, "x", "x", workload(3, first_id=13), Arrivals())
    assert run.requests[0].error == "RESOURCE_EXHAUSTED: queue full" and not run.requests[0].ok
    assert all(r.ok for r in run.requests[1:])


def test_requests_leave_on_a_channel_connected_before_the_clock_starts(gateway, monkeypatch):
    from pdq.bench import service
    states = []
    stream = service.AsyncClient.generate_stream

    def noted(self, *args, **kwargs):
        states.append(self.channel.get_state())
        return stream(self, *args, **kwargs)
    monkeypatch.setattr(service.AsyncClient, "generate_stream", noted)
    _, target = gateway
    run = run_service(target, "x", "x", workload(3), Arrivals())
    assert all(r.ok for r in run.requests)
    assert states == [grpc.ChannelConnectivity.READY] * 3


def test_a_gateway_that_is_down_fails_each_request_soon(monkeypatch):
    from pdq.bench import service
    monkeypatch.setattr(service, "CONNECT_TIMEOUT_S", 0.2)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    run = run_service(f"127.0.0.1:{port}", "x", "x", workload(2), Arrivals(), timeout_s=30)
    assert [r.error.split(":")[0] for r in run.requests] == ["UNAVAILABLE"] * 2
    assert time.monotonic() - started < 10


def test_closed_loop_keeps_concurrency(gateway):
    fake, target = gateway
    run = run_service(target, "x", "x", workload(8), Arrivals(concurrency=2))
    assert fake.max_active <= 2 and all(r.ok for r in run.requests)
    assert sorted(r.due for r in run.requests) != [0.0] * 8  # each sent when one ended


def test_poisson_offers_at_due_times(gateway):
    _, target = gateway
    arrivals = Arrivals(rate=50.0, seed=3)
    run = run_service(target, "x", "x", workload(5), arrivals)
    assert [r.due for r in run.requests] == arrivals.offsets(5)
    assert all(r.ok for r in run.requests)
