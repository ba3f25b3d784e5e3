import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders

from pdq.model import IncrementalDetokenizer, StopChecker
from pdq.model import detokenizer as detokenizer_module


@pytest.fixture(autouse=True, params=["bytes", "window"])
def path(request, monkeypatch, tokenizer):
    """Every detokenizer test runs on both paths: the byte-level one (the built-in tokenizer's)
    and the windowed one (any other tokenizer's)."""
    if request.param == "window":
        monkeypatch.setattr(detokenizer_module, "byte_table", lambda *a, **k: None)
    else:
        assert detokenizer_module.byte_table(tokenizer) is not None
    return request.param

EMOJI_CJK = "🙂👍🏽🚀👨‍👩‍👧日本語中文文本한국어ñé€ "
texts = st.text(alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(EMOJI_CJK)))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts)
def test_deltas_concatenate_to_the_decoded_text(tokenizer, text):
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)
    if "\ufffd" not in text:  # a partial character is never emitted
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=20), st.lists(st.integers(0, 4095), max_size=40))
def test_random_ids_after_a_prompt_detokenize_like_a_full_decode(tokenizer, prompt, generated):
    """Gibberish from a random model: invalid UTF-8, special tokens, anything."""
    prompt_ids = tokenizer.encode(prompt).ids
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    out = "".join(stream(detok, generated))
    assert tokenizer.decode(prompt_ids) + out == tokenizer.decode(prompt_ids + generated)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = [tokenizer.token_to_id(c) for c in "ðŁĻĤ"]  # the 4 bytes of 🙂, one token each
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(i) for i in ids] == ["", "", "", "🙂"]


def test_special_tokens_are_skipped_by_default(tokenizer):
    ids = tokenizer.encode("hi").ids + [1]
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == "hi"
    assert "".join(stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids)) == "hi</s>"


def test_flush_emits_a_trailing_incomplete_character(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(tokenizer.token_to_id("ð")) == ""
    assert detok.flush() == "\ufffd"


def test_the_byte_level_path_is_only_for_a_byte_level_decoder_alone(tokenizer):
    other = copy.deepcopy(tokenizer)
    other.decoder = decoders.Sequence([decoders.ByteLevel()])  # decodes alike, but not ByteLevel alone
    build = detokenizer_module._build_byte_table  # (what byte_table caches)
    assert build(other, True) is None
    table = build(tokenizer, True)
    assert table is not None and table[1] == b"" and table[tokenizer.token_to_id("ð")] == b"\xf0"
    assert build(tokenizer, False)[1] == b"</s>"


def feed(checker: StopChecker, text: str, chunk: int) -> tuple[bool, str]:
    for end in range(chunk, len(text) + chunk, chunk):
        stopped, out = checker.check(text[:end])
        if stopped:
            return stopped, out
    return False, text


def test_stop_string_cuts_the_text_before_it():
    assert feed(StopChecker(["Stop"]), "Hello world. Stop here", 1) == (True, "Hello world. ")
    assert feed(StopChecker(["\n\n"]), "a\nb\n\nc", 3) == (True, "a\nb")
    assert feed(StopChecker(["zz"]), "no stop here", 2) == (False, "no stop here")


def test_earliest_stop_string_wins():
    assert StopChecker(["def", "XY"]).check("abcXYdef") == (True, "abc")
    assert StopChecker(["lo w", "o"]).check("hello world") == (True, "hel")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet="abc ", max_size=40), st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1,
       max_size=3), st.integers(1, 7))
def test_streamed_check_equals_a_full_search_of_each_prefix(text, stop, chunk):
    class FullSearch:
        def check(self, text):
            hits = [i for s in stop if (i := text.find(s)) >= 0]
            return (True, text[: min(hits)]) if hits else (False, text)

    assert feed(StopChecker(stop), text, chunk) == feed(FullSearch(), text, chunk)


def test_safe_len_holds_back_a_possible_stop_prefix():
    checker = StopChecker(["Stop", "\n\n"])
    assert checker.max_stop_len == 4
    assert checker.safe_len("Hello St") == len("Hello ")
    assert checker.safe_len("Hello\n") == len("Hello")
    assert checker.safe_len("Hello") == 5
    assert StopChecker([]).safe_len("abc") == 3


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        StopChecker([""])
