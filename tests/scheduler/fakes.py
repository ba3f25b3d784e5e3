"""Fake workers for scheduler tests: real gRPC servers on loopback that register and heartbeat in
Redis and write tokens through the real store scripts, without a model. A decode step writes one
token for every running sequence; KV room is a number of slots. Their loops ride through Redis
errors (a beat or step that fails is tried again), as real workers do."""

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import redis
import redis.asyncio as aioredis

from pdq.state.registry import WorkerInfo, heartbeat
from pdq.state.request import State
from pdq.state.store import AsyncStore, StepItem
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc


@dataclass
class Seq:
    rid: str
    epoch: int
    next_index: int
    max_tokens: int


class _Worker:
    role = ""

    def __init__(self, store: AsyncStore, worker_id: str, heartbeat_s: float = 0.05):
        self.store = store
        self.worker_id = worker_id
        self.heartbeat_s = heartbeat_s
        self.server = grpc.aio.server()
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.tasks: list[asyncio.Task] = []
        self.alive = True
        self.beating = True  # False: it skips its heartbeats (a worker slow to reach Redis again)
        self.kv_dtype = ""  # the model dtype it reports ("": unknown)

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, self.role, self.address, kv_dtype=self.kv_dtype)

    async def _beat(self) -> None:
        while self.alive:
            if self.beating:
                try:
                    await heartbeat(self.store, self.info(), ttl_s=5)
                except (redis.RedisError, OSError):
                    pass  # Redis away: beat again next period
            await asyncio.sleep(self.heartbeat_s)

    async def start(self) -> None:
        await self.server.start()
        self.tasks.append(asyncio.create_task(self._beat()))

    async def kill(self) -> None:
        """Dies like a killed process: no goodbye, nothing handed back. (Its loops also stop at
        their next turn: a cancelled redis call may swallow the cancellation.)"""
        self.alive = False
        for task in self.tasks:
            task.cancel()
        await asyncio.wait(self.tasks, timeout=2)
        self.tasks.clear()
        await self.server.stop(None)


class FakeDecode(_Worker, pb_grpc.DecodeWorkerServicer):
    role = "decode"

    def __init__(self, store: AsyncStore, worker_id: str, slots: int = 4, step_s: float = 0.005,
                 reservation_timeout_s: float = 2.0, reserve_s: float = 0.0, kv_tokens: int = 0):
        super().__init__(store, worker_id)
        self.kv_tokens = kv_tokens  # the KV pool it reports (0: none, as before workers reported one)
        self.reserve_s = reserve_s  # each Reserve(Many) answers this much later (a busy worker)
        self.reserve_calls: list[int] = []  # the items of each Reserve(Many) call
        pb_grpc.add_DecodeWorkerServicer_to_server(self, self.server)
        self.slots = slots
        self.step_s = step_s
        self.reservation_timeout_s = reservation_timeout_s
        self.holds: dict[str, float | None] = {}  # request -> expiry of an unused reservation (None: running)
        self.running: dict[str, Seq] = {}

    def expire(self) -> None:
        """As the real decode worker: a reservation no hand-off came for (e.g. its scheduler died
        between Reserve and Prefill) frees its slot after reservation_timeout_s."""
        now = asyncio.get_running_loop().time()
        for rid, expiry in list(self.holds.items()):
            if expiry is not None and expiry < now:
                del self.holds[rid]

    def info(self) -> WorkerInfo:
        self.expire()
        return WorkerInfo(self.worker_id, "decode", self.address, free_slots=self.slots - len(self.holds),
                          capacity=self.slots, running=len(self.running), kv_total_tokens=self.kv_tokens,
                          kv_free_tokens=self.kv_tokens, kv_dtype=self.kv_dtype)

    async def start(self) -> None:
        await super().start()
        self.tasks.append(asyncio.create_task(self._loop()))

    async def Reserve(self, request, context):  # noqa: N802 (gRPC method names)
        return (await self.ReserveMany(pb.ReserveManyRequest(items=[request]), context)).items[0]

    async def ReserveMany(self, request, context):  # noqa: N802
        self.reserve_calls.append(len(request.items))
        if self.reserve_s:
            await asyncio.sleep(self.reserve_s)  # the worker's latency, not a synchronization
        return pb.ReserveManyResponse(items=[self._reserve(r) for r in request.items])

    def _reserve(self, request) -> pb.ReserveResponse:
        self.expire()
        granted = request.request_id in self.holds or self.slots - len(self.holds) > request.keep_free
        if granted and request.request_id not in self.holds:
            self.holds[request.request_id] = asyncio.get_running_loop().time() + self.reservation_timeout_s
        return pb.ReserveResponse(granted=granted, free_slots=self.slots - len(self.holds))

    async def Release(self, request, context):
        if request.request_id not in self.running:
            self.holds.pop(request.request_id, None)
        return pb.ReleaseResponse()

    async def join(self, item: pb.PrefillItem) -> bool:
        """The KV hand-off: the sequence joins the batch after the tokens already streamed."""
        rid = item.spec.request_id
        if not self.alive or rid not in self.holds:
            return False
        if not await self.store.transition(rid, item.epoch, State.DECODING, decode_worker=self.address):
            self.holds.pop(rid, None)
            return True  # ended in transit
        self.holds[rid] = None
        n_out = int((await self.store.record(rid)).get("n_out", 0))
        self.running[rid] = Seq(rid, item.epoch, n_out, item.spec.sampling.max_tokens)
        return True

    async def _loop(self) -> None:
        while self.alive:
            await asyncio.sleep(self.step_s)
            seqs = list(self.running.values())
            if not seqs:
                continue
            items = []
            for s in seqs:
                last = s.next_index + 1 >= s.max_tokens
                items.append(StepItem(s.rid, s.epoch, s.next_index, 7, "x",
                                      State.COMPLETED if last else None, "length" if last else ""))
            try:
                kept = await self.store.step(items)
            except (redis.RedisError, OSError):
                continue  # Redis away: the same step again (a replayed index is skipped)
            for s, item, ok in zip(seqs, items, kept):
                s.next_index += 1
                if not ok or item.final_state:
                    del self.running[s.rid]
                    self.holds.pop(s.rid, None)


class FakePrefill(_Worker, pb_grpc.PrefillWorkerServicer):
    role = "prefill"

    def __init__(self, store: AsyncStore, worker_id: str, decoders: dict[str, FakeDecode], prefill_s: float = 0.002):
        super().__init__(store, worker_id)
        pb_grpc.add_PrefillWorkerServicer_to_server(self, self.server)
        self.decoders = decoders  # address -> worker
        self.prefill_s = prefill_s
        self.batches: list[list[str]] = []
        self.received_ms: list[int] = []  # when each batch came (Unix ms)
        self.more_coming: list[bool] = []  # PrefillBatch.more_coming of each batch
        self.priorities: dict[str, int] = {}  # PrefillItem.priority of every request received
        self.failing = False  # True: every KV hand-off fails (as a worker that corrupts them)

    async def Prefill(self, request, context):
        self.batches.append([it.spec.request_id for it in request.items])
        self.received_ms.append(int(time.time() * 1000))
        self.more_coming.append(request.more_coming)
        self.priorities.update({it.spec.request_id: it.priority for it in request.items})
        await asyncio.sleep(self.prefill_s)
        # The fake join sets DECODING before the sequence runs (a real decode worker sets it only
        # once the whole hand-off is in), so it must not be cut off by a scheduler killed mid-call.
        return await asyncio.shield(self._prefill(request))

    async def _prefill(self, request) -> pb.PrefillBatchResult:
        results = []
        for it in request.items:
            rid = it.spec.request_id
            last = it.spec.sampling.max_tokens <= 1
            kept = await self.store.step([StepItem(rid, it.epoch, 0, 7, "x", State.COMPLETED if last else None,
                                                   "length" if last else "")])
            if not kept[0] or last:
                results.append(pb.PrefillItemResult(request_id=rid, ok=True))
                continue
            await self.store.transition(rid, it.epoch, State.TRANSFERRING)
            if self.failing:
                results.append(pb.PrefillItemResult(request_id=rid, ok=False, failure=pb.ATTEMPT_FAILURE_HANDOFF,
                                                    error=f"KV hand-off to {it.decode_address}: checksum mismatch"))
                continue
            ok = await self.decoders[it.decode_address].join(it)
            results.append(pb.PrefillItemResult(request_id=rid, ok=ok, error="" if ok else "KV hand-off refused"))
        return pb.PrefillBatchResult(results=results)


@dataclass
class FakeWorkers:
    """`prefill` fake prefill workers and `decode` fake decode workers on the store's prefix."""

    redis_url: str
    prefix: str
    decode: int = 1
    prefill: int = 1
    slots: int = 4
    step_s: float = 0.005
    reserve_s: float = 0.0
    kv_tokens: int = 0  # each fake decode worker's reported KV pool
    kv_dtypes: tuple[str, ...] = ()  # the dtype decode worker i reports (none given: "")
    prefill_kv_dtype: str = ""  # the dtype every prefill worker reports
    decoders: dict[str, FakeDecode] = field(default_factory=dict)
    prefillers: list[FakePrefill] = field(default_factory=list)

    async def start(self) -> "FakeWorkers":
        self.client = aioredis.Redis.from_url(self.redis_url)
        self.store = AsyncStore(self.client, self.prefix, 600)
        for i in range(self.decode):
            d = FakeDecode(self.store, f"decode-{i}", self.slots, self.step_s, reserve_s=self.reserve_s,
                           kv_tokens=self.kv_tokens)
            d.kv_dtype = self.kv_dtypes[i] if i < len(self.kv_dtypes) else ""
            self.decoders[d.address] = d
            await d.start()
        for i in range(self.prefill):
            p = FakePrefill(self.store, f"prefill-{i}", self.decoders)
            p.kv_dtype = self.prefill_kv_dtype
            self.prefillers.append(p)
            await p.start()
        return self

    async def add_decode(self) -> FakeDecode:
        """Starts one more fake decode worker (the prefill workers hand off to it too)."""
        d = FakeDecode(self.store, f"decode-{len(self.decoders)}", self.slots, self.step_s, reserve_s=self.reserve_s)
        self.decoders[d.address] = d
        await d.start()
        return d

    async def stop(self) -> None:
        for w in [*self.prefillers, *self.decoders.values()]:
            if w.tasks:
                await w.kill()
        await self.client.aclose()


async def wait_for(predicate, timeout_s: float = 10.0, every_s: float = 0.01):
    """Polls an async predicate until it returns something true; returns it."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = await predicate()
        if got:
            return got
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {predicate.__name__}")
        await asyncio.sleep(every_s)

