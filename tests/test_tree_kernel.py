"""The Triton tree-attention kernel against the float64 einops reference.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest): fp32 and fp16 only, since the
interpreter computes bf16 dots wrongly. Small tiles (16 x 16, 32 x 16, ...) make small packs span many
tiles, so full, partial and skipped tiles all occur. Every buffer the kernels allocate (outputs, lse,
gradients) starts filled with NaN, so any element a kernel forgets to write fails the check. The TMA
tests run the tensor-descriptor loads (emulated by the interpreter on CPU) against the pointer loads.
"""


import hypothesis.strategies as st
import pytest
import torch
import triton
from hypothesis import given, settings
from treeattn_lab.kernels import attention_core
from treeattn_lab.kernels import tree_attention as kernel_module
from treeattn_lab.kernels.attention_core import tma_usable
from treeattn_lab.kernels.tree_attention import tile_schedule, triton_tree_attention
from treeattn_lab.kernels.tuning import LaunchConfig

from tests.conftest import poisoned_allocations, relative_error, rollout_forests
from treeattn_lab import RolloutTrie, reference, tree_attention

SMALL_TILES = [
    {"fwd_config": LaunchConfig(16, 16, 4, 1), "dkdv_config": LaunchConfig(16, 16, 4, 1),
     "dq_config": LaunchConfig(16, 16, 4, 1)},
    {"fwd_config": LaunchConfig(32, 16, 4, 1), "dkdv_config": LaunchConfig(16, 32, 4, 1),
     "dq_config": LaunchConfig(32, 16, 4, 1)},
    {"fwd_config": LaunchConfig(16, 16, 4, 1), "dkdv_config": LaunchConfig(32, 16, 4, 1),
     "dq_config": LaunchConfig(16, 32, 4, 1)},
]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU





def _check(pack, *, hq, hkv, d, dtype, seed, tiles, scale=None, split_groups=None):
    gen = torch.Generator().manual_seed(seed)
    T = pack.num_tokens
    q, k, v = (torch.randn(T, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    do = torch.randn(T, hq, d, generator=gen).to(dtype)
    inputs = [x.clone().to(DEVICE).requires_grad_() for x in (q, k, v)]
    with poisoned_allocations(kernel_module):
        out = triton_tree_attention(*inputs, pack.to(DEVICE), scale=scale, split_groups=split_groups, **tiles)
        out.backward(do.to(DEVICE))
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference.tree_attention(*ref_in, pack.subtree_end, scale=scale)
    ref.backward(do.double())
    tol = TOL[dtype]
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tol
    for got, want, name in zip(inputs, ref_in, "qkv", strict=True):
        assert torch.isfinite(got.grad).all(), f"d{name} has non-finite entries"
        assert relative_error(got.grad, want.grad) < 2 * tol, f"d{name} differs"
    # inputs untouched
    for x, x0 in zip(inputs, (q, k, v), strict=True):
        torch.testing.assert_close(x.detach().cpu(), x0, rtol=0, atol=0)


@settings(max_examples=8)
@given(seqs=rollout_forests(max_sequences=6, max_len=24), seed=st.integers(0, 2**31 - 1),
       gqa=st.sampled_from([(2, 1), (2, 2), (4, 2)]), tiles=st.sampled_from(SMALL_TILES),
       split_groups=st.sampled_from([False, True]))
def test_kernel_matches_reference_on_random_forests_fp32(seqs, seed, gqa, tiles, split_groups):
    pack = RolloutTrie.from_sequences(seqs).pack()
    _check(pack, hq=gqa[0], hkv=gqa[1], d=16, dtype=torch.float32, seed=seed, tiles=tiles,
           split_groups=split_groups)


@settings(max_examples=4)
@given(seqs=rollout_forests(max_sequences=6, max_len=24), seed=st.integers(0, 2**31 - 1))
def test_kernel_matches_reference_fp16(seqs, seed):
    pack = RolloutTrie.from_sequences(seqs).pack()
    _check(pack, hq=2, hkv=1, d=32, dtype=torch.float16, seed=seed, tiles=SMALL_TILES[0])


@pytest.mark.parametrize("split_groups", [False, True])
@pytest.mark.parametrize("order", ["insertion", "size"])
def test_prefix_sequences_single_token_nodes_and_awkward_length(order, split_groups):
    # a rollout that is a prefix of another, single-token nodes, duplicates; T = 49 (not a tile multiple)
    seqs = [list(range(30)), list(range(12)), list(range(12)) + [99], list(range(12)) + [99, 5],
            [7], [7, 8] + list(range(40, 55)), list(range(30))]
    pack = RolloutTrie.from_sequences(seqs).pack(order=order)
    assert pack.num_tokens % 16 != 0
    _check(pack, hq=4, hkv=2, d=16, dtype=torch.float32, seed=1, tiles=SMALL_TILES[1], scale=0.3,
           split_groups=split_groups)


def test_default_tiles_head_dim_64_through_public_entry_point():
    seqs = [list(range(50)) + [i] * (10 + 7 * i) for i in range(4)]
    pack = RolloutTrie.from_sequences(seqs).pack()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(pack.num_tokens, 2, 64, generator=gen) for _ in range(3))
    out = tree_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pack.to(DEVICE), backend="triton").cpu()
    want = reference.tree_attention(q.double(), k.double(), v.double(), pack.subtree_end)
    assert relative_error(out, want) < 2e-5


def test_return_lse_matches_reference():
    pack = RolloutTrie.from_sequences([[1, 2, 3, 4, 5], [1, 2, 6], [9] * 20]).pack()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(pack.num_tokens, 2, 16, generator=gen) for _ in range(3))
    _, lse = triton_tree_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pack.to(DEVICE),
                                   fwd_config=LaunchConfig(16, 16, 4, 1), return_lse=True)
    _, want = reference.tree_attention(q.double(), k.double(), v.double(), pack.subtree_end, return_lse=True)
    torch.testing.assert_close(lse.cpu().double(), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=25)
@given(seqs=rollout_forests(max_sequences=8, max_len=40), bm=st.sampled_from([16, 32]),
       bn=st.sampled_from([16, 32]))
def test_schedule_covers_every_visible_pair_and_full_tiles_need_no_mask(seqs, bm, bn):
    pack = RolloutTrie.from_sequences(seqs).pack()
    T = pack.num_tokens
    mask = pack.visibility_mask()
    sched = tile_schedule(pack.subtree_end, bm, bn)
    nq = -(-T // bm)
    covered = torch.zeros(T, T, dtype=torch.bool)
    for i in range(nq):
        start, full_end, end = sched["fwd_ptr"][i].tolist()
        rows = slice(i * bm, min(T, (i + 1) * bm))
        for pos in range(start, end):
            j = int(sched["fwd_idx"][pos])
            cols = slice(j * bn, min(T, (j + 1) * bn))
            if pos < full_end:
                assert mask[rows, cols].all(), "a tile marked full hides an invisible pair"
            assert mask[rows, cols].any(), "the schedule visits an invisible tile"
            covered[rows, cols] = True
    assert not (mask & ~covered).any(), "a visible pair lies in a skipped tile"
    # the backward schedule is the transpose of the forward one
    fwd_pairs = {(i, int(sched["fwd_idx"][p])) for i in range(nq)
                 for p in range(*sched["fwd_ptr"][i, [0, 2]].tolist())}
    bwd_pairs = {(int(sched["bwd_idx"][p]), j) for j in range(sched["bwd_ptr"].shape[0])
                 for p in range(*sched["bwd_ptr"][j, [0, 2]].tolist())}
    assert fwd_pairs == bwd_pairs


def test_schedule_skips_sibling_branches():
    # 8 rollouts share a 64-token prompt and fork into 64-token answers: with 16-token tiles each
    # answer tile sees the prompt and its own answer only
    seqs = [list(range(64)) + [1000 + b] * 64 for b in range(8)]
    pack = RolloutTrie.from_sequences(seqs).pack()
    sched = tile_schedule(pack.subtree_end, 16, 16)
    visited = sched["full_tiles"] + sched["partial_tiles"]
    dense_causal = sum(i + 1 for i in range(-(-pack.num_tokens // 16)))
    assert visited < 0.35 * dense_causal


def test_unsupported_head_dim_and_dtype_are_refused():
    pack = RolloutTrie.from_sequences([[1, 2, 3]]).pack()
    with pytest.raises(ValueError, match="head dim 24"):
        tree_attention(*(torch.randn(3, 1, 24) for _ in range(3)), pack, backend="triton")
    assert not any(key[0] == "triton_tree_schedule" for key in pack._cache), "a refused call cached one"
    with pytest.raises(TypeError, match="float64"):
        q64 = torch.randn(3, 1, 16, dtype=torch.float64)
        tree_attention(q64, q64, q64, pack, backend="triton")


# ------------------------------------------------------------------------------- TMA tile loads
TMA_TILES = {"fwd_config": LaunchConfig(32, 16, 4, 1, tma=True),
             "dkdv_config": LaunchConfig(16, 32, 4, 1, tma=True),
             "dq_config": LaunchConfig(32, 16, 4, 1, tma=True)}


def _awkward_pack():
    # T = 49 (not a tile multiple), a prefix rollout, single-token nodes: ragged last tiles everywhere
    seqs = [list(range(30)), list(range(12)), list(range(12)) + [99], list(range(12)) + [99, 5],
            [7], [7, 8] + list(range(40, 55)), list(range(30))]
    return RolloutTrie.from_sequences(seqs).pack()


def _shared_prompt_pack():
    # a 70-token prompt under three answers (T = 97): key tiles every query of a tile sees, so the
    # kernels' unmasked (full-tile) paths run, next to ragged ones
    pack = RolloutTrie.from_sequences([list(range(70)) + [1000 + b] * (4 + 2 * b) for b in range(3)]).pack()
    for bm, bn in ((16, 32), (32, 16)):
        assert tile_schedule(pack.subtree_end, bm, bn)["full_tiles"] > 0
    return pack


PACKS = {"awkward": _awkward_pack, "shared prompt": _shared_prompt_pack}


def _run(pack, inputs, do, tiles, split_groups, seen=None):
    """Output and gradients of one kernel call; ``seen`` collects the USE_TMA flag of every launch."""
    from treeattn_lab.kernels.tree_attention import _launch

    def spy(*args):
        meta = _launch(*args)
        seen.append(meta["USE_TMA"])
        return meta

    leaves = [x.detach().to(DEVICE).requires_grad_() for x in inputs]  # same storage, same alignment
    with poisoned_allocations(kernel_module, **({"_launch": spy} if seen is not None else {})):
        out = triton_tree_attention(*leaves, pack.to(DEVICE), split_groups=split_groups, **tiles)
        out.backward(do.to(DEVICE))
    return [out.detach().cpu()] + [x.grad.cpu() for x in leaves]


def _rounding_bounds(pack, inputs, do) -> list[torch.Tensor]:
    """Per element of ``(out, dq, dk, dv)``: how far apart two correct kernels of ``inputs``' dtype may land.

    TMA and pointer loads read the same bytes, but a GPU compiles them into different kernels whose dots
    may sum in another order. Each output is a sum of products (``out = P V``, ``dq = dS K``, ``dk = dS^T Q``,
    ``dv = P^T dO``) over intermediates (P, dS) that the kernels round to the input dtype before the second
    dot, then the result is rounded once more when stored. Two kernels therefore agree within
    ``2 u (M + |x|)``: ``u`` the dtype's unit roundoff, ``M`` the same sum over absolute values (float64),
    ``|x|`` the float64 result. Sums that cancel (``|x|`` far below ``M``) are why a bound relative to
    ``|x|`` alone fails for float16. ``dS = P (dP - delta)`` cancels itself, and each kernel takes
    ``delta = rowsum(dO O)`` from its own rounded ``O``, so dq's and dk's sizes use ``P (|dP| + |delta|)``."""
    q, k, v, dout = (x.double() for x in (*inputs, do))
    group = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scale = q.shape[-1] ** -0.5
    p = (torch.einsum("qhd,khd->hqk", q, kk) * scale).masked_fill(~pack.visibility_mask(), float("-inf"))
    p = p.softmax(-1)
    out = torch.einsum("hqk,khd->qhd", p, vv)
    dp, delta = torch.einsum("qhd,khd->hqk", dout, vv), (out * dout).sum(-1).T[:, :, None]
    ds, ds_size = p * (dp - delta), p * (dp.abs() + (out.abs() * dout.abs()).sum(-1).T[:, :, None])
    per_kv_head = lambda x: x.unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731
    u = torch.finfo(inputs[0].dtype).eps / 2
    results = [out, torch.einsum("hqk,khd->qhd", ds, kk) * scale,
               per_kv_head(torch.einsum("hqk,qhd->khd", ds, q) * scale),
               per_kv_head(torch.einsum("hqk,qhd->khd", p, dout))]
    magnitudes = [torch.einsum("hqk,khd->qhd", p, vv.abs()),
                  torch.einsum("hqk,khd->qhd", ds_size, kk.abs()) * scale,
                  per_kv_head(torch.einsum("hqk,qhd->khd", ds_size, q.abs()) * scale),
                  per_kv_head(torch.einsum("hqk,qhd->khd", p, dout.abs()))]
    return [2 * u * (m + x.abs()) for x, m in zip(results, magnitudes, strict=True)]


@pytest.mark.parametrize("pack_kind", sorted(PACKS))
@pytest.mark.parametrize(("dtype", "split_groups"), [(torch.float32, False), (torch.float16, True)])
def test_tma_loads_match_pointer_loads_and_reference(dtype, split_groups, pack_kind):
    # every kernel through tensor descriptors (emulated by the interpreter on CPU, Hopper's TMA on an
    # sm_90 GPU): the same numbers as the pointer loads, and the float64 reference
    pack = PACKS[pack_kind]()
    gen = torch.Generator().manual_seed(11)
    T = pack.num_tokens
    inputs = [torch.randn(T, h, 16, generator=gen).to(dtype) for h in (4, 2, 2)]
    do = torch.randn(T, 4, 16, generator=gen).to(dtype)
    assert tma_usable(*inputs)  # aligned rows (and on CPU the interpreter emulates descriptors)
    seen = []
    tma = _run(pack, inputs, do, TMA_TILES, split_groups, seen)
    assert seen == [tma_usable(*(x.to(DEVICE) for x in inputs))] * 3  # on a GPU before sm_90: pointers
    pointer_tiles = {name: cfg.replace(tma=False) for name, cfg in TMA_TILES.items()}
    pointer = _run(pack, inputs, do, pointer_tiles, split_groups)
    bounds = _rounding_bounds(pack, inputs, do)
    for got, want, bound, name in zip(tma, pointer, bounds, ["out", "dq", "dk", "dv"], strict=True):
        assert torch.isfinite(got).all(), name
        excess = float(((got.double() - want.double()).abs() - bound).max())
        assert excess <= 0, f"{name}: TMA and pointer loads differ by {excess:.2e} beyond rounding"
    _check(pack, hq=4, hkv=2, d=16, dtype=dtype, seed=12, tiles=TMA_TILES, split_groups=split_groups)


def test_tma_falls_back_to_pointer_loads_on_unaligned_rows():
    # rows 4 bytes off a 16-byte boundary cannot be described to the copy engine: the pointer loads run
    pack = _awkward_pack()
    T = pack.num_tokens
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(T * 2 * 16 + 1, generator=gen).to(DEVICE)[1:].view(T, 2, 16) for _ in range(3))
    assert not tma_usable(q, k, v)
    seen = []
    out = _run(pack, (q, k, v), torch.zeros(T, 2, 16), {"fwd_config": LaunchConfig(16, 16, 4, 1, tma=True)},
               False, seen)[0]
    assert seen == [False, False, False]
    want = reference.tree_attention(*(x.cpu().double() for x in (q, k, v)), pack.subtree_end)
    assert relative_error(out, want) < 2e-5


def test_tma_refuses_overlapping_rows():
    # a key broadcast over tokens (stride 0) is aligned but no descriptor can describe it
    x = torch.randn(8, 2, 16).to(DEVICE)
    assert tma_usable(x, x, x)
    assert not tma_usable(x, x[:1].expand(8, 2, 16), x)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: LaunchConfig(16, 16, 4, 1, tma="yes"), TypeError, "tma must be a bool"),
    (lambda: LaunchConfig(24, 16, 4, 1), ValueError, "block_m must be a power of two >= 16"),
    (lambda: LaunchConfig(16, 8, 4, 1), ValueError, "block_n must be a power of two >= 16"),
    (lambda: LaunchConfig(16, 16, 0, 1), ValueError, "num_warps must be an int >= 1"),
    (lambda: (16, 16, 4, 1), TypeError, "dq_config must be a treeattn_lab.kernels.tuning.LaunchConfig"),
    (lambda: "atomic", TypeError, "dq_config must be a treeattn_lab.kernels.tuning.LaunchConfig"),
])
def test_launch_configs_are_validated(make, error, match):
    pack = RolloutTrie.from_sequences([[1, 2, 3]]).pack()
    q = torch.randn(3, 1, 16)
    with pytest.raises(error, match=match):
        triton_tree_attention(q, q, q, pack, dq_config=make())


def test_scratch_allocator_is_installed_only_where_none_is():
    # on-device descriptors need triton.set_allocator; the setting is per thread, so try fresh threads
    import threading

    from triton.runtime import _allocation

    def theirs(size, alignment, stream):
        return None

    found = []

    def fresh_thread(preset):
        if preset is not None:
            triton.set_allocator(preset)
        attention_core.ensure_scratch_allocator()
        found.append(_allocation._allocator.get())

    for preset in (None, theirs):
        thread = threading.Thread(target=fresh_thread, args=(preset,))
        thread.start()
        thread.join()
    assert found == [attention_core.tma_scratch, theirs]
