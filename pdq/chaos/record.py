"""What the load records: per planned request, everything its calls saw (plain data, JSON-able)."""

from dataclasses import dataclass, field


@dataclass
class Call:
    """One call that did not end OK (OK calls are only counted)."""

    method: str  # GenerateStream, StreamResult, Submit, GetResult, Cancel, SetDeadline
    code: str  # grpc.StatusCode name
    details: str
    t: float  # seconds since the run started
    ours: bool = False  # the load ended it itself (a stream it closed to cancel or give up)


@dataclass
class Move:
    """An operator deadline move the load made."""

    t: float
    timeout_ms: int
    code: str  # OK, or the status of its last try
    deadline_ms: int = 0  # the deadline the answer carried (OK only)


@dataclass
class Outcome:
    index: int
    client_id: str
    rids: list[str] = field(default_factory=list)  # every request id a call returned for client_id, first seen first
    created: list[bool] = field(default_factory=list)  # Submit's `created`, per answered Submit
    messages: list[list[int]] = field(default_factory=list)  # [index, tokens] per token message, across resumes
    tokens: list[int] = field(default_factory=list)  # token ids streamed to the client, in order
    resumes: int = 0  # streams resumed (StreamResult after a broken stream)
    stream_end: str = ""  # how its last stream ended: a finish reason (e.g. LENGTH) or a status code
    end_state: str = ""  # the terminal state GetResult reported ("" = the client never learned one)
    end_tokens: list[int] = field(default_factory=list)  # GetResult's token ids at the end
    end_error: str = ""
    echoed_id: str = ""  # the client request id GetResult said the request was submitted with
    cancelled: str = ""  # how the load cancelled it: rpc | disconnect | abandon ("" = never)
    cancel_state: str = ""  # its state (GetResult) just before the cancel
    cancel_answer: str = ""  # Cancel's answer: the state after the call
    moves: list[Move] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    t_start: float = 0.0
    t_first_token: float = 0.0
    t_end: float = 0.0
    abandoned: str = ""  # why the load gave up on it ("" = it did not)
    not_accepted: str = ""  # no call ever returned its id: the last error

    @property
    def rid(self) -> str:
        return self.rids[0] if self.rids else ""

    def note_rid(self, rid: str) -> None:
        if rid and rid not in self.rids:
            self.rids.append(rid)
