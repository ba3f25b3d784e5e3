"""A colocated worker's model loop (a thread): prefill and decode in one forward per step.

A colocated worker (`python -m decode_worker --colocate true`) serves both worker roles in one
process over one `ModelRunner`: one model, one KV pool, one thread running the model. Each step
runs every running sequence's decode row and, in the rest of the token budget
(`--step-tokens`), the next prompt chunks of the prefill jobs, in one forward pass, as the
in-process engine does. A prompt whose decode worker is this process keeps its K/V where it is
(`prefill_worker.loop.Outcome` "local"), so the hand-off moves no bytes.

The two halves stay what they are alone (`PrefillLoop` plans chunks and samples first tokens,
`DecodeLoop` admits, samples and streams); this loop only feeds them from one inbox and runs the
forward pass they share. On a machine that two separate workers would share, this avoids two
processes fighting for the same cores and runs the decode rows inside the prompt passes.
"""

import logging
import queue
import time

from decode_worker.loop import DecodeLoop, take
from pdq.worker import ModelLoop
from prefill_worker.loop import Job, Outcome, PrefillLoop

log = logging.getLogger("pdq.colocated")


class ColocatedLoop(ModelLoop):
    thread_name = "colocated-loop"

    def __init__(self, prefill: PrefillLoop, decode: DecodeLoop, step_tokens: int):
        if prefill.runner is not decode.runner:
            raise ValueError("a colocated loop needs one runner for prefill and decode")
        self.prefill = prefill
        self.decode = decode
        self.runner = decode.runner
        self.step_tokens = step_tokens
        self.inbox: queue.Queue = queue.Queue()
        prefill.inbox = decode.inbox = self.inbox  # submit() and add() land here
        self.pending: list[Job] = []

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.decode.busy)

    def _run(self) -> None:
        d = self.decode
        while True:
            if not take(self.inbox, 0 if self.pending or d.running else d._idle_timeout(), self._take):
                self._shutdown()
                return
            try:
                d._drop_ended()
                d._admit()
                self._step()
            except Exception as exc:
                log.exception("colocated step failed; requeueing its sequences")
                self._fail_all(f"step failed: {exc}")

    def _take(self, item: object) -> None:
        if isinstance(item, Job):
            self.pending.append(item)
        else:
            self.decode._arrive(item)

    def _step(self) -> None:
        """One forward: every running sequence's decode row, then prompt chunks in the budget left."""
        d, p = self.decode, self.prefill
        started = time.perf_counter()
        seqs, rows = d.rows() if d.running else ([], [])
        live, chunks, jobs = [], [], []
        if self.pending:
            live, chunks, jobs = p.plan(self.pending, max(1, self.step_tokens - len(rows)))
            self.pending = live
        if not chunks and not rows:
            return
        logits = self.runner.step(chunks, rows)
        if d.step_delay_s:  # fault injection: a slow worker
            time.sleep(d.step_delay_s)
        if chunks:
            self.pending = p.finish(live, chunks, jobs, logits[:len(chunks)], started)
        if rows:
            d.after(seqs, logits[len(chunks):], started)

    def _fail_all(self, why: str) -> None:
        for job in self.pending:
            self.prefill._end(job, Outcome("error", error=f"prefill failed: {why}"))
        self.pending = []
        self.decode._requeue_all(f"decode {why}")

    def _shutdown(self) -> None:
        for job in self.pending:
            self.prefill._end(job, Outcome("error", error="prefill worker shutting down"))
        self.pending = []
        self.decode._shutdown()
