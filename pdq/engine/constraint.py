"""Structured output in the workers: a request's output kept inside its grammar (`pdq.model.grammar`)
by masking, at every step, the tokens that would leave it (llguidance's matcher).

The prefill worker samples the first token under the constraint, the decode worker the rest: it
replays the tokens generated so far into a fresh matcher (`Grammars.matcher`), so a migrated or
resumed sequence goes on where it was.
"""

import torch

from pdq.model.grammar import grammar


class Grammars:
    """A worker's side: its tokenizer as llguidance sees it, and the masks of a step's rows.
    `runner`: the model's (its vocabulary size), read when the first constrained request comes."""

    def __init__(self, tokenizer, runner, eos_ids):
        self._source, self._runner, self._eos = tokenizer, runner, sorted(eos_ids)
        self._tokenizer = None  # llguidance's view of it, built by the first constrained request

    @property
    def vocab_size(self) -> int:
        return self._runner.vocab_size

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import PreTrainedTokenizerFast

            self._tokenizer = llguidance.hf.from_tokenizer(PreTrainedTokenizerFast(tokenizer_object=self._source),
                                                           n_vocab=self.vocab_size,
                                                           eos_token=self._eos[0] if self._eos else None)
        return self._tokenizer

    def matcher(self, params, generated=()):
        """A matcher for `params`' constraint with `generated` consumed, or None (no constraint).
        Raises ValueError when the grammar does not compile or the tokens leave it."""
        import llguidance

        if not (params.json_schema or params.regex):
            return None
        m = llguidance.LLMatcher(self.tokenizer, grammar(params.json_schema, params.regex))
        if m.is_error():
            raise ValueError(f"the output constraint does not compile: {m.get_error()}")
        if generated and not m.consume_tokens(list(generated)):
            raise ValueError(f"the tokens so far leave the output constraint: {m.get_error()}")
        return m

    def mask(self, logits: torch.Tensor, matchers) -> torch.Tensor:
        """`logits` with each constrained row's disallowed tokens at -inf (a copy if any).

        The matchers fill llguidance's bitmask (a bit per token, 32 to an int32) in NumPy and the
        bits are unpacked with plain torch ops: `llguidance.torch` applies them with a function
        under `torch.compile`, whose import and first compilation (inductor, a C++ build on CPU)
        took seconds in each worker, in the model thread, on the first constrained request:
        every sequence of that worker waited."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        import llguidance.numpy

        vocab = self.vocab_size
        bits = llguidance.numpy.allocate_token_bitmask(len(rows), vocab)
        for j, i in enumerate(rows):
            llguidance.numpy.fill_next_token_bitmask(matchers[i], bits, j)
        allowed = unpack_bits(torch.from_numpy(bits), vocab).to(logits.device)
        out = logits.float().clone()
        index = torch.tensor(rows, device=logits.device)
        sub = out.index_select(0, index)
        sub[:, :vocab].masked_fill_(~allowed, float("-inf"))
        sub[:, vocab:] = float("-inf")  # columns past the tokenizer's vocabulary: never
        out.index_copy_(0, index, sub)
        return out


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """llguidance's token bitmask (rows of int32 words, token t at bit t % 32 of word t // 32)
    -> a bool tensor of `n` columns, True where the token is allowed."""
    return ((bits.unsqueeze(-1) >> _SHIFTS) & 1).view(bits.shape[0], -1)[:, :n].bool()


def advance(matcher, token: int) -> bool:
    """Feeds the sampled token to the matcher. -> True when the constraint is now complete (the
    output ends here), False while it goes on."""
    if matcher is None:
        return False
    matcher.consume_token(token)
    return matcher.is_stopped()
