"""Incremental detokenization and stop strings, for streaming text (no torch).

``IncrementalDetokenizer`` decodes a small window of ids (``prefix_offset``/``read_offset``,
as vLLM and TGI do) so a token that ends inside a multi-byte character yields no text until
the character is complete. A tokenizer whose decoder is byte-level alone (GPT-2 style BPE, the
built-in model's) takes a faster path: each id stands for fixed bytes (``byte_table``), fed to
an incremental UTF-8 decoder, so a token costs the same however long the window of incomplete
or invalid bytes has grown (a random model's output: the window could grow to the whole
completion). ``StopChecker`` cuts the output before the first stop string.
"""

from __future__ import annotations

import codecs
import functools

from tokenizers import Tokenizer, decoders

PROMPT_CONTEXT_TOKENS = 5  # prompt ids kept as decoding context (vLLM uses 5 too)
REPLACEMENT_CHAR = "\ufffd"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_table(tokenizer: Tokenizer, skip_special_tokens: bool = True) -> list[bytes] | None:
    """The bytes each id decodes to, when the tokenizer's decoder is ByteLevel alone, so that
    decoding ids is decoding the concatenation of their bytes as UTF-8 (invalid bytes as
    U+FFFD); None otherwise. Checked once per tokenizer against its own decode of every id;
    any difference: None (the windowed path)."""
    return _build_byte_table(tokenizer, skip_special_tokens)


@functools.lru_cache(maxsize=None)  # per tokenizer (hashed by identity; a process has one or two)
def _build_byte_table(tokenizer: Tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    table = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        piece = tokenizer.id_to_token(i)
        if piece is None or (skip_special_tokens and i in special):
            table.append(b"")
            continue
        if any(c not in to_byte for c in piece):
            return None
        table.append(bytes(to_byte[c] for c in piece))
        if table[i].decode("utf-8", "replace") != tokenizer.decode([i], skip_special_tokens=skip_special_tokens):
            return None
    return table


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    ``add(id)`` returns only new, final text: the concatenation of all deltas plus
    ``flush()`` equals ``decode(prompt_ids + generated) - decode(prompt_ids)`` (exactly, for
    byte-level tokenizers; for prompts that end on a character boundary). While the decoded
    window ends in U+FFFD (an incomplete UTF-8 sequence) its text is held back. The last
    ``PROMPT_CONTEXT_TOKENS`` prompt ids are decoding context only: they never appear in
    ``text`` but let decoders that strip a leading space (SentencePiece) get it right.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # all text emitted so far (prompt excluded)
        self._ids = list(prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:]  # ids from prefix_offset on
        self._read_offset = len(self._ids)  # ids before it have been emitted as text
        self._bytes = byte_table(tokenizer, skip_special_tokens)  # the byte-level path, when it applies
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._bytes is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self) -> str:
        prefix_text = self._decode(self._ids[: self._read_offset])
        new_text = self._decode(self._ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

    def _emit(self, delta: str) -> str:
        self._ids = self._ids[self._read_offset:]  # prefix_offset moves to read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" if held back)."""
        if self._utf8 is not None:
            table = self._bytes
            delta = self._utf8.decode(table[token_id] if 0 <= token_id < len(table) else b"")
            self.text += delta
            return delta
        self._ids.append(token_id)
        delta = self._delta()
        if not delta or delta.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(delta)

    def flush(self) -> str:
        """Return text still held back (with U+FFFD for incomplete bytes); call at the end."""
        if self._utf8 is not None:
            delta = self._utf8.decode(b"", final=True)
            self.text += delta
            return delta
        return self._emit(self._delta()) if self._read_offset < len(self._ids) else ""


class StopChecker:
    """Finds the first stop string in the growing output text.

    ``check`` must be given text that extends the text of its previous call (append-only, like
    ``IncrementalDetokenizer.text``): it only searches where a new match can be. On a match the
    output ends just before the stop string (vLLM's default). For streaming, ``safe_len`` says
    how much of a not-yet-stopped text can be sent without ever having to take it back.
    """

    def __init__(self, stop: list[str]):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(dict.fromkeys(stop))
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self._searched = 0  # text[:_searched] held no stop string at the last call
        self._floor = 0  # no stop string may start before this (skip)

    def check(self, text_so_far: str) -> tuple[bool, str]:
        """-> (stopped, text cut before the earliest stop string; unchanged if not stopped)."""
        if len(text_so_far) < self._searched:  # not an extension: search it all
            self._searched = self._floor = 0
        start = max(self._floor, self._searched - self.max_stop_len + 1)
        self._searched = len(text_so_far)
        hits = [i for s in self.stop if (i := text_so_far.find(s, start)) >= 0]
        if not hits:
            return False, text_so_far
        return True, text_so_far[: min(hits)]

    def skip(self, text_so_far: str) -> None:
        """No stop string may start within `text_so_far` (min_tokens): later checks search
        only what comes after it."""
        self._searched = self._floor = len(text_so_far)

    def safe_len(self, text: str) -> int:
        """Length of the prefix of ``text`` (holding no stop string) that can be streamed now:
        all but the longest tail that is a proper prefix of some stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold
