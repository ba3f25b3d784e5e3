"""An in-process OTLP/gRPC trace collector for tests: a real `TraceService` server (from the
opentelemetry-proto stubs) that keeps every span it receives, as plain `Span` records."""

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(v: common_pb2.AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[tuple[str, dict]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    status: str = "UNSET"  # UNSET | OK | ERROR
    status_message: str = ""

    def event(self, name: str) -> dict | None:
        return next((a for n, a in self.events if n == name), None)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, port: int = 0):
        self.spans: list[Span] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self.port = port  # 0: any free port, known after start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            service = _attrs(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        service=service, name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), kind=KINDS.get(s.kind, str(s.kind)),
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano, attributes=_attrs(s.attributes),
                        events=[(e.name, _attrs(e.attributes)) for e in s.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        status={0: "UNSET", 1: "OK", 2: "ERROR"}[s.status.code], status_message=s.status.message))
        with self._cond:
            self.spans.extend(got)
            self._cond.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> "Collector":
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    def trace(self, trace_id: str) -> list[Span]:
        with self._cond:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, check: Callable[[list[Span]], bool], timeout_s: float = 15.0) -> list[Span]:
        """Waits until `check(all spans so far)` holds; returns the spans (raises on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not check(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"spans not there after {timeout_s}s; have "
                                       f"{sorted({(s.service, s.name) for s in self.spans})}")
                self._cond.wait(min(left, 0.2))
            return list(self.spans)
