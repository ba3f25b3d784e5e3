"""The fused CPU kernels of a decoder layer's elementwise work (`pdq.engine.cpu_kernels`:
RMSNorm with and without the residual add, rotary embedding in place, rotary with the step's
K/V written to the pool, SwiGLU) against the torch ops they replace, on views as the layer
passes them; and a whole model's logits with them on and off."""

import pytest
import torch
import torch.nn.functional as F

from pdq.engine import cpu_kernels
from pdq.engine.attention import kv_rows
from pdq.engine.layers import RotaryEmbedding, residual_rms_norm, rms_norm, rotary_and_store, silu_and_mul

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def built():
    assert cpu_kernels.fused_ops()  # CI has a C compiler: the fused path must not silently fall back


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 512: past the threshold where rows go to threads
def test_rms_norm_and_the_residual_add_match_torch_and_the_add_lands_in_place(rows):
    g = torch.Generator().manual_seed(rows)
    x, add, w = torch.randn(rows, 512, generator=g), torch.randn(rows, 512, generator=g), torch.randn(512, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), F.rms_norm(x, (512,), w, 1e-5), **TOL)
    wide = torch.randn(rows, 700, generator=g)  # a view whose rows are 700 floats apart
    torch.testing.assert_close(rms_norm(wide[:, 100:612], w, 1e-5), F.rms_norm(wide[:, 100:612], (512,), w, 1e-5),
                               **TOL)
    stream = x.clone()
    out_stream, normed = residual_rms_norm(stream, add, w, 1e-5)
    assert out_stream is stream  # added in place: no new tensor for the residual stream
    torch.testing.assert_close(stream, x + add, rtol=0, atol=0)
    torch.testing.assert_close(normed, F.rms_norm(x + add, (512,), w, 1e-5), **TOL)


@pytest.mark.parametrize("rows", [1, 9, 200])
def test_rotary_in_place_on_the_q_and_k_heads_of_a_fused_qkv_matches_torch_and_leaves_v(rows):
    g = torch.Generator().manual_seed(rows)
    dim, q_heads, kv_heads = 64, 8, 4
    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), 1.0, 4096, torch.float32)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * dim, generator=g)
    before = qkv.clone()
    cos, sin = rotary.tables(torch.randint(0, 4096, (rows,), generator=g))
    qk = qkv[:, : (q_heads + kv_heads) * dim].view(rows, -1, dim)
    t, h, d = qk.shape
    swapped = qk.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    expected = qk * cos + swapped * sin  # the torch formula (a new tensor)
    got = RotaryEmbedding.apply(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # rotated where it lies
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(qkv[:, (q_heads + kv_heads) * dim:], before[:, (q_heads + kv_heads) * dim:],
                               rtol=0, atol=0)  # v untouched


@pytest.mark.parametrize("rows", [1, 9, 200])
def test_rotary_with_the_kv_write_equals_rotary_then_torchs_index_copies_bit_for_bit(rows):
    g = torch.Generator().manual_seed(rows)
    dim, q_heads, kv_heads, blocks, bs = 64, 8, 4, 64, 16
    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), 1.0, 4096, torch.float32)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = rotary.tables(torch.randint(0, 4096, (rows,), generator=g))
    where = kv_rows(torch.randperm(blocks * bs, generator=g)[:rows], torch.arange(kv_heads), bs)  # scattered slots
    caches = [torch.randn(blocks, kv_heads, bs, dim, generator=g) for _ in range(2)]

    def views(t):  # (q|k heads, v heads) of a fused qkv output
        at = (q_heads + kv_heads) * dim
        return t[:, :at].view(rows, -1, dim), t[:, at:].view(rows, kv_heads, dim)

    want_qkv, (want_k, want_v) = qkv.clone(), [c.clone() for c in caches]
    qk, v = views(want_qkv)
    RotaryEmbedding.apply(qk, cos, sin)
    want_k.view(-1, dim).index_copy_(0, where, qk[:, q_heads:].reshape(-1, dim))
    want_v.view(-1, dim).index_copy_(0, where, v.reshape(-1, dim))

    qk, v = views(qkv)
    got, stored = rotary_and_store(qk, q_heads, cos, sin, v, caches[0], caches[1], where)
    assert stored and got.data_ptr() == qkv.data_ptr()  # the fused path, in place
    torch.testing.assert_close(qkv, want_qkv, rtol=0, atol=0)
    torch.testing.assert_close(caches[0], want_k, rtol=0, atol=0)  # every other slot untouched too
    torch.testing.assert_close(caches[1], want_v, rtol=0, atol=0)


def test_swiglu_matches_torch():
    gate_up = torch.randn(33, 2 * 1408, generator=torch.Generator().manual_seed(3)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, **TOL)


def test_a_models_logits_are_the_same_with_the_fused_kernels_on_and_off(tiny_llama, make_runner, monkeypatch):
    from pdq.engine.runner import PrefillItem

    def logits() -> torch.Tensor:
        runner = make_runner(tiny_llama)
        runner.allocate("a")
        runner.allocate("b")
        first = runner.step([PrefillItem("a", list(range(5, 40)), 0), PrefillItem("b", list(range(9, 20)), 0)], [])
        return torch.cat([first, runner.step([], [("a", 7, 35), ("b", 8, 11)])])

    on = logits()
    monkeypatch.setenv("PDQ_NO_FUSED_OPS", "1")
    assert not cpu_kernels.fused_ops()
    off = logits()
    torch.testing.assert_close(on, off, rtol=1e-4, atol=1e-4)
    assert torch.equal(on.argmax(-1), off.argmax(-1))


# bfloat16 (a model loaded with dtype bfloat16 on CPU): the same kernels, rounding where torch's bfloat16
# ops round, against those ops (PDQ_NO_FUSED_OPS: the layers' torch path)

def _torch_path(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv("PDQ_NO_FUSED_OPS", "1")
        return fn()


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_bfloat16_rms_norm_and_residual_add_match_torchs_bfloat16_ops(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    x, add, w = (torch.randn(rows, 512, generator=g).bfloat16(), torch.randn(rows, 512, generator=g).bfloat16(),
                 torch.randn(512, generator=g).bfloat16())
    want = _torch_path(monkeypatch, lambda: rms_norm(x, w, 1e-5))
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    # the mean of squares sums in another order: at most a last-bit difference here and there
    torch.testing.assert_close(got, want)
    assert (got != want).float().mean() < 0.01
    stream = x.clone()
    out_stream, normed = residual_rms_norm(stream, add, w, 1e-5)
    assert out_stream is stream
    torch.testing.assert_close(stream, x + add, rtol=0, atol=0)  # the add rounds as torch's bfloat16 add
    torch.testing.assert_close(normed, _torch_path(monkeypatch, lambda: rms_norm(x + add, w, 1e-5)))


@pytest.mark.parametrize("rows", [1, 9, 200])
def test_bfloat16_rotary_with_the_kv_write_equals_torchs_bfloat16_rotary_and_index_copies(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    dim, q_heads, kv_heads, blocks, bs = 64, 8, 4, 64, 16
    rotary = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), 1.0, 4096, torch.bfloat16)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    cos, sin = rotary.tables(torch.randint(0, 4096, (rows,), generator=g))
    where = kv_rows(torch.randperm(blocks * bs, generator=g)[:rows], torch.arange(kv_heads), bs)
    caches = [torch.randn(blocks, kv_heads, bs, dim, generator=g).bfloat16() for _ in range(2)]

    def views(t):
        at = (q_heads + kv_heads) * dim
        return t[:, :at].view(rows, -1, dim), t[:, at:].view(rows, kv_heads, dim)

    want_qkv, (want_k, want_v) = qkv.clone(), [c.clone() for c in caches]
    qk, v = views(want_qkv)
    rotated = _torch_path(monkeypatch, lambda: RotaryEmbedding.apply(qk, cos, sin))  # torch: a new tensor
    assert rotated.data_ptr() != want_qkv.data_ptr()
    qk.copy_(rotated)
    want_k.view(-1, dim).index_copy_(0, where, qk[:, q_heads:].reshape(-1, dim))
    want_v.view(-1, dim).index_copy_(0, where, v.reshape(-1, dim))

    qk, v = views(qkv)
    got, stored = rotary_and_store(qk, q_heads, cos, sin, v, caches[0], caches[1], where)
    assert stored and got.data_ptr() == qkv.data_ptr()
    # each product and the sum rounded to bfloat16 as torch's ops round them: bit for bit
    torch.testing.assert_close(qkv, want_qkv, rtol=0, atol=0)
    torch.testing.assert_close(caches[0], want_k, rtol=0, atol=0)
    torch.testing.assert_close(caches[1], want_v, rtol=0, atol=0)


def test_a_bfloat16_models_logits_with_the_cpu_kernels_on_and_off(tiny_llama, make_runner, monkeypatch):
    """A bfloat16 model on CPU runs the paged decode kernel and the fused ops (not torch's gather
    and elementwise ops), and its logits agree with those ops' to bfloat16's precision."""
    from pdq.engine.runner import PrefillItem

    def logits() -> tuple[torch.Tensor, bool]:
        runner = make_runner(tiny_llama, dtype=torch.bfloat16)
        runner.allocate("a")
        runner.allocate("b")
        first = runner.step([PrefillItem("a", list(range(5, 40)), 0), PrefillItem("b", list(range(9, 20)), 0)], [])
        return torch.cat([first, runner.step([], [("a", 7, 35), ("b", 8, 11)])]).float(), runner.decode_kernel

    on, kernel = logits()
    assert kernel
    monkeypatch.setenv("PDQ_NO_CPU_KERNEL", "1")
    monkeypatch.setattr(cpu_kernels, "_tried", False)  # read the variable again
    try:
        off, kernel = logits()
    finally:
        monkeypatch.undo()
        cpu_kernels._tried = False
    assert not kernel
    torch.testing.assert_close(on, off, rtol=0.05, atol=0.05)
