"""Redis calls as values, and the two ways pdq runs them.

A `Call[T]` is what one store operation sends (Lua scripts by name, raw commands) and how its
replies become a T. `RequestStore` (`pdq.state.store`) builds them, each operation written once as
an `@op` method; the same method is then an `async def` on an `AsyncStore` (the gateway and the
scheduler, on a `redis.asyncio.Redis`) and a plain call on a `SyncStore` (a worker's model thread,
tools and tests, on a `redis.Redis`), typed either way:

    await async_store.transition(rid, epoch, State.DECODING)   # -> Moved | bool
    sync_store.transition(rid, epoch, State.DECODING)          # -> Moved | bool

A call of one command is sent alone (a script through redis-py's `Script`, which loads it when
Redis had not seen it); a call of several is one pipeline, one round trip, its scripts sent as
EVALSHA and any this Redis had not seen run again alone after the rest (loading them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Concatenate, Generic, ParamSpec, TypeVar, overload

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from pdq.state.keys import SCRIPTS, Keys

T = TypeVar("T")
U = TypeVar("U")
P = ParamSpec("P")


@dataclass(frozen=True)
class Script:
    """One run of Lua script `name` (`pdq.state.keys.SCRIPTS`) with `args` in wire order (`pack`);
    the key prefix goes before them."""

    name: str
    args: list[Any]


Command = tuple[Any, ...]  # a raw Redis command, e.g. ("HGETALL", key)


@dataclass(frozen=True)
class Call(Generic[T]):
    """What one operation sends, in order, and `parse` of the replies (one per part) -> T.
    `transaction`: the parts run in MULTI/EXEC (raw commands only)."""

    parts: tuple[Script | Command, ...]
    parse: Callable[[list[Any]], T]
    transaction: bool = False


def script(name: str, args: list[Any], parse: Callable[[Any], T]) -> Call[T]:
    """A call of one script whose reply `parse` reads."""
    return Call((Script(name, args),), lambda replies: parse(replies[0]))


def command(*cmd: Any, parse: Callable[[Any], T]) -> Call[T]:
    """A call of one raw command whose reply `parse` reads."""
    return Call((cmd,), lambda replies: parse(replies[0]))


def pipeline(cmds: list[Command], parse: Callable[[list[Any]], T], transaction: bool = False) -> Call[T]:
    """A call of raw commands in one round trip."""
    return Call(tuple(cmds), parse, transaction)


def joined(first: Call[T], second: Call[U]) -> Call[tuple[T, U]]:
    """Both calls in one round trip (one pipeline): -> (first's result, second's)."""
    if first.transaction or second.transaction:
        raise ValueError("a transaction cannot be joined to another call")
    n = len(first.parts)
    return Call(first.parts + second.parts, lambda replies: (first.parse(replies[:n]), second.parse(replies[n:])))


def batched(calls: list[Call[T]]) -> Call[list[T]]:
    """Every call in one round trip (one pipeline), in order: -> their results."""
    if any(c.transaction for c in calls):
        raise ValueError("a transaction cannot be batched with other calls")
    ends = [0]
    for c in calls:
        ends.append(ends[-1] + len(c.parts))
    return Call(tuple(p for c in calls for p in c.parts),
                lambda replies: [c.parse(replies[a:b]) for c, a, b in zip(calls, ends, ends[1:])])


def mapped(call: Call[T], convert: Callable[[T], U]) -> Call[U]:
    """`call` with its result passed through `convert`."""
    return Call(call.parts, lambda replies: convert(call.parse(replies)), call.transaction)


class _Runner:
    """What both stores hold: the client, the key names and the registered scripts."""

    def __init__(self, client: Any, prefix: str):
        self.client = client
        self.keys = Keys(prefix)
        self._scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}

    def _queue(self, pipe: Any, call: Call[Any]) -> None:
        for part in call.parts:
            if isinstance(part, Script):
                if call.transaction:
                    raise ValueError("a transaction holds raw commands only")
                pipe.evalsha(self._scripts[part.name].sha, 0, self.keys.prefix, *part.args)
            else:
                pipe.execute_command(*part)

    def _reruns(self, call: Call[Any], replies: list[Any]) -> list[int]:
        """The parts to run again alone (a script this Redis had not seen); raises any other error."""
        again = []
        for i, reply in enumerate(replies):
            if isinstance(reply, NoScriptError) and isinstance(call.parts[i], Script):
                again.append(i)
            elif isinstance(reply, Exception):
                raise reply
        return again

    def _script_args(self, part: Script) -> list[Any]:
        return [self.keys.prefix, *part.args]


class SyncRunner(_Runner):
    client: redis.Redis

    def run(self, call: Call[T]) -> T:
        """Sends `call` and returns its parsed result."""
        if len(call.parts) == 1 and not call.transaction:
            part = call.parts[0]
            if isinstance(part, Script):
                return call.parse([self._scripts[part.name](keys=[], args=self._script_args(part))])
            return call.parse([self.client.execute_command(*part)])
        pipe = self.client.pipeline(transaction=call.transaction)
        self._queue(pipe, call)
        return self.parse_replies(call, pipe.execute(raise_on_error=False))

    def parse_replies(self, call: Call[T], replies: list[Any]) -> T:
        """`call`'s result from its replies, one per part (an error as its exception): a script
        this Redis had not seen runs again alone (loading it); any other error raises."""
        for i in self._reruns(call, replies):
            part = call.parts[i]
            assert isinstance(part, Script)
            replies[i] = self._scripts[part.name](keys=[], args=self._script_args(part))
        return call.parse(replies)


class AsyncRunner(_Runner):
    client: aioredis.Redis

    async def run(self, call: Call[T]) -> T:
        """Sends `call` and returns its parsed result."""
        if len(call.parts) == 1 and not call.transaction:
            part = call.parts[0]
            if isinstance(part, Script):
                return call.parse([await self._scripts[part.name](keys=[], args=self._script_args(part))])
            return call.parse([await self.client.execute_command(*part)])
        pipe = self.client.pipeline(transaction=call.transaction)
        self._queue(pipe, call)
        replies = await pipe.execute(raise_on_error=False)
        for i in self._reruns(call, replies):
            part = call.parts[i]
            assert isinstance(part, Script)
            replies[i] = await self._scripts[part.name](keys=[], args=self._script_args(part))
        return call.parse(replies)


class op(Generic[P, T]):
    """Marks a store method that builds a `Call[T]`: read from an `AsyncRunner` it is a method
    returning an awaitable of T, from a `SyncRunner` one returning T."""

    def __init__(self, build: Callable[Concatenate[Any, P], Call[T]]):
        self.build = build
        functools.update_wrapper(self, build)  # type: ignore[arg-type]

    @overload
    def __get__(self, obj: None, owner: type) -> op[P, T]: ...
    @overload
    def __get__(self, obj: AsyncRunner, owner: type) -> Callable[P, Awaitable[T]]: ...
    @overload
    def __get__(self, obj: SyncRunner, owner: type) -> Callable[P, T]: ...

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        build, run = self.build, obj.run

        def call(*args: Any, **kwargs: Any) -> Any:
            return run(build(obj, *args, **kwargs))
        return call

