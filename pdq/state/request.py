"""The one request state enum, and how states map to finish reasons and gRPC codes."""

import enum

import grpc

from pdq.v1 import generation_pb2 as gen_pb


class State(str, enum.Enum):
    """A request's life: QUEUED -> PREFILLING -> TRANSFERRING -> DECODING -> one terminal state
    (TRANSFERRING skipped when a colocated worker decodes the prompt it prefilled)."""

    QUEUED = "QUEUED"
    PREFILLING = "PREFILLING"
    TRANSFERRING = "TRANSFERRING"
    DECODING = "DECODING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"
    FAILED = "FAILED"
    REJECTED = "REJECTED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


MAX_STREAM_INTERVAL = 256  # GenerateRequest.stream_interval: most decode steps between writes

TERMINAL = frozenset({State.COMPLETED, State.CANCELLED, State.TIMED_OUT, State.FAILED, State.REJECTED})

# finish_reason strings written by workers -> protobuf enum
FINISH_REASONS = {
    "length": gen_pb.FINISH_REASON_LENGTH,
    "eos": gen_pb.FINISH_REASON_EOS,
    "stop": gen_pb.FINISH_REASON_STOP,
    "cancelled": gen_pb.FINISH_REASON_CANCELLED,
    "timeout": gen_pb.FINISH_REASON_TIMEOUT,
    "error": gen_pb.FINISH_REASON_ERROR,
}

STATUS_OF_STATE = {
    State.COMPLETED: grpc.StatusCode.OK,
    State.CANCELLED: grpc.StatusCode.CANCELLED,
    State.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    State.FAILED: grpc.StatusCode.UNAVAILABLE,
    State.REJECTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
