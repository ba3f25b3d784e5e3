"""CUDA graphs of decode-only steps: one kernel-launch replay instead of hundreds of launches.

On a GPU a decode step of a small or mid-size model is bound by launching its kernels from Python
(tens per layer), not by the GPU. `DecodeGraphs` captures the decode forward once per shape and
replays it. Shapes are bucketed: the batch is padded up to a `BATCH_BUCKETS` size and the block
tables up to a power-of-two width. Padding rows are harmless: they feed token 0 at position 0,
write their K/V into the pool's scratch block (which no sequence is ever given) and read only it.

The captured function, `forward`, is the eager gather path of `pdq.engine.attention` with its
mask computed from the lengths inside the graph; with `capture=False` it runs eagerly, padded
the same way, which is how the CPU tests check that padding changes no real row's logits.
"""

import logging

import numpy as np

import torch

from pdq.engine.attention import AttnMetadata, decode_mask, kv_rows

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_WIDTH = 8  # blocks: the narrowest table bucket
log = logging.getLogger("pdq.engine")


def bucket(n: int, sizes) -> int | None:
    """The smallest size >= n, or None when n exceeds them all."""
    return next((s for s in sizes if s >= n), None)


def width_buckets(max_width: int) -> tuple[int, ...]:
    """Powers of two from MIN_WIDTH, ending at max_width (blocks of the longest sequence)."""
    sizes, w = [], MIN_WIDTH
    while w < max_width:
        sizes.append(w)
        w *= 2
    return (*sizes, max_width)


class _Graph:
    def __init__(self, graph, inputs: tuple[torch.Tensor, ...], out: torch.Tensor):
        self.graph, self.inputs, self.out = graph, inputs, out


class DecodeGraphs:
    """Decode-only forwards of `model` over `kv` at bucketed shapes, captured on first use (or
    ahead, by `capture_all`). `run` returns the logits of the real rows, or None when the step's
    shape is beyond the largest bucket (the caller runs it eagerly)."""

    def __init__(self, model, kv: torch.Tensor, *, num_kv_heads: int, block_size: int, scratch_block: int,
                 max_width: int, max_batch: int = BATCH_BUCKETS[-1], capture: bool = True):
        self.model, self.kv = model, kv
        self.block_size, self.scratch = block_size, scratch_block
        self.batches = tuple(b for b in BATCH_BUCKETS if b <= max(1, max_batch)) or (1,)
        self.widths = width_buckets(max_width)
        self.capture = capture
        dev = kv.device
        self._heads = torch.arange(num_kv_heads, device=dev)
        self._keys = torch.arange(max_width * block_size, device=dev)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None
        self.runs = 0  # steps served at a bucketed shape

    def forward(self, ids, positions, rows, tables, lens) -> torch.Tensor:
        """The decode forward of a fixed shape: ids, positions, rows (pool row of each token's
        K/V: block * block_size + offset) long [B]; tables int32 [B, W]; lens int32 [B]."""
        bs = self.block_size
        meta = AttnMetadata(positions=positions, kv_rows=kv_rows(rows, self._heads, bs), chunks=[], num_prefill_tokens=0,
                            num_decode=ids.shape[0], decode_tables=tables, decode_lens=lens,
                            decode_mask=decode_mask(self._keys[: tables.shape[1] * bs], lens, self.kv.dtype))
        return self.model(ids, meta, self.kv, slice(None))

    def _inputs(self, b: int, w: int) -> tuple[torch.Tensor, ...]:
        dev, s = self.kv.device, self.scratch
        return (torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev),
                torch.full((b,), s * self.block_size, dtype=torch.long, device=dev),
                torch.full((b, w), s, dtype=torch.int32, device=dev), torch.ones(b, dtype=torch.int32, device=dev))

    def _capture(self, b: int, w: int) -> _Graph:
        inputs = self._inputs(b, w)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.kv.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the first run initializes libraries outside the capture
            self.forward(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.forward(*inputs)
        return _Graph(graph, inputs, out)

    @torch.inference_mode()
    def capture_all(self, max_batch: int) -> int:
        """Capture every bucket up to `max_batch` rows, largest first (the smaller ones reuse
        its memory). -> graphs held."""
        if self.capture:
            top = bucket(min(max(1, max_batch), self.batches[-1]), self.batches)
            for b in sorted((b for b in self.batches if b <= top), reverse=True):
                for w in reversed(self.widths):
                    if (b, w) not in self._graphs:
                        try:
                            self._graphs[(b, w)] = self._capture(b, w)
                        except RuntimeError as exc:
                            log.warning("CUDA graphs of decode batches of %d and more not captured (%s): "
                                        "they run eagerly", b, exc)
                            self.batches = tuple(x for x in self.batches if x < b)
                            break
        return len(self._graphs)

    def run(self, tokens: list[int], positions: list[int], rows: list[int], tables: np.ndarray) -> torch.Tensor | None:
        """Logits [len(tokens), vocab] of one decode step, or None if its shape has no bucket.
        tables: int32 [len(tokens), width], each row's block table then valid blocks of no
        meaning (`BlockManager.table_rows`: the mask hides what lies past a row's length)."""
        n, width = tables.shape
        b, w = bucket(n, self.batches), bucket(width, self.widths)
        if b is None or w is None:
            return None
        pad, s = b - n, self.scratch
        padded = np.full((b, w), s, dtype=np.int32)
        padded[:n, :width] = tables
        host = (torch.tensor(tokens + [0] * pad), torch.tensor(positions + [0] * pad),
                torch.tensor(rows + [s * self.block_size] * pad), torch.from_numpy(padded),
                torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32))
        self.runs += 1
        if not self.capture:
            return self.forward(*(h.to(self.kv.device) for h in host))[:n]
        graph = self._graphs.get((b, w))
        if graph is None:
            try:
                graph = self._graphs[(b, w)] = self._capture(b, w)
            except RuntimeError as exc:  # e.g. out of memory: this shape runs eagerly from now on
                log.warning("CUDA graph of a %d x %d-block decode step not captured (%s): runs eagerly", b, w, exc)
                self.batches = tuple(x for x in self.batches if x < b)
                return None
        for dst, src in zip(graph.inputs, host):
            dst.copy_(src, non_blocking=True)
        graph.graph.replay()
        return graph.out[:n].clone()
