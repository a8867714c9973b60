"""The block-sparse Triton kernel (tiles + bar columns) against the float64 einops reference.

On CPU the kernel runs under TRITON_INTERPRET=1 (set in conftest): fp32 and fp16 only, since the
interpreter computes bf16 dots wrongly. Blocks of 16 or 32 tokens and bar chunks of 16 columns make
small sequences span many tiles and chunks; the SUBTILED launch settings cut every 32-token block into
two programs and two steps, as the GPU settings cut 128-token blocks. Every buffer the kernel module
allocates starts filled with NaN, so any element a kernel forgets to write fails the check. The last
test compiles the kernels for an H200 (sm_90) without a GPU, catching what the interpreter lets pass.
"""

import os
import subprocess
import sys
import textwrap

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from treeattn_lab.kernels import block_sparse as kernel_module
from treeattn_lab.kernels import tuning
from treeattn_lab.kernels.attention_core import attention_delta
from treeattn_lab.kernels.bar_columns import BAR_PAD, bar_plan, gather_bars
from treeattn_lab.kernels.block_sparse import sparse_backward, sparse_forward, triton_sparse_attention
from treeattn_lab.kernels.tuning import LaunchConfig, SparseConfig

from tests.conftest import poisoned_allocations, relative_error
from treeattn_lab import sparse_attention
from treeattn_lab.patterns.vertical_slash import VerticalSlashPattern
from treeattn_lab.reference.sparse import sparse_attention as reference_sparse_attention

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
SMALL = SparseConfig(bar=16, split=2)
SUBTILED = SparseConfig(fwd=LaunchConfig(16, 16, 4, 1), dq=LaunchConfig(16, 16, 4, 1),
                        dkdv=LaunchConfig(16, 16, 4, 1), bar=16, bar_kv=32, split=1)
CONFIGS = [SMALL, SUBTILED, SparseConfig(bar=32, bar_kv=16, split=3)]
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
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(20, 130), block_size=st.sampled_from([16, 32]),
       gqa=st.sampled_from([(2, 1), (2, 2), (4, 2)]),
       lines=st.sampled_from([(0, 3), (5, 4), (12, 2), (40, 2)]), config=st.sampled_from(CONFIGS))
def test_kernel_matches_reference_on_random_patterns_fp32(seed, n, block_size, gqa, lines, config):
    gen = torch.Generator().manual_seed(seed)
    pattern = random_pattern(gen, n, gqa[0], block_size, *lines)
    _check(pattern, n, hq=gqa[0], hkv=gqa[1], d=16, dtype=torch.float32, seed=seed, config=config)


@pytest.mark.parametrize("config", [SMALL, SUBTILED], ids=["small", "subtiled"])
def test_kernel_matches_reference_fp16_awkward_size(config):
    gen = torch.Generator().manual_seed(7)
    pattern = random_pattern(gen, 83, 2, 16, 7, 4)  # 83 tokens: neither tiles nor chunks divide it
    _check(pattern, 83, hq=2, hkv=1, d=32, dtype=torch.float16, seed=7, scale=0.2, config=config)


def test_dq_into_a_callers_buffer_of_another_dtype():
    """The dQ kernel writes (or with accumulate_q adds) into a caller's fp16 dQ what it returns fresh."""
    n, heads, d = 80, 2, 16
    gen = torch.Generator().manual_seed(9)
    index = random_pattern(gen, n, heads, 16, 6, 3).to(DEVICE).block_index(n)
    q, k, v, do = (torch.randn(n, heads, d, generator=gen).to(DEVICE, torch.float16) for _ in range(4))
    bar_k, bar_v = gather_bars(k, v, index)
    o, lse = sparse_forward(q, k, v, bar_k, bar_v, index, scale=0.25)
    delta = attention_delta(o, do)
    fresh = sparse_backward(do, q, k, v, bar_k, bar_v, lse, delta, index, scale=0.25, config=SMALL)[0]
    assert torch.isfinite(fresh).all() and fresh.abs().sum() > 0
    start = torch.randn(n, heads, d, generator=gen).to(DEVICE, torch.float16)
    for accumulate in (False, True):
        dq = start.clone()
        out = sparse_backward(do, q, k, v, bar_k, bar_v, lse, delta, index, scale=0.25, dq=dq,
                              accumulate_q=accumulate, config=SMALL)[0]
        assert out is dq
        want = start.float() + fresh.float() if accumulate else fresh.float()
        torch.testing.assert_close(dq.float(), want, rtol=2e-3, atol=2e-3)


def test_clean_bar_chunks_run_unmasked_and_match_fp16_subtiled():
    """Many columns: most chunks are clean (before the block, in no tile) and take the unmasked path;
    awkward length, GQA, sub-tiled programs, a far slash whose tiles swallow some columns."""
    n, bs = 179, 32
    gen = torch.Generator().manual_seed(5)
    vertical = torch.randperm(n, generator=gen)[:100].reshape(2, 50)
    pattern = VerticalSlashPattern(vertical, torch.tensor([[0, 1, -1], [0, 1, 100]]), bs)
    plan = bar_plan(pattern.block_index(n), 32)
    assert (plan.clean >= 32).any(), "no clean chunk: the unmasked bar path would go untested"
    assert (plan.clean_from < plan.clean.shape[1]).any()
    _check(pattern, n, hq=2, hkv=1, d=32, dtype=torch.float16, seed=5, config=SUBTILED)
    _check(pattern, n, hq=2, hkv=2, d=16, dtype=torch.float32, seed=6, config=SparseConfig(bar=16, bar_kv=16))


@settings(max_examples=8)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(40, 200), bar_kv=st.sampled_from([16, 32]),
       ring=st.booleans())
def test_bar_plan_agrees_with_the_bar_mask(seed, n, bar_kv, ring):
    """The plan's promises, checked against ``bar_mask`` (which bars each query reads): the first
    ``clean`` bars are read by every query of the block; from ``clean_from`` on every real bar of the
    chunk is; before ``first`` none is. Also for a ring step's blocks."""
    gen = torch.Generator().manual_seed(seed)
    pattern = random_pattern(gen, n, 2, 16, 30, 4)
    nb = pattern.num_blocks(n)
    if ring:
        q_blocks = torch.randperm(nb, generator=gen)[: max(1, nb // 2)].sort().values
        k_blocks = torch.arange(nb)
        index = pattern.block_index(n, q_blocks=q_blocks, k_blocks=k_blocks)
    else:
        index = pattern.block_index(n)
    if index.bar_pos is None:
        return
    plan = bar_plan(index, bar_kv)
    reads = index.bar_mask()  # [H, num_q, nb]
    real = index.bar_pos != BAR_PAD
    block = torch.arange(index.num_q) // index.block_size
    for h in range(index.num_heads):
        for i in range(index.q_blocks.numel()):
            rows = reads[h, block == i]  # [queries of block i, nb]
            everyone = rows.all(0) & real[h]
            clean = int(plan.clean[h, i])
            assert everyone[:clean].all()
            assert clean == everyone.numel() or not everyone[clean], "clean prefix is not maximal"
            for c in range(plan.first.shape[1]):
                cols = slice(c * bar_kv, (c + 1) * bar_kv)
                if i < int(plan.first[h, c]):
                    assert not rows[:, cols].any(), "a chunk is read before its first block"
                if i >= int(plan.clean_from[h, c]):
                    assert (everyone[cols] | ~real[h, cols]).all(), "a clean chunk needs a mask"
    assert plan.pairs == int((index.q_blocks.numel() - plan.first.long()).sum())


def test_empty_verticals_and_all_local_pattern():
    # only the local window, no columns at all: the bar part is absent
    local = VerticalSlashPattern(torch.zeros(3, 0, dtype=torch.long), torch.arange(20).expand(3, -1), 16)
    assert local.block_index(70).bar_pos is None
    _check(local, 70, hq=3, hkv=3, d=16, dtype=torch.float32, seed=1)
    _check(local, 70, hq=3, hkv=3, d=16, dtype=torch.float32, seed=4, config=SUBTILED)
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


@pytest.mark.parametrize("config", [SMALL, SUBTILED], ids=["small", "subtiled"])
def test_merge_state_and_accumulated_gradients_across_split_keys(config):
    """Two calls over disjoint key halves, merged in place, equal one call; so do their gradients
    (the ring's contract: MERGE forward, ACCUMULATE dq, fresh fp32 dk/dv per call)."""
    n, heads, d, bs = 96, 2, 16, 16 if config is SMALL else 32
    gen = torch.Generator().manual_seed(11)
    pattern = random_pattern(gen, n, heads, bs, 6, 4).to(DEVICE)
    q, k, v, do = (torch.randn(n, heads, d, generator=gen).to(DEVICE) for _ in range(4))
    full = pattern.block_index(n)
    bar_k, bar_v = gather_bars(k, v, full)
    o_full, lse_full = sparse_forward(q, k, v, bar_k, bar_v, full, scale=0.25, config=config)
    nb = n // bs
    halves = [torch.arange(0, nb, 2), torch.arange(1, nb, 2)]
    state = (torch.zeros(n, heads, d, device=DEVICE), torch.full((heads, n), float("-inf"), device=DEVICE))
    parts = []
    for j, kb in enumerate(halves):
        idx = pattern.block_index(n, q_blocks=torch.arange(nb), k_blocks=kb, bars=j == 0)
        rows = (kb[:, None] * bs + torch.arange(bs)).flatten().to(DEVICE)
        parts.append((idx, rows))
        sparse_forward(q, k[rows], v[rows], bar_k, bar_v, idx, scale=0.25, state=state, config=config)
    torch.testing.assert_close(state[0], o_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1], lse_full, rtol=1e-5, atol=1e-5)
    delta = attention_delta(o_full, do)
    dq_full, dk_full, dv_full, dbk_full, dbv_full = sparse_backward(
        do, q, k, v, bar_k, bar_v, lse_full, delta, full, scale=0.25, config=config)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for j, (idx, rows) in enumerate(parts):
        dk_part, dv_part = torch.full_like(k[rows], float("nan")), torch.full_like(v[rows], float("nan"))
        _, _, _, dbk, dbv = sparse_backward(do, q, k[rows], v[rows], bar_k, bar_v, lse_full, delta, idx,
                                            scale=0.25, dq=dq, dk=dk_part, dv=dv_part, accumulate_q=True,
                                            config=config)
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
    index = pattern.block_index(8)
    for make, error, match in [
            (lambda: {"bar": 16}, TypeError, "config must be a treeattn_lab.kernels.tuning.SparseConfig"),
            (lambda: SparseConfig(fwd=(16, 16, 4, 1)), TypeError, "SparseConfig.fwd must be a"),
            (lambda: SparseConfig(dq=LaunchConfig(128, 24, 4, 2)), ValueError, "block_n must be a power"),
            (lambda: SparseConfig(bar=8), ValueError, "bar must be a power of two >= 16"),
            (lambda: SparseConfig(split=0), ValueError, "split must be an int >= 1"),
            (lambda: SparseConfig(dkdv=LaunchConfig(16, 16, 4, 1, tma=True)), ValueError, "no TMA path")]:
        with pytest.raises(error, match=match):
            triton_sparse_attention(q, q, q, index, config=make())


COMPILE_FOR_SM90 = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "0"  # real Triton, compiled for a GPU that is not here
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)

    def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization,
                                                                options)
        kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
        name, shared = self.__name__, kernel.metadata.shared
        assert shared <= 232448, f"{name}: {shared} B of shared memory, the H200 has 227 KB"
        assert "wgmma" in kernel.asm["ptx"], f"{name}: no tensor-core dots"
        print("compiled", self.__name__, "shared", kernel.metadata.shared)

    JITFunction.run = compile_instead_of_launch
    from treeattn_lab.kernels import block_sparse as B
    from treeattn_lab.patterns.vertical_slash import synthetic_pattern

    n, hq, hkv, d = 2048, 4, 2, 128  # the GPU's block size, head dim, dtype and launch settings; GQA
    B._num_sms = lambda device: 132
    index = synthetic_pattern(n, hq, n_vertical=300, n_slash=100).block_index(n)
    q, do = (torch.randn(n, hq, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(n, hkv, d, dtype=torch.bfloat16) for _ in range(2))
    bk, bv = (x.contiguous() for x in B.gather_bars(k, v, index))
    lse = torch.zeros(hq, n)
    B.sparse_forward(q, k, v, bk, bv, index, scale=0.1, state=(q.float(), lse))
    B.sparse_backward(do, q, k, v, bk, bv, lse, lse, index, scale=0.1, dq=q.float(), dk=k.float(),
                      dv=v.float(), accumulate_q=True, accumulate_kv=True)
""")


def test_kernels_compile_for_sm90():
    """The GPU build (bf16, head dim 128, default launch settings, GQA, merge and accumulate variants)
    passes Triton's compiler and ptxas for sm_90: the interpreter does not check dot shapes, dtypes,
    constexpr use or shared memory."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled") == 3, result.stdout


def test_short_calls_start_from_the_short_configs():
    """Calls up to SPARSE_SHORT_QUERIES queries use the short-sequence launches; longer ones SPARSE;
    explicit fields win; shapes never exceed the index's block."""
    from types import SimpleNamespace

    short = SimpleNamespace(block_size=128, num_q=tuning.SPARSE_SHORT_QUERIES)
    long = SimpleNamespace(block_size=128, num_q=tuning.SPARSE_SHORT_QUERIES + 1)
    assert kernel_module.resolve_config(None, short)["dkdv"] == tuning.SPARSE_SHORT.dkdv
    assert kernel_module.resolve_config(None, short)["split"] == tuning.SPARSE_SHORT.split
    assert kernel_module.resolve_config(None, long)["dkdv"] == tuning.SPARSE.dkdv
    assert kernel_module.resolve_config(None, long)["split"] is None
    mine = SparseConfig(dkdv=LaunchConfig(16, 16, 1, 1))
    assert kernel_module.resolve_config(mine, short)["dkdv"] == LaunchConfig(16, 16, 1, 1)
    assert kernel_module.resolve_config(mine, short)["fwd"] == tuning.SPARSE_SHORT.fwd
    small_block = SimpleNamespace(block_size=32, num_q=64)
    fwd = kernel_module.resolve_config(None, small_block)["fwd"]
    assert (fwd.block_m, fwd.block_n) == (32, 32)
