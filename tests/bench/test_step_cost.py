"""`python -m pdq.bench.step_cost`: a real DecodeLoop over the null model and a real Redis,
stepped in this process; every step it times is a step the loop really took and wrote."""

import json

from pdq.bench.step_cost import StepLab, main
from pdq.model.null import greedy_output


def test_the_lab_steps_every_sequence_and_writes_each_token(redis_server):
    lab = StepLab(redis_server.url, capacity=3, max_seq_len=64)
    try:
        rids = lab.add(3)
        assert lab.cpu_us_per_step(5) > 0
        assert sorted(lab.loop.running) == sorted(rids)  # admitted at the first step, none left
    finally:
        lab.close()  # settles the last step: its tokens are in Redis too
    vocab = lab.runner.vocab_size
    for rid in rids:
        tokens = lab.store.streamed_tokens(rid)  # the first token (the "prefill") and one per step
        assert tokens == greedy_output([5, 6, 7, 8, 9, 10, 11, 12], 6, vocab)


def test_the_command_writes_a_report_per_batch_size(tmp_path):
    out = tmp_path / "step-cost.json"
    assert main(["--sequences", "1,2", "--steps", "3", "--repeats", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["sequences"] for r in doc["step_cost"]] == [1, 2]
    for r in doc["step_cost"]:
        assert len(r["cpu_us_per_step"]["runs"]) == 2
        assert 0 < r["cpu_us_per_step"]["min"] <= r["cpu_us_per_step"]["median"]
        assert abs(r["cpu_us_per_sequence"]["min"] - r["cpu_us_per_step"]["min"] / r["sequences"]) < 0.1
    assert doc["command"].startswith("python -m pdq.bench.step_cost") and doc["machine"]["cpus"] >= 1
