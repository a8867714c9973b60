"""The block-sparse Triton kernel (tiles + bar columns) against the float64 einops reference.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest): fp32 and fp16 only, since the
interpreter computes bf16 dots wrongly. Blocks of 16 or 32 tokens and bar chunks of 16 columns make
small sequences span many tiles and chunks. Every buffer the kernel module allocates starts filled with
NaN, so any element a kernel forgets to write fails the check.
"""


import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from treeattn_lab.kernels import block_sparse as kernel_module
from treeattn_lab.kernels.block_sparse import (
    attention_delta,
    gather_bars,
    sparse_backward,
    sparse_forward,
    triton_sparse_attention,
)

from tests.conftest import poisoned_allocations, relative_error
from treeattn_lab import sparse_attention
from treeattn_lab.ops.sparse import reference_sparse_attention
from treeattn_lab.patterns.vertical_slash import VerticalSlashPattern

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
SMALL = {"bar": 16, "split": 2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU





def random_pattern(gen, n, heads, block_size, n_vertical, n_slash, *, diagonal=True):
    vertical = torch.randint(-1, n, (heads, n_vertical), generator=gen)
    slash = torch.randint(-1, n, (heads, n_slash), generator=gen)
    if diagonal and n_slash:
        slash[:, 0] = 0
    return VerticalSlashPattern(vertical, slash, block_size)


def _check(pattern, n, *, hq, hkv, d, dtype, seed, scale=None, config=SMALL):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    do = torch.randn(n, hq, d, generator=gen).to(dtype)
    inputs = [x.clone().to(DEVICE).requires_grad_() for x in (q, k, v)]
    index = pattern.to(DEVICE).block_index(n)
    with poisoned_allocations(kernel_module):
        out, lse = triton_sparse_attention(*inputs, index, scale=scale, config=config, return_lse=True)
        out.backward(do.to(DEVICE))
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = reference_sparse_attention(*ref_in, pattern, scale=scale, return_lse=True)
    ref.backward(do.double())
    tol = TOL[dtype]
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tol
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen), "rows that see nothing must have lse -inf"
    torch.testing.assert_close(lse.cpu().double()[seen], ref_lse[seen], rtol=10 * tol, atol=10 * tol)
    for got, want, name in zip(inputs, ref_in, "qkv", strict=True):
        assert torch.isfinite(got.grad).all(), f"d{name} has non-finite entries"
        assert relative_error(got.grad, want.grad) < 2 * tol, f"d{name} differs"
    for x, x0 in zip(inputs, (q, k, v), strict=True):  # inputs untouched
        torch.testing.assert_close(x.detach().cpu(), x0, rtol=0, atol=0)


@settings(max_examples=6)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(20, 150), block_size=st.sampled_from([16, 32]),
       gqa=st.sampled_from([(2, 1), (2, 2), (4, 2)]), lines=st.sampled_from([(0, 3), (5, 4), (12, 2)]))
def test_kernel_matches_reference_on_random_patterns_fp32(seed, n, block_size, gqa, lines):
    gen = torch.Generator().manual_seed(seed)
    pattern = random_pattern(gen, n, gqa[0], block_size, *lines)
    _check(pattern, n, hq=gqa[0], hkv=gqa[1], d=16, dtype=torch.float32, seed=seed)


def test_kernel_matches_reference_fp16_awkward_size():
    gen = torch.Generator().manual_seed(7)
    pattern = random_pattern(gen, 83, 2, 16, 7, 4)  # 83 tokens: neither tiles nor chunks divide it
    _check(pattern, 83, hq=2, hkv=1, d=32, dtype=torch.float16, seed=7, scale=0.2)


def test_empty_verticals_and_all_local_pattern():
    # only the local window, no columns at all: the bar part is absent
    local = VerticalSlashPattern(torch.zeros(3, 0, dtype=torch.long), torch.arange(20).expand(3, -1), 16)
    assert local.block_index(70).bar_pos is None
    _check(local, 70, hq=3, hkv=3, d=16, dtype=torch.float32, seed=1)
    # columns padded away entirely (-1) behave the same
    padded = VerticalSlashPattern(torch.full((3, 4), -1), torch.arange(20).expand(3, -1), 16)
    _check(padded, 70, hq=3, hkv=3, d=16, dtype=torch.float32, seed=2)


def test_rows_that_see_nothing_output_zero():
    # no diagonal 0 and a single late column: early queries see no key at all (block rounding: slash 90
    # = 5 blocks of 16 + 10 selects the tiles 5 and 6 blocks below the diagonal, so rows >= 80 see keys)
    pattern = VerticalSlashPattern(torch.tensor([[40], [-1]]), torch.tensor([[50], [90]]), 16)
    _check(pattern, 100, hq=2, hkv=1, d=16, dtype=torch.float32, seed=3)
    q = torch.randn(100, 2, 16)
    out = triton_sparse_attention(q.to(DEVICE), q[:, :1].to(DEVICE), q[:, :1].to(DEVICE),
                                  pattern.to(DEVICE).block_index(100), config=SMALL).cpu()
    assert (out[:40, 0] == 0).all() and (out[:80, 1] == 0).all()
    assert (out[80:, 1] != 0).any()


def test_merge_state_and_accumulated_gradients_across_split_keys():
    """Two calls over disjoint key halves, merged in place, equal one call; so do their gradients
    (the ring's contract: MERGE forward, ACCUMULATE dq, fresh fp32 dk/dv per call)."""
    n, heads, d, bs = 96, 2, 16, 16
    gen = torch.Generator().manual_seed(11)
    pattern = random_pattern(gen, n, heads, bs, 6, 4).to(DEVICE)
    q, k, v, do = (torch.randn(n, heads, d, generator=gen).to(DEVICE) for _ in range(4))
    full = pattern.block_index(n)
    bar_k, bar_v = gather_bars(k, v, full)
    o_full, lse_full = sparse_forward(q, k, v, bar_k, bar_v, full, scale=0.25, config=SMALL)
    nb = n // bs
    halves = [torch.arange(0, nb, 2), torch.arange(1, nb, 2)]
    state = (torch.zeros(n, heads, d, device=DEVICE), torch.full((heads, n), float("-inf"), device=DEVICE))
    parts = []
    for j, kb in enumerate(halves):
        idx = pattern.block_index(n, q_blocks=torch.arange(nb), k_blocks=kb, bars=j == 0)
        rows = (kb[:, None] * bs + torch.arange(bs)).flatten().to(DEVICE)
        parts.append((idx, rows))
        sparse_forward(q, k[rows], v[rows], bar_k, bar_v, idx, scale=0.25, state=state, config=SMALL)
    torch.testing.assert_close(state[0], o_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1], lse_full, rtol=1e-5, atol=1e-5)
    delta = attention_delta(o_full, do)
    dq_full, dk_full, dv_full, dbk_full, dbv_full = sparse_backward(
        do, q, k, v, bar_k, bar_v, lse_full, delta, full, scale=0.25, config=SMALL)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for j, (idx, rows) in enumerate(parts):
        dk_part, dv_part = torch.full_like(k[rows], float("nan")), torch.full_like(v[rows], float("nan"))
        _, _, _, dbk, dbv = sparse_backward(do, q, k[rows], v[rows], bar_k, bar_v, lse_full, delta, idx,
                                            scale=0.25, dq=dq, dk=dk_part, dv=dv_part, accumulate_q=True,
                                            config=SMALL)
        dk[rows] += dk_part
        dv[rows] += dv_part
        if j == 0:
            torch.testing.assert_close(dbk, dbk_full, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dbv, dbv_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dq, dq_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk, dk_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dv, dv_full, rtol=1e-5, atol=1e-5)


def test_public_entry_point_backends_agree():
    gen = torch.Generator().manual_seed(4)
    n = 64
    pattern = random_pattern(gen, n, 4, 16, 5, 3)
    q = torch.randn(n, 4, 16, generator=gen)
    k, v = (torch.randn(n, 2, 16, generator=gen) for _ in range(2))
    want = sparse_attention(q.double(), k.double(), v.double(), pattern, backend="reference")
    assert sparse_attention(q, k, v, pattern).dtype == torch.float32  # auto: reference on CPU
    got = sparse_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pattern.to(DEVICE), backend="triton")
    assert relative_error(got, want) < 2e-5
    if DEVICE == "cpu":  # FlexAttention: forward only on CPU
        flex = sparse_attention(q, k, v, pattern, backend="flex")
        assert relative_error(flex, want) < 2e-5


def test_bad_inputs_are_refused_clearly():
    pattern = VerticalSlashPattern([[0, 3]], [[0]], 16)
    q = torch.randn(8, 1, 16)
    with pytest.raises(TypeError, match="VerticalSlashPattern"):
        sparse_attention(q, q, q, {"vertical": [0]})
    with pytest.raises(ValueError, match="pattern has 1 heads but q has 2"):
        sparse_attention(torch.randn(8, 2, 16), q, q, pattern)
    with pytest.raises(ValueError, match="out of range"):
        sparse_attention(torch.randn(2, 1, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16), pattern)
    with pytest.raises(ValueError, match="head dim 24"):
        sparse_attention(*(torch.randn(8, 1, 24) for _ in range(3)), pattern, backend="triton")
    with pytest.raises(TypeError, match="float64"):
        q64 = torch.randn(8, 1, 16, dtype=torch.float64)
        sparse_attention(q64, q64, q64, pattern, backend="triton")
    with pytest.raises(ValueError, match="unknown backend"):
        sparse_attention(q, q, q, pattern, backend="cuda")
    with pytest.raises(ValueError, match="scale"):
        sparse_attention(q, q, q, pattern, scale=-1.0)
