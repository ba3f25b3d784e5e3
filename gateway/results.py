"""Reading a request's output stream in Redis: tokens in order, then its end."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.follower import COUNT, OutputFollower
from pdq.state.request import FINISH_REASONS, State
from pdq.state.store import AsyncStore, _str, decode_logprobs
from pdq.v1 import generation_pb2 as gen_pb

# A request's usage and timing fields, in its record and (in this order) on its end entry.
USAGE_FIELDS = ("created_ms", "prompt_tokens", "n_out", "dispatched_ms", "first_token_ms", "finished_ms")


class Event:
    """One entry of a request's output stream: tokens from `index` on (index set), or the end
    (state set). An entry holds one token, or several a worker wrote at once (stream_interval)."""

    __slots__ = ("index", "token_ids", "texts", "state", "reason", "error", "usage", "logprobs")

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
        # each token's log-probabilities (`pdq.state.store.encode_logprobs`), when its request asked
        self.logprobs = [token_logprob(t, r) for t, r in zip(self.token_ids, _str(f["p"]).split(","))] if "p" in f else []
        self.state = State(_str(f["done"])) if "done" in f else None
        self.reason = _str(f.get("r", ""))
        self.error = _str(f.get("e", ""))
        # an end's usage fields (USAGE_FIELDS, in order), so that its reader needs no other read
        self.usage = dict(zip(USAGE_FIELDS, _str(f["u"]).split(","))) if "u" in f else None

    def then(self, other: "Event") -> "Event":
        """This token event and `other`, the next, as one (a new event: the follower hands one
        parsed entry to every subscriber of its stream, so none is changed)."""
        out = Event.__new__(Event)
        out.index, out.token_ids = self.index, self.token_ids + other.token_ids
        out.texts, out.logprobs = self.texts + other.texts, self.logprobs + other.logprobs
        out.state, out.reason, out.error, out.usage = None, "", "", None
        return out


def token_logprob(token_id: int, record: str) -> gen_pb.TokenLogprob:
    chosen, top = decode_logprobs(record)
    return gen_pb.TokenLogprob(token_id=token_id, logprob=chosen,
                               top=[gen_pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


async def follow(store: AsyncStore, follower: OutputFollower, rid: str,
                 wait_ms: int | None = None) -> AsyncIterator[Event]:
    """Yields the request's output stream from its first entry until its end entry; with
    wait_ms, stops early (without an end) once that long has passed (0: what is there now).
    Raises FollowerUnavailable when the stream cannot be followed (Redis unreachable past the
    outage window, the gateway stopping): the request is untouched."""
    key = store.keys.output(rid)
    if wait_ms == 0:
        async for fields in _entries(store, key, b"+"):
            event = Event(fields)
            yield event
            if event.state is not None:
                return
        return
    sub = follower.subscribe(key)
    deadline = None if wait_ms is None else asyncio.get_running_loop().time() + wait_ms / 1000
    try:
        if sub.start != b"0-0":  # joined a stream already followed: its entries so far are ours to read
            async for fields in _entries(store, key, sub.start):
                event = Event(fields)
                yield event
                if event.state is not None:
                    return
        while True:
            if deadline is None:
                batch = await sub.queue.get()
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        batch = await sub.queue.get()
                except TimeoutError:
                    return
            if isinstance(batch, Exception):
                raise batch
            events, failed = at_hand(batch, sub.queue)
            for event in coalesce(events):
                yield event
                if event.state is not None:
                    return
            if failed is not None:
                raise failed
    finally:
        follower.unsubscribe(sub)


def at_hand(batch: list, queue: asyncio.Queue) -> tuple[list[Event], Exception | None]:
    """The events of `batch` and of every batch already queued behind it (the subscriber fell
    behind the stream), and the failure queued after them, if one was."""
    events = []
    while True:
        events += [entry if isinstance(entry, Event) else Event(entry) for _, entry in batch]  # parsed by the follower, or not
        if queue.empty():
            return events, None
        batch = queue.get_nowait()
        if isinstance(batch, Exception):
            return events, batch


# At most this many tokens in one joined event (the largest stream_interval): a message stays
# small (a replay of a long finished stream comes in many), well under gRPC's 4 MB limit even
# with 20 top log-probabilities a token.
JOIN_MAX_TOKENS = 256


def coalesce(events: list[Event]) -> list[Event]:
    """Consecutive token events as one (their tokens, texts and log-probabilities in order), up
    to JOIN_MAX_TOKENS: a reader that fell behind the stream sends what it has in one message
    instead of a message per entry, each of which costs the gateway and its client more than its
    tokens do (vLLM's output collector merges a slow consumer's outputs the same way). The
    tokens and their order are the stream's, and an entry is never split; only how many
    messages carry them changes."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if (last is not None and last.state is None and last.index is not None and event.index is not None
                and event.index == last.index + len(last.token_ids)
                and len(last.token_ids) + len(event.token_ids) <= JOIN_MAX_TOKENS):
            out[-1] = last.then(event)
        else:
            out.append(event)
    return out


async def _entries(store: AsyncStore, key: str, upto: bytes) -> AsyncIterator[dict]:
    """The stream's entries from its first to `upto` (an entry id, or b"+": its last), read
    COUNT at a time."""
    start = b"-"
    while True:
        entries = await store.client.xrange(key, start, upto, count=COUNT)
        for _, fields in entries:
            yield fields
        if len(entries) < COUNT:
            return
        start = b"(" + entries[-1][0]


@dataclass
class Collected:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    end: Event | None = None

    def add(self, event: Event) -> None:
        if event.index is not None:
            self.token_ids += event.token_ids
            self.text += event.texts
            self.logprobs += event.logprobs
        if event.state is not None:
            self.end = event


async def usage_and_timings(store: AsyncStore, rid: str, end: Event | None = None
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


async def response(store: AsyncStore, rid: str, got: Collected) -> gen_pb.GenerateResponse:
    out = gen_pb.GenerateResponse(request_id=rid, text="".join(got.text), token_ids=got.token_ids,
                                  logprobs=got.logprobs)
    if got.end is not None:
        out.finish_reason = FINISH_REASONS.get(got.end.reason, 0)
        usage, timings = await usage_and_timings(store, rid, got.end)
        out.usage.CopyFrom(usage)
        out.timings.CopyFrom(timings)
    return out
