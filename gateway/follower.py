"""One blocking XREAD for every output stream a gateway follows.

A streaming call that ran its own blocking XREAD cost the gateway one Redis round trip per
token per call: with 30 streams and a decode step every 30 ms, ~1,000 calls a second, each with
the Python client's overhead. The follower reads every followed stream with one XREAD (BLOCK)
on a connection of its own and hands each entry to the queue of the call that follows it. A
stream that starts being followed while that XREAD blocks wakes it with CLIENT UNBLOCK, so its
entries are read at once.

Contract: `subscribe(key)` -> a `Subscription` whose queue gets every entry of the stream from
the start, in order, as (entry_id, fields); or an exception (the read failed: Redis gone),
after which nothing more comes. `unsubscribe` when done. A stream already followed on this
gateway gets None: the caller reads it on its own (rare: two calls following one request).
"""

import asyncio
import logging
from dataclasses import dataclass, field

log = logging.getLogger("pdq.gateway")

# One blocking XREAD waits at most this long (well under a Redis client's socket timeout).
MAX_BLOCK_MS = 1000
COUNT = 512  # entries per stream per read
WAKE_TRIES = 50


@dataclass(eq=False)
class Subscription:
    key: str
    last: str = "0-0"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class OutputFollower:
    """`reader`: a redis.asyncio client on one connection of its own (it blocks in XREAD);
    `waker`: any other client of the same Redis (sends CLIENT UNBLOCK)."""

    def __init__(self, reader, waker):
        self.reader = reader
        self.waker = waker
        self.subs: dict[str, Subscription] = {}
        self._reader_id: int | None = None
        self._reading = 0  # generation of the XREAD in flight; 0 when none
        self._generation = 0
        self._waking = 0  # generation of the XREAD a wake was sent for (one wake per XREAD)
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._wakes: set[asyncio.Task] = set()
        self._closing = False

    def subscribe(self, key: str) -> Subscription | None:
        if key in self.subs:
            return None
        sub = self.subs[key] = Subscription(key)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._changed.set()
        if self._reading and self._waking != self._reading:  # streams subscribed meanwhile share its wake
            self._waking = self._reading
            wake = asyncio.get_running_loop().create_task(self._wake(self._reading))
            self._wakes.add(wake)
            wake.add_done_callback(self._wakes.discard)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Stops following; a blocked XREAD keeps the key until it returns, which is harmless."""
        if self.subs.get(sub.key) is sub:
            del self.subs[sub.key]

    async def close(self) -> None:
        """Ends the reading task (waking its XREAD; cancelling a command in flight can leave
        redis-py's connection waiting) and closes the reader."""
        self._closing = True
        self._changed.set()
        if self._task is not None:
            if self._reading:
                await self._wake(self._reading)
            await self._task
        for wake in list(self._wakes):
            wake.cancel()
        await self.reader.aclose()

    async def _wake(self, generation: int) -> None:
        """Unblocks the XREAD of `generation`. CLIENT UNBLOCK answers 0 when the XREAD has not
        reached Redis yet (sent, not yet blocking): try again, for up to WAKE_TRIES ms. Past
        that the reader's id is stale (redis-py reconnected it): it is read again next time,
        and this XREAD returns within MAX_BLOCK_MS anyway."""
        try:
            for _ in range(WAKE_TRIES):
                if self._reading != generation or self._reader_id is None:
                    return
                if await self.waker.client_unblock(self._reader_id):
                    return
                await asyncio.sleep(0.001)
            self._reader_id = None
        except Exception as exc:
            log.debug("could not wake the output follower: %s", exc)

    async def _run(self) -> None:
        while not self._closing:
            if not self.subs:
                self._changed.clear()
                await self._changed.wait()
                continue
            try:
                if self._reader_id is None:
                    self._reader_id = int(await self.reader.client_id())
                # no await from here to the XREAD: a stream subscribed later sees _reading and wakes it
                self._generation += 1
                self._reading = self._generation
                streams = {key: sub.last for key, sub in self.subs.items()}
                try:
                    reply = await self.reader.xread(streams, block=MAX_BLOCK_MS, count=COUNT)
                finally:
                    self._reading = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone: every follower gets the error, as its own read would
                self._reader_id = None  # a new connection has a new id
                for sub in self.subs.values():
                    sub.queue.put_nowait(exc)
                self.subs.clear()
                continue
            for key, entries in reply or []:
                sub = self.subs.get(key.decode() if isinstance(key, bytes) else key)
                if sub is None:
                    continue
                for entry_id, fields in entries:
                    sub.last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    sub.queue.put_nowait((sub.last, fields))
