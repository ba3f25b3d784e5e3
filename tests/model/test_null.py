"""The null model (`pdq.model.null`): its spec, its checkpoint dir, and its forward through
`ModelRunner`: the next token of every row as `next_token` says, at most 1000 / STEP_MS steps/s."""

import time

import pytest

from pdq.engine.runner import ModelRunner, PrefillItem
from pdq.model.loader import resolve_model
from pdq.model.null import greedy_output, next_token, parse_step_ms


def test_null_specs_name_a_step_in_milliseconds_and_bad_ones_are_refused():
    assert parse_step_ms("null") == 0.0
    assert parse_step_ms("null:2.5") == 2.5
    for bad in ("null:fast", "null:-1"):
        with pytest.raises(ValueError, match="STEP_MS"):
            resolve_model(bad)


def test_the_null_model_never_emits_a_special_token():
    assert min(next_token(t, p, 4096) for t in range(0, 4096, 7) for p in range(0, 3000, 13)) >= 3


def test_a_null_runner_generates_the_known_greedy_output_and_sleeps_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("PDQ_CACHE_DIR", str(tmp_path))
    runner = ModelRunner.from_pretrained(resolve_model("null:20"), kv_budget_tokens=256, max_seq_len=128)
    assert runner.num_layers == 1 and runner.num_kv_heads == 1
    prompts = {"a": [5, 6, 7], "b": [9] * 20}
    for seq, prompt in prompts.items():
        runner.allocate(seq, prompt, reserve_tokens=len(prompt) + 4)
    t0 = time.perf_counter()
    logits = runner.prefill([PrefillItem(seq, prompt) for seq, prompt in prompts.items()])
    out = {seq: [int(t)] for seq, t in zip(prompts, logits.argmax(-1))}
    for _ in range(3):
        logits = runner.decode([(seq, out[seq][-1], len(prompts[seq]) + len(out[seq]) - 1) for seq in prompts])
        for seq, t in zip(prompts, logits.argmax(-1)):
            out[seq].append(int(t))
    assert time.perf_counter() - t0 >= 4 * 0.020
    assert out == {seq: greedy_output(prompt, 4, runner.vocab_size) for seq, prompt in prompts.items()}
