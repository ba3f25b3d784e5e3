"""The references the service is measured against, run in this process on the same requests.

- `engine`: pdq's own `LLMEngine`, the engine core (`pdq.engine.core`) with a sampler (the same
  model runtime, KV pool and batching strategies as the workers, with no RPC, no Redis, no KV
  hand-off). It honours every arrival pattern: a request
  joins at the first step after it is due. A token's time is the end of the step that made it.
- `hf`: naive `transformers` `generate()`: requests in order, in static batches of 8, left
  padded, greedy, every batch run to its longest request (as a naive server does). Arrivals
  are always all at once. A token's time is when `generate()` produced it (seen by a stopping
  criterion); a request ends when its batch's `generate()` returns, as a naive server answers.
  Only each request's own `max_tokens` count as output: padding and the tokens generated past
  a request's length are waste.

Both run on the CPU threads torch gives this process (`torch.get_num_threads()`); the CPU time
this process spends in a run is the baseline's own (`client_cpu_s` of its record). During a
run their threads are pinned one per CPU when a worker's would be (`pdq.ops.cpu.pin_torch_threads`:
as many threads as CPUs), and unpinned after, so that the clients of a service run that
follows in this process run anywhere.

OpenMP wait policy: the same as the workers `pdq up` starts: unless OMP_WAIT_POLICY or
GOMP_SPINCOUNT is set, torch is loaded here with GOMP_SPINCOUNT=pdq.ops.up.OMP_SPIN_COUNT (set
only for the import: libgomp reads it when it loads, and clusters spawned later get theirs
from `pdq up`), so both sides of a ratio run alike: under another policy a baseline would
measure the policy too (under PASSIVE, where idle threads sleep at once, the engine runs
markedly slower than when they spin, which would flatter the service's ratio to it).
"""

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pdq.bench.arrivals import Arrivals
from pdq.bench.prefix import counts
from pdq.bench.record import RequestRecord, RunRecord
from pdq.bench.workload import BenchRequest, Workload
from pdq.ops.memory import DEFAULT_HEAP_RESERVE_MB, reserve_heap

ENGINE_KV_BUDGET_TOKENS = 65536  # = the decode worker's default pool
ENGINE_MAX_SEQ_LEN = 2048  # = the workers' default max_seq_len
HF_BATCH_SIZE = 8
WARM_DECODE_ROWS = 64  # = the decode worker's default max_batch_size

Progress = Callable[[RequestRecord], None]


_omp_policy = ""  # the OpenMP policy torch was loaded with by import_torch()


def import_torch() -> str:
    """Imports torch (see the module doc); returns the OpenMP wait policy in force. This
    process keeps its freed memory from then on, as a worker does (pdq.ops.memory), for every
    baseline alike."""
    global _omp_policy
    from pdq.ops.memory import keep_freed_memory
    from pdq.ops.up import OMP_SPIN_COUNT

    keep_freed_memory()
    if "torch" in sys.modules:
        return _omp_policy or "as loaded before (unknown)"
    given = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    if not given:
        os.environ["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT
    try:
        import torch  # noqa: F401
    finally:
        if not given:
            del os.environ["GOMP_SPINCOUNT"]
    _omp_policy = " ".join(f"{k}={v}" for k, v in given.items()) or f"GOMP_SPINCOUNT={OMP_SPIN_COUNT}"
    return _omp_policy


@contextmanager
def pinned_threads() -> Iterator[bool]:
    """Pins this thread and torch's threads one per CPU, as a worker that owns the machine does
    (pdq.ops.cpu), for the block. -> whether they were pinned."""
    from pdq.ops.cpu import pin_torch_threads, unpin

    pinned = pin_torch_threads()
    try:
        yield bool(pinned.threads)
    finally:
        unpin(pinned)


def _warm_up_requests(workload: Workload) -> Workload:
    first = workload.requests[0].prompt_token_ids[:1]
    return Workload("warm-up", 0, tuple(BenchRequest(i, first * 16, 4) for i in range(2)))


class EngineBaseline:
    """The in-process engine; the model loads once and serves every run."""

    name = "engine"

    def __init__(self, model_dir: str | Path, kv_budget_tokens: int = ENGINE_KV_BUDGET_TOKENS,
                 max_seq_len: int = ENGINE_MAX_SEQ_LEN, dtype: str | None = None):
        self.omp_wait_policy = import_torch()
        from pdq.engine import LLMEngine
        from pdq.engine.runner import torch_dtype

        self.engine = LLMEngine.from_pretrained(str(model_dir), kv_budget_tokens=kv_budget_tokens,
                                                max_seq_len=max_seq_len, dtype=torch_dtype(dtype))
        p = self.engine.policy
        # as a worker does at start-up (a decode worker: its max_batch_size, 64 by default, of GEMM row counts)
        self.engine.runner.warm_up(p.max_batched_tokens, p.prefill_chunk, min(p.max_num_seqs, WARM_DECODE_ROWS))
        reserve_heap(DEFAULT_HEAP_RESERVE_MB << 20)  # as a worker does: its first run takes no page faults

    def notes(self) -> dict:
        p = self.engine.policy
        from pdq.engine.runner import dtype_name

        return {"engine": {"dtype": dtype_name(self.engine.runner.dtype),
                           "max_batched_tokens": p.max_batched_tokens, "prefill_chunk": p.prefill_chunk,
                           "max_num_seqs": p.max_num_seqs, "omp_wait_policy": self.omp_wait_policy,
                           "heap_reserve_mb": DEFAULT_HEAP_RESERVE_MB}}

    def run(self, workload: Workload, arrivals: Arrivals, on_done: Progress | None = None,
            warm_up: bool = True) -> RunRecord:
        blocks = self.engine.runner.pool.blocks
        with pinned_threads() as pinned:
            if warm_up:
                self._run(_warm_up_requests(workload), Arrivals())
            queried, hit = blocks.queried_tokens, blocks.hit_tokens
            record = self._run(workload, arrivals, on_done)
        record.notes["engine"]["pinned"] = pinned
        record.notes["prefix_cache"] = counts(blocks.queried_tokens - queried, blocks.hit_tokens - hit)
        return record

    def _run(self, workload: Workload, arrivals: Arrivals, on_done: Progress | None = None) -> RunRecord:
        from pdq.engine import SamplingParams

        engine = self.engine
        reqs = workload.requests
        offsets = arrivals.offsets(len(reqs))
        records: list[RequestRecord | None] = [None] * len(reqs)
        by_seq: dict[int, RequestRecord] = {}
        clock = time.perf_counter
        cpu0 = time.process_time()
        t0 = clock()
        sent = 0

        def add(i: int, due: float) -> None:
            r = reqs[i]
            seq_id = engine.add_request(list(r.prompt_token_ids),
                                        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
            by_seq[seq_id] = records[i] = RequestRecord(r, due)

        while sent < len(reqs) or engine.has_unfinished():
            now = clock() - t0
            if offsets is None:
                while sent < len(reqs) and len(by_seq) < arrivals.concurrency:
                    add(sent, now)
                    sent += 1
            else:
                while sent < len(reqs) and offsets[sent] <= now:
                    add(sent, offsets[sent])
                    sent += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, offsets[sent] - now))
                continue
            completions = engine.step()
            now = clock() - t0
            for seq in engine.running.values():
                times = by_seq[seq.seq_id].token_times
                times.extend([now] * (len(seq.output) - len(times)))
            for c in completions:
                rec = by_seq.pop(c.seq_id)
                rec.token_times.extend([now] * (len(c.token_ids) - len(rec.token_times)))
                rec.end, rec.finish_reason = now, c.finish_reason
                if on_done:
                    on_done(rec)
        return RunRecord(self.name, self.name, workload, arrivals, list(records),
                         client_cpu_s=time.process_time() - cpu0, server_cpu_s={}, notes=self.notes())


class HFBaseline:
    """Naive `transformers` `generate()` in static, left-padded batches."""

    name = "hf"

    def __init__(self, model_dir: str | Path, batch_size: int = HF_BATCH_SIZE, dtype: str | None = None):
        import json

        self.omp_wait_policy = import_torch()
        from pdq.model.loader import load_hf_model

        self.model = load_hf_model(model_dir, dtype=dtype)  # None: float32
        self.batch_size = batch_size
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.pad_id = config.get("pad_token_id")
        if self.pad_id is None:
            self.pad_id = 0

    def run(self, workload: Workload, on_done: Progress | None = None, warm_up: bool = True) -> RunRecord:
        with pinned_threads() as pinned:
            if warm_up:
                self._run(_warm_up_requests(workload))
            record = self._run(workload, on_done)
        record.notes["hf"]["pinned"] = pinned
        return record

    def _run(self, workload: Workload, on_done: Progress | None = None) -> RunRecord:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        clock = time.perf_counter
        cpu0 = time.process_time()
        t0 = clock()

        class StepTimes(StoppingCriteria):
            """Never stops; notes when each generated token (column) exists."""

            def __init__(self):
                self.times: list[float] = []

            def __call__(self, input_ids, scores, **kwargs):
                self.times.append(clock() - t0)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        reqs = workload.requests
        records = [RequestRecord(r, 0.0) for r in reqs]
        with torch.inference_mode():
            for start in range(0, len(reqs), self.batch_size):
                batch = reqs[start:start + self.batch_size]
                width = max(r.prompt_len for r in batch)
                ids = torch.tensor([[self.pad_id] * (width - r.prompt_len) + list(r.prompt_token_ids) for r in batch])
                mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch])
                n = max(r.max_tokens for r in batch)
                steps = StepTimes()
                out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                          min_new_tokens=n, pad_token_id=self.pad_id,
                                          stopping_criteria=StoppingCriteriaList([steps]))
                end = clock() - t0
                if out.shape[1] - width != n or len(steps.times) != n:
                    raise RuntimeError(f"hf generate() made {out.shape[1] - width} tokens ({len(steps.times)} steps), "
                                       f"expected {n}")
                for rec in records[start:start + self.batch_size]:
                    rec.token_times = steps.times[:rec.request.max_tokens]
                    rec.end, rec.finish_reason = end, "length"
                    if on_done:
                        on_done(rec)
        notes = {"hf": {"batch_size": self.batch_size, "padding": "left", "decoding": "greedy",
                        "omp_wait_policy": self.omp_wait_policy}}
        return RunRecord(self.name, self.name, workload, Arrivals(), records, client_cpu_s=time.process_time() - cpu0,
                         server_cpu_s={}, notes=notes)
