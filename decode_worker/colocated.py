"""A colocated worker's model loop (a thread): prefill and decode in one forward per step.

A colocated worker (`python -m decode_worker --colocate true`) serves both worker roles in one
process over one `ModelRunner`: one model, one KV pool, one thread running the model. Each step
runs every running sequence's decode row and, in the rest of the token budget
(`--step-tokens`), the next prompt chunks of the prefill jobs, in one forward pass, as the
in-process engine does. A prompt whose decode worker is this process keeps its K/V where it is
(`prefill_worker.loop.Outcome` "local"), so the hand-off moves no bytes.

The two halves stay what they are alone, each a shell around its engine core over the one
runner and pool (`PrefillLoop`'s plans the prompt chunks and the loop samples first tokens;
`DecodeLoop`'s admits and plans the decode rows, and the loop samples and streams); this loop
only feeds them from one inbox and runs the forward pass they share. On a machine that two
separate workers would share, this avoids two processes fighting for the same cores and runs
the decode rows inside the prompt passes.
"""

import logging
import queue
import time

from decode_worker.loop import DecodeLoop, take
from decode_worker.writes import RideAlong
from pdq.engine.core import CorePlan
from pdq.state import redisconn
from pdq.engine.worker import ModelLoop, ModelThread
from prefill_worker.loop import Job, Outcome, PrefillLoop

log = logging.getLogger("pdq.colocated")


class ColocatedLoop(ModelLoop):
    thread_name = "colocated-loop"

    def __init__(self, prefill: PrefillLoop, decode: DecodeLoop, step_tokens: int, gather_ms: float = 0.0):
        if prefill.runner is not decode.runner:
            raise ValueError("a colocated loop needs one runner for prefill and decode")
        self.prefill = prefill
        self.decode = decode
        self.runner = decode.runner
        self.step_tokens = step_tokens
        self.inbox: queue.Queue = queue.Queue()
        prefill.inbox = decode.inbox = self.inbox  # submit() and add() land here
        # first tokens of the prompts the decode side takes go to Redis with its next step
        prefill.ride_along = lambda items, moves, then: decode.writes.ride_along(RideAlong(items, moves, then))
        prefill.written = lambda rid, moved: decode.first_written(rid, moved)
        self.pending: list[Job] = []
        self.gather_s = gather_ms / 1000
        self._coming = False  # the latest batch taken said more was coming (PrefillBatch.more_coming)

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.decode.busy)

    def start(self, thread: ModelThread | None = None) -> None:
        super().start(thread)
        self.prefill._done = self.decode._done = self._done  # the halves live and die with this loop

    def stop(self) -> None:
        self.prefill._stopping = self.decode._stopping = True
        super().stop()

    def _wait_s(self) -> float | None:
        """How long the next take may block: not at all while prompts are pending or sequences
        run; while sequences wait to be admitted (a hand-off this thread took after its pass),
        what the strategy hints; with nothing at all, until an item comes (or IDLE_BEAT_S)."""
        d = self.decode
        if self.pending or d.running:
            return 0
        return d._idle_timeout()

    def _run(self) -> None:
        d = self.decode
        try:
            while True:
                try:
                    idle = not (self.pending or d.running or d.waiting)
                    if not take(self.inbox, self._wait_s(), self._take):
                        break
                    if idle and self.pending and not self._gather():
                        break
                    d._drop_ended()
                    self._step()
                except Exception as exc:
                    if redisconn.unavailable(exc):
                        raise  # Redis stayed unreachable past the client's window: the process goes down
                    log.exception("colocated step failed; requeueing its sequences")
                    self._fail_all(f"step failed: {exc}")
                self.liveness.beat()
        except BaseException:
            self._answer_pending("prefill worker lost its model loop")
            raise
        self._shutdown()

    def _gather(self) -> bool:
        """The first pass after idling waits, at most gather_s, while the scheduler says more
        batches are coming and the prompts taken do not fill the pass: a burst then starts with
        a full pass instead of its first prompt alone, which would run while the rest arrive
        (their arrival takes the cores meanwhile) and leave one pass more. -> False at stop."""
        end = time.monotonic() + self.gather_s
        while self._coming and sum(len(j.item.spec.prompt_token_ids) for j in self.pending) < self.step_tokens:
            left = end - time.monotonic()
            if left <= 0:
                break
            self._coming = False  # until a batch taken now says otherwise
            if not take(self.inbox, left, self._take):
                return False
        return True

    def _take(self, item: object) -> None:
        if isinstance(item, Job):
            self._coming = item.more_coming
            self.pending.append(item)
        else:
            self.decode._arrive(item)

    def _step(self) -> None:
        """One forward: every running sequence's decode row (the decode core's plan), then
        prompt chunks in the budget left."""
        d, p = self.decode, self.prefill
        started = time.perf_counter()
        plan = d.schedule() if d.core.has_unfinished() else CorePlan()
        rows = plan.items()[1]
        prompts = CorePlan()
        if self.pending:
            self.pending, prompts = p.plan(self.pending, max(1, self.step_tokens - len(rows)))
        chunks, last = prompts.items()  # (a prompt with one token left runs as a one-token row)
        if not chunks and not last and not rows:
            d._give_back_preempted()
            return
        logits = self.runner.step(chunks, last + rows)
        if d.step_delay_s:  # fault injection: a slow worker
            time.sleep(d.step_delay_s)
        n = len(chunks) + len(last)
        if n:
            self.pending = p.finish(self.pending, prompts, logits[:n], started)
        if rows:
            d.after(plan, logits[n:], started)
        else:
            d._give_back_preempted()
            d.writes.flush_riders()  # no step to ride along with: the first tokens go alone (read after the next pass)

    def _answer_pending(self, error: str) -> None:
        for job in self.pending:
            self.prefill._end(job, Outcome("error", error=error))
        self.pending = []

    def _fail_all(self, why: str) -> None:
        self._answer_pending(f"prefill failed: {why}")
        self.decode._requeue_all(f"decode {why}")

    def _shutdown(self) -> None:
        self._answer_pending("prefill worker shutting down")
        self.decode._shutdown()
