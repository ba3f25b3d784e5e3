"""Structured output's masks (llguidance) on the built-in tokenizer: under a constraint, only
tokens that keep the output inside it can be sampled, whatever the logits say; a decode worker's
fresh matcher replays the tokens so far; the gateway's check names what does not compile."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from pdq.engine import SamplingParams
from pdq.engine.constraint import Grammars, advance
from pdq.model.grammar import check
from pdq.model.builtin import ensure_builtin
from pdq.model.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars():
    tok = load_tokenizer(ensure_builtin("tiny"))
    return Grammars(tok, SimpleNamespace(vocab_size=tok.get_vocab_size()), {1}), tok


def generate(grammars, params, seed: int, limit: int = 64) -> tuple[list[int], bool]:
    """Random logits, masked: the output the constraint lets a random model write."""
    g, _ = grammars
    m, out = g.matcher(params), []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(limit):
        logits = g.mask(torch.randn(1, g.vocab_size, generator=gen) * 5, [m])
        token = int(logits.argmax())
        out.append(token)
        if advance(m, token):
            return out, True
    return out, False


@pytest.mark.parametrize("seed", range(5))
def test_every_output_under_a_schema_is_valid_json_of_it(grammars, seed):
    _, tok = grammars
    ids, done = generate(grammars, SamplingParams(json_schema=json.dumps(SCHEMA)), seed)
    assert done
    value = json.loads(tok.decode(ids))
    assert set(value) == {"color", "n"} and value["color"] in ("red", "green") and 0 <= value["n"] <= 9


@pytest.mark.parametrize("seed", range(3))
def test_every_output_under_a_regex_matches_it(grammars, seed):
    _, tok = grammars
    ids, done = generate(grammars, SamplingParams(regex=r"[0-9]{3}-[a-z]{2}"), seed)
    assert done and re.fullmatch(r"[0-9]{3}-[a-z]{2}", tok.decode(ids))


def test_a_fresh_matcher_replays_the_tokens_so_far(grammars):
    g, _ = grammars
    params = SamplingParams(json_schema=json.dumps(SCHEMA))
    ids, _ = generate(grammars, params, 0)
    resumed = g.matcher(params, ids[:3])  # a decode worker taking the sequence after 3 tokens
    logits = torch.zeros(1, g.vocab_size)
    logits[0, ids[3]] = 1.0
    assert int(g.mask(logits, [resumed]).argmax()) == ids[3]
    with pytest.raises(ValueError, match="leave the output constraint"):
        g.matcher(params, [ids[0], ids[0], ids[0]])  # not a prefix of any valid output
    assert g.matcher(SamplingParams()) is None
    unchanged = torch.randn(2, g.vocab_size)
    assert g.mask(unchanged, [None, None]) is unchanged


def test_check_names_what_cannot_be_used():
    assert check(json.dumps(SCHEMA)) == "" and check(regex="[a-z]+") == ""
    assert "not both" in check("{}", "x")
    assert "Invalid type" in check('{"type": "nonsense"}')
    assert "not valid JSON" in check("{")
    assert "unclosed group" in check(regex="(")


def test_unpack_bits_reads_token_t_at_bit_t_mod_32_of_word_t_div_32():
    from pdq.engine.constraint import unpack_bits

    words = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int64).to(torch.int32)
    got = unpack_bits(words, 100)
    want = torch.tensor([[(int(words[r, t // 32]) >> (t % 32)) & 1 for t in range(100)] for r in range(3)]).bool()
    assert got.shape == (3, 100) and torch.equal(got, want)


def test_masking_runs_no_torch_compile():
    """llguidance.torch applies its bitmask under torch.compile (seconds of import and C++ build
    in the model thread on a worker's first constrained request); the mask is plain torch ops."""
    import subprocess
    import sys

    code = ("import json, sys, torch; from types import SimpleNamespace;"
            "from pdq.engine import SamplingParams; from pdq.engine.constraint import Grammars;"
            "from pdq.model.builtin import ensure_builtin; from pdq.model.tokenizer import load_tokenizer;"
            "tok = load_tokenizer(ensure_builtin('tiny'));"
            "g = Grammars(tok, SimpleNamespace(vocab_size=tok.get_vocab_size()), {1});"
            "m = g.matcher(SamplingParams(regex='[0-9]+'));"
            "out = g.mask(torch.zeros(2, g.vocab_size + 3), [None, m]);"
            "ids = out[1].isfinite().nonzero().flatten().tolist();"
            "assert ids and all(tok.decode([i]).isdigit() for i in ids) and out[0].isfinite().all(), ids;"
            "print(sorted(k for k in sys.modules if k in ('llguidance.torch', 'torch._dynamo', 'torch._inductor')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
