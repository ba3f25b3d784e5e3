"""What prefill and decode workers share: the model thread, the model loops' life, model loading,
registry heartbeats (cancel notices: `pdq.state.cancel_listener`)."""

import asyncio
import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from pdq.observability import liveness
from pdq.config import WorkerConfig
from pdq.state.keys import Keys
from pdq.observability.liveness import Liveness
from pdq.state.registry import MAX_PREFIXES, PREFIX_HEX, WorkerInfo, deregister, heartbeat
from pdq.state.store import AsyncStore, RetryLimits, SyncStore

log = logging.getLogger("pdq.worker")


class ModelThread:
    """The one thread that runs a worker's torch work: it loads the model, then runs the model
    loop (`submit(loop._run)`), in that order.

    libgomp (torch's OpenMP on Linux) keeps a pool of threads for every thread that ever ran a
    parallel region, and once it manages more threads than there are cores, its idle threads
    spin ~100 rounds instead of GOMP_SPINCOUNT before they sleep: each parallel region of a
    forward pass then waits for a sleeping thread to wake. A model loaded in one thread
    (prepacking weights runs parallel regions) and run in another would leave two pools on the
    cores, so every decode step would pay those wake-ups and context switches; one thread for
    both keeps one pool. Calls run one at a time, in order; the thread is a daemon, as the
    loops' threads are.
    """

    def __init__(self, name: str = "model"):
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """fn(*args) in this thread, after every call submitted before. -> its future."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
        done: Future = Future()
        self._calls.put((done, fn, args))
        return done

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """From an event loop: awaits fn(*args) run in this thread."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def _serve(self) -> None:
        while True:
            done, fn, args = self._calls.get()
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args))
                except BaseException as exc:
                    done.set_exception(exc)


# A model loop idle this long wakes to mark its liveness (a loop blocked on an empty inbox makes no rounds).
IDLE_BEAT_S = 5.0


class ModelLoop:
    """The life of a model loop (prefill, decode, colocated): `start(thread)` runs its `_run` in
    `thread`, the ModelThread that loaded the model (else a thread of its own); `stop()` puts the
    stop sentinel (None) in its `inbox` and returns once `_run` has returned.

    `_run` beats `liveness` once a round. It rides what it can (a failed forward pass gives its
    sequences back; Redis errors are ridden by the store's client for redis_outage_s); whatever
    escapes it (Redis unreachable past that window, a bug) takes the process down through
    `pdq.observability.liveness.fatal`: never a loop that died while its worker goes on taking work. `alive`
    says whether it runs and was not told to stop: workers grant work only then."""

    thread_name = "model-loop"
    inbox: queue.Queue
    liveness: Liveness
    _done: Future | None = None
    _stopping = False

    def _run(self) -> None:
        raise NotImplementedError

    def start(self, thread: ModelThread | None = None) -> None:
        self.liveness = Liveness(self.thread_name)
        self._done = (thread or ModelThread(self.thread_name)).submit(self._main)

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            log.critical("%s died", self.thread_name, exc_info=True)
            if not self._stopping:
                liveness.fatal(self.thread_name, f"{type(exc).__name__}: {exc}")
        finally:
            self.liveness.stopped()

    @property
    def alive(self) -> bool:
        return self._done is not None and not self._done.done() and not self._stopping

    def stop(self) -> None:
        self._stopping = True
        self.inbox.put(None)
        if self._done is not None:
            self._done.result()


@functools.cache
def _mkl_set_dynamic() -> Callable[[int], None] | None:
    """MKL_Set_Dynamic from torch's own library, looked up once; None where torch has no MKL."""
    import ctypes
    import os

    import torch

    try:
        fn = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).MKL_Set_Dynamic
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], None
    return fn


def set_torch_threads(n: int) -> None:
    """torch.set_num_threads(n), with MKL's dynamic threading left on. torch turns it off there
    (so that Intel's OpenMP keeps its threads across MKL calls; torch's CPU wheels use GNU
    OpenMP, whose pool stays anyway), and MKL then runs every small matrix product (a decode
    step's attention) on all threads, where splitting it costs more than it saves: that slows
    every step of a decode worker that shares the cores with a prefill worker (1 thread, 2 while
    nothing of its is being prefilled).
    Best effort: where torch carries no MKL, only the count changes. Call it from the thread
    that runs the model: torch sets its threads up in each thread at the first call there, and
    once a count was set that turns MKL's dynamic threading off again."""
    import torch

    torch.get_num_threads()  # this thread's set-up now, not at its next parallel op
    torch.set_num_threads(n)
    set_dynamic = _mkl_set_dynamic()
    if set_dynamic is not None:
        set_dynamic(1)


def load_runner(config: WorkerConfig, kv_budget_tokens: int, warm_up: tuple[int, ...] = (0, 1)) -> Any:
    """Loads the model into a ModelRunner on the configured device, dtype and threads, then
    runs a full-size pass to warm it up (`warm_up`: tokens of the pass, the longest chunk and
    optionally the largest decode batch, `ModelRunner.warm_up`; 0 tokens: none) and faults in
    `heap_reserve_mb` of heap on CPU. The dtype is `config.dtype`, else this machine's serving
    default (`runner.resolve_dtype`). Call it in the `ModelThread` that will run the model. Freed memory stays with the process
    (pdq.ops.memory); with `pin_threads`, the model's threads are pinned one per CPU if they are as
    many as the CPUs (pdq.ops.cpu)."""
    import torch

    from pdq.engine.runner import ModelRunner, default_device, resolve_dtype
    from pdq.ops.memory import keep_freed_memory, reserve_heap
    from pdq.model.loader import resolve_model

    keep_freed_memory()
    if config.threads > 0 and config.threads != torch.get_num_threads():
        set_torch_threads(config.threads)
    dtype = resolve_dtype(config.dtype, torch.device(config.device) if config.device else default_device())
    runner = ModelRunner.from_pretrained(resolve_model(config.model), device=config.device or None, dtype=dtype,
                                         kv_budget_tokens=kv_budget_tokens, max_seq_len=config.max_seq_len,
                                         block_size=config.kv_block_size, prefix_cache=config.prefix_cache)
    if warm_up[0] > 0:
        runner.warm_up(*warm_up)
    if runner.device.type == "cpu" and config.heap_reserve_mb:
        reserve_heap(config.heap_reserve_mb << 20)
    if config.pin_threads and runner.device.type == "cpu":
        from pdq.ops.cpu import pin_torch_threads

        pinned = pin_torch_threads()
        if pinned.threads:
            log.info("model thread and torch threads pinned one per CPU: %s",
                     ", ".join(f"thread {tid} -> CPU {cpu}" for tid, cpu in pinned.threads))
    return runner


class Heartbeat:
    """Keeps this worker in the registry: at `start()`, every period, and whenever `poke()` is
    called, while `alive()` (the server takes calls and its model loop runs); after `nudge()`, once
    NUDGE_S has passed since the latest beat (news that can wait a moment: a burst of it costs a
    beat every NUDGE_S, not one each). Start it last, once the model is loaded and warm: a worker in the
    registry can serve. A worker whose loop died leaves it."""

    NUDGE_S = 0.1

    def __init__(self, config: WorkerConfig, keys: Keys, info: Callable[[], WorkerInfo],
                 alive: Callable[[], bool] = lambda: True):
        self.config = config
        self.keys = keys
        self.info = info
        self.alive = alive
        self.client = config.redis()
        self.store = AsyncStore(self.client, keys.prefix)
        self.liveness = Liveness(f"heartbeat-{info().role}")
        self.registered = False
        self._poke = asyncio.Event()
        self._last_beat = 0.0  # time.monotonic() of the latest beat sent
        self._urgent = False  # poked (not only nudged) since the latest beat
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> None:
        """The first beat (the worker is in the registry when this returns, if alive), then the rest."""
        await self._round()
        self._task = asyncio.create_task(self._run())

    def poke(self) -> None:
        self._urgent = True
        self._poke.set()

    def nudge(self) -> None:
        self._poke.set()

    async def _round(self) -> None:
        if self.alive():
            self._last_beat = time.monotonic()
            try:
                await heartbeat(self.store, self.info(), ttl_s=max(3 * self.config.heartbeat_s, 5.0))
                self.registered = True
                self.liveness.beat()
            except Exception as exc:  # Redis down past the client's window: again next period
                self.liveness.error(exc)
        elif self.registered:
            log.warning("model loop not running: leaving the registry")
            self.registered = False
            await self._leave()

    async def _run(self) -> None:
        while not self._stopping:
            woken = True
            try:
                await asyncio.wait_for(self._poke.wait(), self.config.heartbeat_s)
            except asyncio.TimeoutError:
                woken = False  # the period came
            self._poke.clear()
            if woken and not self._urgent and not self._stopping:  # only nudged: at most one beat per NUDGE_S
                await asyncio.sleep(max(0.0, self._last_beat + self.NUDGE_S - time.monotonic()))
            self._urgent = False
            if self._stopping:
                break
            await self._round()
        self.liveness.stopped()

    async def _leave(self) -> None:
        info = self.info()
        try:
            await asyncio.wait_for(deregister(self.client, self.keys, info.worker_id, info.role), timeout=5.0)
        except Exception as exc:  # the scheduler reaps it once its heartbeats stop
            log.warning("could not leave the registry: %s", exc)

    async def stop(self) -> None:
        """Stops beating (a beat in flight finishes first, so none lands after the
        deregistration), then leaves the registry."""
        self._stopping = True
        self._poke.set()
        if self._task:
            try:
                await asyncio.wait_for(self._task, timeout=5.0)  # cancels it if a beat hangs
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        try:
            await self._leave()
        finally:
            await self.client.aclose()


async def reclaim_previous_life(store: SyncStore, worker_id: str, max_attempts: int) -> None:
    """Run at start, before the first heartbeat. A worker id can outlive its process: a fixed
    --worker-id, or a container restarted with the same hostname and pid 1, heartbeats again
    before the scheduler's worker_timeout_s has noticed the old process died, so the scheduler
    would never reap it. A fresh process holds nothing, so whatever this id still holds is an
    orphan of its previous life: it goes back to the queue (or FAILS after max_attempts) as
    when a worker dies. (So two live workers must never share an id.)"""
    requeued, failed = await asyncio.to_thread(store.reap_worker, worker_id, max_attempts)
    if requeued or failed:
        log.warning("worker id %s held %d request(s) from a previous run: %d requeued, %d failed",
                    worker_id, requeued + failed, requeued, failed)


def kv_grant_tokens(prompt: int, max_tokens: int, max_seq_len: int, output_grant: int = 0) -> int:
    """KV positions granted to a request up front: its prompt plus the tokens it may generate, or,
    with `output_grant` > 0, at most that many of them (the rest it takes as it grows)."""
    out = min(max_tokens, output_grant) if output_grant else max_tokens
    return min(max_seq_len, prompt + out)


def kv_reserve_tokens(spec: Any, max_seq_len: int, output_grant: int = 0) -> int:
    """`kv_grant_tokens` of a `RequestSpec`."""
    return kv_grant_tokens(len(spec.prompt_token_ids), spec.sampling.max_tokens, max_seq_len, output_grant)


def kv_info(runner: Any, prefixes: bool = True, kept_tokens: int = 0) -> dict[str, Any]:
    """A runner's KV pool for its heartbeat (`WorkerInfo` fields), with (`prefixes`) what its
    prefix cache holds, for the scheduler's prefix-aware placement of prefill batches; nothing
    before it is loaded. `kept_tokens`: positions of the pool this role may not use (a colocated
    worker's decode role: the room it keeps for prompts it prefills for other workers), left out
    of its total and free figures, which the scheduler's KV-fit check reads."""
    if runner is None:
        return {}
    from pdq.engine.runner import dtype_name

    blocks = getattr(getattr(runner, "pool", None), "blocks", None)
    held = blocks.cached_hashes(MAX_PREFIXES) if prefixes and blocks is not None and blocks.prefix_cache else []
    return {"kv_free_tokens": max(0, runner.free_tokens - kept_tokens),
            "kv_total_tokens": runner.capacity_tokens - kept_tokens,
            "kv_block_size": runner.block_size, "prefixes": tuple(h.hex()[:PREFIX_HEX] for h in held),
            "kv_dtype": dtype_name(runner.dtype)}


def sync_store(config: WorkerConfig) -> SyncStore:
    return SyncStore(config.redis(aio=False), config.key_prefix, config.result_ttl_s, RetryLimits.of(config))
