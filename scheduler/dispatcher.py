"""The dispatch loop: queue in Redis -> prefill batches on workers, with KV room reserved on a
decode worker first. IO lives here; the choices are made by `scheduler.policy`."""

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

import grpc

from pdq.config import SchedulerConfig
from pdq.registry import WorkerInfo, live_workers
from pdq.request import State
from pdq.serving import GRPC_OPTIONS
from pdq.store import RequestStore, _str, now_ms, spec_from_bytes
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from scheduler.policy import Candidate, DecodeSlots, choose_decode_worker, form_batch

log = logging.getLogger("pdq.scheduler")

MAX_ATTEMPTS = 3  # prefill/hand-off attempts before a request FAILS
INFLIGHT_PER_PREFILL_WORKER = 2  # batches in flight per prefill worker (one running, one ready)


@dataclass
class _Peer:
    address: str
    channel: grpc.aio.Channel
    stub: object
    inflight: int = 0
    free_slots: int = 0
    tasks: set = field(default_factory=set)


class Dispatcher:
    def __init__(self, config: SchedulerConfig, store: RequestStore):
        self.config = config
        self.store = store
        self.wake = asyncio.Event()
        self._peers: dict[str, _Peer] = {}
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="dispatch")

    async def stop(self) -> None:
        self._stopping = True
        self.wake.set()
        if self._task:
            await self._task
        tasks = [t for p in self._peers.values() for t in p.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.grace_s)
        for peer in self._peers.values():
            await peer.channel.close()

    def _peer(self, info: WorkerInfo) -> _Peer:
        peer = self._peers.get(info.worker_id)
        if peer is None or peer.address != info.address:
            channel = grpc.aio.insecure_channel(info.address, options=GRPC_OPTIONS)
            stub = (pb_grpc.PrefillWorkerStub if info.role == "prefill" else pb_grpc.DecodeWorkerStub)(channel)
            peer = self._peers[info.worker_id] = _Peer(info.address, channel, stub)
        return peer

    async def _loop(self) -> None:
        interval = self.config.dispatch_interval_ms / 1000
        while not self._stopping:
            try:
                await asyncio.wait_for(self.wake.wait(), interval)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            if self._stopping:
                break
            try:
                await self.expire_deadlines()
                while await self.dispatch_once():
                    pass
            except Exception:  # keep dispatching; Redis or a worker may come back
                log.exception("dispatch failed")
                await asyncio.sleep(interval)

    async def expire_deadlines(self) -> None:
        """Ends requests past their deadline that no worker ended (e.g. still queued)."""
        client = self.store.client
        due = await client.zrangebyscore(self.store.keys.deadlines, "-inf", now_ms(), start=0, num=256)
        for rid in due:
            await self.store.finish(_str(rid), State.TIMED_OUT, "timeout", "deadline exceeded")

    async def dispatch_once(self) -> bool:
        """Sends at most one batch. -> True when a batch went out (call again)."""
        timeout = self.config.worker_timeout_s
        client = self.store.client
        prefill = [w for w in await live_workers(client, self.store.keys, "prefill", timeout) if not w.draining]
        decode = [w for w in await live_workers(client, self.store.keys, "decode", timeout) if not w.draining]
        if not prefill or not decode:
            return False
        peers = [self._peer(w) for w in prefill]
        target = min(peers, key=lambda p: p.inflight)
        if target.inflight >= INFLIGHT_PER_PREFILL_WORKER:
            return False
        candidates = await self._candidates(self.config.max_batch_size * 2)
        batch = form_batch(candidates, self.config.max_batch_size, self.config.max_batched_tokens)
        if not batch:
            return False
        slots = []
        for w in decode:
            self._peer(w)
            slots.append(DecodeSlots(w.worker_id, w.address, w.free_slots))
        placed: list[tuple[Candidate, DecodeSlots]] = []
        for cand in batch:
            choice = choose_decode_worker(slots)
            if choice is None:
                break
            if not await self._reserve(choice, cand):
                choice.free_slots = 0
                continue
            choice.free_slots -= 1
            placed.append((cand, choice))
        if not placed:
            return False
        epochs = await self.store.claim([c.request_id for c, _ in placed], target.address)
        items, reserved = [], []
        raw_specs = await self._specs([c.request_id for c, _ in placed])
        for (cand, dw), epoch, raw in zip(placed, epochs, raw_specs):
            if epoch == 0 or raw is None:  # cancelled or ended meanwhile
                await self._release(dw, cand.request_id)
                continue
            items.append(pb.PrefillItem(spec=spec_from_bytes(raw), epoch=epoch, decode_address=dw.address))
            reserved.append(dw)
        if not items:
            return True
        batch_msg = pb.PrefillBatch(batch_id=uuid.uuid4().hex[:12], items=items)
        target.inflight += 1
        task = asyncio.create_task(self._run_batch(target, batch_msg, reserved))
        target.tasks.add(task)
        task.add_done_callback(target.tasks.discard)
        return True

    async def _candidates(self, limit: int) -> list[Candidate]:
        client = self.store.client
        rids = [_str(r) for r in await client.zrange(self.store.keys.queue, 0, limit - 1)]
        if not rids:
            return []
        pipe = client.pipeline(transaction=False)
        for rid in rids:
            pipe.hmget(self.store.keys.request(rid), "prompt_tokens", "max_tokens", "tenant", "tier", "deadline_ms")
        out = []
        for rid, row in zip(rids, await pipe.execute()):
            if row[0] is None:
                continue
            out.append(Candidate(rid, int(row[0]), int(row[1]), _str(row[2]), _str(row[3]), int(row[4])))
        return out

    async def _specs(self, rids: list[str]) -> list[bytes | None]:
        pipe = self.store.client.pipeline(transaction=False)
        for rid in rids:
            pipe.hget(self.store.keys.request(rid), "spec")
        return await pipe.execute()

    async def _reserve(self, slots: DecodeSlots, cand: Candidate) -> bool:
        peer = self._peers[slots.worker_id]
        try:
            resp = await peer.stub.Reserve(pb.ReserveRequest(request_id=cand.request_id, tokens=cand.kv_tokens),
                                           timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("reserve on %s failed: %s", slots.address, exc.details())
            return False
        return resp.granted

    async def _release(self, slots: DecodeSlots, rid: str) -> None:
        try:
            await self._peers[slots.worker_id].stub.Release(pb.ReleaseRequest(request_id=rid), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("release on %s failed: %s", slots.address, exc.details())

    async def _run_batch(self, peer: _Peer, batch: pb.PrefillBatch, reserved: list[DecodeSlots]) -> None:
        """Runs one batch on a prefill worker; failed items go back to the queue."""
        try:
            result = await peer.stub.Prefill(batch)
            failed = {r.request_id: r.error for r in result.results if not r.ok}
        except grpc.aio.AioRpcError as exc:
            failed = {it.spec.request_id: f"prefill worker {peer.address}: {exc.code().name} {exc.details()}"
                      for it in batch.items}
        finally:
            peer.inflight -= 1
            self.wake.set()
        for item, dw in zip(batch.items, reserved):
            rid = item.spec.request_id
            if rid in failed:
                log.warning("request %s attempt %d failed: %s", rid, item.epoch, failed[rid])
                await self._release(dw, rid)
                await self.store.requeue(rid, item.epoch, failed[rid], MAX_ATTEMPTS)
