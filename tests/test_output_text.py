"""Streamed text with stop strings: deltas are never taken back and add up to the final text."""

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pdq.model.loader import resolve_model
from pdq.model.tokenizer import load_tokenizer
from pdq.model.output_text import TextOutput

TOKENIZER = load_tokenizer(resolve_model("builtin:tiny"))
SPECIAL = [t.content for t in TOKENIZER.get_added_tokens_decoder().values() if t.special]


def run(text: str, stop: list[str]) -> tuple[str, bool]:
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    out = TextOutput(TOKENIZER, stop)
    streamed = []
    for token in ids:
        delta, stopped = out.add(token)
        streamed.append(delta)
        if stopped:
            return "".join(streamed), True
    streamed.append(out.flush())
    return "".join(streamed), False


def test_stop_string_cuts_before_it_and_is_never_streamed():
    assert run("count 1, 2, 3, 4, 5, 6", ["4,"]) == ("count 1, 2, 3, ", True)
    assert run("no stop here", ["zzz"]) == ("no stop here", False)


def test_special_tokens_are_not_streamed_as_text():
    """Like vLLM's skip_special_tokens: a generated <s> or </s> adds no text."""
    assert {"<s>", "</s>"} <= set(SPECIAL)
    assert run("a<s>b</s>c", []) == ("abc", False)
    assert run("a<s>b", ["ab"]) == ("", True)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=60), st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_streamed_text_equals_the_cut_full_text(text, stop):
    assume(not any(s in text for s in SPECIAL))  # those encode to special tokens, which are not text
    streamed, stopped = run(text, stop)
    hits = [text.find(s) for s in stop if s in text]
    if stopped:
        assert streamed == text[:min(hits)]
    else:
        assert streamed == text and not hits


def test_no_stop_string_ends_the_text_before_min_tokens_nor_starts_in_it():
    ids = TOKENIZER.encode("a, b, c, d", add_special_tokens=False).ids
    head = len(TOKENIZER.encode("a, b", add_special_tokens=False).ids)  # the text "a, b" as tokens

    def stream(min_tokens: int) -> tuple[str, bool]:
        out, streamed = TextOutput(TOKENIZER, [","], min_tokens=min_tokens), []
        for token in ids:
            delta, stopped = out.add(token)
            streamed.append(delta)
            if stopped:
                return "".join(streamed), True
        return "".join(streamed) + out.flush(), False

    assert stream(0) == ("a", True)
    assert stream(head) == ("a, b", True)  # the commas in "a, b" are past; the next one stops it
    assert stream(len(ids)) == ("a, b, c, d", False)
