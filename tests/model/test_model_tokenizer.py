import json

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

from pdq.model import build_tokenizer

EXAMPLES = ["", " ", "Hello, world!", "naïve café 🙂👍🏽 日本語 中文 한국어", "\x00\t\r\n  x", "def f(x):\n\treturn x ** 2\n"]


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_unicode_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_round_trips_through_the_transformers_wrapper(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    for text in EXAMPLES:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert ids == Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).encode(text).ids


def test_vocab_has_every_byte_and_the_special_tokens(tokenizer):
    vocab = tokenizer.get_vocab()
    assert tokenizer.get_vocab_size() == len(vocab) == 4096
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)
    assert [vocab["<s>"], vocab["</s>"], vocab["<pad>"]] == [0, 1, 2]


def test_encode_adds_no_bos(tiny_dir, tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    ids = tokenizer.encode("hello world").ids
    assert ids and 0 not in ids
    assert tok("hello world").input_ids == ids


def test_training_is_deterministic():
    a = build_tokenizer().backend_tokenizer.to_str()
    b = build_tokenizer().backend_tokenizer.to_str()
    assert a == b
    assert len(json.loads(a)["model"]["merges"]) > 3000
