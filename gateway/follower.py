"""Every output stream a gateway follows, read by a few blocking XREADs, fanned out to every call.

A call that ran its own blocking XREAD held a Redis connection for its whole life: 300
StreamResult followers and 150 GetResult long-polls of one request needed 450 connections. Here
a few connections, each blocking in one XREAD over its share of the followed streams, serve
every streaming call, unary call and long-poll of the gateway, however many follow one stream:

- `subscribe(key)` -> a `Subscription`. Its queue gets, in order, every entry of the stream after
  `sub.start` as batches [(entry_id, parse(fields)), ...]; the entries up to `start` (those the stream
  had when the call joined a stream already followed) are the subscriber's to read
  (`gateway.results.follow` reads them with XRANGE), so a late subscriber still sees the stream
  from its first entry, and nothing comes twice. `unsubscribe` when done.
- A stream followed for the first time wakes its reader's XREAD with CLIENT UNBLOCK (sent by
  `waker`, any client of the same Redis) so that its entries are read within WAKE_AFTER_S, not
  after the block time, unless that XREAD returns by itself first (a busy reader's does with
  every step a worker writes); a subscriber of a stream already followed costs no Redis command.
- An XREAD costs Redis time in proportion to its keys, and a reader sends it again after every
  entry: so a stream starts on a "cold" reader, and moves to a "hot" one with its first entry.
  Streams that wait (queued requests) cost the hot path nothing; a token of a running request
  waits for an XREAD over the running streams only. Each XREAD is packed from pieces each
  stream keeps encoded: thousands of keys cost a join, not thousands of argument encodings.
- Redis unreachable: a reader reconnects with backoff and resumes every stream from the last
  entry it delivered (nothing lost, nothing repeated); its subscriptions wait meanwhile. A
  subscription that has waited through `outage_s` of failures gets `FollowerUnavailable` in its
  queue (its call ends UNAVAILABLE, the request untouched) and nothing more. `close()` gives
  every subscription `FollowerUnavailable` too (the gateway is stopping).

Each reader owns its connection outright (no pool, no hidden retries), so it knows when it
reconnected and re-reads its client id before the next XREAD: a wake never names a stale id.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pdq.state import redisconn
from pdq.observability.liveness import Liveness

log = logging.getLogger("pdq.gateway")

COLD_READERS = 2  # XREAD connections for streams without an entry yet
HOT_READERS = 2  # and for those that have one (running requests)
# One XREAD blocks at most this long (a wake ends it sooner): a cold reader's keys are many and
# rarely have news, and each XREAD over them costs Redis time.
HOT_BLOCK_MS = 1000
COLD_BLOCK_MS = 10_000
COUNT = 512  # entries per stream per read
WAKE_BACKOFF_CAP_S = 0.05
WAKE_AFTER_S = 0.002  # a new stream's wake waits this long for the XREAD in flight to return by itself
WAKES_PER_TURN = 128  # subscribers handed entries per turn of the event loop
RETRY_CAP_S = 1.0  # a reader retries Redis at least this often during an outage


class FollowerUnavailable(Exception):
    """The stream cannot be followed now; the request itself is untouched. `reason`:
    REDIS_UNAVAILABLE (past the outage window), GATEWAY_STOPPING, or SERVER_ERROR (a bug, logged)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _stopping() -> FollowerUnavailable:
    return FollowerUnavailable("the gateway is stopping", "GATEWAY_STOPPING")


def _arg(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


@dataclass(eq=False)
class Subscription:
    key: bytes
    start: bytes  # entries up to this id are the subscriber's to read; later ones come in `queue`
    since: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass(eq=False)
class _Stream:
    key: bytes
    key_arg: bytes
    last: bytes = b"0-0"  # the last entry delivered to the subscribers
    last_arg: bytes = _arg(b"0-0")
    subs: dict[Subscription, None] = field(default_factory=dict)  # in the order they came


class _Reader:
    """One connection blocking in XREAD over some of the followed streams."""

    def __init__(self, name: str, url: str, waker, outage_s: float, block_ms: int, parse: Callable[[dict], Any],
                 promote: Callable[[_Stream], None] | None = None):
        """promote: where a stream goes once it has delivered entries (None: it stays)."""
        self.name = name
        self.parse = parse
        self.block_ms = block_ms
        self.promote = promote
        self.waker = waker
        self.outage_s = outage_s
        pool = redisconn.pool(  # a Sentinel URL: each (re)connect goes to the primary named then
            url, aio=True, retry=Retry(NoBackoff(), 0), socket_keepalive=True,
            socket_connect_timeout=redisconn.CONNECT_TIMEOUT_S,
            socket_timeout=block_ms / 1000 + redisconn.SOCKET_TIMEOUT_S)
        self.conn = pool.make_connection()
        self.streams: dict[bytes, _Stream] = {}
        self.client_id: int | None = None  # of the live connection; None until read after a (re)connect
        self.connects = 0  # connections made so far (a restarted Redis may give a new one the old id)
        self.reading = 0  # generation of the XREAD in flight; 0 when none
        self._generation = 0
        self._waking = 0  # generation of the XREAD a wake was sent for (one wake per XREAD)
        self._changed = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._wakes: set[asyncio.Task] = set()
        self.failing_since: float | None = None  # monotonic time of the first failure of an outage
        self.liveness = Liveness(name)

    def add(self, stream: _Stream) -> None:
        """Follows a new stream (its entries from the first): wakes the XREAD in flight, which
        does not name it yet."""
        self.streams[stream.key] = stream
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)
        self._changed.set()
        if self.reading and self._waking != self.reading:  # streams added meanwhile share its wake
            self._waking = self.reading
            wake = asyncio.get_running_loop().create_task(self._wake(self.reading))
            self._wakes.add(wake)
            wake.add_done_callback(self._wakes.discard)

    async def close(self) -> None:
        """Ends the reading task. A read in flight is ended by closing its socket: cancelling a
        redis-py command is unreliable (asyncio.wait_for of Python < 3.12 can swallow a cancel
        that meets a completed write)."""
        self._closing.set()
        self._changed.set()
        for wake in list(self._wakes):
            wake.cancel()
        await self.conn.disconnect(nowait=True)
        if self._task is not None:
            await self._task
        await self.conn.disconnect(nowait=True)  # in case it connected again meanwhile
        self.liveness.stopped()

    async def _wake(self, generation: int) -> None:
        """Unblocks the XREAD of `generation`, unless it returns by itself within WAKE_AFTER_S
        (a busy reader's XREAD returns with every step a worker writes, and the streams added
        meanwhile go in the next one: a round trip and an XREAD saved). CLIENT UNBLOCK answers 0
        while that XREAD has not reached Redis yet (sent, not yet blocking): try again until it
        has, or has returned."""
        await asyncio.sleep(WAKE_AFTER_S)
        delay = 0.001
        try:
            while self.reading == generation and self.client_id is not None:
                if await self.waker.client_unblock(self.client_id):
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, WAKE_BACKOFF_CAP_S)
        except Exception as exc:  # Redis unreachable: the XREAD fails or returns by itself
            log.debug("could not wake %s: %s", self.name, exc)

    async def _run(self) -> None:
        failures = 0
        while not self._closing.is_set():
            if not self.streams:
                self._changed.clear()
                await self._changed.wait()
                continue
            try:
                if self.client_id is None:
                    await self.conn.connect()
                    await self.conn.send_command("CLIENT", "ID", check_health=False)
                    self.client_id = int(await self.conn.read_response())
                    self.connects += 1
                if self._closing.is_set():
                    return
                if not self.streams:  # all left while it connected
                    continue
                streams = self.streams.copy()
                reply = await self._xread(streams)
                if reply:
                    await self._deliver(reply, streams)
            except Exception as exc:
                self.client_id = None
                if self._closing.is_set():
                    return
                await self.conn.disconnect(nowait=True)
                failures = self._failed(exc)
                try:
                    async with asyncio.timeout(redisconn.backoff_s(failures, cap_s=RETRY_CAP_S)):
                        await self._closing.wait()
                except TimeoutError:
                    pass
                continue
            if failures:
                failures = 0
                self.failing_since = None
                redisconn.OUTAGES.recovered()
            self.liveness.beat()

    async def _xread(self, streams: dict[bytes, _Stream]) -> list:
        # no await between reading `self.streams` and setting `reading`: a stream added later
        # sees `reading` and wakes this XREAD
        self._generation += 1
        self.reading = self._generation
        try:
            values = streams.values()
            head = b"*%d\r\n$5\r\nXREAD\r\n$5\r\nCOUNT\r\n%s$5\r\nBLOCK\r\n%s$7\r\nSTREAMS\r\n" % (
                6 + 2 * len(streams), _arg(b"%d" % COUNT), _arg(b"%d" % self.block_ms))
            await self.conn.send_packed_command(b"".join([head, *[s.key_arg for s in values],
                                                          *[s.last_arg for s in values]]), check_health=False)
            return await self.conn.read_response()
        finally:
            self.reading = 0

    async def _deliver(self, reply, streams: dict[bytes, _Stream]) -> None:
        """Hands each stream's new entries to its subscribers, WAKES_PER_TURN at a time: a token
        of a stream with thousands of followers (or of thousands of streams) wakes that many
        calls, and between those turns the event loop also runs everything else (the gRPC
        server accepts one new call per turn). Who gets what is fixed before the first turn: a
        subscriber that joins meanwhile starts after these entries (`Subscription.start`)."""
        wakes, moved = [], []
        for key, entries in (reply.items() if isinstance(reply, dict) else reply):
            stream = streams.get(key)
            if stream is None or self.streams.get(key) is not stream or not entries:
                continue  # no longer followed (or followed anew, from its start, since the XREAD)
            stream.last = entries[-1][0]
            stream.last_arg = _arg(stream.last)
            batch = self._batch(key, entries)
            if batch:
                wakes += [(sub.queue, batch) for sub in stream.subs]
            moved.append(stream)
        for i in range(0, len(wakes), WAKES_PER_TURN):
            if i:
                await asyncio.sleep(0)
            for queue, batch in wakes[i:i + WAKES_PER_TURN]:
                queue.put_nowait(batch)
        if self.promote is not None:  # only now: the hot reader's entries come after these
            for stream in moved:
                if self.streams.get(stream.key) is stream:
                    del self.streams[stream.key]
                    self.promote(stream)

    def _batch(self, key: bytes, entries: list) -> list | FollowerUnavailable:
        """The entries as subscribers get them: [(entry_id, parse(fields))], parsed once for all
        of them; an entry that does not parse fails this stream's subscribers only."""
        try:
            return [(entry_id, self.parse(dict(zip(flat[::2], flat[1::2])))) for entry_id, flat in entries
                    if flat is not None]
        except Exception as exc:
            log.error("%s: an entry of %s does not parse", self.name, key, exc_info=exc)
            return FollowerUnavailable(f"an entry of the output stream does not parse ({type(exc).__name__}: "
                                       f"{exc}; it is logged)", "SERVER_ERROR")

    def _failed(self, exc: BaseException) -> int:
        """A round failed: note it; give up on subscriptions that waited through the outage
        window (all of them at once for an error that is no outage: a bug). -> failures in a row."""
        now = time.monotonic()
        self.failing_since = self.failing_since or now
        failures = self.liveness.error(exc)
        outage = redisconn.unavailable(exc)
        if outage:
            redisconn.OUTAGES.failed(exc)
            message, reason = f"Redis unreachable for {now - self.failing_since:.0f} s ({exc})", "REDIS_UNAVAILABLE"
        else:
            if failures == 1:
                log.error("%s: unexpected error reading output streams", self.name, exc_info=exc)
            message = f"the gateway failed to read the output stream ({type(exc).__name__}: {exc}; it is logged)"
            reason = "SERVER_ERROR"
        for key, stream in list(self.streams.items()):
            expired = [s for s in stream.subs if not outage or now - max(self.failing_since, s.since) >= self.outage_s]
            for sub in expired:
                del stream.subs[sub]
                sub.queue.put_nowait(FollowerUnavailable(message, reason))
            if not stream.subs:
                del self.streams[key]
        return failures


class OutputFollower:
    """`url`: the Redis the readers connect to (cold + hot connections of their own); `waker`: a
    client of the same Redis (sends CLIENT UNBLOCK); `outage_s`: how long a subscription waits
    through a Redis outage before it gets FollowerUnavailable; `parse`: what an entry's fields
    become, once for all its subscribers (a stream with thousands of followers is parsed once)."""

    def __init__(self, url: str, waker, outage_s: float = redisconn.DEFAULT_OUTAGE_S, cold: int = COLD_READERS,
                 hot: int = HOT_READERS, parse: Callable[[dict], Any] = lambda fields: fields):
        self.hot = [_Reader(f"output_follower_hot_{i}", url, waker, outage_s, HOT_BLOCK_MS, parse) for i in range(hot)]
        self.cold = [_Reader(f"output_follower_cold_{i}", url, waker, outage_s, COLD_BLOCK_MS, parse, self._promote)
                     for i in range(cold)]
        self.readers = self.cold + self.hot
        self._closed = False

    def _promote(self, stream: _Stream) -> None:
        min(self.hot, key=lambda r: len(r.streams)).add(stream)

    def _find(self, key: bytes) -> tuple[_Reader | None, _Stream | None]:
        for reader in self.readers:
            stream = reader.streams.get(key)
            if stream is not None:
                return reader, stream
        return None, None

    def subscribe(self, key: str | bytes) -> Subscription:
        key = key.encode() if isinstance(key, str) else key
        reader, stream = self._find(key)
        sub = Subscription(key, stream.last if stream is not None else b"0-0")
        if self._closed:
            sub.queue.put_nowait(_stopping())
        elif stream is not None:
            stream.subs[sub] = None
        else:
            stream = _Stream(key, _arg(key), subs={sub: None})
            min(self.cold, key=lambda r: len(r.streams)).add(stream)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Stops following; a blocked XREAD keeps the key until it returns, which is harmless."""
        reader, stream = self._find(sub.key)
        if stream is None or sub not in stream.subs:
            return
        del stream.subs[sub]
        if not stream.subs:
            del reader.streams[sub.key]

    @property
    def streams(self) -> int:
        """Streams followed now."""
        return sum(len(r.streams) for r in self.readers)

    async def close(self) -> None:
        """Ends every subscription with FollowerUnavailable and closes the readers."""
        self._closed = True
        for reader in self.readers:
            for stream in reader.streams.values():
                for sub in stream.subs:
                    sub.queue.put_nowait(_stopping())
            reader.streams.clear()
            await reader.close()
