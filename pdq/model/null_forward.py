"""The null model's forward pass (`pdq.model.null`): `LlamaModel.forward`'s call, no compute."""

import time

import torch

from pdq.model.null import FIRST_TOKEN


class NullForward:
    """Called as `LlamaModel` is: (input_ids [T], meta, kv pool, logit_rows) -> float logits
    [len(logit_rows), vocab]. Each chosen row's logits are 0 at `pdq.model.null.next_token` of its
    token and position and -1e4 elsewhere, so any sampling picks that token; the pool is not
    written. Sleeps `step_s` first (the GIL released), standing in for the model's compute.

    Build it in the thread that runs the model: it sets that thread's torch to one thread. A
    null step's tensors (the logits, the sampler's argmax over them) are a few hundred KB, which
    torch splits over its threads, and waking them costs more than the work (~0.5 ms a step at
    32 rows on 2 busy cores, against ~0.1 ms on one thread)."""

    def __init__(self, vocab_size: int, step_s: float, device: torch.device):
        torch.set_num_threads(1)
        self.vocab_size = vocab_size
        self.step_s = step_s
        self.device = device

    def __call__(self, input_ids: torch.Tensor, meta, kv: torch.Tensor, logit_rows) -> torch.Tensor:
        if self.step_s > 0:
            time.sleep(self.step_s)
        tokens, positions = input_ids[logit_rows], meta.positions[logit_rows]
        chosen = FIRST_TOKEN + (tokens * 31 + positions * 17) % (self.vocab_size - FIRST_TOKEN)
        logits = torch.full((len(chosen), self.vocab_size), -1e4, dtype=torch.float32, device=self.device)
        return logits.scatter_(1, chosen[:, None], 0.0)
