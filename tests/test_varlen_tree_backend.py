"""The ``"varlen"`` tree-attention backend: one variable-length causal sequence per leaf.

On the CPU the plan (queries straight from the pack, each leaf's rollout gathered as keys, causal aligned
bottom-right) runs through the einops reference with its mask spelled out; it must equal the tree rule
on random forests, forward and backward. On a GPU the same plan runs FlashAttention's varlen kernel: the
last test checks that kernel against this file's mask (it runs where CUDA is present, e.g. on the H200
with ``pytest tests/test_varlen_tree_backend.py``).
"""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from tests.conftest import (
    check_tree_backend,
    head_configs,
    long_rollout_forests,
    orders,
    relative_error,
    rollout_forests,
    seeds,
    tree_backend_inputs,
)
from treeattn_lab import RolloutTrie, reference, tree_attention
from treeattn_lab.ops import varlen_tree

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
forests = st.one_of(rollout_forests(max_sequences=6, max_len=16), long_rollout_forests(30, 80))


@settings(max_examples=25)
@given(forests, orders, head_configs(), seeds, st.sampled_from([torch.float32, torch.float64]),
       st.one_of(st.none(), st.floats(0.1, 1.5)))
def test_varlen_matches_reference_on_random_forests(seqs, order, heads, seed, dtype, scale):
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    check_tree_backend(pack, heads, seed, dtype, "varlen", TOL[dtype], scale=scale)


@pytest.mark.parametrize("order", ["insertion", "size"])
def test_prefix_rollouts_single_token_nodes_and_duplicates(order):
    seqs = [list(range(30)), list(range(12)), list(range(12)) + [99], list(range(12)) + [99, 5],
            [7], [7, 8] + list(range(40, 55)), list(range(30)), [3]]
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    check_tree_backend(pack, (4, 2, 8), 3, torch.float64, "varlen", TOL[torch.float64], scale=0.3)


@settings(max_examples=20)
@given(rollout_forests(max_sequences=8, max_len=12), orders)
def test_plan_takes_queries_in_pack_order_and_whole_rollouts_as_keys(seqs, order):
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    plan = varlen_tree.varlen_plan(pack)
    assert varlen_tree.varlen_plan(pack) is plan  # cached on the pack
    q_len, k_len = plan.cu_q.diff(), plan.cu_k.diff()
    assert plan.cu_q.dtype == plan.cu_k.dtype == torch.int32
    assert int(plan.cu_q[0]) == 0 and int(plan.cu_q[-1]) == pack.num_tokens
    assert bool((q_len >= 1).all()) and bool((k_len >= q_len).all())
    assert plan.max_q == int(q_len.max()) and plan.max_k == int(k_len.max())
    # one sequence per distinct root-to-leaf rollout; its keys are that rollout's tokens in order
    rollouts = {tuple(pack.input_ids[plan.key_rows[a:b]].tolist())
                for a, b in zip(plan.cu_k[:-1].tolist(), plan.cu_k[1:].tolist(), strict=True)}
    leaves = {tuple(s) for s in seqs if not any(len(o) > len(s) and o[:len(s)] == s for o in seqs)}
    assert rollouts == leaves
    # each sequence's queries are the last q_len keys of its rollout: the packed rows themselves
    for j in range(plan.num_sequences):
        b = int(plan.cu_k[j + 1])
        tail = plan.key_rows[b - int(q_len[j]):b]
        assert torch.equal(tail, torch.arange(int(plan.cu_q[j]), int(plan.cu_q[j + 1])))


def test_mask_is_the_tree_rule_through_the_gather():
    pack = RolloutTrie.from_sequences([[1, 2, 3, 4], [1, 2, 5], [6, 7], [1, 9, 9, 9, 9]]).pack()
    plan = varlen_tree.varlen_plan(pack)
    mask = varlen_tree.varlen_mask(plan)
    # gathered key s of query i is packed key key_rows[s]: the mask folded back onto the pack is the tree's
    folded = torch.zeros(pack.num_tokens, pack.num_tokens, dtype=torch.int64)
    folded.index_add_(1, plan.key_rows, mask.long())
    assert torch.equal(folded > 0, pack.visibility_mask())
    assert int(folded.max()) == 1  # every visible pair exactly once: the tree's pairs, nothing repeated
    assert int(mask.sum()) == pack.attended_pairs()


def test_cuda_needs_what_flash_takes(monkeypatch):
    q = torch.zeros(3, 2, 12)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert not varlen_tree.runs_flash(q)  # fp32, head dim 12
    with pytest.raises(ValueError, match="fp16 or bf16 and a head dim that is a multiple of 8"):
        varlen_tree.varlen_tree_attention(q, q, q, None)
    assert varlen_tree.runs_flash(torch.zeros(3, 2, 128, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128)])
def test_flash_varlen_kernel_equals_the_mask_on_cuda(dtype, heads):
    seqs = [list(range(300)), list(range(200)) + [7] * 90, list(range(50)) + [5] * 301, [3] * 77]
    pack = RolloutTrie.from_sequences(seqs).pack().to("cuda")
    q, k, v, do = (x.cuda() for x in tree_backend_inputs(pack, heads, 11, torch.float32))
    low = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = tree_attention(*low, pack, backend="varlen")
    out.backward(do.to(dtype))
    want = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference.tree_attention(*want, pack.subtree_end, scale=None)
    ref.backward(do.double())
    assert relative_error(out, ref) < 1e-2
    for x, w in zip(low, want, strict=True):
        assert relative_error(x.grad, w.grad) < 1e-2
