"""ModelRunner: chunking and batching do not change results; the KV hand-off is lossless."""

import pytest
import torch

from pdq.engine import KVPoolFull, PrefillItem

ATOL = 1e-5


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(runner, seq_id, ids: list[int]) -> torch.Tensor:
    runner.allocate(seq_id)
    out = runner.prefill([PrefillItem(seq_id, ids, 0)])[0]
    runner.free(seq_id)
    return out


def test_chunked_and_batched_prefill_equal_alone(tiny_llama, make_runner):
    runner = make_runner(tiny_llama, slots=4)
    a, b, c = tokens(70, 1), tokens(9, 2), tokens(33, 3)
    ref = {name: alone(runner, name, ids) for name, ids in (("a", a), ("b", b), ("c", c))}
    for s in "abc":
        runner.allocate(s)
    # step 1: a's first chunk + all of b; step 2: a's second chunk + c's first; step 3: rest
    out1 = runner.prefill([PrefillItem("a", a[:30], 0), PrefillItem("b", b, 0)])
    out2 = runner.prefill([PrefillItem("c", c[:1], 0), PrefillItem("a", a[30:64], 30)])
    out3 = runner.prefill([PrefillItem("a", a[64:], 64), PrefillItem("c", c[1:], 1)])
    assert out1.shape == (2, 256) and out2.shape == (2, 256)
    torch.testing.assert_close(out1[1], ref["b"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out3[0], ref["a"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out3[1], ref["c"], atol=ATOL, rtol=0)
    assert [runner.kv_length(s) for s in "abc"] == [70, 9, 33]


def test_mixed_step_and_sparse_decode(tiny_llama, make_runner):
    """Decode rows for a subset of slots while another sequence prefills in the same forward."""
    runner = make_runner(tiny_llama, slots=4)
    seqs = {s: tokens(n, i) for i, (s, n) in enumerate((("x", 12), ("y", 40), ("z", 25)))}
    refs = {s: alone(runner, s, ids + [7]) for s, ids in seqs.items()}
    for s, ids in seqs.items():
        runner.allocate(s)
    runner.prefill([PrefillItem("x", seqs["x"]), PrefillItem("z", seqs["z"]), PrefillItem("y", seqs["y"][:10])])
    # z decodes, y continues its prompt, x sits this step out: decode slots are not 0..n-1
    out = runner.step([PrefillItem("y", seqs["y"][10:], 10)], [("z", 7, 25)])
    torch.testing.assert_close(out[1], refs["z"], atol=ATOL, rtol=0)
    out = runner.decode([("y", 7, 40), ("x", 7, 12)])
    torch.testing.assert_close(out[0], refs["y"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], refs["x"], atol=ATOL, rtol=0)


def test_freeing_one_sequence_leaves_the_others_kv_as_it_was(tiny_llama, make_runner):
    runner = make_runner(tiny_llama, slots=3)
    a, b, c = tokens(20, 5), tokens(30, 6), tokens(10, 7)
    refs = {s: alone(runner, s, ids + [3]) for s, ids in (("a", a), ("b", b), ("c", c))}
    for s, ids in (("a", a), ("b", b), ("c", c)):
        runner.allocate(s)
        runner.prefill([PrefillItem(s, ids)])
    runner.free("a")
    runner.allocate("x", tokens(40, 8))  # takes a's blocks and writes them
    runner.prefill([PrefillItem("x", tokens(40, 8))])
    out = runner.decode([("c", 3, 10), ("b", 3, 30)])
    torch.testing.assert_close(out[0], refs["c"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], refs["b"], atol=ATOL, rtol=0)


def greedy_continue(runner, seq_id, first: int, pos: int, n: int) -> list[int]:
    out, tok = [], first
    for i in range(n):
        tok = int(runner.decode([(seq_id, tok, pos + i)])[0].argmax())
        out.append(tok)
    return out


@pytest.mark.parametrize("via_bytes", [False, True], ids=["tensor", "bytes"])
def test_kv_handoff_equals_uninterrupted(tiny_llama, make_runner, via_bytes):
    prompt = tokens(45, 9)
    one = make_runner(tiny_llama)
    one.allocate(0)
    first = int(one.prefill([PrefillItem(0, prompt)])[0].argmax())
    expected = greedy_continue(one, 0, first, len(prompt), 12)

    prefill_side, decode_side = make_runner(tiny_llama), make_runner(tiny_llama)
    prefill_side.allocate("r")
    assert int(prefill_side.prefill([PrefillItem("r", prompt)])[0].argmax()) == first
    layers = prefill_side.export_kv("r", len(prompt))
    prefill_side.free("r")  # exported copies outlive the blocks
    assert len(layers) == decode_side.num_layers
    assert layers[0][0].shape == (decode_side.num_kv_heads, len(prompt), decode_side.head_dim)
    kv = torch.stack([torch.stack(layer) for layer in layers])
    if via_bytes:  # as received off the wire
        kv = torch.frombuffer(bytearray(kv.numpy().tobytes()), dtype=torch.float32).view(kv.shape)
    decode_side.allocate("other", tokens(20, 1))  # the hand-off lands in blocks other than the first
    decode_side.allocate("r", reserve_tokens=len(prompt) + 12)
    decode_side.write_kv("r", kv, prompt)
    assert decode_side.kv_length("r") == len(prompt)
    assert greedy_continue(decode_side, "r", first, len(prompt), 12) == expected


def test_runner_rejects_bad_items(tiny_llama, make_runner):
    runner = make_runner(tiny_llama, slots=1, max_seq_len=32)
    with pytest.raises(KeyError, match="no KV blocks"):
        runner.prefill([PrefillItem("nope", [1, 2])])
    runner.allocate("a", reserve_tokens=32)
    with pytest.raises(KVPoolFull):
        runner.allocate("b")
    with pytest.raises(ValueError, match="only 0 positions"):
        runner.prefill([PrefillItem("a", [1, 2], 5)])
    with pytest.raises(ValueError, match="max_seq_len"):
        runner.prefill([PrefillItem("a", list(range(33)))])
    with pytest.raises(ValueError, match="twice"):
        runner.step([PrefillItem("a", [1, 2])], [("a", 3, 2)])
    with pytest.raises(ValueError, match="shape"):
        runner.write_kv("a", torch.zeros(1, 2, 4, 3, 16))


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "gather"])
def test_paged_decode_of_many_lengths_equals_alone(tiny_llama, make_runner, kernel):
    """Sequences of many lengths, their blocks interleaved in the pool, decoded in one step with
    rows in no particular order: every row equals the sequence decoded alone, through the C
    kernel and through the gather path alike."""
    from pdq.engine import cpu_kernels

    assert cpu_kernels.available()  # CI has a C compiler: the kernel path must not silently fall back
    lengths = [5 + (i * 37) % 90 for i in range(24)]  # 5..94, in no order
    prompts = {f"s{i}": tokens(length, 100 + i) for i, length in enumerate(lengths)}
    runner = make_runner(tiny_llama, slots=24)
    runner.decode_kernel = kernel
    refs = {s: alone(runner, s, ids + [9]) for s, ids in prompts.items()}
    for s, ids in prompts.items():
        runner.allocate(s)
    for start in range(0, 95, 16):  # chunk by chunk, so the sequences' blocks interleave
        runner.prefill([PrefillItem(s, ids[start:start + 16], start) for s, ids in prompts.items() if len(ids) > start])
    items = [(s, 9, len(ids)) for s, ids in reversed(prompts.items())]
    out = runner.decode(items)
    assert all(runner.kv_length(s) == len(ids) + 1 for s, ids in prompts.items())
    for row, (s, _, _) in enumerate(items):
        torch.testing.assert_close(out[row], refs[s], atol=ATOL, rtol=0)


def test_warm_up_runs_full_size_passes_and_leaves_the_pool_as_it_was(tiny_llama, make_runner):
    runner = make_runner(tiny_llama, slots=4)
    ids = tokens(40, 5)
    before = alone(runner, "x", ids)
    runner.allocate("held")  # a sequence already in the pool keeps its blocks
    free, cached = runner.free_tokens, runner.pool.usage().blocks_cached
    calls = []
    step = runner.step
    runner.step = lambda prefill, decode, commit=True: (calls.append(([len(p.token_ids) for p in prefill], len(decode)))
                                                        or step(prefill, decode, commit))
    runner.warm_up(300, 64)
    runner.step = step
    assert calls == [([64, 64, 64, 64, 44], 0), ([], 5)]
    assert runner.free_tokens == free and runner.kv_length("held") == 0
    assert runner.pool.usage().blocks_cached == cached  # scratch tokens are not cached
    torch.testing.assert_close(alone(runner, "x", ids), before, atol=ATOL, rtol=0)
    n = 0
    while runner.can_allocate(128):
        runner.allocate(n, reserve_tokens=128)
        n += 1
    calls.clear()
    runner.warm_up(300, 64)  # a pool without room: nothing to run on, nothing changes
    assert runner.free_tokens < 128


def test_warm_up_runs_every_projection_shape_at_every_decode_batch_size(tiny_llama, make_runner, monkeypatch):
    """oneDNN builds a GEMM per row count the first time it sees one: the warm-up runs each
    distinct projection shape (q/k/v, o, gate/up, down, the head) at 1..decode_rows rows, so no
    decode step pays it later, and leaves the pool as it was."""
    from pdq.engine.layers import Linear

    runner = make_runner(tiny_llama, slots=4)
    seen: dict[tuple, list[int]] = {}
    forward = Linear.forward

    def spy(self, x):
        seen.setdefault(tuple(self.weight.shape), []).append(x.shape[0])
        return forward(self, x)

    monkeypatch.setattr(Linear, "forward", spy)
    free = runner.free_tokens
    runner.warm_gemms(6)
    shapes = {tuple(m.weight.shape) for m in runner.model.modules() if isinstance(m, Linear)}
    assert set(seen) == shapes and len(shapes) >= 5  # qkv, o, gate_up, down, lm_head
    assert all(rows == [1, 2, 3, 4, 5, 6] for rows in seen.values())  # one layer of each shape, every count
    assert runner.free_tokens == free
    seen.clear()
    runner.warm_up(0, 1, decode_rows=3)
    assert all(rows[-3:] == [1, 2, 3] for rows in seen.values())


def test_bfloat16_projections_are_warmed_unless_torch_emulates_their_gemm(tiny_llama, make_runner, monkeypatch):
    """On a CPU without AMX or AVX512_BF16 whose projections torch's own GEMM runs (not prepacked
    for oneDNN: an AVX2 CPU), bfloat16 is emulated and a first GEMM at a row count costs no more
    than a later one: the warm-up would only lengthen the start. With a bfloat16 unit, or with
    oneDNN's prepacked GEMM (which it builds per row count), every count runs, the bucketed larger
    counts too."""
    from pdq.engine.layers import BUCKET_ROWS, Linear

    runner = make_runner(tiny_llama.to(torch.bfloat16), slots=4, dtype=torch.bfloat16)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    seen: list[int] = []
    monkeypatch.setattr(Linear, "forward", lambda self, x: seen.append(x.shape[0]) or x)  # no GEMM runs
    every = {*range(1, BUCKET_ROWS + 1), 2 * BUCKET_ROWS, 3 * BUCKET_ROWS}  # past 64 rows: multiples of it
    for m in linears:
        m.packed = None  # torch's own GEMM, as on an AVX2 CPU
    runner.warm_gemms(3, 2 * BUCKET_ROWS + 1, cpu_flags=frozenset({"avx2"}))
    assert seen == []
    runner.warm_gemms(3, 2 * BUCKET_ROWS + 1, cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert set(seen) == every
    seen.clear()
    for m in linears:
        m.packed = object()  # prepacked for oneDNN (AVX-512 without a bfloat16 unit)
    runner.warm_gemms(3, 2 * BUCKET_ROWS + 1, cpu_flags=frozenset({"avx2", "avx512f"}))
    assert set(seen) == every
    seen.clear()
    f32 = make_runner(tiny_llama.to(torch.float32), slots=4)
    f32.warm_gemms(3, cpu_flags=frozenset({"avx2"}))  # float32 builds its GEMMs on any CPU
    assert set(seen) == {1, 2, 3}


def test_the_cpu_kernel_leaves_the_process_floating_point_mode_alone():
    """A library built with -ffast-math turns on flush-to-zero for the whole process when loaded:
    subnormal floats would then read as zero everywhere (numpy, torch, property tests)."""
    from pdq.engine import cpu_kernels

    assert cpu_kernels.available()
    tiny = float.fromhex("0x1p-1070")  # subnormal
    assert tiny * 2 > 0 and torch.tensor([tiny], dtype=torch.float64).mul(2).item() > 0



def test_prompt_attention_runs_torchs_fused_cpu_kernel(tiny_llama, make_runner):
    """Prompt chunks, from position 0 (causal) and continuing one (masked), attend through
    torch's flash kernel for CPU: given 3-D inputs SDPA falls back to its math path (scores
    materialized, a "safe" softmax), 2-3x slower."""
    runner = make_runner(tiny_llama, slots=2)
    a, b = tokens(40, 11), tokens(24, 12)
    for s in "ab":
        runner.allocate(s)
    runner.prefill([PrefillItem("a", a[:16], 0)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner.prefill([PrefillItem("a", a[16:], 16), PrefillItem("b", b, 0)])
    ops = [e.name for e in prof.events()]
    assert ops.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 2 * tiny_llama.config.num_hidden_layers
    assert "aten::_scaled_dot_product_attention_math" not in ops


def test_bfloat16_gemms_past_the_bucket_run_padded_and_return_their_own_rows():
    """A bfloat16 projection of more than BUCKET_ROWS rows runs at the next multiple of it (zero
    rows added, their output dropped): the same numbers as the product at its own row count."""
    from pdq.engine.layers import BUCKET_ROWS, Linear, gemm_rows

    g = torch.Generator().manual_seed(0)
    linear = Linear((torch.randn(96, 40, generator=g) * 0.1).bfloat16())
    linear.prepack()
    assert gemm_rows(BUCKET_ROWS, torch.bfloat16) == BUCKET_ROWS
    assert gemm_rows(BUCKET_ROWS + 1, torch.bfloat16) == 2 * BUCKET_ROWS
    assert gemm_rows(BUCKET_ROWS + 1, torch.float32) == BUCKET_ROWS + 1
    for rows in (3, BUCKET_ROWS, BUCKET_ROWS + 5, 3 * BUCKET_ROWS - 1):
        x = torch.randn(rows, 40, generator=g).bfloat16()
        out = linear(x)
        assert out.shape == (rows, 96) and out.is_contiguous()
        torch.testing.assert_close(out.float(), x.float() @ linear.weight.float().T, rtol=2e-2, atol=2e-2)


def test_blocks_a_sequence_fills_while_decoding_join_the_prefix_cache(tiny_llama, make_runner):
    """A decode row names its sequence's blocks for the prefix cache when it fills one (only
    then: the others are partly written), so a later prompt of those tokens skips them."""
    runner = make_runner(tiny_llama)
    bs = runner.block_size
    prompt = list(range(3, 3 + bs - 3))  # three positions short of the first block's end
    runner.allocate("a", prompt)
    tokens = prompt + [int(runner.prefill([PrefillItem("a", prompt, 0)])[0].argmax())]
    while len(tokens) < 2 * bs + 2:  # decode past two block boundaries
        if runner.missing_blocks("a", len(tokens)):
            runner.ensure("a", len(tokens))
        cached = runner.cached_tokens(tokens)
        tokens.append(int(runner.decode([("a", tokens[-1], len(tokens) - 1)])[0].argmax()))
        written = len(tokens) - 1  # positions with K/V
        assert cached == (written - 1) // bs * bs  # before this row: the blocks full then
        assert runner.cached_tokens(tokens) == written // bs * bs  # after it, with the one it filled
    assert runner.cached_tokens(tokens) == 2 * bs
