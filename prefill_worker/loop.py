"""The prefill model loop (a thread): a shell around the engine core, chunked, batched prefill
under a token budget, then the first token written to Redis and the KV cache exported for the
hand-off.

The prompts are the engine core's (`pdq.engine.core.EngineCore`, the one the in-process engine
runs, with prefill only): a job's prompt joins it as a `Sequence` of the scheduler's priority
(`urgent_first`: a pass runs only the most urgent prompts that can run), the core admits it by free
KV blocks (sharing what the prefix cache holds, waiting a pass for blocks another prompt is
computing) and plans each pass's chunks; once its prompt is complete it leaves the core with its
blocks (`detach`) and this loop samples its first token and hands it off. This loop is what is
around the core: jobs, cancels and deadlines in; first tokens to Redis and the KV out.

A failed forward pass answers its jobs with an error (the scheduler retries them); a request whose
own parameters cannot be sampled ends FAILED alone. Redis errors are ridden by the store's client
for redis_outage_s; one that outlasts it takes the process down (`pdq.engine.worker.ModelLoop`), after
answering the pending jobs.
"""

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdq.observability import metrics, telemetry
from pdq.state import redisconn
from pdq.state.cancel_listener import CancelListener
from pdq.transport.convert import sampling_from_pb
from pdq.engine.batch_policy import BatchPolicy
from pdq.engine.constraint import Grammars, advance
from pdq.engine.core import CorePlan, EngineCore
from pdq.engine.sampling import SamplingParams, logprob_records, sample_each
from pdq.engine.sequence import Sequence, SeqStatus, end_reason
from pdq.model.output_text import TextOutput
from pdq.state.ending import Ending
from pdq.state.request import State
from pdq.state.store import Moved, StepItem, SyncStore, now_ms
from pdq.v1 import internal_pb2 as pb
from pdq.engine.worker import IDLE_BEAT_S, ModelLoop, kv_reserve_tokens

log = logging.getLogger("pdq.prefill")


@dataclass
class Outcome:
    """What became of one item: `kind` is "handoff" (layers set), "local" (a colocated worker's
    hand-off to itself, done on the model thread: the K/V stayed in the shared pool under slot
    `key` and the decode side took it, unless `error` says why not, and then freed it),
    "finished" (the request ended at its first token), "dropped" (it ended elsewhere: cancel,
    deadline) or "error"."""

    kind: str
    generated: list[int] = field(default_factory=list)  # tokens so far, the last one not in `layers`
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    error: str = ""
    key: Any = None  # "local": the pool slot holding the K/V
    lost: bool = False  # "error": lost to this worker's own trouble (shutting down), not the request's failure


@dataclass
class Job:
    item: pb.PrefillItem
    done: Callable[[Outcome], None]  # called once, from the model thread
    prompt: list[int] = field(default_factory=list)  # tokens to prefill
    generated: list[int] = field(default_factory=list)  # streamed by an earlier attempt (migration)
    seq: Sequence | None = None  # its prompt in the engine core (from its start)
    admitted: bool = False  # holds KV blocks under `key` (in the core, or detached from it)
    started: bool = False
    span: Any = None  # this attempt's prefill span (None when tracing is off)
    more_coming: bool = False  # its batch's PrefillBatch.more_coming: the scheduler is sending more
    params: SamplingParams | None = None  # its sampling parameters, read when it starts
    ended: bool = False  # `done` was called

    @property
    def rid(self) -> str:
        return self.item.spec.request_id

    @property
    def key(self) -> tuple[str, str, int]:
        """Its KV slot's key: never the bare request id, which a decode sequence of an earlier
        attempt may still hold in a pool shared with decode (a colocated worker)."""
        return ("prefill", self.rid, self.item.epoch)


class PrefillLoop(ModelLoop):
    """`local(item)` says whether an item's decode worker is this very process (a colocated
    worker sharing this runner's pool): its K/V then stays in place, and `adopt(header, key,
    moved)` hands the slot to the decode side on this thread (-> None, else why not; Outcome
    "local"); `moved` says whether the request is already DECODING (moved with its first token,
    in one round trip), or None."""

    thread_name = "prefill-loop"

    def __init__(self, runner: Any, store: SyncStore, cancels: CancelListener, tokenizer: Any,
                 eos_ids: list[int], max_batched_tokens: int, prefill_chunk: int,
                 local: Callable[[pb.PrefillItem], bool] | None = None,
                 adopt: Callable[[pb.KVHeader, Any, bool | None], str | None] | None = None,
                 taken: Callable[[str], None] | None = None):
        self.runner = runner
        # a colocated worker's decode side (`ColocatedLoop`): first tokens of prompts handed to it
        # are written with its next step (ride_along(items, moves, then)), and it hears which
        # Redis refused (written(request id, moved))
        self.ride_along: Callable[[list[StepItem], list, Callable[[list[bool], list], None]], None] | None = None
        self.written: Callable[[str, Moved | bool], None] | None = None
        self.output_grant = 0  # a local prompt's output positions granted up front (its decode worker's setting)
        self.taken = taken  # told (with the request id) when a local prompt takes its reserved blocks
        self.local = local
        self.adopt = adopt
        self.store = store
        self.cancels = cancels
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.grammars = Grammars(tokenizer, runner, self.eos_ids)  # structured output's masks
        self.max_batched_tokens = max_batched_tokens
        self.prefill_chunk = prefill_chunk
        # the prompts: admitted by free blocks, most urgent first; the pool may be shared with a
        # colocated decode core, so a prompt that does not fit now waits rather than fails
        self.core = EngineCore(runner, BatchPolicy(max_batched_tokens, prefill_chunk, max_num_seqs=1 << 30),
                               urgent_first=True, alone=False)
        self._jobs: dict[Any, Job] = {}  # by key: the jobs whose prompt is in the core
        metrics.KV_POOLS.watch("prefill", runner)
        self.inbox: queue.Queue[Job | None] = queue.Queue()
        self._gaps_seen = cancels.gaps if cancels is not None else 0  # the listener's gaps caught up on

    def submit(self, job: Job) -> None:
        self.inbox.put(job)

    def _start(self, job: Job) -> bool:
        """Reads what an earlier attempt already streamed. A resumed request prefills prompt +
        those tokens (all but the last, which the decode worker feeds next) and samples nothing,
        so the client sees every token index once. -> False when the job ended here."""
        job.started = True
        try:
            job.params = sampling_from_pb(job.item.spec.sampling)
        except ValueError as exc:  # the request's own fault: it alone ends, before any pass
            self._fail(job, f"invalid sampling parameters: {exc}")
            return False
        prompt = list(job.item.spec.prompt_token_ids)
        # a first attempt (epoch 1) has streamed nothing: no Redis round trip in the model thread
        job.generated = self.store.streamed_tokens(job.rid) if job.item.epoch > 1 else []
        job.prompt = prompt + job.generated[:-1]
        ended = job.params.finish(job.generated[-1], self.eos_ids) if job.generated else ""
        if job.generated and (len(job.generated) >= job.params.max_tokens or ended):
            reason = ended or "length"
            self.store.step([StepItem(job.rid, job.item.epoch, final_state=State.COMPLETED, finish_reason=reason)])
            self._end(job, Outcome("finished", generated=job.generated))
            return False
        # a prompt whose decode worker is this process holds room for every token it may generate
        reserve = kv_reserve_tokens(job.item.spec, self.runner.max_seq_len, self.output_grant) if self._local(job) else 0
        job.seq = Sequence(job.key, job.prompt, job.params, priority=(job.item.priority,), reserve_tokens=reserve)
        self._jobs[job.key] = job
        self.core.add(job.seq)
        return True

    def _run(self) -> None:
        pending: list[Job] = []
        try:
            while True:
                try:
                    got = self.inbox.get(timeout=IDLE_BEAT_S) if not pending else self.inbox.get_nowait()
                    while True:
                        if got is None:
                            for job in pending:
                                self._end(job, Outcome("error", error="prefill worker shutting down", lost=True))
                            return
                        pending.append(got)
                        got = self.inbox.get_nowait()
                except queue.Empty:
                    pass
                try:
                    pending = self._pass(pending)
                except Exception as exc:  # a bad batch must not kill the worker
                    if redisconn.unavailable(exc):
                        raise  # Redis stayed unreachable past the client's window: the process goes down
                    log.exception("prefill pass failed")
                    for job in pending:
                        self._end(job, Outcome("error", error=f"prefill failed: {exc}"))
                    pending = []
                self.liveness.beat()
        except BaseException:
            for job in pending:
                self._end(job, Outcome("error", error="prefill worker lost its model loop", lost=True))
            raise

    def _fail(self, job: Job, error: str) -> None:
        """Ends one request FAILED (its own fault); its call answers it as ended ("dropped")."""
        log.error("request %s failed: %s", job.rid, error)
        self.store.end(job.rid, Ending.failed(error), epoch=job.item.epoch)
        self._end(job, Outcome("dropped", error=error))

    def _end(self, job: Job, outcome: Outcome) -> None:
        if job.ended:  # answered already (a pass that failed after ending some of its jobs)
            return
        job.ended = True
        if self._jobs.pop(job.key, None) is not None:
            self.core.finish(job.key, outcome.kind)  # still in the core (waiting or prefilling): out, blocks freed
        if job.admitted:
            self.runner.free(job.key)
            job.admitted = False
        if job.span is not None:
            if outcome.kind == "error":
                telemetry.end(job.span, "failed", outcome.error)
            elif outcome.kind == "dropped":
                telemetry.end(job.span, "dropped", event_attributes={"pdq.reason": outcome.error})
            else:
                telemetry.end(job.span, outcome.kind, attributes={"pdq.kv.tokens": len(job.prompt)})
            job.span = None
        job.done(outcome)

    def _pass(self, pending: list[Job]) -> list[Job]:
        """One forward pass over chunks of pending jobs. -> jobs still pending."""
        live, plan = self.plan(pending, self.max_batched_tokens)
        if not plan:
            return live
        started = time.perf_counter()
        logits = self.runner.step(*plan.items())
        return self.finish(live, plan, logits, started)

    def plan(self, pending: list[Job], budget: int) -> tuple[list[Job], CorePlan]:
        """Drops jobs that ended, then the core's next pass under `budget` tokens (admissions by
        free blocks, most urgent first; the chunks). -> (jobs still live, the plan)."""
        live = []
        self._gaps_seen = self.cancels.caught_up(self._gaps_seen, self.store,
                                                 lambda: [(j.rid, j.item.epoch) for j in pending])
        now = now_ms()
        # before timing a job out, its record's deadline: an operator may have moved it unheard
        self.cancels.reread_deadlines(self.store, [j.rid for j in pending
                                                   if 0 < self.cancels.deadline(j.rid, j.item.spec.deadline_ms) <= now])
        for job in pending:
            deadline = self.cancels.deadline(job.rid, job.item.spec.deadline_ms)
            if not job.started and not self._start(job):
                continue
            if self.cancels.pop(job.rid):
                self._end(job, Outcome("dropped", error="request ended"))
            elif deadline and now >= deadline:
                state = self.store.end(job.rid, Ending.timed_out("during prefill"), epoch=job.item.epoch)
                if state is not None and not state.terminal:  # moved since it was read: it goes on
                    self.cancels.reread_deadlines(self.store, [job.rid])
                    live.append(job)
                    continue
                if state == State.TIMED_OUT:
                    metrics.TIMEOUTS.labels("prefill").inc()
                telemetry.add_event(job.span, "timeout", error="deadline exceeded during prefill")
                self._end(job, Outcome("dropped", error="deadline exceeded"))
            else:
                live.append(job)
        plan = self.core.schedule(budget)
        for job in live:  # admitted this pass: its blocks are held under its key
            if not job.admitted and job.seq is not None and job.seq.status is SeqStatus.RUNNING:
                job.admitted = True
                if self.taken is not None and self._local(job):
                    self.taken(job.rid)
        return live, plan

    def finish(self, live: list[Job], plan: CorePlan, logits: torch.Tensor, started: float) -> list[Job]:
        """After the pass (`logits`: a row per chunk, then per one-token row, of `plan`, started
        at perf_counter `started`): the prompts it completed leave the core with their blocks;
        their first tokens, and their hand-offs. -> jobs still pending. (A prompt with one token
        left, e.g. past a cached prefix, runs as a one-token row.)"""
        metrics.prefill_pass(len(plan.prefill) + len(plan.decode),
                             sum(c.length for c in plan.prefill) + len(plan.decode), self.max_batched_tokens,
                             time.perf_counter() - started)
        metrics.prefix_cache("prefill", self.runner)
        complete = []
        for row, seq in zip(plan.sample_rows, plan.sample):
            job = self._jobs.pop(seq.seq_id, None)
            if job is not None:  # (None: it ended meanwhile)
                self.core.detach(job.key)
                complete.append((row, job))
        fresh = [(row, job) for row, job in complete if not job.generated]
        if fresh:
            self._first_tokens(logits, fresh)
        for _, job in complete:
            if job.generated:  # resumed: hand off at once, nothing to sample
                self._handoff(job, job.generated)
        done = {id(j) for _, j in complete}
        return [j for j in live if id(j) not in done]

    def _first_tokens(self, logits: torch.Tensor, complete: list[tuple[int, Job]]) -> None:
        rows = torch.tensor([r for r, _ in complete], device=logits.device)
        params = [j.params for _, j in complete]
        picked = logits.index_select(0, rows)
        matchers: list = [None] * len(complete)
        if any(p.json_schema or p.regex for p in params):
            for i, p in enumerate(params):
                try:
                    matchers[i] = self.grammars.matcher(p)
                except ValueError as exc:
                    matchers[i] = exc
        masked = self.grammars.mask(picked, [None if isinstance(m, Exception) else m for m in matchers])
        tokens = sample_each(masked, params, [0] * len(complete), [(j.prompt, ()) for _, j in complete],
                             [self.eos_ids] * len(complete))
        tokens = [m if isinstance(m, Exception) else t for m, t in zip(matchers, tokens)]
        records = logprob_records(picked, tokens, params)
        items, results = [], []
        for (_, job), p, token, record, matcher in zip(complete, params, tokens, records, matchers):
            if isinstance(token, Exception):  # this request's own: it alone ends
                self._fail(job, f"sampling failed: {token}")
                continue
            text = TextOutput(self.tokenizer, p.stop, job.prompt, min_tokens=p.min_tokens)
            delta, stopped = text.add(token)
            complete_ = advance(matcher, token)
            reason = end_reason(p, token, self.eos_ids, 1, len(job.prompt), self.runner.max_seq_len, stopped, complete_)
            if reason and reason != "stop":
                delta += text.flush()
            items.append(StepItem(job.rid, job.item.epoch, 0, token, delta,
                                  State.COMPLETED if reason else None, reason, record))
            results.append((job, token, reason))
        if not results:
            return
        # the DECODING moves of prompts this process's decode side takes go in the same round trip
        local = [(job, token) for job, token, reason in results if not reason and self.adopt and self._local(job)]
        moves = [(job.rid, job.item.epoch, State.DECODING, {"decode_worker": job.item.decode_address})
                 for job, _ in local]
        if self.ride_along is not None and len(local) == sum(1 for _, _, reason in results if not reason):
            self._first_riding(items, moves, results)
            return
        kept, moved = self.store.step_and_transition(items, moves)
        moved_by_job = {id(job): ok for (job, _), ok in zip(local, moved)}
        now = now_ms()
        for (job, token, reason), ok in zip(results, kept):
            if ok:  # once per request: its first token (a resumed request never samples here)
                self._first_token_seen(job, reason, now)
            if not ok:
                self._end(job, Outcome("dropped", error="request ended"))
            elif reason:
                self._end(job, Outcome("finished", generated=[token]))
            else:
                self._handoff(job, [token], moved_by_job.get(id(job)))

    def _first_riding(self, items: list[StepItem], moves: list, results: list[tuple[Job, int, str]]) -> None:
        """First tokens whose requests all end here or go to this process's decode side: their
        writes ride along with the decode side's next step (`ride_along`) instead of the model
        thread waiting for the round trip. The prompts are handed to the decode side now, as
        moved; when Redis answers, one it refused (ended meanwhile, a stale attempt) leaves the
        decode side again (`written`), as a refused step of a running sequence would."""
        now = now_ms()
        for job, token, reason in results:
            telemetry.add_event(job.span, "first_token", {"pdq.token_index": 0, "pdq.finish_reason": reason})
            if reason:
                self._end(job, Outcome("finished", generated=[token]))
            else:
                self._handoff(job, [token], True)
        local = [job for job, _, reason in results if not reason]

        def then(kept: list[bool], moved: list) -> None:
            for (job, _, reason), ok in zip(results, kept):
                if ok:
                    self._first_token_seen(job, reason, now, span=False)
            for job, ok in zip(local, moved):
                if self.written is not None:
                    self.written(job.rid, ok)
        assert self.ride_along is not None
        self.ride_along(items, moves, then)

    def _first_token_seen(self, job: Job, reason: str, now: int, span: bool = True) -> None:
        """Once per request, its first token written (a resumed request never samples here)."""
        spec = job.item.spec
        labels = (spec.tier, spec.tenant)
        metrics.TTFT.labels(*labels).observe(max(0, now - spec.arrival_ms) / 1000)
        metrics.PROMPT_TOKENS.labels(*labels).inc(len(job.prompt))
        metrics.GENERATED_TOKENS.labels(*labels).inc()
        if reason:
            metrics.E2E.labels(*labels).observe(max(0, now - spec.arrival_ms) / 1000)
        if span:
            telemetry.add_event(job.span, "first_token", {"pdq.token_index": 0, "pdq.finish_reason": reason})

    def _local(self, job: Job) -> bool:
        """Whether the job's decode worker is this process (its K/V stays in place)."""
        return self.local is not None and self.local(job.item)

    def _handoff(self, job: Job, generated: list[int], moved: Moved | bool | None = None) -> None:
        """moved: for a local hand-off, whether the request was moved to DECODING already (None:
        not tried; the decode side does it)."""
        if self._local(job):
            # the decode side of this process takes the slot as it is: no transfer, so no
            # TRANSFERRING; it moves the request to DECODING (or drops it if it ended meanwhile)
            job.admitted = False
            header = pb.KVHeader(spec=job.item.spec, epoch=job.item.epoch, generated_token_ids=generated,
                                 num_tokens=len(job.prompt) + len(generated) - 1)
            error = self.adopt(header, job.key, moved) if self.adopt else "no decode role in this process"
            self._end(job, Outcome("local", generated=generated, key=job.key, error=error or ""))
            return
        if not self.store.transition(job.rid, job.item.epoch, State.TRANSFERRING):
            self._end(job, Outcome("dropped", error="request ended"))
            return
        layers = [(k.cpu(), v.cpu()) for k, v in self.runner.export_kv(job.key, len(job.prompt))]
        self._end(job, Outcome("handoff", generated=generated, layers=layers))
