"""The fixed-shape decode step that CUDA graphs replay, run eagerly on the CPU: padding the batch
and the block tables up to their buckets changes no real row's logits and writes no real block.
(The graphs themselves are captured and replayed in test_cuda.py, wherever a GPU is present.)"""

import numpy as np
import torch

from pdq.engine import PrefillItem
from pdq.engine.cuda_graphs import BATCH_BUCKETS, DecodeGraphs, bucket, width_buckets

from .test_runner import tokens


def test_buckets_pad_up_and_end_at_the_largest():
    assert [bucket(n, BATCH_BUCKETS) for n in (1, 3, 17, 256)] == [1, 4, 24, 256]
    assert bucket(257, BATCH_BUCKETS) is None
    assert width_buckets(128) == (8, 16, 32, 64, 128)
    assert width_buckets(40) == (8, 16, 32, 40)
    assert width_buckets(5) == (5,)


def padded(runner, max_batch: int = BATCH_BUCKETS[-1]) -> DecodeGraphs:
    runner.decode_kernel = False  # the graphs' gather path, on both sides
    runner.graphs = DecodeGraphs(runner.model, runner.pool.kv, num_kv_heads=runner.num_kv_heads,
                                 block_size=runner.block_size, scratch_block=runner.pool.scratch_block,
                                 max_width=runner.blocks_for(runner.max_seq_len), max_batch=max_batch, capture=False)
    return runner.graphs


def test_a_padded_decode_step_equals_the_eager_one(tiny_llama, make_runner):
    eager, fixed = make_runner(tiny_llama, slots=4), make_runner(tiny_llama, slots=4)
    eager.decode_kernel = False
    padded(fixed)
    prompts = {"a": tokens(37, 1), "b": tokens(5, 2), "c": tokens(70, 3)}  # 3 rows -> a batch of 4
    last = {}
    for runner in (eager, fixed):
        for name, ids in prompts.items():
            runner.allocate(name)
        out = runner.prefill([PrefillItem(name, ids, 0) for name, ids in prompts.items()])
        last[runner] = out.argmax(-1).tolist()
    assert last[eager] == last[fixed]
    feed = dict(zip(prompts, last[eager]))
    for _ in range(20):  # crosses block boundaries: tables grow, and a's and b's widths differ from c's
        steps = [[(name, feed[name], r.kv_length(name)) for name in prompts] for r in (eager, fixed)]
        a, b = eager.decode(steps[0]), fixed.decode(steps[1])
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        feed = dict(zip(prompts, a.argmax(-1).tolist()))
    scratch = fixed.pool.scratch_block
    assert scratch == fixed.pool.num_blocks  # beyond every block the manager hands out
    torch.testing.assert_close(fixed.pool.kv[:, :, :scratch], eager.pool.kv[:, :, :scratch], atol=1e-5, rtol=0)
    assert fixed.graphs.runs == 20  # every decode step ran padded


def test_a_step_beyond_the_largest_bucket_runs_eagerly(tiny_llama, make_runner):
    runner = make_runner(tiny_llama, slots=4)
    graphs = padded(runner, max_batch=2)
    for name in "abc":
        runner.allocate(name)
    runner.prefill([PrefillItem(name, tokens(9, i), 0) for i, name in enumerate("abc")])
    assert graphs.run([1, 2, 3], [9, 9, 9], [0, 16, 32], np.array([[0], [1], [2]], dtype=np.int32)) is None  # 3 rows > 2
    assert runner.decode([(name, 1, 9) for name in "abc"]).shape == (3, 256)  # the eager path serves it
