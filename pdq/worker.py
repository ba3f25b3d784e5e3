"""What prefill and decode workers share: model loading, registry heartbeats, cancel notices."""

import asyncio
import logging
import threading
from typing import Any, Callable

import redis
import redis.asyncio as aioredis

from pdq.config import WorkerConfig
from pdq.keys import Keys
from pdq.registry import WorkerInfo, deregister, heartbeat
from pdq.store import RequestStore

log = logging.getLogger("pdq.worker")


def load_runner(config: WorkerConfig, kv_budget_tokens: int) -> Any:
    """Loads the model into a ModelRunner on the configured device, dtype and threads."""
    import torch

    from pdq.engine.runner import ModelRunner
    from pdq.model.loader import resolve_model

    if config.threads > 0:
        torch.set_num_threads(config.threads)
    dtype = getattr(torch, config.dtype) if config.dtype else None
    return ModelRunner.from_pretrained(resolve_model(config.model), device=config.device or None, dtype=dtype,
                                       kv_budget_tokens=kv_budget_tokens, max_seq_len=config.max_seq_len)


class CancelListener:
    """Follows the cancel channel in a thread: `ended` holds ids of requests that just ended
    (cancelled, timed out, finished elsewhere), so a model loop can drop them at its next step."""

    def __init__(self, redis_url: str, keys: Keys):
        self.client = redis.Redis.from_url(redis_url)
        self.channel = keys.cancel_channel
        self.ended: set[str] = set()
        self._lock = threading.Lock()
        self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(**{self.channel: self._on_message})
        self._thread = self._pubsub.run_in_thread(sleep_time=0.05, daemon=True)

    def _on_message(self, message: dict) -> None:
        rid = message["data"].decode()
        with self._lock:
            self.ended.add(rid)
            if len(self.ended) > 100_000:  # ids of requests we never held; bound the memory
                self.ended.clear()

    def pop(self, rid: str) -> bool:
        """True (once) when rid has ended since it was last asked about."""
        with self._lock:
            if rid in self.ended:
                self.ended.discard(rid)
                return True
            return False

    def close(self) -> None:
        self._thread.stop()
        self._thread.join(timeout=2)
        self._pubsub.close()
        self.client.close()


class Heartbeat:
    """Keeps this worker in the registry: now, every period, and whenever `poke()` is called."""

    def __init__(self, config: WorkerConfig, keys: Keys, info: Callable[[], WorkerInfo]):
        self.config = config
        self.keys = keys
        self.info = info
        self.client = aioredis.Redis.from_url(config.redis_url)
        self._poke = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._beat()
        self._task = asyncio.create_task(self._run())

    def poke(self) -> None:
        self._poke.set()

    async def _beat(self) -> None:
        await heartbeat(self.client, self.keys, self.info(), ttl_s=max(3 * self.config.heartbeat_s, 5.0))

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poke.wait(), self.config.heartbeat_s)
            except asyncio.TimeoutError:
                pass
            self._poke.clear()
            try:
                await self._beat()
            except (redis.RedisError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        info = self.info()
        try:
            await deregister(self.client, self.keys, info.worker_id, info.role)
        finally:
            await self.client.aclose()


def sync_store(config: WorkerConfig) -> RequestStore:
    return RequestStore(redis.Redis.from_url(config.redis_url), config.key_prefix, config.result_ttl_s)
