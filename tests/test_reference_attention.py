"""Reference attention: tree attention over a pack equals flat causal attention per rollout (float64).

Ground truth is a naive per-sequence softmax written here (explicit tril mask, repeat_interleave for GQA),
independent of ``masked_attention``.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import generator, head_configs, orders, randn, rollout_forests, seeds
from treeattn_lab import RolloutTrie, reference
from treeattn_lab import tree_attention as ops_tree_attention

F64 = dict(rtol=1e-10, atol=1e-10)


def naive_causal(q, k, v, scale=None):
    """Causal attention of one sequence ``q [L, Hq, D]``, ``k, v [L, Hkv, D]``, the textbook way."""
    L, hq, d = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out, torch.logsumexp(scores, -1).T  # [L, Hq, D], [L, Hq]


def flat_per_sequence(pack, q, k, v, scale=None):
    """Padded ``[B, L, Hq, D]`` flat attention, each rollout on its own (zeros at padding)."""
    qp, kp, vp = pack.to_padded(q), pack.to_padded(k), pack.to_padded(v)
    outs = []
    for i, L in enumerate(pack.seq_lengths.tolist()):
        out, _ = naive_causal(qp[i, :L], kp[i, :L], vp[i, :L], scale)
        outs.append(torch.cat([out, out.new_zeros((qp.shape[1] - L,) + out.shape[1:])]))
    return torch.stack(outs)


def draw_qkv(pack, heads, seed, dtype=torch.float64):
    hq, hkv, d = heads
    g = generator(seed)
    T = pack.num_tokens
    return (
        randn(g, T, hq, d, dtype=dtype, requires_grad=True),
        randn(g, T, hkv, d, dtype=dtype, requires_grad=True),
        randn(g, T, hkv, d, dtype=dtype, requires_grad=True),
    )


scales = st.one_of(st.none(), st.floats(0.05, 2.0))


@given(rollout_forests(), orders, head_configs(), seeds, scales)
def test_tree_equals_flat_forward(seqs, order, heads, seed, scale):
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    q, k, v = draw_qkv(pack, heads, seed)
    out_tree = reference.tree_attention(q, k, v, pack.subtree_end, scale=scale)
    assert out_tree.shape == q.shape and out_tree.dtype == torch.float64
    expected = flat_per_sequence(pack, q, k, v, scale)
    torch.testing.assert_close(pack.to_padded(out_tree), expected, **F64)
    # the padded reference agrees too, with zeros at padded positions
    flat = reference.causal_attention(
        pack.to_padded(q), pack.to_padded(k), pack.to_padded(v), pack.seq_lengths, scale=scale
    )
    torch.testing.assert_close(flat, expected, **F64)
    # and the public entry point's reference backend is the same function
    ops = ops_tree_attention(q, k, v, pack, scale=scale, backend="reference")
    torch.testing.assert_close(ops, out_tree, rtol=0, atol=0)


@given(rollout_forests(), orders, head_configs(), seeds)
def test_tree_equals_flat_gradients(seqs, order, heads, seed):
    """Gradients of q, k, v agree; a shared token's gradient sums over the rollouts through it."""
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    q, k, v = draw_qkv(pack, heads, seed)
    _, valid = pack.padded_index()
    g = generator(seed ^ 0x5EED)
    weights = torch.randn(valid.shape + q.shape[1:], generator=g, dtype=torch.float64)
    weights = weights * valid[..., None, None]

    out_flat = reference.causal_attention(
        pack.to_padded(q), pack.to_padded(k), pack.to_padded(v), pack.seq_lengths
    )
    grads_flat = torch.autograd.grad((out_flat * weights).sum(), (q, k, v))

    out_tree = ops_tree_attention(q, k, v, pack, backend="reference")
    grads_tree = torch.autograd.grad((pack.to_padded(out_tree) * weights).sum(), (q, k, v))

    # the naive per-sequence version gives the same gradients as well
    grads_naive = torch.autograd.grad((flat_per_sequence(pack, q, k, v) * weights).sum(), (q, k, v))
    for name, a, b, c in zip("qkv", grads_tree, grads_flat, grads_naive, strict=True):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **F64, msg=f"d{name}")
        torch.testing.assert_close(a, c, **F64, msg=f"d{name}")


@given(rollout_forests(max_sequences=4, max_len=8), head_configs(), seeds)
def test_return_lse(seqs, heads, seed):
    pack = RolloutTrie.from_sequences(seqs).pack()
    q, k, v = draw_qkv(pack, heads, seed)
    out, lse = reference.tree_attention(q, k, v, pack.subtree_end, return_lse=True)
    assert lse.shape == q.shape[:2]
    torch.testing.assert_close(out, reference.tree_attention(q, k, v, pack.subtree_end), rtol=0, atol=0)
    for i in range(pack.num_sequences):
        idx = pack.seq_index(i)
        ref_out, ref_lse = naive_causal(q[idx], k[idx], v[idx])
        torch.testing.assert_close(out[idx], ref_out, **F64)
        torch.testing.assert_close(lse[idx], ref_lse, **F64)


def test_single_rollout_is_causal_attention():
    pack = RolloutTrie.from_sequences([[3, 1, 4, 1, 5, 9, 2, 6]]).pack()
    g = generator(0)
    q, k, v = randn(g, 8, 4, 8), randn(g, 8, 2, 8), randn(g, 8, 2, 8)
    out = reference.tree_attention(q, k, v, pack.subtree_end)
    torch.testing.assert_close(out, naive_causal(q, k, v)[0], **F64)
    torch.testing.assert_close(out, reference.causal_attention(q[None], k[None], v[None])[0], **F64)


def test_first_token_attends_only_itself():
    pack = RolloutTrie.from_sequences([[1, 2, 3], [4, 5]]).pack()
    g = generator(1)
    q, k, v = randn(g, 5, 2, 4), randn(g, 5, 1, 4), randn(g, 5, 1, 4)
    out = reference.tree_attention(q, k, v, pack.subtree_end)
    for root_token in (0, 3):  # both rollouts' first tokens see only their own value
        torch.testing.assert_close(out[root_token], v[root_token].expand(2, 4), **F64)


def test_gqa_head_grouping():
    """Query head h reads kv head h // (Hq / Hkv)."""
    g = generator(2)
    T, hkv, group, d = 5, 2, 3, 4
    q, k, v = randn(g, T, hkv * group, d), randn(g, T, hkv, d), randn(g, T, hkv, d)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    out = reference.masked_attention(q, k, v, mask)
    for h in range(hkv * group):
        one = reference.masked_attention(
            q[:, h : h + 1], k[:, h // group : h // group + 1], v[:, h // group : h // group + 1], mask
        )
        torch.testing.assert_close(out[:, h : h + 1], one, **F64)


def test_fully_masked_rows_are_zero_and_finite():
    g = generator(3)
    q, k, v = (randn(g, 4, 2, 3, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    out, lse = reference.masked_attention(q, k, v, mask, return_lse=True)
    assert (out[1] == 0).all() and (out[3] == 0).all()
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in grads)
    assert (grads[0][1] == 0).all() and (grads[0][3] == 0).all()


@pytest.mark.parametrize("heads", [(2, 1, 3), (2, 2, 2)])
def test_gradcheck(heads):
    pack = RolloutTrie.from_sequences([[1, 2, 3], [1, 2, 4, 5], [6]]).pack()
    q, k, v = draw_qkv(pack, heads, seed=4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: ops_tree_attention(q, k, v, pack, backend="reference"), (q, k, v)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merge_attention_states_equals_attention_over_the_union(seed):
    g = torch.Generator().manual_seed(seed)
    T, S, H, D = 7, 11, 4, 8
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, S, H, D, generator=g, dtype=torch.float64)
    mask = torch.rand(T, S, generator=g) < 0.6
    mask[0] = False  # a row that sees nothing at all
    split = torch.rand(T, S, generator=g) < 0.5
    full, full_lse = reference.masked_attention(q, k, v, mask, return_lse=True)
    a, lse_a = reference.masked_attention(q, k, v, mask & split, return_lse=True)
    b, lse_b = reference.masked_attention(q, k, v, mask & ~split, return_lse=True)
    out, lse = reference.merge_attention_states(a, lse_a, b, lse_b)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)
    assert torch.all(out[0] == 0) and torch.all(torch.isinf(lse[0]))
