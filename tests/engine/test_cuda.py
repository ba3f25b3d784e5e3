"""The same runtime on a CUDA GPU: every family's logits agree with the CPU's in float32, the
default 16-bit dtype serves a batch to the end, and the CUDA graphs of decode steps replay what
the eager step computes. These run wherever a GPU is present; CI and this
project's development machines are CPU-only, so there they are skipped, saying so."""

import pytest
import torch

from pdq.engine import LLMEngine, ModelRunner, PrefillItem, SamplingParams

from .test_families import FAMILIES, MAX_TOKENS, PROMPTS, save_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: CI is CPU-only; runs wherever one is present")


def last_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    runner.allocate("s")
    try:
        return runner.prefill([PrefillItem("s", ids)])[0].float().cpu()
    finally:
        runner.free("s")


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_on_cuda_match_the_cpus(tmp_path, family):
    save_checkpoint(tmp_path, family)
    kw = dict(kv_budget_tokens=4 * 128, max_seq_len=128, dtype=torch.float32)
    cpu = ModelRunner.from_pretrained(str(tmp_path), device="cpu", **kw)
    gpu = ModelRunner.from_pretrained(str(tmp_path), device="cuda", **kw)
    assert gpu.device.type == "cuda"
    for ids in PROMPTS:
        torch.testing.assert_close(last_logits(gpu, ids), last_logits(cpu, ids), atol=2e-3, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_16_bit_dtype_serves_a_batch_to_the_end(tmp_path, family):
    save_checkpoint(tmp_path, family)
    runner = ModelRunner.from_pretrained(str(tmp_path), kv_budget_tokens=4 * 128, max_seq_len=128)
    assert runner.device.type == "cuda" and runner.dtype in (torch.bfloat16, torch.float16)
    engine = LLMEngine(runner, max_batched_tokens=48, prefill_chunk=16)
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS])
    assert [len(o) for o in outs] == MAX_TOKENS
    assert runner.free_tokens == runner.capacity_tokens  # every sequence's KV freed
    fp32 = ModelRunner.from_pretrained(str(tmp_path), kv_budget_tokens=4 * 128, max_seq_len=128, dtype=torch.float32)
    for ids in PROMPTS:  # 16-bit logits point the same way as float32's
        a, b = last_logits(runner, ids), last_logits(fp32, ids)
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_replay_the_eager_decode_step(tmp_path, family):
    save_checkpoint(tmp_path, family)
    kw = dict(kv_budget_tokens=8 * 128, max_seq_len=128, dtype=torch.float32, device="cuda")
    eager, graphed = (ModelRunner.from_pretrained(str(tmp_path), **kw) for _ in range(2))
    eager.graphs = None
    graphed.warm_up(16, 16)  # captures the batch buckets up to 16 rows, every table width
    assert graphed.graphs is not None and graphed.graphs.capture_all(16) == 5 * len(graphed.graphs.widths)
    feed = {}
    for runner in (eager, graphed):
        for i, ids in enumerate(PROMPTS):
            runner.allocate(i)
        feed[runner] = runner.prefill([PrefillItem(i, ids, 0) for i, ids in enumerate(PROMPTS)]).argmax(-1).tolist()
    assert feed[eager] == feed[graphed]
    ids, warmed = feed[eager], graphed.graphs.runs  # warm_up's decode step ran through a graph too
    for _ in range(24):  # 3 rows padded to 4; tables grow across block boundaries
        steps = [[(i, t, r.kv_length(i)) for i, t in enumerate(ids)] for r in (eager, graphed)]
        a, b = eager.decode(steps[0]), graphed.decode(steps[1])
        torch.testing.assert_close(b, a, atol=2e-4, rtol=0)
        ids = a.argmax(-1).tolist()
    assert graphed.graphs.runs - warmed == 24


def test_a_16_bit_engine_serves_through_lazily_captured_graphs(tmp_path):
    save_checkpoint(tmp_path, "llama")
    runner = ModelRunner.from_pretrained(str(tmp_path), kv_budget_tokens=8 * 128, max_seq_len=128)
    engine = LLMEngine(runner, max_batched_tokens=48, prefill_chunk=16)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    outs = engine.generate(PROMPTS, params)
    assert [len(o) for o in outs] == MAX_TOKENS
    assert runner.graphs.runs > 0 and runner.free_tokens == runner.capacity_tokens
