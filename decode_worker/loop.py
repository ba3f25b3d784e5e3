"""The decode model loop (a thread): iteration-level continuous batching.

Every step runs all running sequences in one forward pass. A sequence joins at the first step
after its KV cache arrives and leaves at the step it finishes, is cancelled or times out; its
KV slot is freed the same step. Each step's tokens (and ends) go to Redis in one round trip.
"""

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdq.convert import sampling_from_pb
from pdq.engine.sampling import SamplingParams, sample
from pdq.kv_transfer import ReceivedKV
from pdq.output_text import TextOutput
from pdq.request import State
from pdq.store import RequestStore, StepItem, now_ms
from pdq.worker import CancelListener

log = logging.getLogger("pdq.decode")

MAX_ATTEMPTS = 3


@dataclass
class Sequence:
    rid: str
    epoch: int
    prompt_len: int
    params: SamplingParams
    text: TextOutput
    generated: list[int]
    deadline_ms: int

    @property
    def position(self) -> int:
        """Position of the last generated token, the one fed to the next step."""
        return self.prompt_len + len(self.generated) - 1


class DecodeLoop:
    def __init__(self, runner: Any, store: RequestStore, cancels: CancelListener, tokenizer: Any,
                 eos_ids: list[int], worker_address: str, on_leave: Callable[[str], None]):
        self.runner = runner
        self.store = store
        self.cancels = cancels
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.address = worker_address
        self.on_leave = on_leave  # called from this thread when a sequence leaves (frees its hold)
        self.inbox: queue.Queue[ReceivedKV | None] = queue.Queue()
        self.running: dict[str, Sequence] = {}
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    def add(self, kv: ReceivedKV) -> None:
        self.inbox.put(kv)

    def stop(self) -> None:
        self.inbox.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                got = self.inbox.get(block=not self.running)
                while True:
                    if got is None:
                        self._shutdown()
                        return
                    self._join(got)
                    got = self.inbox.get_nowait()
            except queue.Empty:
                pass
            if not self.running:
                continue
            try:
                self._step()
            except Exception:
                log.exception("decode step failed; requeueing the running sequences")
                self._requeue_all("decode step failed")

    def _join(self, kv: ReceivedKV) -> None:
        h = kv.header
        rid = h.spec.request_id
        try:
            self.runner.allocate(rid)
            for layer, (k, v) in enumerate(kv.layers):
                self.runner.import_kv(rid, layer, k, v)
        except Exception as exc:
            log.error("cannot take KV of %s: %s", rid, exc)
            self.runner.free(rid)
            self.store.finish(rid, State.FAILED, "error", f"decode worker could not load KV: {exc}", epoch=h.epoch)
            self.on_leave(rid)
            return
        params = sampling_from_pb(h.spec.sampling)
        prompt = list(h.spec.prompt_token_ids)
        generated = list(h.generated_token_ids)
        seq = Sequence(rid, h.epoch, len(prompt), params, TextOutput(self.tokenizer, params.stop, prompt, generated),
                       generated, h.spec.deadline_ms)
        if not self.store.transition(rid, h.epoch, State.DECODING, decode_worker=self.address):
            self._leave(seq)  # ended while in transit
            return
        self.running[rid] = seq

    def _leave(self, seq: Sequence) -> None:
        self.running.pop(seq.rid, None)
        self.runner.free(seq.rid)
        self.on_leave(seq.rid)

    def _step(self) -> None:
        now = now_ms()
        ended: list[StepItem] = []
        for seq in list(self.running.values()):
            if self.cancels.pop(seq.rid):
                self._leave(seq)
            elif seq.deadline_ms and now >= seq.deadline_ms:
                ended.append(StepItem(seq.rid, seq.epoch, final_state=State.TIMED_OUT, finish_reason="timeout"))
                self._leave(seq)
        if ended:
            self.store.step(ended)
        if not self.running:
            return
        seqs = list(self.running.values())
        logits = self.runner.decode([(s.rid, s.generated[-1], s.position) for s in seqs])
        tokens = sample(logits, [s.params for s in seqs], [len(s.generated) for s in seqs])
        self.steps += 1
        items, leaving = [], []
        for seq, token in zip(seqs, tokens):
            index = len(seq.generated)
            seq.generated.append(token)
            delta, stopped = seq.text.add(token)
            reason = ("stop" if stopped
                      else "eos" if token in self.eos_ids and not seq.params.ignore_eos
                      else "length" if len(seq.generated) >= seq.params.max_tokens
                      or seq.position + 1 >= self.runner.max_seq_len else "")
            if reason and reason != "stop":
                delta += seq.text.flush()
            items.append(StepItem(seq.rid, seq.epoch, index, token, delta,
                                  State.COMPLETED if reason else None, reason))
            if reason:
                leaving.append(seq)
        kept = self.store.step(items)
        for seq, ok in zip(seqs, kept):
            if not ok and seq.rid in self.running:
                leaving.append(seq)
        for seq in leaving:
            if seq.rid in self.running:
                self._leave(seq)

    def _shutdown(self) -> None:
        self._requeue_all("decode worker shut down")

    def _requeue_all(self, why: str) -> None:
        """Gives every running sequence back to the scheduler. A new attempt regenerates the same
        tokens (seeded per index) and Redis drops the indices already streamed."""
        for seq in list(self.running.values()):
            self.store.requeue(seq.rid, seq.epoch, why, MAX_ATTEMPTS)
            self._leave(seq)
