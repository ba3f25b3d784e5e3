"""The machine's matrix-multiply roofline for a workload: how fast its tokens could come if a
forward pass were its matrix multiplies alone, measured here, now, in the same invocation.

The workload runs as an ideal continuous batcher would run it, every request arriving at once:
prompts in passes of `step_tokens` rows, then one decode step per output position with every
sequence still running as a row. A pass costs the model's linear layers at its row count
(q|k|v, o, gate|up, down per layer, the LM head on the rows that sample), timed with the
runtime's own fastest GEMM path (`pdq.engine.layers.Linear`, prepacked on CPU) on weights of the
model's shapes, plus attention's two matrix multiplies per layer (scores and values, batched
matmuls): each prompt over itself, each decode step's rows over as many keys as the step's
sequences hold (every row over their mean context: the real step's work and bytes). Each layer
reads keys and values of its own, as the model's layers do: one tensor reread by every layer
would time the cache, not memory. Norms, rotary, softmax, sampling and everything else count as
free, so no server beats the roofline as a whole (its attention part is torch's batched matmul,
which pdq's own paged decode kernel outruns on CPU: a bound for the linear layers, a yardstick
for attention); a run's efficiency is its tokens/s over the roofline's. On a GPU each pass is
timed as a CUDA graph replay, so that kernel launches, free on the roofline too, do not bound it.
"""

import logging
import time
from collections import Counter
from dataclasses import dataclass

from pdq.bench.workload import Workload

log = logging.getLogger("pdq.bench")


@dataclass(frozen=True)
class Roofline:
    seconds: float  # the workload's matrix multiplies alone
    output_tokens: int
    passes: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"seconds": round(self.seconds, 3), "output_tokens_per_s": round(self.output_tokens_per_s, 1),
                "passes": self.passes}


def passes(workload: Workload, step_tokens: int) -> Counter:
    """(rows, sampled rows) -> how many passes of that shape the ideal batcher runs."""
    out: Counter = Counter()
    full, rest = divmod(workload.prompt_tokens, step_tokens)
    # a prompt samples its first token in the pass that holds its last row: at most one per prompt
    sampled, n = len(workload.requests), full + (1 if rest else 0)
    for i in range(n):
        rows = step_tokens if i < full else rest
        out[rows, min(rows, sampled // n + (i < sampled % n))] += 1
    for running, _ in decode_steps(workload):
        out[running, running] += 1
    return out


def decode_steps(workload: Workload) -> list[tuple[int, int]]:
    """(sequences running, keys they read: their contexts summed) of each decode step, every
    request started at once."""
    reqs = [(r.max_tokens - 1, r.prompt_len) for r in workload.requests]
    steps = max((left for left, _ in reqs), default=0)
    return [(sum(1 for left, _ in reqs if left > k), sum(p + 1 + k for left, p in reqs if left > k))
            for k in range(steps)]


def measure(model_dir: str, workload: Workload, *, step_tokens: int = 1024, repeats: int = 3,
            dtype: str | None = None) -> Roofline:
    """Times every pass shape of `passes` (the best of `repeats`: other load only ever slows a
    timing, and a roofline is a bound) on this machine's CPU or GPU, in `dtype` (a torch dtype's
    name; None: what the engine runs by default there, `pdq.engine.runner.default_dtype`)."""
    import torch
    from transformers import AutoConfig

    from pdq.engine.layers import Linear
    from pdq.engine.runner import default_device, default_dtype, torch_dtype
    from pdq.model.arch import ModelSpec

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
    device = default_device()
    dtype = torch_dtype(dtype) or default_dtype(device, None)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def linear(out_f: int, in_f: int) -> Linear:
        layer = Linear((torch.randn(out_f, in_f, generator=gen) * 0.02).to(device, dtype))
        layer.prepack()
        return layer

    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layers = [(linear(q + 2 * kv, h), linear(h, q), linear(2 * spec.intermediate_size, h),
               linear(h, spec.intermediate_size)) for _ in range(spec.num_layers)]
    head = linear(spec.vocab_size, h)

    @torch.inference_mode()
    def one_pass(x: torch.Tensor, x_mid: torch.Tensor, x_attn: torch.Tensor, sampled: int) -> None:
        for qkv, o, gate_up, down in layers:
            qkv(x)
            o(x_attn)
            gate_up(x)
            down(x_mid)
        head(x[:sampled])

    def timed(rows: int, sampled: int) -> float:
        x = torch.randn(rows, h, generator=gen).to(device, dtype)
        x_attn = torch.randn(rows, q, generator=gen).to(device, dtype)
        x_mid = torch.randn(rows, spec.intermediate_size, generator=gen).to(device, dtype)
        return _best_time(lambda: one_pass(x, x_mid, x_attn, sampled), repeats, device)

    group = spec.num_heads // spec.num_kv_heads
    steps = [(running, -(-keys // running)) for running, keys in decode_steps(workload)]  # (rows, mean context)
    # every layer's keys and values, as much as the largest pass reads (the workload's own KV at
    # its largest step), each pass a view of its start; one value throughout, which leaves a
    # matrix multiply's speed as it is
    most = spec.num_kv_heads * spec.head_dim * max([1, *(r.prompt_len for r in workload.requests),
                                                    *(running * keys for running, keys in steps)])
    kv = [(torch.full((most,), 0.02, dtype=dtype, device=device), torch.full((most,), 0.02, dtype=dtype, device=device))
          for _ in range(spec.num_layers)]

    @torch.inference_mode()
    def attention(batch: int, queries: int, keys: int) -> float:
        """Both matmuls of every layer: [batch * kv_heads, group * queries, hd] x keys, over
        that layer's own keys and values."""
        q_ = torch.randn(batch * spec.num_kv_heads, group * queries, spec.head_dim, generator=gen).to(device, dtype)
        rows = batch * spec.num_kv_heads
        n = rows * keys * spec.head_dim
        layers = [(k_[:n].view(rows, keys, spec.head_dim), v_[:n].view(rows, keys, spec.head_dim)) for k_, v_ in kv]

        def run() -> None:
            for k_, v_ in layers:
                torch.bmm(torch.bmm(q_, k_.transpose(1, 2)), v_)

        return _best_time(run, repeats, device)

    shapes = passes(workload, step_tokens)
    seconds = sum(count * timed(rows, sampled) for (rows, sampled), count in shapes.items())
    seconds += sum(attention(1, r.prompt_len, r.prompt_len) for r in workload.requests) / 2  # causal: half
    seconds += sum(attention(running, 1, keys) for running, keys in steps)
    return Roofline(seconds, workload.output_tokens, sum(shapes.values()))


def _best_time(fn, repeats: int, device) -> float:
    import torch

    fn()  # warm: first use of a shape
    if device.type == "cuda":
        fn = _graphed(fn)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def _graphed(fn):
    """`fn` captured as a CUDA graph: its replay times the GPU's work, not Python launching it
    (eagerly, a small model's pass is bound by the launches). Eager if it cannot be captured."""
    import torch

    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        log.warning("roofline: a pass could not be captured as a CUDA graph (%s): timed eagerly", exc)
        return fn
    return graph.replay


def efficiency(tokens_per_s: float, roof: Roofline) -> float:
    """A run's tokens/s as a share of the roofline's (0..1, or above 1 if the model is wrong)."""
    return tokens_per_s / roof.output_tokens_per_s if roof.output_tokens_per_s else 0.0
