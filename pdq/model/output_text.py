"""One completion's text as it grows, with stop strings: what may be streamed now.

Holds back text that might still become a stop string (and incomplete UTF-8), so a streamed
delta is never taken back. Before `min_tokens` tokens no stop string ends it, and one that
starts in the text of those tokens never does (vLLM's rule). Pure: tokenizer in, strings out.
"""

from pdq.model.detokenizer import IncrementalDetokenizer, StopChecker


class TextOutput:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), prompt_ids: list[int] | None = None,
                 generated: list[int] | tuple[int, ...] = (), min_tokens: int = 0):
        self.detok = IncrementalDetokenizer(tokenizer, list(prompt_ids or []))
        self.stop = list(stop)
        self.checker = StopChecker(self.stop) if self.stop else None
        self.emitted = 0  # characters of detok.text already streamed
        self.stopped = False
        self.min_tokens = min_tokens
        self.tokens = 0  # tokens added
        for token in generated:  # replay tokens already streamed by an earlier hop
            self.add(token)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Adds a token. -> (text to stream now, whether a stop string ended the completion)."""
        delta = self.detok.add(token_id)
        self.tokens += 1
        if self.checker is None:  # no stop strings: the detokenizer's delta is all of the new text
            self.emitted += len(delta)
            return delta, False
        text = self.detok.text
        if self.tokens < self.min_tokens:
            self.checker.skip(text)  # no stop string yet, nor later one that starts in this text
            return self._emit(text, len(text)), False
        stopped, truncated = self.checker.check(text)
        if stopped:
            self.stopped = True
            return self._emit(truncated, len(truncated)), True
        return self._emit(text, self.checker.safe_len(text)), False

    def flush(self) -> str:
        """The held-back rest (incomplete bytes as U+FFFD), when the completion ends for a
        reason other than a stop string."""
        self.detok.flush()
        return self._emit(self.detok.text, len(self.detok.text))

    def _emit(self, text: str, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = text[self.emitted:upto]
        self.emitted = upto
        return delta
