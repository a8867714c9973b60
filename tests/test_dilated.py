"""Dilated attention: the pattern, the Triton kernel against the einops reference, the op, the decode step.

On CPU the kernel runs under TRITON_INTERPRET=1 (fp32 and fp16 only); on a GPU it runs compiled. Small
tiles (16 x 16, 32 x 16) make short sequences cross many tiles, so unaligned compact tiles, whole tiles
and window tiles all occur. Every buffer the kernel module allocates starts as NaN.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from treeattn_lab.kernels import dilated_attention as kernel_module
from treeattn_lab.kernels.dilated_attention import triton_dilated_attention
from treeattn_lab.kernels.tuning import LaunchConfig

from tests.conftest import poisoned_allocations, relative_error
from treeattn_lab import dilated_attention, reference
from treeattn_lab.ops.dilated_decode import DilatedKVCache, dilated_decode_step
from treeattn_lab.patterns.dilated import DilatedPattern, dilated_mask, dilated_mask_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
SMALL_TILES = [
    {"fwd_config": LaunchConfig(16, 16, 4, 1), "dkdv_config": LaunchConfig(16, 16, 4, 1),
     "dq_config": LaunchConfig(16, 16, 4, 1)},
    {"fwd_config": LaunchConfig(32, 16, 4, 1), "dkdv_config": LaunchConfig(16, 32, 4, 1),
     "dq_config": LaunchConfig(16, 32, 4, 1)},
]


# ---------------------------------------------------------------------------------------------- pattern
def _rule(t: int, p: int, D: int, W: int, P: int) -> bool:
    """The rule exactly as the issue states it, one pair at a time."""
    return p <= t and (t - p <= W or p < P or ((p + 1) % D == 0 and p < t - W))


@settings(max_examples=25)
@given(n=st.integers(0, 40), D=st.integers(1, 12), W=st.integers(0, 12), P=st.integers(0, 12))
def test_pattern_forms_agree_with_the_rule(n, D, W, P):
    pattern = DilatedPattern(D, W, P)
    mask = pattern.dense_mask(n)
    expected = torch.tensor([[_rule(t, p, D, W, P) for p in range(n)] for t in range(n)], dtype=torch.bool)
    assert torch.equal(mask, expected.reshape(n, n))
    t, p = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert torch.equal(dilated_mask_mod(D, W, P)(0, 0, t, p), mask)
    # the three parts are disjoint and cover the row; compact key j sits at position j D + D - 1
    pos = pattern.compact_positions(n)
    assert pos.numel() == pattern.num_compact(n) == n // D and bool(((pos + 1) % D == 0).all())
    cover = torch.zeros(n, n, dtype=torch.int64)
    for name, (start, end) in pattern.parts(torch.arange(n)).items():
        for row in range(n):
            keys = torch.arange(int(start[row]), int(end[row]))
            cover[row, pos[keys] if name == "strided" else keys] += 1
    assert torch.equal(cover, mask.long())
    assert pattern.num_pairs(n) == int(mask.sum())
    assert pattern.kv_cache_entries(n) <= min(n, P + W + 1 + n // D)


def test_dilation_one_is_causal_and_cache_shrinks():
    assert torch.equal(dilated_mask(9, 1, 0, 0), torch.ones(9, 9, dtype=torch.bool).tril())
    assert torch.equal(dilated_mask(9, 3, window=100), torch.ones(9, 9, dtype=torch.bool).tril())
    pattern = DilatedPattern(16, 256, 4)
    assert pattern.kv_cache_entries(131072) == 4 + 256 + 1 + 8192
    causal = DilatedPattern(1).num_pairs(4096)
    assert causal == 4096 * 4097 // 2
    assert 12 < causal / DilatedPattern(16, 0, 0).num_pairs(4096) < 17


@pytest.mark.parametrize(
    ("args", "error"),
    [((0, 0, 0), ValueError), ((4, -1, 0), ValueError), ((4, 0, -2), ValueError), ((2.0, 0, 0), TypeError),
     ((True, 0, 0), TypeError), ((4, "1", 0), TypeError)],
)
def test_pattern_rejects_bad_parameters(args, error):
    with pytest.raises(error):
        DilatedPattern(*args)


# ---------------------------------------------------------------------------------------------- kernel



def _check(shape, pattern, *, dtype, seed, tiles, scale=None):
    """Kernel vs float64 reference, forward and backward, NaN-poisoned buffers, inputs untouched."""
    (B, N, hq, hkv, d), (D, W, P) = shape, pattern
    gen = torch.Generator().manual_seed(seed)
    lead = (B,) if B else ()
    q, k, v, do = (torch.randn(*lead, N, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv, hq))
    inputs = [x.clone().to(DEVICE).requires_grad_() for x in (q, k, v)]
    with poisoned_allocations(kernel_module):
        out, lse = triton_dilated_attention(*inputs, dilation=D, window=W, initial=P, scale=scale,
                                            return_lse=True, **tiles)
        out.backward(do.to(DEVICE))
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    mask = DilatedPattern(D, W, P).dense_mask(N)
    rows = zip(*ref_in, strict=True) if B else [ref_in]
    refs = [reference.masked_attention(*r, mask, scale=scale, return_lse=True) for r in rows]
    ref = torch.stack([o for o, _ in refs]) if B else refs[0][0]
    ref_lse = torch.stack([s for _, s in refs]) if B else refs[0][1]
    ref.backward(do.double())
    tol = TOL[dtype]
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tol
    torch.testing.assert_close(lse.cpu().double(), ref_lse.detach(), atol=1e-3, rtol=1e-3)
    for got, want, name in zip(inputs, ref_in, "qkv", strict=True):
        assert torch.isfinite(got.grad).all(), f"d{name} has non-finite entries"
        assert relative_error(got.grad, want.grad) < 2 * tol, f"d{name} differs"
    for x, x0 in zip(inputs, (q, k, v), strict=True):
        torch.testing.assert_close(x.detach().cpu(), x0, rtol=0, atol=0)


@settings(max_examples=10)
@given(
    n=st.integers(1, 90),
    D=st.integers(1, 20),
    W=st.sampled_from([0, 0, 1, 5, 16, 33]),
    P=st.sampled_from([0, 0, 1, 4, 17, 40]),
    heads=st.sampled_from([(2, 1), (2, 2), (4, 2)]),
    batch=st.sampled_from([0, 2]),
    seed=st.integers(0, 2**31 - 1),
    tiles=st.sampled_from(SMALL_TILES),
)
def test_kernel_matches_reference_fp32(n, D, W, P, heads, batch, seed, tiles):
    _check((batch, n, *heads, 16), (D, W, P), dtype=torch.float32, seed=seed, tiles=tiles)


@pytest.mark.parametrize(
    ("shape", "pattern"),
    [
        ((0, 77, 2, 1, 16), (4, 0, 0)),  # window 0: the query itself plus every 4th key; 77 % 4 != 0
        ((0, 50, 2, 2, 32), (3, 7, 2)),  # N, W, P not multiples of D or of the tiles
        ((2, 40, 4, 2, 16), (64, 3, 5)),  # D > N: no strided key at all
        ((0, 64, 2, 1, 16), (2, 0, 40)),  # initial keys spanning several tiles
    ],
)
def test_kernel_matches_reference_edge_cases(shape, pattern):
    _check(shape, pattern, dtype=torch.float32, seed=sum(shape), tiles=SMALL_TILES[0], scale=0.3)


@pytest.mark.parametrize(("n", "pattern"), [(61, (4, 8, 2)), (45, (1, 0, 0))])
def test_kernel_matches_reference_fp16(n, pattern):
    _check((0, n, 2, 1, 16), pattern, dtype=torch.float16, seed=n, tiles=SMALL_TILES[1])


@pytest.mark.parametrize(("config", "error", "match"), [
    ((16, 16, 4, 1), TypeError, "dkdv_config must be a treeattn_lab.kernels.tuning.LaunchConfig"),
    (LaunchConfig(16, 16, 4, 1, tma=True), ValueError, "no TMA path"),
])
def test_launch_configs_are_checked(config, error, match):
    q = torch.randn(20, 1, 16, device=DEVICE)
    with pytest.raises(error, match=match):
        triton_dilated_attention(q, q, q, dilation=4, dkdv_config=config)


def test_dilation_one_equals_causal_attention():
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 37, h, 16, generator=gen) for h in (4, 2, 2))
    want = reference.causal_attention(q.double(), k.double(), v.double())
    for backend in ("reference", "triton"):
        dev = DEVICE if backend == "triton" else "cpu"
        got = dilated_attention(q.to(dev), k.to(dev), v.to(dev), dilation=1, window=3, initial=2,
                                backend=backend)
        assert relative_error(got, want) < 1e-5


# ---------------------------------------------------------------------------------------------- the op
def _qkv(n=12, hq=2, hkv=1, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv)]


def test_flex_backend_matches_reference():
    q, k, v = _qkv(n=70, seed=3)
    want = dilated_attention(q, k, v, dilation=8, window=4, initial=2, backend="reference")
    got = dilated_attention(q, k, v, dilation=8, window=4, initial=2, backend="flex")
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "flex", "triton"])
@pytest.mark.parametrize("lead", [(), (2,)])
def test_no_tokens_give_an_empty_output_on_every_backend(backend, lead):
    q, k, v = (torch.randn(*lead, 0, h, 16, requires_grad=True) for h in (2, 1, 1))
    dev = DEVICE if backend == "triton" else "cpu"
    leaves = [x.detach().to(dev).requires_grad_() for x in (q, k, v)]
    out = dilated_attention(*leaves, dilation=4, window=2, initial=1, backend=backend)
    assert out.shape == (*lead, 0, 2, 16) and out.dtype == q.dtype
    if backend != "triton":  # the kernels' autograd on zero tokens: nothing to launch
        out.sum().backward()
        assert all(x.grad is not None and x.grad.shape == x.shape for x in leaves)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"dilation": 0}, ValueError, "dilation"),
        ({"dilation": 2.5}, TypeError, "dilation"),
        ({"window": -1}, ValueError, "window"),
        ({"initial": None}, TypeError, "initial"),
        ({"backend": "fast"}, ValueError, "unknown backend"),
        ({"scale": -1.0}, ValueError, "scale"),
        ({"k": torch.zeros(11, 1, 16)}, ValueError, "token counts"),
        ({"k": torch.zeros(12, 2, 16), "v": torch.zeros(12, 2, 16), "q": torch.zeros(12, 3, 16)}, ValueError,
         "multiple"),
        ({"q": torch.zeros(12, 2, 16, dtype=torch.float64)}, TypeError, "dtypes"),
        ({"q": torch.zeros(2, 12, 2, 16)}, ValueError, "3-D"),
    ],
)
def test_op_rejects_bad_input(change, error, match):
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v, "dilation": 4, **change}
    with pytest.raises(error, match=match):
        dilated_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_op_does_not_touch_inputs_and_batches():
    q, k, v = _qkv(n=20, seed=2)
    copies = [x.clone() for x in (q, k, v)]
    single = dilated_attention(q, k, v, dilation=3, window=2, initial=1, backend="reference")
    batched = dilated_attention(q[None].expand(2, -1, -1, -1), k[None].expand(2, -1, -1, -1),
                                v[None].expand(2, -1, -1, -1), dilation=3, window=2, initial=1)
    torch.testing.assert_close(batched[1], single)
    for x, x0 in zip((q, k, v), copies, strict=True):
        assert torch.equal(x, x0)


# ---------------------------------------------------------------------------------------------- decode
@settings(max_examples=15)
@given(n=st.integers(1, 60), D=st.integers(1, 9), W=st.integers(0, 9), P=st.integers(0, 9),
       heads=st.sampled_from([(2, 1), (2, 2)]), seed=st.integers(0, 2**31 - 1))
def test_decode_step_equals_last_row_of_full_attention(n, D, W, P, heads, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64) for h in (heads[0], *heads[1:] * 2))
    full, full_lse = reference.masked_attention(q, k, v, dilated_mask(n, D, W, P), return_lse=True)
    cache = DilatedKVCache(dilation=D, window=W, initial=P)
    cache.extend(k, v)  # the whole prompt at once
    out, lse = dilated_decode_step(q[-1], cache, return_lse=True)
    torch.testing.assert_close(out, full[-1])
    torch.testing.assert_close(lse, full_lse[-1])
    assert cache.entries <= P + W + 1 + n // D
    stepped = DilatedKVCache(dilation=D, window=W, initial=P)  # token by token: every row
    for t in range(n):
        stepped.append(k[t], v[t])
        torch.testing.assert_close(dilated_decode_step(q[t], stepped), full[t])
    for part in ("initial_k", "window_k", "compact_k"):
        assert torch.equal(getattr(stepped, part), getattr(cache, part))


def test_decode_rejects_bad_use():
    with pytest.raises(ValueError, match="empty"):
        dilated_decode_step(torch.zeros(2, 8), DilatedKVCache(dilation=4))
    cache = DilatedKVCache(dilation=4)
    cache.append(torch.zeros(1, 8), torch.zeros(1, 8))
    with pytest.raises(ValueError, match="match"):
        cache.append(torch.zeros(2, 8), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="one token"):
        dilated_decode_step(torch.zeros(3, 2, 8), cache)
    with pytest.raises(TypeError, match="DilatedKVCache"):
        dilated_decode_step(torch.zeros(2, 8), object())
