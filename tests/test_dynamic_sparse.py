"""Dynamic sparse attention (ops.dynamic_sparse): per-call estimation, then sparse attention forward and back.

The estimate is a discrete choice made without gradient, so the op must equal, value and gradient, the
reference sparse attention under the pattern it chose; with a budget covering every line it is dense
causal attention. The Triton path (interpreted on a CPU, fp32) is checked against the same reference.
"""

import pytest
import torch

from treeattn_lab.ops.dynamic_sparse import (
    DynamicSparseAttention,
    PairStats,
    SparseBudget,
    fixed_pattern_attention,
    per_sequence,
)
from treeattn_lab.ops.sparse import sparse_attention
from treeattn_lab.patterns.vertical_slash import VerticalSlashPattern
from treeattn_lab.reference import TinyLM, TinyLMConfig, causal_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton path: compiled on a GPU


def qkv(seed, batch, n, hq, hkv, d, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, hq, d, generator=g, dtype=dtype)
    k = torch.randn(batch, n, hkv, d, generator=g, dtype=dtype)
    v = torch.randn(batch, n, hkv, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(("seed", "n", "hq", "hkv"), [(11, 37, 2, 1), (12, 70, 4, 2), (13, 129, 2, 2)])
def test_budget_covering_every_line_is_dense_causal_attention(seed, n, hq, hkv):
    q, k, v = qkv(seed, 2, n, hq, hkv, 8)
    attention = DynamicSparseAttention(SparseBudget(n, n, sinks=0, local=n, last_q=5, block_size=16),
                                       backend="reference")
    out = attention(q, k, v)
    torch.testing.assert_close(out, causal_attention(q, k, v), rtol=1e-12, atol=1e-12)
    assert attention.stats.fraction == 1.0 and attention.stats.calls == 2


@pytest.mark.parametrize(("seed", "n", "hq", "hkv", "budget"),
                         [(21, 45, 2, 1, (6, 5, 2, 3)), (22, 160, 4, 2, (8, 3, 2, 1)),
                          (23, 77, 3, 3, (3, 2, 0, 1))])
def test_values_and_gradients_match_reference_sparse_attention_under_its_patterns(seed, n, hq, hkv, budget):
    nv, ns, sinks, local = budget
    q, k, v = qkv(seed, 3, n, hq, hkv, 16)
    budget = SparseBudget(nv, ns, sinks=sinks, local=local, last_q=7, block_size=16)
    attention = DynamicSparseAttention(budget, backend="reference")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*leaves)
    do = torch.randn_like(out)
    out.backward(do)

    patterns = [attention.pattern_for(q[b], k[b]) for b in range(q.shape[0])]
    assert any(p.density(n) < 0.9 for p in patterns), "the budget should leave pairs out"
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = torch.stack([sparse_attention(*(x[b] for x in ref_leaves), p, backend="reference")
                       for b, p in enumerate(patterns)])
    ref.backward(do)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    expected = sum(p.num_pairs(n) for p in patterns) / (3 * hq * n * (n + 1) / 2)
    assert attention.stats.fraction == pytest.approx(expected)
    assert not torch.equal(out, causal_attention(q, k, v)), "sparse attention should differ from dense"


def test_triton_path_matches_reference_fp32():
    """The kernel path (Triton's interpreter here) against the float64 reference under the same patterns,
    forward and backward (the kernel's own NaN-poisoned buffer tests live in test_block_sparse)."""
    q, k, v = qkv(31, 2, 80, 2, 1, 16)
    budget = SparseBudget(5, 4, sinks=2, local=2, last_q=8, block_size=16)
    tri = DynamicSparseAttention(budget, backend="triton")
    leaves = [x.float().to(DEVICE).requires_grad_() for x in (q, k, v)]
    out = tri(*leaves)
    assert torch.isfinite(out).all()
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out.backward(do.float().to(DEVICE))
    patterns = [tri.pattern_for(leaves[0][b], leaves[1][b]).to("cpu") for b in range(2)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = torch.stack([sparse_attention(*(x[b] for x in ref_leaves), p, backend="reference")
                       for b, p in enumerate(patterns)])
    ref.backward(do)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, rtol=1e-4, atol=1e-4)


def test_inputs_are_not_mutated_and_unbatched_calls_work():
    q, k, v = qkv(41, 1, 50, 2, 1, 8)
    before = [x.clone() for x in (q, k, v)]
    attention = DynamicSparseAttention(SparseBudget(4, 4, sinks=1, local=2, last_q=4, block_size=16),
                                       backend="reference")
    batched = attention(q, k, v)
    single = attention(q[0], k[0], v[0])
    torch.testing.assert_close(batched[0], single, rtol=0, atol=0)
    for x, y in zip((q, k, v), before, strict=True):
        assert torch.equal(x, y)


def test_drops_into_tiny_lm_and_trains():
    torch.manual_seed(0)
    model = TinyLM(TinyLMConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48))
    attention = DynamicSparseAttention(SparseBudget(4, 6, sinks=1, local=3, last_q=4, block_size=16),
                                       backend="reference")
    ids = torch.randint(0, 32, (2, 40))
    logits = model(ids, torch.arange(40).expand(2, 40), attention)
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert attention.stats.calls == 4  # 2 layers x 2 sequences
    attention.stats.reset()
    assert attention.stats == PairStats()


def test_fixed_pattern_attention_uses_one_pattern_for_every_sequence():
    q, k, v = qkv(51, 2, 40, 2, 2, 8)
    pattern = VerticalSlashPattern(torch.tensor([[0], [3]]), torch.tensor([[0, 1], [0, 5]]), 16)
    out = fixed_pattern_attention(pattern, backend="reference")(q, k, v)
    for b in range(2):
        torch.testing.assert_close(out[b], sparse_attention(q[b], k[b], v[b], pattern, backend="reference"))


def test_bad_budgets_and_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="local"):
        SparseBudget(8, 4, sinks=0, local=5)
    with pytest.raises(ValueError, match="sinks"):
        SparseBudget(2, 4, sinks=3, local=1)
    with pytest.raises(ValueError, match="n_slash"):
        SparseBudget(2, 0, sinks=0, local=0)
    with pytest.raises(TypeError, match="block_size"):
        SparseBudget(2, 2, sinks=0, local=0, block_size=16.0)
    with pytest.raises(TypeError, match="SparseBudget"):
        DynamicSparseAttention({"n_vertical": 4})
    with pytest.raises(TypeError, match="VerticalSlashPattern"):
        fixed_pattern_attention("band")
    q, k, v = qkv(61, 2, 20, 2, 1, 8)
    with pytest.raises(ValueError, match="batch sizes"):
        per_sequence(lambda *a: a[0], q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"\[B, N, H, D\]"):
        per_sequence(lambda *a: a[0], q[None], k[None], v[None])
