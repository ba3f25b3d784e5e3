"""Redis connections for every pdq process: bounded blocking pools that ride through outages.

Contract of a client made by `connect()` (sync or asyncio):
- At most `max_connections` connections; a command that finds them all busy waits for one
  (up to POOL_WAIT_S, or the outage window if that is longer) instead of failing, so a burst of
  calls queues rather than errors: waiting for a busy connection is queueing, not Redis being
  unreachable, and it is not bounded by a short outage window.
- A command that meets a connection error (a broken pooled socket after a Redis restart, a
  dropped connection, Redis down or still loading its AOF) reconnects and is sent again, with
  exponential backoff and jitter (first retry at once, then up to 1 s apart), for up to
  `outage_s` from its first failure; then the error is raised. A command may thus be applied
  twice (the reply of the first was lost): every multi-key write of pdq is a Lua script that is
  safe to repeat (pdq.state.keys says how each one is).
- Idle connections are checked (PING) before reuse; a hung Redis fails a command after
  SOCKET_TIMEOUT_S (then it is retried, as above).

`unavailable(exc)` says whether an exception means "Redis cannot be reached now" (clients get
UNAVAILABLE with a retry hint, loops back off and carry on); anything else from Redis is a bug.

A URL is redis://, rediss:// or unix:// (as redis-py reads them), or a Sentinel URL
(`pdq.state.redis_url`): then every connection asks the Sentinels for the primary's address when it
connects, so after a failover the next connection (the retry of a command that failed on the old
primary) goes to the new one.
"""

import asyncio
import logging
import random
import threading
import time
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel as sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

from pdq.state.redis_url import SentinelURL, parse_sentinel_url

log = logging.getLogger("pdq.redis")

# What "Redis cannot be reached now" looks like (BusyLoadingError, LOADING after a restart, is a
# ConnectionError; OSError: a socket error redis-py did not wrap).
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError)
SOCKET_TIMEOUT_S = 10.0  # a command (or a blocking read beyond its block time) hung this long fails
CONNECT_TIMEOUT_S = 2.0
HEALTH_CHECK_INTERVAL_S = 15  # a connection idle this long is PINGed before use
RETRY_BASE_S = 0.01
RETRY_CAP_S = 1.0
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_OUTAGE_S = 30.0
POOL_WAIT_S = 30.0  # the longest a command waits for a busy pool's connection (or the outage window, if longer)


def unavailable(exc: BaseException) -> bool:
    """Whether `exc` means Redis cannot be reached now (as opposed to a bug or bad data)."""
    return isinstance(exc, UNAVAILABLE_ERRORS)


class _Outages:
    """Logs an outage once when it starts and once when it ends (per process), and keeps the
    time of the last failure, for loops that must not read an outage as silence (e.g. missed
    heartbeats)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failing_since: float | None = None  # monotonic time of the first failure of the current outage
        self.last_failure = 0.0

    def failed(self, error: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            self.last_failure = now
            if self.failing_since is None:
                self.failing_since = now
                log.warning("Redis unreachable (%s); commands are retried", error)

    def recovered(self) -> None:
        if self.failing_since is None:
            return
        with self._lock:
            if self.failing_since is not None:
                log.warning("Redis reachable again after %.1f s", time.monotonic() - self.failing_since)
                self.failing_since = None


OUTAGES = _Outages()


class _Window:
    """One command's retries: after each failure, how long to wait before the next try, or the
    error again once `outage_s` have passed since the first failure (the first retry is at once:
    a broken pooled socket)."""

    def __init__(self, outage_s: float, backoff: ExponentialWithJitterBackoff):
        self.outage_s, self.backoff = outage_s, backoff
        self.failures, self.first = 0, 0.0

    def succeeded(self) -> None:
        if self.failures:
            OUTAGES.recovered()

    def failed(self, error: BaseException) -> float:
        """-> seconds to wait before the next try; raises `error` when the window is spent."""
        self.failures += 1
        now = time.monotonic()
        self.first = self.first or now
        left = self.outage_s - (now - self.first)
        if left <= 0:
            raise error
        if self.failures == 1:
            return 0.0
        OUTAGES.failed(error)
        return max(0.0, min(left, self.backoff.compute(self.failures - 1)))


def _supported() -> tuple[type[BaseException], ...]:
    return (redis.ConnectionError, redis.TimeoutError, OSError)


class RideRetry(Retry):
    """redis-py's Retry bounded by time instead of a count (`_Window`)."""

    def __init__(self, outage_s: float):
        super().__init__(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S), -1,
                         supported_errors=_supported())
        self.outage_s = outage_s

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        window = _Window(self.outage_s, self._backoff)
        while True:
            try:
                result = do()
                window.succeeded()
                return result
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                fail(error, window.failures + 1) if with_failure_count else fail(error)
                time.sleep(window.failed(error))


class AsyncRideRetry(AsyncRetry):
    """`RideRetry` for redis.asyncio clients."""

    def __init__(self, outage_s: float):
        super().__init__(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S), -1,
                         supported_errors=_supported())
        self.outage_s = outage_s

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        window = _Window(self.outage_s, self._backoff)
        while True:
            try:
                result = await do()
                window.succeeded()
                return result
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                await (fail(error, window.failures + 1) if with_failure_count else fail(error))
                await asyncio.sleep(window.failed(error))


def _pool_kwargs(max_connections: int, outage_s: float, socket_timeout: float | None) -> dict[str, Any]:
    return dict(max_connections=max_connections, timeout=max(outage_s, POOL_WAIT_S), socket_timeout=socket_timeout,
                socket_connect_timeout=CONNECT_TIMEOUT_S, socket_keepalive=True,
                health_check_interval=HEALTH_CHECK_INTERVAL_S)


def connect(url: str, *, max_connections: int = DEFAULT_MAX_CONNECTIONS, outage_s: float = DEFAULT_OUTAGE_S,
            socket_timeout: float | None = SOCKET_TIMEOUT_S) -> redis.Redis:
    """A sync client (for model threads) under the contract above. Responses stay bytes."""
    return redis.Redis.from_pool(pool(url, blocking=True, retry=RideRetry(outage_s),
                                      **_pool_kwargs(max_connections, outage_s, socket_timeout)))


def connect_async(url: str, *, max_connections: int = DEFAULT_MAX_CONNECTIONS, outage_s: float = DEFAULT_OUTAGE_S,
                  socket_timeout: float | None = SOCKET_TIMEOUT_S) -> aioredis.Redis:
    """An asyncio client under the contract above. Responses stay bytes."""
    return aioredis.Redis.from_pool(pool(url, aio=True, blocking=True, retry=AsyncRideRetry(outage_s),
                                         **_pool_kwargs(max_connections, outage_s, socket_timeout)))


def pool(url: str, *, aio: bool = False, blocking: bool = False, **kwargs: Any) -> Any:
    """A redis-py connection pool (asyncio with `aio`; a BlockingConnectionPool with `blocking`)
    for any URL pdq takes, Sentinel URLs included; `kwargs` as for redis-py's `from_url` (options
    in the URL's query win). For processes that need connections with their own retry policy (a
    pub/sub listener, a reader that owns its connection): `make_connection()` of an asyncio
    pool works while the pool itself is dropped."""
    target = parse_sentinel_url(url)
    if target is None:
        plain = aioredis if aio else redis
        return (plain.BlockingConnectionPool if blocking else plain.ConnectionPool).from_url(url, **kwargs)
    if not blocking:
        kwargs.pop("timeout", None)
    kwargs["connection_class"] = _SENTINEL_CONNECTIONS[aio, target.tls]
    return _SENTINEL_POOLS[aio, blocking](target.service, _sentinels(target, aio), **{**kwargs, **target.options})


def _sentinels(target: SentinelURL, aio: bool) -> Any:
    """Who to ask for the primary: each Sentinel in turn, one try each per lookup (a lookup that
    finds none is a ConnectionError, retried under the outage window like any other)."""
    options = dict(socket_timeout=CONNECT_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_keepalive=True,
                   **target.sentinel_options)
    if aio:
        return aiosentinel.Sentinel(target.sentinels, sentinel_kwargs={**options, "retry": AsyncRetry(NoBackoff(), 1)})
    return sentinel.Sentinel(target.sentinels, sentinel_kwargs={**options, "retry": Retry(NoBackoff(), 1)})


class _SentinelConnection(sentinel.SentinelManagedConnection):
    """A connection to the primary the Sentinels name at each socket connect. redis-py's asks them
    in `connect()` only, and a command retried after a broken socket reconnects without it, to
    the old primary, for the whole outage window (redis-py issue #3874)."""

    def connect(self) -> None:
        redis.Connection.connect(self)  # the socket connect below asks the Sentinels

    def _connect(self) -> Any:
        self.host, self.port = self.connection_pool.get_master_address()
        return super()._connect()


class _AsyncSentinelConnection(aiosentinel.SentinelManagedConnection):
    """`_SentinelConnection` for redis.asyncio."""

    async def connect(self) -> None:
        await aioredis.Connection.connect(self)

    async def _connect(self) -> None:
        self.host, self.port = await self.connection_pool.get_master_address()
        await super()._connect()


class _SentinelSSLConnection(_SentinelConnection, redis.SSLConnection):
    """`_SentinelConnection` over TLS (rediss+sentinel://)."""


class _AsyncSentinelSSLConnection(_AsyncSentinelConnection, aioredis.SSLConnection):
    """`_AsyncSentinelConnection` over TLS (rediss+sentinel://)."""


_SENTINEL_CONNECTIONS = {(False, False): _SentinelConnection, (False, True): _SentinelSSLConnection,
                         (True, False): _AsyncSentinelConnection, (True, True): _AsyncSentinelSSLConnection}


class _BlockingSentinelPool(sentinel.SentinelConnectionPool, redis.BlockingConnectionPool):
    """Connections to the primary a Sentinel names, at most `max_connections`, waiting for a free one."""


class _AsyncSentinelPool(aiosentinel.SentinelConnectionPool):
    """Connections to the primary a Sentinel names; they hold their pool (redis-py's hold a weak
    proxy of it, which dies with a pool that was only used to make a connection)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.connection_kwargs["connection_pool"] = self


class _AsyncBlockingSentinelPool(_AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """`_AsyncSentinelPool`, at most `max_connections`, waiting for a free one."""


_SENTINEL_POOLS = {(False, False): sentinel.SentinelConnectionPool, (False, True): _BlockingSentinelPool,
                   (True, False): _AsyncSentinelPool, (True, True): _AsyncBlockingSentinelPool}


def backoff_s(failures: int, cap_s: float = 5.0, base_s: float = 0.05) -> float:
    """How long a loop waits after its `failures`-th failure in a row: exponential with full
    jitter, capped. For loops that do their own retrying (a pub/sub listener, a model loop)."""
    return random.uniform(0, min(cap_s, base_s * 2 ** min(failures, 20)))
