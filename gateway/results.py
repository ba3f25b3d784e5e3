"""Reading a request's output stream in Redis: tokens in order, then its end."""

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.follower import COUNT, MAX_BLOCK_MS, OutputFollower, Subscription
from pdq.request import FINISH_REASONS, State
from pdq.store import RequestStore, _str
from pdq.v1 import generation_pb2 as gen_pb

# A request's usage and timing fields, in its record and (in this order) on its end entry.
USAGE_FIELDS = ("created_ms", "prompt_tokens", "n_out", "dispatched_ms", "first_token_ms", "finished_ms")


class Event:
    """One entry of a request's output stream: tokens from `index` on (index set), or the end
    (state set). An entry holds one token, or several a worker wrote at once (stream_interval)."""

    __slots__ = ("index", "token_ids", "texts", "state", "reason", "error", "usage")

    def __init__(self, fields: dict):
        f = {_str(k): v for k, v in fields.items()}
        self.index = int(f["i"]) if "i" in f else None
        self.token_ids = [int(t) for t in _str(f["t"]).split(",")] if "t" in f else []
        raw = f.get("x", b"")
        raw = raw.encode() if isinstance(raw, str) else raw
        if len(self.token_ids) > 1 and "l" in f:  # each token's text, by byte length
            self.texts, at = [], 0
            for n in map(int, _str(f["l"]).split(",")):
                self.texts.append(raw[at:at + n].decode())
                at += n
        else:
            self.texts = [raw.decode()] if self.token_ids else []
        self.state = State(_str(f["done"])) if "done" in f else None
        self.reason = _str(f.get("r", ""))
        self.error = _str(f.get("e", ""))
        # an end's usage fields (USAGE_FIELDS, in order), so that its reader needs no other read
        self.usage = dict(zip(USAGE_FIELDS, _str(f["u"]).split(","))) if "u" in f else None


async def follow(store: RequestStore, rid: str, wait_ms: int | None = None,
                 follower: OutputFollower | None = None) -> AsyncIterator[Event]:
    """Yields the stream's entries from the start until the end entry; with wait_ms, stops
    early (without an end) once that long has passed. Without wait_ms, reads through
    `follower` (one XREAD for every stream the gateway follows) when given and the stream is
    not followed already."""
    key = store.keys.output(rid)
    sub = follower.subscribe(key) if follower is not None and wait_ms is None else None
    entries = _read_alone(store, key, wait_ms) if sub is None else _read_followed(sub)
    try:
        async for fields in entries:
            event = Event(fields)
            yield event
            if event.state is not None:
                return
    finally:
        if sub is not None:
            follower.unsubscribe(sub)


async def _read_followed(sub: Subscription) -> AsyncIterator[dict]:
    while True:
        got = await sub.queue.get()
        if isinstance(got, Exception):
            raise got
        yield got[1]


async def _read_alone(store: RequestStore, key: str, wait_ms: int | None) -> AsyncIterator[dict]:
    last = "0-0"
    deadline = None if wait_ms is None else time.monotonic() + wait_ms / 1000
    while True:
        block = MAX_BLOCK_MS
        if deadline is not None:
            block = min(MAX_BLOCK_MS, int((deadline - time.monotonic()) * 1000))
            if block <= 0:
                block = None  # one last non-blocking read
        reply = await store.client.xread({key: last}, block=block, count=COUNT)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = _str(entry_id)
                yield fields
        if block is None:
            return


@dataclass
class Collected:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    end: Event | None = None

    def add(self, event: Event) -> None:
        if event.index is not None:
            self.token_ids += event.token_ids
            self.text += event.texts
        if event.state is not None:
            self.end = event


async def usage_and_timings(store: RequestStore, rid: str, end: Event | None = None
                            ) -> tuple[gen_pb.Usage, gen_pb.Timings]:
    """The request's usage and timings: from its end entry when that carries them (the stream's
    `finish` writes them there), else from its record."""
    rec = end.usage if end is not None and end.usage else await store.record_fields(rid, USAGE_FIELDS)
    created = float(rec.get("created_ms") or 0)

    def since(name: str) -> float:
        value = rec.get(name)
        return float(value) - created if value else 0.0

    usage = gen_pb.Usage(prompt_tokens=int(rec.get("prompt_tokens") or 0), completion_tokens=int(rec.get("n_out") or 0))
    timings = gen_pb.Timings(queue_ms=since("dispatched_ms"), ttft_ms=since("first_token_ms"),
                             e2e_ms=since("finished_ms"))
    return usage, timings


async def response(store: RequestStore, rid: str, got: Collected) -> gen_pb.GenerateResponse:
    out = gen_pb.GenerateResponse(request_id=rid, text="".join(got.text), token_ids=got.token_ids)
    if got.end is not None:
        out.finish_reason = FINISH_REASONS.get(got.end.reason, 0)
        usage, timings = await usage_and_timings(store, rid, got.end)
        out.usage.CopyFrom(usage)
        out.timings.CopyFrom(timings)
    return out
