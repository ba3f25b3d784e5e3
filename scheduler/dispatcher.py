"""The dispatch loop: queue in Redis -> prefill batches on workers, with KV room reserved on a
decode worker first. IO lives here; the choices are made by `scheduler.policies`.

One dispatch: read a bounded snapshot of the queue (per tier, the backlogged tenants with the
lowest counters and the head of each one's queue), let the policies order it and cut a batch,
reserve a decode slot for each request, CLAIM them in Redis (atomically: requests cancelled
meanwhile are skipped, tenants are charged), and send the batch to the prefill worker whose prefix
cache holds most of its prompts, weighed against the work in flight there (`scheduler.prefix_routing`;
with --no-prefix-routing, the least busy one).
A failed attempt goes back to the queue (REQUEUE), or FAILS when its attempts are spent: the
request's own failures (a failed hand-off, an error on the worker) are retried after a backoff on
other workers, attempts lost to infrastructure are bounded apart (`scheduler.policies.retry`), and
a worker whose hand-offs keep failing is quarantined (`scheduler.retries`).
"""

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from pdq.observability import metrics, telemetry, telemetry_grpc
from pdq.transport import mtls
from pdq.state import redisconn
from pdq.config import SchedulerConfig
from pdq.observability.liveness import Liveness
from pdq.state.calls import joined
from pdq.state.registry import PREFIX_HEX, ROLES, WorkerInfo, live_from, live_workers, registry_call
from pdq.transport.serving import GRPC_OPTIONS
from pdq.state.store import Deposed, AsyncStore, Registry, RequestStore, TenantBacklog, now_ms, spec_from_bytes
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from scheduler.policies import (Candidate, DecodeSlots, DrainRate, Headroom, TenantQueue, TierQueue,
                                decode_chooser, fair_policy, form_batch, handoff_skip, kv_matched, place_prefill,
                                place_round, preemptible_tiers, prefer_healthy, prefill_priority, same_kv_dtype,
                                schedule, tier_policy)
from scheduler.leader import Leadership, Sole
from scheduler.prefix_routing import PrefixRouter
from scheduler.retries import BatchOutcome, Retries

log = logging.getLogger("pdq.scheduler")

# Prompt tokens in flight per prefill worker, in batches' worth (max_batched_tokens): one running,
# one ready. Counting tokens, not batches, lets small batches (one slot freed at a time) flow.
INFLIGHT_BATCHES_PER_PREFILL_WORKER = 2

# The poll period while the queue is empty (at least dispatch_interval_ms). Everything that queues
# work wakes the loop at once: submits and this scheduler's requeues poke it, and a requeue by
# anyone else (a worker, another process) or an operator's resume comes on the queued channel.
# Polling an empty queue every 100 ms took ~1% of a core (a Redis script each time) and woke
# Redis and the scheduler 20 times a second, each time taking a core from the model's threads.
IDLE_POLL_S = 1.0

# After a preemption, no other until a round placed a request or this long passed: the freed seat
# reaches the dispatcher with the worker's next heartbeat, and one seat is what the head asked for.
PREEMPT_SETTLE_S = 2.0
# How long the dispatch loop waits for a worker's preemption (one model step, normally): past it the
# call is cancelled, and so is the preemption if the model loop has not begun it.
PREEMPT_CALL_S = 3.0


@dataclass
class _Peer:
    address: str
    channel: grpc.aio.Channel
    stub: object
    inflight: int = 0  # prompt tokens of its batches in flight
    heartbeat_ms: int = 0  # its last heartbeat seen
    failed_hb: int = -1  # its last heartbeat seen when a call failed to reach it: skipped until a newer one
    tasks: set = field(default_factory=set)


def to_tier_queues(snapshot: dict[str, list[TenantBacklog]], tiers: list[str],
                   default_weight: float) -> list[TierQueue]:
    """A store snapshot as the policies' plain data."""
    out = []
    for rank, tier in enumerate(tiers):
        queues = [TenantQueue(b.tenant, b.counter, b.weight if b.weight and b.weight > 0 else default_weight,
                              [Candidate(h.request_id, h.prompt_tokens, h.max_tokens, b.tenant, tier, h.deadline_ms,
                                         h.created_ms, h.avoid) for h in b.heads])
                  for b in snapshot.get(tier, []) if b.heads]
        out.append(TierQueue(tier, rank, queues))
    return out


@dataclass
class RoundRead:
    """What a dispatch round reads first, in one round trip: the `batch` in the order of choice,
    whether it left queued requests out (`cut`: its size or token limit), the `registry` as read
    (`registry_call`; turned into workers only for a round with a batch, `live_from`), and the
    queue's counters (`load`, `RequestStore.load`)."""

    batch: list[Candidate]
    cut: bool
    registry: Registry
    load: dict[str, int]


class Dispatcher:
    def __init__(self, config: SchedulerConfig, store: AsyncStore, leader: Leadership | Sole | None = None):
        self.config = config
        self.store = store
        self.leader = leader or Sole()  # rounds run only while it leads; its epoch fences the claims
        self.wake = asyncio.Event()
        self.drain = DrainRate()  # tokens dispatched per second, for retry hints
        self.tiers = config.tier_names
        self.tier_policy = tier_policy(config.tier_policy, config.aging_ms)
        self.fair_policy = fair_policy(config.fair_policy)
        self._peers: dict[str, _Peer] = {}
        self._task: asyncio.Task | None = None
        self._listener: asyncio.Task | None = None
        self._stopping = False
        self.headroom = Headroom(config.reserve_slots)
        self._tls = mtls.InternalTLS.from_config(config)
        self._weights: dict[str, float] = {}  # tenant -> weight, from the latest queue snapshot
        self._served: dict[str, float] = {}  # tenant -> monotonic time of its latest dispatch
        self._requeued_ms: dict[str, int] = {}  # requests this dispatcher requeued -> when (their queue wait starts)
        self._depth_at = 0.0  # last refresh of the queue depth gauges
        self._depth_labels: set[tuple[str, str]] = set()
        self.on_deadline: Callable[[int], None] = lambda deadline_ms=0: None  # a deadline set or moved (wakes the janitor)
        self._queue_empty = False  # the latest snapshot held nothing, and no poke came since
        self._next_retry_ms = 0  # when a request held back after a failure may go (0 = none held back)
        self._pokes = 0  # work queued since start (submits, requeues): did any come while a batch was placed?
        self._stopped = asyncio.Event()
        self._preempted_at = 0.0  # monotonic time of the latest preemption (0: none since a round placed one)
        self._dtype_warned = -60.0  # monotonic time of the latest warning of workers left out for their dtype
        self._live: dict[str, list[WorkerInfo]] = {role: [] for role in ROLES}  # the registry as last used
        self._registry: Registry | None = None  # the registry as the latest round read it
        self.retries = Retries(config, store, self._release)
        self.prefix_router = PrefixRouter(store, config.prefix_weight) if config.prefix_routing else None

    def poke(self, queued: bool = True) -> None:
        """Wakes the loop for work queued meanwhile (a submit, a requeue; queued=False: room freed
        up, nothing new): it reads the queue at once."""
        self._queue_empty = False
        self._pokes += queued
        self.wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="dispatch")
        self._listener = asyncio.create_task(self._listen(), name="dispatch-heartbeats")

    async def stop(self) -> None:
        self._stopping = True
        self._stopped.set()
        self.wake.set()
        if self._task:
            await self._task
        if self._listener:  # it blocks until a message comes: cancel it (it closes its pubsub)
            self._listener.cancel()
            try:
                await self._listener
            except asyncio.CancelledError:
                pass
        tasks = [t for p in self._peers.values() for t in p.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.grace_s)
        for peer in self._peers.values():
            await peer.channel.close()

    def _peer(self, info: WorkerInfo) -> _Peer:
        peer = self._peers.get(info.worker_id)
        if peer is None or peer.address != info.address:
            channel = mtls.aio_channel(info.address, self._tls, GRPC_OPTIONS,
                                       interceptors=telemetry_grpc.client_interceptors())
            stub = (pb_grpc.PrefillWorkerStub if info.role == "prefill" else pb_grpc.DecodeWorkerStub)(channel)
            peer = self._peers[info.worker_id] = _Peer(info.address, channel, stub)
        return peer

    async def _pause(self, seconds: float) -> None:
        """Sleeps, or less when the dispatcher stops."""
        try:
            await asyncio.wait_for(self._stopped.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _wait_s(self, interval: float) -> float:
        """How long to wait for a poke: the poll period (longer with the queue empty), cut short
        when a request held back after a failure may go. On standby: the idle poll (taking the
        lease pokes the loop)."""
        if not self.leader.leading:
            return max(interval, IDLE_POLL_S)
        wait = max(interval, IDLE_POLL_S) if self._queue_empty else interval
        if self._next_retry_ms:
            wait = min(wait, max(0.0, (self._next_retry_ms - now_ms()) / 1000))
        return wait

    async def _loop(self) -> None:
        interval = self.config.dispatch_interval_ms / 1000
        live = Liveness("dispatcher")
        try:
            while not self._stopping:
                try:
                    await asyncio.wait_for(self.wake.wait(), self._wait_s(interval))
                except asyncio.TimeoutError:
                    pass
                self.wake.clear()
                if self._stopping:
                    break
                if not self.leader.leading:
                    continue
                try:
                    while await self.dispatch_once():
                        pass
                    await self.observe_queue()
                    live.beat()
                except Exception as exc:  # keep dispatching; Redis or a worker may come back
                    if not redisconn.unavailable(exc):
                        log.exception("dispatch failed")
                    await self._pause(max(interval, redisconn.backoff_s(live.error(exc))))
        finally:
            live.stopped()

    async def _listen(self) -> None:
        """Wakes the loop on a worker heartbeat while requests may be queued: a worker heartbeats
        when its free slots change, so a freed KV slot is used at once, not at the next poll.
        With the queue empty at the latest read and no poke since, a freed slot has nothing to
        take (and with nothing queued in Redis the heartbeat is not published at all). A request
        queued elsewhere (a worker's requeue) or a resumed queue (the queued channel) pokes it.
        An operator's deadline change (the deadline channel) calls `on_deadline`."""
        keys = self.store.keys
        live = Liveness("dispatch-listener")
        try:
            while not self._stopping:
                pubsub = self.store.client.pubsub(ignore_subscribe_messages=True)
                try:
                    await pubsub.subscribe(keys.heartbeat_channel, keys.deadline_channel, keys.queued_channel)
                    live.beat()
                    self.poke(queued=False)  # anything queued while it was away is read now
                    while not self._stopping:
                        message = await pubsub.get_message(timeout=None)
                        if not message:
                            continue
                        channel = message["channel"]
                        channel = channel.decode() if isinstance(channel, bytes) else channel
                        if channel == keys.deadline_channel:
                            self.on_deadline()
                        elif channel == keys.queued_channel:
                            self.poke()
                        elif not self._queue_empty:
                            self.wake.set()
                except Exception as exc:  # Redis went away: the loop polls meanwhile; subscribe again
                    await self._pause(redisconn.backoff_s(live.error(exc)))
                finally:
                    try:
                        await pubsub.aclose()
                    except Exception:  # its connection is gone already
                        pass
        finally:
            live.stopped()

    async def _workers(self, live: dict[str, list[WorkerInfo]] | None = None
                       ) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
        """The prefill and the decode workers that may take work now, from `live` (the registry
        as read with the queue's snapshot), else read now (one Redis round trip)."""
        if live is None:
            live = await live_workers(self.store, ROLES, self.config.worker_timeout_s)
        self._live = live
        now = now_ms()

        def usable(role: str) -> list[WorkerInfo]:
            metrics.LIVE_WORKERS.labels(role).set(len(live[role]))
            self.retries.handoffs.seen(live[role])
            out = []
            for w in live[role]:
                peer = self._peer(w)
                peer.heartbeat_ms = w.heartbeat_ms
                if not w.draining and w.heartbeat_ms > peer.failed_hb:
                    out.append(w)
            return prefer_healthy(out, lambda w: w.quarantined(now))
        return usable("prefill"), usable("decode")

    async def dispatch_once(self) -> bool:
        """Sends at most one batch. -> True when a batch went out (call again)."""
        pokes = self._pokes
        read = await self.next_batch()  # the queue, the registry and the load: one round trip
        batch, cut = read.batch, read.cut
        if not batch:
            return False
        prefill, decode = await self._workers(live_from(read.registry, ROLES))
        matched = kv_matched(prefill, decode)
        if len(matched) < len(prefill):
            self._dtype_mismatch(prefill, decode, matched)
        prefill = matched
        if not prefill or not decode:
            return False
        loads = [(w.worker_id, self._peers[w.worker_id].inflight) for w in prefill]
        cap = INFLIGHT_BATCHES_PER_PREFILL_WORKER * self.config.max_batched_tokens
        if self.prefix_router:
            target_id, placeable = await self.prefix_router.place(batch, prefill, decode, loads, cap)
        else:
            target_id, placeable = place_prefill(batch, loads, cap)
        if target_id is None:
            return False
        cut = cut or len(placeable) < len(batch)  # some wait for another prefill worker
        batch = placeable
        target_info = next(w for w in prefill if w.worker_id == target_id)
        decode = [w for w in decode if same_kv_dtype(target_info.kv_dtype, w.kv_dtype)]  # its hand-offs land there
        target = self._peers[target_id]
        slots = [DecodeSlots(w.worker_id, w.address, w.free_slots) for w in decode]
        capacity = sum(w.capacity for w in decode)
        tenants = {c.tenant for c in batch}
        if (sum(s.free_slots for s in slots) - len(batch) >= self.headroom.reserve and len(tenants) == 1
                and tenants >= set(self._served)):
            running, active = {}, set()  # room past the reserve, one tenant, no other lately: no Redis read
        else:
            running, active = self._competition(read.load)
        weights = {t: self._weights.get(t, self.config.default_weight) for t in active | {c.tenant for c in batch}}
        prefixes = (await self.prefix_router.decode_prefixes(batch, decode, target_info.address)
                    if self.prefix_router else {})
        plans = place_round(batch, slots, target_info.address, self.headroom, capacity, running, weights, active,
                            decode_chooser(prefixes))
        if not plans and self.config.preempt_lower_tiers:
            await self._preempt_for(batch[0], decode, sum(s.free_slots for s in slots))
            return False
        replies = await self._reserve_round([(p.worker, p.candidate, p.keep_free) for p in plans])
        left: dict[str, int] = {}  # worker -> its own count of free slots after the round
        placed: list[tuple[Candidate, DecodeSlots, int, str]] = []
        for plan, (kv_address, worker_free) in zip(plans, replies):
            cand, choice, under = plan.candidate, plan.worker, plan.under_share
            left[choice.worker_id] = min(left.get(choice.worker_id, worker_free), worker_free)
            if kv_address is None:
                running[cand.tenant] -= 1
                continue
            self._served[cand.tenant] = time.monotonic()
            placed.append((cand, choice, prefill_priority(self._tier_rank(cand.tier), under), kv_address))
        for s in slots:
            s.free_slots = left.get(s.worker_id, s.free_slots)
        if not placed:
            return False
        self._preempted_at = 0.0
        batch_id = uuid.uuid4().hex[:12]
        try:
            claimed = await self.store.claim([(c.request_id, dw.worker_id) for c, dw, _, _ in placed],
                                             target_info.worker_id, target.address,
                                             int(self.config.prefill_lease_s * 1000), self.config.default_weight,
                                             token=batch_id, fence=self.leader.epoch)
        except Deposed:  # another scheduler leads: it dispatches these
            self.leader.deposed()
            for cand, dw, _, _ in placed:
                await self._release(dw, cand.request_id)
            return False
        items, reserved = [], []
        sent_to = {dw.worker_id for _, dw, _, _ in placed}  # the prefix caches of separate decode workers taking some
        decode_by_id = {w.worker_id: w for w in decode}
        held = {w.worker_id: (w.kv_block_size, frozenset(w.prefixes)) for w in decode
                if w.worker_id in sent_to and w.prefixes and w.address != target.address}
        for (cand, dw, priority, kv_address), got in zip(placed, claimed):
            if got.epoch == 0 or got.spec is None:  # cancelled or ended meanwhile
                await self._release(dw, cand.request_id)
                continue
            spec = spec_from_bytes(got.spec)
            spec.deadline_ms = cand.deadline_ms  # the record's: an operator may have moved it
            block_size, prefixes = held.get(dw.worker_id, (0, frozenset()))
            hashed = self.prefix_router.hashes(cand.request_id, block_size) if self.prefix_router else None
            items.append(pb.PrefillItem(spec=spec, epoch=got.epoch, decode_address=dw.address, priority=priority,
                                        decode_kv_address=kv_address,
                                        decode_cached_tokens=handoff_skip(spec.prompt_token_ids, block_size,
                                                                          prefixes, PREFIX_HEX, hashed)))
            reserved.append(dw)
            self.drain.add(time.monotonic(), cand.kv_tokens)
            self._waited(items[-1])
        if not items:
            return True
        if self.prefix_router:
            self.prefix_router.dispatched(target_info, [it.spec.request_id for it in items])
            for it, dw in zip(items, reserved):
                if dw.address != target.address:
                    self.prefix_router.handed_off(decode_by_id[dw.worker_id], it.spec.request_id)
        prompt_tokens = sum(len(it.spec.prompt_token_ids) for it in items)
        metrics.BATCH_SIZE.labels("dispatch").observe(len(items))
        metrics.BATCH_TOKENS.labels("dispatch").observe(prompt_tokens)
        metrics.TOKEN_BUDGET_USE.labels("dispatch").observe(min(1.0, prompt_tokens / self.config.max_batched_tokens))
        # more is coming only where a seat is left for it: a batch that took the last free seats
        # is the last until sequences end (a worker waiting for more would idle meanwhile)
        coming = (cut or self._pokes != pokes) and sum(s.free_slots for s in slots) > 0
        batch_msg = pb.PrefillBatch(batch_id=batch_id, items=items, more_coming=coming)
        target.inflight += prompt_tokens
        task = asyncio.create_task(self._run_batch(target, target_id, batch_msg, reserved))
        target.tasks.add(task)
        task.add_done_callback(target.tasks.discard)
        return True

    def _dtype_mismatch(self, prefill: list[WorkerInfo], decode: list[WorkerInfo], matched: list[WorkerInfo]) -> None:
        """Says (at most once a minute) which prefill workers get no work: no decode worker runs
        their model's dtype, so every hand-off of theirs would be refused (operations.md)."""
        now = time.monotonic()
        if now - self._dtype_warned < 60:
            return
        self._dtype_warned = now
        left = [f"{w.worker_id} ({w.kv_dtype})" for w in prefill if w not in matched]
        dtypes = sorted({w.kv_dtype for w in decode})
        log.warning("prefill workers %s get no work: no decode worker runs their dtype (decode workers run %s); "
                    "start every worker with the same --dtype (PDQ_DTYPE)", ", ".join(left), ", ".join(dtypes))

    async def next_batch(self) -> "RoundRead":
        """The next batch in the order of choice, from a bounded snapshot of the queue, with the
        registry and the queue's counters read in the same round trip (a round's reads before
        its reservations are one wait, not three)."""
        size, store = self.config.max_batch_size, self.store
        (snapshot, registry), load = await store.run(joined(
            joined(RequestStore.snapshot.build(store, self.tiers, size, size),
                   registry_call(store, ROLES, self.config.worker_timeout_s)),
            RequestStore.load.build(store)))
        self._registry = registry
        self._queue_empty = not any(b.heads for backlogs in snapshot.values() for b in backlogs)
        self._next_retry_ms = snapshot.next_retry_ms
        self._weights = {b.tenant: b.weight for backlogs in snapshot.values() for b in backlogs if b.weight}
        order = schedule(to_tier_queues(snapshot, self.tiers, self.config.default_weight), now_ms(),
                         self.tier_policy, self.fair_policy)
        seen = 0

        def counted() -> Iterator[Candidate]:
            nonlocal seen
            for cand in order:
                seen += 1
                yield cand
        batch = form_batch(counted(), size, self.config.max_batched_tokens)
        # queued requests left out: form_batch stopped before the end of the snapshot, or the
        # snapshot itself held all it may of a tenant (the queue may go on behind those)
        cut = (seen > len(batch) or next(order, None) is not None
               or any(len(b.heads) >= size for backlogs in snapshot.values() for b in backlogs))
        return RoundRead(batch, cut, registry, load)

    async def _preempt_for(self, head: Candidate, decode: list[WorkerInfo], free_slots: int) -> None:
        """The head of the queue found no room: a decode worker preempts one running request of
        a lower tier (`preemptible_tiers`), asked one worker after another until one has such a
        request. At most one preemption until the freed seat is taken."""
        tiers = preemptible_tiers(self.tiers, head.tier, free_slots)
        if not tiers or time.monotonic() - self._preempted_at < PREEMPT_SETTLE_S:
            return
        request = pb.PreemptRequest(tiers=tiers, reason=f"preempted for a request of tier {head.tier}")
        for w in decode:
            try:
                reply = await self._peer(w).stub.Preempt(request, timeout=PREEMPT_CALL_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("preemption on %s failed: %s", w.worker_id, exc.details())
                continue
            if reply.request_id:
                self._preempted_at = time.monotonic()
                log.info("%s preempted %s for %s (tier %s)", w.worker_id, reply.request_id, head.request_id, head.tier)
                return

    def _tier_rank(self, tier: str) -> int:
        return self.tiers.index(tier) if tier in self.tiers else len(self.tiers)

    def _competition(self, load: dict[str, int]) -> tuple[dict[str, int], set[str]]:
        """-> decode slots each tenant holds, and the tenants competing for them now: those
        running or queued (`load`: the queue's counters, `RequestStore.load`), and those served
        within share_window_s."""
        running = {k.removeprefix("running:"): v for k, v in load.items() if k.startswith("running:") and v > 0}
        queued = {k.removeprefix("n:") for k, v in load.items() if k.startswith("n:") and v > 0}
        cutoff = time.monotonic() - self.config.share_window_s
        self._served = {t: at for t, at in self._served.items() if at >= cutoff}
        return running, set(running) | queued | set(self._served)

    async def _reserve_round(self, wanted: list[tuple[DecodeSlots, Candidate, int]]) -> list[tuple[str | None, int]]:
        """Reserves KV room for a round's requests: each on its worker if more than its
        `keep_free` slots are free there. One call per worker for the round (ReserveMany, answered
        in order), so a request submitted meanwhile waits for one reply, not one per request.
        -> per item, in order: (None when refused, else where the worker takes the hand-off over
        TCP, "" = PushKV only; the worker's own count of free slots after it, 0 when unreachable)."""
        by_worker: dict[str, list[int]] = {}
        for i, (slots, _, _) in enumerate(wanted):
            by_worker.setdefault(slots.worker_id, []).append(i)
        out: list[tuple[str | None, int]] = [(None, 0)] * len(wanted)

        async def one(worker_id: str, indices: list[int]) -> None:
            peer, address = self._peers[worker_id], wanted[indices[0]][0].address
            items = [pb.ReserveRequest(request_id=wanted[i][1].request_id, tokens=wanted[i][1].kv_tokens,
                                       keep_free=wanted[i][2], prompt_tokens=wanted[i][1].prompt_tokens)
                     for i in indices]
            try:
                resp = await peer.stub.ReserveMany(pb.ReserveManyRequest(items=items), timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                log.warning("reserve on %s failed: %s", address, exc.details())
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    peer.failed_hb = peer.heartbeat_ms
                return
            for i, r in zip(indices, resp.items):
                out[i] = (r.kv_address if r.granted else None), r.free_slots
        await asyncio.gather(*(one(w, idx) for w, idx in by_worker.items()))
        return out

    async def _release(self, slots: DecodeSlots, rid: str) -> None:
        try:
            await self._peers[slots.worker_id].stub.Release(pb.ReleaseRequest(request_id=rid), timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("release on %s failed: %s", slots.address, exc.details())

    def _waited(self, item: pb.PrefillItem) -> None:
        """Records a claimed request's queue wait: from its arrival (first attempt) or from when
        this dispatcher requeued it, to now (the time of its dispatch)."""
        spec = item.spec
        since = spec.arrival_ms if item.epoch <= 1 else self._requeued_ms.pop(spec.request_id, 0)
        if not since:  # requeued elsewhere (a worker, the janitor): when is not known here
            return
        metrics.QUEUE_TIME.labels(spec.tier, spec.tenant).observe(max(0, now_ms() - since) / 1000)
        telemetry.end(telemetry.start("pdq.queue_wait", spec.traceparent, start_ms=since,
                                      attributes={"pdq.request_id": spec.request_id, "pdq.tenant": spec.tenant,
                                                  "pdq.tier": spec.tier, "pdq.attempt": item.epoch}))

    async def observe_queue(self) -> None:
        """Refreshes the queue gauges (requests and tokens per tier and tenant, one Redis round
        trip: the queue's own counters) and the live worker gauges, at most once a second."""
        if time.monotonic() - self._depth_at < 1.0:
            return
        self._depth_at = time.monotonic()
        # the live worker gauges, from the registry the round just before read
        await self._workers(live_from(self._registry, ROLES) if self._registry is not None else None)
        depth = await self.store.depth(self.tiers)
        labels = set()
        for tier, tenant, requests, tokens in depth:
            metrics.QUEUE_DEPTH.labels(tier, tenant).set(requests)
            metrics.QUEUE_TOKENS.labels(tier, tenant).set(tokens)
            labels.add((tier, tenant))
        for gone in self._depth_labels - labels:
            metrics.QUEUE_DEPTH.labels(*gone).set(0)
            metrics.QUEUE_TOKENS.labels(*gone).set(0)
        self._depth_labels = labels

    def stand_by(self) -> None:
        """This scheduler no longer leads: its queue gauges go to 0 (the leader's count)."""
        for labels in self._depth_labels:
            metrics.QUEUE_DEPTH.labels(*labels).set(0)
            metrics.QUEUE_TOKENS.labels(*labels).set(0)
        self._depth_labels = set()
        self._depth_at = 0.0

    async def _run_batch(self, peer: _Peer, worker_id: str, batch: pb.PrefillBatch, reserved: list[DecodeSlots]) -> None:
        """Runs one batch on prefill worker `worker_id`; failed items go back to the queue
        (`scheduler.retries`)."""
        span = telemetry.start("pdq.dispatch", kind=telemetry.SpanKind.CLIENT,
                               links=[telemetry.span_context_of(it.spec.traceparent) for it in batch.items],
                               attributes={"pdq.batch_id": batch.batch_id, "pdq.batch.size": len(batch.items),
                                           "pdq.batch.prompt_tokens": sum(len(it.spec.prompt_token_ids)
                                                                          for it in batch.items),
                                           "server.address": peer.address})
        try:
            with telemetry.use(span):  # the prefill worker's batch continues this span's trace
                outcome = BatchOutcome.of(batch, reserved, worker_id, await peer.stub.Prefill(batch))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                peer.failed_hb = peer.heartbeat_ms
            outcome = BatchOutcome.lost(batch, reserved, f"prefill worker {peer.address}: {exc.code().name} {exc.details()}")
        finally:
            peer.inflight -= sum(len(it.spec.prompt_token_ids) for it in batch.items)
        telemetry.end(span, attributes={"pdq.batch.failed": len(outcome.failed)})
        try:
            for rid in await self.retries.settle(outcome, self._live):
                if len(self._requeued_ms) > 100_000:  # ids that never came back (cancelled meanwhile)
                    self._requeued_ms.clear()
                self._requeued_ms[rid] = now_ms()
        except Exception as exc:  # Redis gone past its outage window: the prefill leases bring them back
            log.warning("batch %s: could not give back its failed attempts (%s); their leases will", batch.batch_id, exc)
        self.poke(queued=bool(outcome.failed))  # its prompt tokens are no longer in flight; failed ones went back
