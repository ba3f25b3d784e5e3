"""The decode model loop (a thread): a shell around the engine core, one forward pass per step.

The batch is the engine core's (`pdq.engine.core.EngineCore`, the one the in-process engine
runs): a sequence whose KV cache has arrived joins it (`add_prefilled`) and waits until the
strategy (`pdq.engine.batching`) admits it; with `continuous` that is the next step. The core
makes room for every running sequence's next token (preempting the least important by
`memory_victim` when the blocks not promised to arriving hand-offs run out), plans the decode
rows, and after the forward keeps the books of the sampled tokens (`bookkeeping.judge`: stop
strings, grammars, EOS, max_tokens). This loop is what is around it: arrivals, cancels and
deadlines in; tokens, ends and preempted sequences out to Redis. A sequence leaves the step it
finishes, is cancelled or times out, and its KV blocks are freed then. With the request-level
strategies a finished sequence keeps its seat until its whole batch is done, as naive servers
run. Each step's tokens (and ends) go to Redis in one command, whose reply is read after the
next forward pass (`decode_worker.writes.StepWriter`): Redis applies them while the model runs.

Redis trouble never gives sequences back: every write is retried (`StepWriter`), and an outage
longer than the store's client rides takes the process down (`ModelLoop`), its sequences then
resumed elsewhere. Only a failed forward pass gives the running sequences back to the scheduler.
"""

import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from decode_worker import bookkeeping
from decode_worker.kv_receive import Arrived, Discard
from decode_worker.writes import StepWriter
from pdq.engine.batch_policy import BatchPolicy
from pdq.engine.batching import Strategy
from pdq.engine.core import CorePlan, EngineCore
from pdq.engine.sequence import Sequence as CoreSequence, SeqStatus
from pdq.observability import metrics, telemetry
from pdq.state import redisconn
from pdq.state.cancel_listener import CancelListener
from pdq.transport.convert import sampling_from_pb
from pdq.engine.constraint import Grammars
from pdq.engine.sampling import SamplingParams, logprob_records, sample_each
from pdq.ops.faults import Faults
from pdq.model.output_text import TextOutput
from pdq.state.request import State
from pdq.state.ending import FAILURE, LOST, PREEMPTED, Ending
from pdq.state.store import Moved, StepItem, SyncStore, now_ms
from pdq.engine.worker import IDLE_BEAT_S, ModelLoop

log = logging.getLogger("pdq.decode")

@dataclass(eq=False)
class Sequence(CoreSequence):
    """A request decoding here: the engine core's sequence (`seq_id` = its request id; `prompt`;
    `output` = every token generated so far, the last one not yet in the KV cache) with what the
    worker keeps around it."""

    epoch: int = 0
    text: Any = None  # its TextOutput: detokenizing, stop strings
    deadline_ms: int = 0
    arrived: float = field(default_factory=time.monotonic)
    labels: tuple[str, str] = ("", "")  # (tier, tenant) of its metrics
    arrival_ms: int = 0  # the request's arrival (Unix ms), for e2e latency
    last_token_at: float = 0.0  # monotonic time of its previous token, for inter-token latency
    span: Any = None  # this attempt's decode span (None when tracing is off)
    interval: int = 1  # decode steps per write to Redis (RequestSpec.stream_interval)
    held: list[StepItem] = field(default_factory=list)  # tokens sampled, not written yet
    matcher: Any = None  # its structured output's matcher (pdq.engine.constraint), None when unconstrained
    delta: str = ""  # the text of its newest token (`bookkeeping.judge`)
    admitted: bool = False  # the core has run it here
    left: bool = False  # it has left this worker (`DecodeLoop._leave`)

    @property
    def rid(self) -> str:
        return self.seq_id

    @property
    def generated(self) -> list[int]:
        return self.output

    @property
    def done(self) -> bool:
        """Finished (while still here: its seat kept by a request-level batch)."""
        return self.status is SeqStatus.FINISHED

    @property
    def position(self) -> int:
        """Position of the last generated token, the one fed to the next step."""
        return self.num_tokens - 1


@dataclass
class PreemptAsk:
    """Preempt one held sequence of one of `tiers` (best first): the lowest tier's newest.
    `done` gets its request id, or "" when none runs here."""

    tiers: tuple[str, ...]
    reason: str
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def preempt_victim(seqs: "list[Sequence]", tiers: tuple[str, ...]) -> "Sequence | None":
    """Which sequence a preemption for `tiers` takes: of those of the listed tiers not finished,
    the worst tier's, and of those the one that arrived last (it has the least to recompute
    and the least time in)."""
    rank = {t: i for i, t in enumerate(tiers)}
    held = [s for s in seqs if not s.done and s.labels[0] in rank]
    return max(held, key=lambda s: (rank[s.labels[0]], s.arrived), default=None)


def memory_victim(seqs: "list[Sequence]", tiers: tuple[str, ...]) -> "Sequence | None":
    """Which running sequence gives its blocks back when the pool runs out: the least important
    of those not finished: the lowest tier (`tiers` best first; an unknown tier counts as the
    lowest), then the tenant holding the most of them here (the furthest over its share of this
    worker), then the one that arrived last (the least to recompute)."""
    held = [s for s in seqs if not s.done]
    rank = {t: i for i, t in enumerate(tiers)}
    seats: dict[str, int] = {}
    for s in held:
        seats[s.labels[1]] = seats.get(s.labels[1], 0) + 1
    return max(held, key=lambda s: (rank.get(s.labels[0], len(tiers)), seats[s.labels[1]], s.arrived), default=None)


def take(inbox: queue.Queue, wait: float | None, handle: Callable[[Any], None]) -> bool:
    """Hands everything in `inbox` to `handle`, first waiting up to `wait` seconds for an item
    (0: not at all, None: until one comes). -> False at the stop sentinel (None)."""
    try:
        got = inbox.get(block=wait != 0, timeout=wait)
        while True:
            if got is None:
                return False
            handle(got)
            got = inbox.get_nowait()
    except queue.Empty:
        return True


@dataclass
class LoopStats:
    steps: int = 0
    seq_steps: int = 0  # sequence-steps computed


class DecodeLoop(ModelLoop):
    thread_name = "decode-loop"

    def __init__(self, runner: Any, store: SyncStore, cancels: CancelListener, tokenizer: Any,
                 eos_ids: list[int], worker_address: str, on_leave: Callable[[list[str]], None],
                 strategy: Strategy = Strategy(), threads: Callable[[], int] | None = None, max_attempts: int = 3,
                 prefilling: Callable[[], bool] | None = None, yield_to_prefill_ms: float = 0.0,
                 tiers: tuple[str, ...] = (), promised: Callable[[], int] = lambda: 0):
        self.runner = runner
        self.tiers = tiers  # best first: who keeps its blocks when they run out (`memory_victim`)
        self.promised = promised  # free blocks granted to hand-offs not arrived yet: growth leaves them
        self.store = store
        self.cancels = cancels
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.grammars = Grammars(tokenizer, runner, self.eos_ids)  # structured output's masks
        self.address = worker_address
        self.on_leave = on_leave  # called from this thread with the sequences that left (frees their holds)
        self.strategy = strategy
        self.threads = threads  # torch threads for the next step (None: leave them as they are)
        self.max_attempts = max_attempts  # a request given back more often than this FAILS
        self.prefilling = prefilling  # True while a request reserved here is being prefilled
        self.yield_to_prefill_ms = yield_to_prefill_ms  # then steps start at least this far apart
        self._last_step_end = 0.0
        self.inbox: queue.Queue[Arrived | Discard | PreemptAsk | None] = queue.Queue()
        # the batch: KV in the pool, waiting to be admitted, then running; no prefill here, so the
        # token budget and seats are the scheduler's (its reservations), not the core's
        self.core = EngineCore(runner, BatchPolicy(max_batched_tokens=1 << 30, max_num_seqs=1 << 30), strategy,
                               requeue_preempted=False, victim=lambda seqs: memory_victim(seqs, self.tiers),
                               reserved_blocks=promised)
        self._preempted: list[Sequence] = []  # preempted by the core, not given back to the scheduler yet
        self._first_pending: list[Sequence] = []  # traced sequences whose next token is their first here
        self.stats = LoopStats()
        self.step_metrics = metrics.DecodeStepStats(strategy.name)
        metrics.KV_POOLS.watch("decode", runner)
        self.writes: StepWriter[Sequence] = StepWriter(store, self._refused)  # each step's, read a step later
        self._gaps_seen = cancels.gaps if cancels is not None else 0  # the listener's gaps caught up on
        self._left: list[str] | None = None  # during `after`: who left, told in one on_leave call at its end
        # fault injection (PDQ_FAULTS decode_step_delay_ms): every forward pass takes this much longer
        self.step_delay_s = Faults.from_env().get("decode_step_delay_ms") / 1000

    def add(self, item: Arrived | Discard | PreemptAsk) -> None:
        """A received hand-off to decode, the slot of a failed one to free (see kv_receive), or a
        preemption to make."""
        self.inbox.put(item)

    def arrive(self, item: Arrived, moved: "Moved | bool | None" = None) -> None:
        """`add`, from the thread that runs this loop (a colocated worker's own hand-off): the
        sequence waits to join at the next step, without a trip through the inbox. `moved`:
        whether the request was moved to DECODING already (None: it is moved here)."""
        self._arrive(item, moved)

    @property
    def running(self) -> dict[str, Sequence]:
        """Admitted sequences by request id (the core's running batch)."""
        return self.core.running  # type: ignore[return-value]

    @property
    def waiting(self) -> list[Sequence]:
        """Sequences whose KV is here, not admitted yet (oldest first)."""
        return list(self.core.waiting)  # type: ignore[arg-type]

    @property
    def busy(self) -> bool:
        return bool(self.core.has_unfinished() or self._preempted)

    def _run(self) -> None:
        while True:
            try:
                if not take(self.inbox, self._yield_s() if self.running else self._idle_timeout(), self._arrive):
                    break
                self._drop_ended()
                if self.core.has_unfinished() and not self._yield_s():
                    self._step()
            except Exception as exc:
                if redisconn.unavailable(exc):
                    raise  # Redis stayed unreachable past the client's window: the process goes down
                log.exception("decode step failed; requeueing its sequences")
                self._requeue_all(f"decode step failed: {exc}")
            self.liveness.beat()
        self._shutdown()

    def _yield_s(self) -> float:
        """Seconds the next step waits, leaving the cores to prefill: while a request reserved
        here is being prefilled (on the same machine), steps start `yield_to_prefill_ms` after
        the previous one ended. Prefill goes first, as in a single engine that runs a prompt's
        pass before the next decode step; arrivals, cancels and deadlines are still handled."""
        if not self.yield_to_prefill_ms or self.prefilling is None or not self.prefilling():
            return 0.0
        return max(0.0, self._last_step_end + self.yield_to_prefill_ms / 1000 - time.monotonic())

    def _idle_timeout(self) -> float:
        if not self.core.waiting:
            return IDLE_BEAT_S
        return max(0.001, self.core.wait_hint_s())

    def _arrive(self, kv: Arrived | Discard | PreemptAsk, moved: "Moved | bool | None" = None) -> None:
        if isinstance(kv, PreemptAsk):
            self._preempt(kv)
            return
        if isinstance(kv, Discard):
            self.runner.free(kv.key)
            if kv.done.set_running_or_notify_cancel():  # False: the waiter gave up (cancelled)
                kv.done.set_result(None)
            return
        h = kv.header
        rid = h.spec.request_id
        span = telemetry.start("pdq.decode", h.spec.traceparent,
                               attributes={**telemetry.request_attributes(h.spec), "pdq.attempt": h.epoch,
                                           "pdq.worker": self.address, "pdq.strategy": self.strategy.name,
                                           "pdq.resumed_tokens": len(h.generated_token_ids) - 1})
        own = ""  # what is wrong with the request itself (it FAILS; another worker would fail it too)
        try:  # anything wrong here frees the slot and the hold: no KV leaks on a bad hand-off
            params = sampling_from_pb(h.spec.sampling)
            prompt = list(h.spec.prompt_token_ids)
            generated = list(h.generated_token_ids)
            seq = Sequence(rid, prompt, params, output=generated, num_cached=len(prompt) + len(generated) - 1,
                           epoch=h.epoch, deadline_ms=h.spec.deadline_ms,
                           text=TextOutput(self.tokenizer, params.stop, prompt, generated, params.min_tokens))
            if params.json_schema or params.regex:
                try:
                    seq.matcher = self.grammars.matcher(params, generated)
                except ValueError as exc:
                    own = f"structured output: {exc}"
            if not own:
                held = self.runner.kv_length(kv.key)
                if held != seq.num_cached:  # (a header at odds with its K/V: it must not reach a shared step)
                    raise ValueError(f"the hand-off holds K/V for {held} positions, its tokens need {seq.num_cached}")
                self.runner.rename(kv.key, rid)  # the K/V was received into the slot (kv_receive)
        except Exception as exc:
            log.error("cannot take KV of %s: %s", rid, exc)
            self.runner.free(kv.key)
            telemetry.end(span, "failed", f"could not load KV: {exc}")
            self.on_leave([rid])
            # a failed attempt: retried on another worker after a backoff, FAILED once attempts are spent
            self.store.requeue(rid, h.epoch, f"decode worker could not load KV: {exc}", self.max_attempts)
            return
        if own:
            log.error("request %s failed: %s", rid, own)
            self.runner.free(kv.key)
            self.store.end(rid, Ending.failed(own), epoch=h.epoch)
            telemetry.end(span, "failed", own)
            self.on_leave([rid])
            return
        seq.labels = (h.spec.tier, h.spec.tenant)
        seq.arrival_ms = h.spec.arrival_ms
        seq.last_token_at = seq.arrived  # the first gap here runs from the KV cache's arrival
        seq.span = span
        seq.interval = max(1, h.spec.stream_interval)
        if moved is None:
            moved = self.store.transition(rid, h.epoch, State.DECODING, decode_worker=self.address)
        if not moved:
            self._end_span(seq, "dropped", reason="request ended during the KV hand-off")
            self._leave(seq)  # ended while in transit
            return
        if isinstance(moved, Moved):  # the record's deadline: an operator may have moved it meanwhile
            seq.deadline_ms = moved.deadline_ms
        self.core.add_prefilled(seq)

    def first_written(self, rid: str, moved: "Moved | bool") -> None:
        """The first token and DECODING move of a sequence adopted before they were applied
        (`arrive(..., moved=True)`, its prefill pass's writes riding along): Redis answered
        `moved`. Refused (it ended elsewhere meanwhile, or the attempt is stale): it leaves;
        moved: it takes the record's deadline (an operator may have moved it)."""
        seq = self.running.get(rid) or next((s for s in self.core.waiting if s.seq_id == rid), None)
        if seq is None:
            return
        if not moved:
            self._end_span(seq, "dropped", reason="request ended during the KV hand-off")
            self._leave(seq)  # type: ignore[arg-type]
        elif isinstance(moved, Moved):
            seq.deadline_ms = moved.deadline_ms  # type: ignore[attr-defined]

    def _note_admitted(self, plan: CorePlan) -> None:
        """Marks the sequences the core admitted for this step (their spans' "admitted" event)."""
        for seq in cast(list[Sequence], plan.decode):
            if not seq.admitted:
                seq.admitted = True
                if seq.span is not None:
                    seq.span.add_event("admitted", {"pdq.batch.running": len(self.core.running)})
                    self._first_pending.append(seq)

    def _end_span(self, seq: Sequence, event: str, error: str | None = None, reason: str = "") -> None:
        """Ends the sequence's decode span once (the first end wins)."""
        if seq.span is not None:
            attributes = {"gen_ai.usage.output_tokens": len(seq.generated)}
            if event == "finish":
                attributes["gen_ai.response.finish_reasons"] = [reason]
            telemetry.end(seq.span, event, error, attributes, {"pdq.reason": reason or error or ""})
            seq.span = None

    def _leave(self, seq: Sequence) -> None:
        """The sequence leaves this worker (once): out of the core, its blocks freed, its hold told."""
        if seq.left:
            return
        seq.left = True
        self._end_span(seq, "left")
        self.core.finish(seq.rid, seq.finish_reason or "left")
        self.runner.free(seq.rid)
        if self._left is not None:
            self._left.append(seq.rid)
        else:
            self.on_leave([seq.rid])

    def _held(self) -> list[Sequence]:
        """The sequences this worker holds that have not finished: the core's, and those it
        preempted that are not given back yet."""
        return [*self.core.held(), *(s for s in self._preempted if not s.left)]  # type: ignore[list-item]

    def _release_seats(self) -> None:
        """A request-level batch whose sequences have all finished gives up its seats."""
        for seq in self.core.release_seats():
            self._leave(seq)  # type: ignore[arg-type]

    def _drop_ended(self) -> None:
        """Drops sequences that ended elsewhere (cancel) and ends those past their deadline. After
        a gap in the cancel listener's subscription, it first catches up on what it missed."""
        self._gaps_seen = self.cancels.caught_up(self._gaps_seen, self.store,
                                                 lambda: [(s.rid, s.epoch) for s in self._held()])
        now = now_ms()
        ended: list[StepItem] = []
        due: list[Sequence] = []
        for seq in self._held():
            seq.deadline_ms = self.cancels.deadline(seq.rid, seq.deadline_ms)
            if self.cancels.pop(seq.rid):
                self._end_span(seq, "dropped", reason="request ended elsewhere (cancelled, timed out or failed)")
                self._leave(seq)
            elif seq.deadline_ms and now >= seq.deadline_ms:
                due.append(seq)
        timed_out = []
        for seq, deadline in zip(due, self.cancels.reread_deadlines(self.store, [s.rid for s in due])):
            if not deadline or deadline > now:  # moved by an operator; the notice did not reach us
                seq.deadline_ms = deadline
            else:
                ended += seq.held  # its tokens so far, then its end
                seq.held = []
                ended.append(StepItem(seq.rid, seq.epoch, final_state=State.TIMED_OUT, finish_reason="timeout"))
                timed_out.append(seq)
        if ended:
            self.store.step(ended)
            # STEP does not end a request whose deadline was moved since it was read: those go on
            for seq, state in zip(timed_out, self.store.states([s.rid for s in timed_out])):
                if state is None or state.terminal:
                    metrics.TIMEOUTS.labels("decode").inc(state == State.TIMED_OUT)
                    self._end_span(seq, "timeout", "deadline exceeded during decode")
                    self._leave(seq)
                else:
                    seq.deadline_ms = self.cancels.reread_deadlines(self.store, [seq.rid])[0]
        self._release_seats()

    def _step(self) -> None:
        started = time.perf_counter()
        plan = self.schedule()
        if not plan:
            self._give_back_preempted()
            return
        if self.threads is not None and (n := self.threads()) != torch.get_num_threads():
            from pdq.engine.worker import set_torch_threads
            set_torch_threads(n)
        logits = self.runner.step(*plan.items())
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.after(plan, logits, started)

    def schedule(self) -> CorePlan:
        """The core's next step (`EngineCore.schedule`): room for every running sequence's next
        token, taken from the free blocks not promised to arriving hand-offs; while a
        sequence's next block is not free, the least important running sequence
        (`memory_victim`) is preempted by recompute (which may be that sequence itself), to be
        given back to the scheduler once the step's writes have settled; the strategy's
        admissions; the decode rows."""
        self._release_seats()  # a batch whose last running sequence left (preempted, cancelled) is over
        plan = self.core.schedule()
        self._preempted += plan.preempted  # type: ignore[arg-type]
        self._note_admitted(plan)
        return plan

    def settle(self) -> None:
        """Reads the reply of the step sent last (and sends and reads what waits to ride along,
        `StepWriter.settle`): its running sequences that Redis dropped (cancelled, timed out or
        failed elsewhere, or a stale epoch) leave now, one step later than a blocking round
        trip would have let them (the cancel notice usually came first)."""
        self.writes.settle()

    def _refused(self, seq: Sequence) -> None:
        if self.running.get(seq.rid) is seq:
            self._end_span(seq, "dropped", reason="request ended elsewhere (cancelled, timed out or stale)")
            self._leave(seq)

    def after(self, plan: CorePlan, logits: torch.Tensor, started: float) -> None:
        """Samples the step's tokens (`logits`: a row per decode row of `plan`), hands them to the
        core (`EngineCore.update`, judged by `bookkeeping.judge`: what ended and why), sends what
        is written now (`bookkeeping.writes`) to Redis in one command, and lets the sequences that
        ended leave. First it settles the previous step, whose reply came in during this step's
        forward pass, and gives back what the core preempted for this step.

        Sequences that finish free their K/V before the send (the core frees them as it ends
        them): sending wakes Redis, the gateway and the client, which then take a core from the
        model's threads, and the pool's compaction copy (a parallel region) would wait at its
        barrier for a thread they took the core of; before the send the cores are the model's.
        Those that leave are told to `on_leave` in one call, after the send, so the event loop
        wakes once a step, not once a sequence."""
        self.writes.settle_sent()  # (writes riding along from this pass go with this step's)
        self._give_back_preempted(settle=False)
        seqs: list[Sequence] = plan.sample  # type: ignore[assignment]
        params = [s.params for s in seqs]
        tokens = sample_each(self.grammars.mask(logits, [s.matcher for s in seqs]), params,
                             [len(s.generated) for s in seqs], [(s.prompt, s.generated) for s in seqs],
                             [self.eos_ids] * len(seqs))
        records = logprob_records(logits, tokens, params)
        self.stats.steps += 1
        self.stats.seq_steps += len(seqs)
        for seq, token in zip(seqs, tokens):
            if isinstance(token, Exception) and not seq.done and self.running.get(seq.rid) is seq:
                self._fail(seq, f"sampling failed: {token}")  # this request's own: it alone ends
        max_seq_len = self.runner.max_seq_len
        outputs = self.core.update(plan, [t if isinstance(t, int) else 0 for t in tokens],
                                   lambda seq, token: bookkeeping.judge(seq, token, self.eos_ids, max_seq_len))  # type: ignore[arg-type]
        step = bookkeeping.writes(outputs, {id(s): r for s, r in zip(seqs, records)}, self.stats.steps)
        now = time.monotonic()
        itl = []
        for seq, _ in step.live:
            itl.append((seq.labels, now - seq.last_token_at))
            seq.last_token_at = now
        self.writes.send(step.items, step.owners)
        if self._first_pending:
            for seq in self._first_pending:
                if seq.span is not None:
                    seq.span.add_event("first_token", {"pdq.token_index": len(seq.generated) - 1})
            self._first_pending.clear()
        self._left = []
        try:
            for seq, reason in step.live:
                if reason:
                    metrics.E2E.labels(*seq.labels).observe(max(0, now_ms() - seq.arrival_ms) / 1000)
                    self._end_span(seq, "finish", reason=reason)
                    if self.running.get(seq.rid) is not seq:  # it left the core (a request-level batch keeps its seat)
                        self._leave(seq)
            self.step_metrics.step(self.stats.seq_steps, self.core.padded, len(seqs),
                                   time.perf_counter() - started, itl)
            self._release_seats()
        finally:
            left, self._left = self._left, None
            if left:
                self.on_leave(left)
        if not self.running:  # no next forward to overlap with
            self.settle()
        self._last_step_end = time.monotonic()

    def _preempt(self, ask: PreemptAsk) -> None:
        """Gives one sequence back to the queue by recompute (`PreemptAsk`): its tokens so far
        written first (the last step's reply settled, its held interval flushed), then requeued
        as preempted, and its seat and blocks freed. A later attempt resumes it from those tokens:
        the client sees none twice and none missing."""
        if not ask.done.set_running_or_notify_cancel():  # the caller gave up
            return
        try:
            self.settle()  # the last step's reply first: who is still here, its tokens in Redis
            seq = preempt_victim(self._held(), ask.tiers)
            if seq is not None:
                self._give_back(seq, ask.reason)
        except BaseException as exc:
            ask.done.set_exception(exc)
            raise
        ask.done.set_result(seq.rid if seq is not None else "")

    def _give_back_preempted(self, settle: bool = True) -> None:
        """Gives back to the scheduler the sequences the core preempted (their blocks are free
        already), once the last step's reply has settled (`settle`: here, else the caller did)."""
        if not self._preempted:
            return
        if settle:
            self.settle()
        preempted, self._preempted = self._preempted, []
        for seq in preempted:
            self._give_back(seq, f"KV blocks ran out on this worker ({self.runner.free_blocks} free)")

    def _give_back(self, seq: Sequence, reason: str) -> None:
        """Preempts one sequence by recompute, after the last step's reply has settled (the
        caller's part): its held tokens written, requeued as preempted (no attempt counted), its
        seat and blocks freed. A later attempt resumes from its streamed tokens: the client sees
        none twice and none missing."""
        if seq.left:
            return  # it left when the step settled
        if seq.held:
            self.store.step(seq.held)
            seq.held.clear()
        state = self.store.requeue(seq.rid, seq.epoch, reason, self.max_attempts, PREEMPTED)
        metrics.PREEMPTIONS.labels(seq.labels[0]).inc()
        log.info("preempted %s (%s, %d tokens): %s -> %s", seq.rid, seq.labels[0], len(seq.generated), reason,
                 state or "stale")
        self._end_span(seq, "preempted", reason=f"{reason}: {state or 'stale'}")
        self._leave(seq)

    def _fail(self, seq: Sequence, error: str) -> None:
        """Ends one sequence FAILED (its own fault, e.g. its sampling raised); the rest go on."""
        log.error("request %s failed: %s", seq.rid, error)
        self.store.end(seq.rid, Ending.failed(error), epoch=seq.epoch)
        self._end_span(seq, "failed", error)
        self._leave(seq)

    def _shutdown(self) -> None:
        try:
            self._requeue_all("decode worker shut down", LOST)
        except Exception as exc:  # Redis down: the scheduler reaps them once this worker's heartbeats stop
            log.error("could not give back the held sequences at shutdown: %s", exc)

    def _requeue_all(self, why: str, kind: str = FAILURE) -> None:
        """Gives every held sequence back to the scheduler (a failed forward pass, or shutdown).
        A new attempt regenerates the same tokens (seeded per index) and Redis drops the indices
        already streamed. Redis errors go up (the store's client rode them as long as it may)."""
        try:
            self.settle()  # the last step's tokens are in Redis before their requests go back
        except Exception as exc:
            if redisconn.unavailable(exc):
                raise
            log.warning("could not apply the last decode step: %s", exc)
        self._give_back_preempted(settle=False)  # preempted, not failed: no attempt counted
        seated = [s for s in self.running.values() if s.done]
        for seq in self._held():
            state = self.store.requeue(seq.rid, seq.epoch, why, self.max_attempts, kind)
            metrics.REQUEUES.labels("decode", state or "stale").inc()
            self._end_span(seq, "requeued", why, reason=f"{why}: {state or 'stale'}")
            self._leave(seq)
        for seq in seated:
            self._leave(seq)  # type: ignore[arg-type]
