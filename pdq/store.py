"""The request store: typed calls to the Lua scripts in `pdq.keys`.

Works with a sync `redis.Redis` (workers, whose model loop is a thread) and with a
`redis.asyncio.Redis` (gateway, scheduler): every method returns its result, or an awaitable of
it for an async client. Clients must use `decode_responses=False` (records hold protobuf bytes).
"""

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

from pdq.keys import SCRIPTS, Keys
from pdq.request import State
from pdq.v1 import internal_pb2 as pb


def now_ms() -> int:
    return int(time.time() * 1000)


def _then(value: Any, fn: Callable[[Any], Any]) -> Any:
    if inspect.isawaitable(value):
        async def run() -> Any:
            return fn(await value)
        return run()
    return fn(value)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class StepItem:
    """One sequence's part of a worker step: maybe a token, maybe its end."""

    request_id: str
    epoch: int
    index: int | None = None  # token index in the completion; None = no token this step
    token_id: int = 0
    text: str = ""
    final_state: State | None = None
    finish_reason: str = ""


class RequestStore:
    def __init__(self, client: Any, prefix: str = "pdq", result_ttl_s: int = 3600):
        self.client = client
        self.keys = Keys(prefix)
        self.result_ttl_s = result_ttl_s
        self._scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self._scripts[name](keys=keys, args=args)

    def _end_keys(self, rid: str) -> list[str]:
        k = self.keys
        return [k.request(rid), k.output(rid), k.queue, k.deadlines]

    def submit(self, spec: pb.RequestSpec, idempotency_key: str = "", max_queued: int = 10**9) -> Any:
        """Writes and queues a request. -> ("created"|"existing"|"rejected", request id or reason)."""
        k = self.keys
        keys = [k.request(spec.request_id), k.idempotency(spec.tenant, idempotency_key or "-"),
                k.queue, k.deadlines, k.seq]
        args = [spec.request_id, spec.SerializeToString(), spec.tenant, spec.tier, spec.arrival_ms,
                spec.deadline_ms, len(spec.prompt_token_ids), spec.sampling.max_tokens, max_queued,
                1 if idempotency_key else 0, self.result_ttl_s]
        kinds = {1: "created", 0: "existing", -1: "rejected"}
        return _then(self._run("submit", keys, args), lambda r: (kinds[int(r[0])], _str(r[1])))

    def claim(self, rids: list[str], worker: str) -> Any:
        """Moves queued requests to PREFILLING. -> epochs (0 = no longer queued)."""
        keys = [self.keys.queue] + [self.keys.request(r) for r in rids]
        return _then(self._run("claim", keys, [now_ms(), worker]), lambda r: [int(x) for x in r])

    def requeue(self, rid: str, epoch: int, error: str, max_attempts: int) -> Any:
        """Puts a failed attempt back in the queue, or FAILS it. -> new state name or None."""
        args = [epoch, now_ms(), max_attempts, error, self.result_ttl_s, self.keys.cancel_channel]
        return _then(self._run("requeue", self._end_keys(rid), args), lambda r: _str(r) if r else None)

    def transition(self, rid: str, epoch: int, state: State, **fields: Any) -> Any:
        """Moves a live request of this epoch to `state`, setting fields. -> True when moved."""
        args: list[Any] = [epoch, state.value]
        for name, value in fields.items():
            args += [name, value]
        return _then(self._run("transition", [self.keys.request(rid)], args), lambda r: bool(r))

    def step(self, items: list[StepItem]) -> Any:
        """Appends tokens / ends requests in one round trip. -> per item True (kept) / False (drop)."""
        k = self.keys
        keys = [k.queue, k.deadlines]
        args: list[Any] = [now_ms(), self.result_ttl_s, k.cancel_channel]
        for it in items:
            keys += [k.request(it.request_id), k.output(it.request_id)]
            args += [it.epoch, "" if it.index is None else it.index, it.token_id, it.text,
                     it.final_state.value if it.final_state else "", it.finish_reason]
        return _then(self._run("step", keys, args), lambda r: [bool(x) for x in r])

    def finish(self, rid: str, state: State, reason: str, error: str = "", epoch: int | None = None) -> Any:
        """Ends a request from outside (cancel, timeout, failure). -> state after, None if unknown."""
        args = [state.value, reason, error, now_ms(), self.result_ttl_s, self.keys.cancel_channel,
                "" if epoch is None else epoch]
        return _then(self._run("finish", self._end_keys(rid), args), lambda r: State(_str(r)) if r else None)

    def record(self, rid: str) -> Any:
        """The request record as {field: str}, with `spec` left as bytes; {} when unknown."""
        def decode(raw: dict) -> dict:
            return {_str(f): (v if _str(f) == "spec" else _str(v)) for f, v in raw.items()}
        return _then(self.client.hgetall(self.keys.request(rid)), decode)

    def streamed_tokens(self, rid: str) -> Any:
        """Token ids already written to the output stream, in index order."""
        def tokens(entries: list) -> list[int]:
            return [int(f[b"t"]) for _, f in entries if b"i" in f]
        return _then(self.client.xrange(self.keys.output(rid)), tokens)

    def lookup_idempotent(self, tenant: str, key: str) -> Any:
        return _then(self.client.get(self.keys.idempotency(tenant, key)), lambda r: _str(r) if r else None)


def spec_from_bytes(raw: bytes) -> pb.RequestSpec:
    spec = pb.RequestSpec()
    spec.ParseFromString(raw)
    return spec
