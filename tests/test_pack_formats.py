"""A pack's attention rule in other engines' formats: a FlexAttention mask_mod and BlockMask, varlen metadata.

Each format must give the tree rule itself: the mask_mod element by element, the BlockMask through
FlexAttention's own (eager, CPU) attention, the varlen plan through the sequences it names.
"""

import torch
from hypothesis import given, settings
from torch.nn.attention.flex_attention import flex_attention

from tests.conftest import orders, relative_error, rollout_forests
from treeattn_lab import RolloutTrie, ops, reference
from treeattn_lab.patterns.tree import tree_visibility


@settings(max_examples=15, deadline=None)
@given(rollout_forests(max_sequences=6, max_len=20), orders)
def test_mask_mod_and_block_mask_are_the_tree_rule(seqs, order):
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    T = pack.num_tokens
    q_idx, kv_idx = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    got = ops.pack_mask_mod(pack)(0, 0, q_idx, kv_idx)
    assert torch.equal(got, tree_visibility(pack.subtree_end))
    block_mask = ops.tree_block_mask(pack)
    assert ops.tree_block_mask(pack) is block_mask  # cached on the pack
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=block_mask)
    want = reference.tree_attention(*(x[0].transpose(0, 1) for x in (q, k, v)), pack.subtree_end)
    assert relative_error(out[0].transpose(0, 1), want) < 1e-10


@settings(max_examples=15, deadline=None)
@given(rollout_forests(max_sequences=6, max_len=20), orders)
def test_varlen_plan_names_every_leaf_rollout_as_one_sequence(seqs, order):
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    plan = ops.varlen_plan(pack)
    assert isinstance(plan, ops.VarlenPlan)
    mask = tree_visibility(pack.subtree_end)
    q_len, k_len = plan.cu_q.diff(), plan.cu_k.diff()
    assert int(plan.cu_q[0]) == int(plan.cu_k[0]) == 0 and int(plan.cu_q[-1]) == pack.num_tokens
    assert bool((q_len >= 1).all()) and int(plan.cu_k[-1]) == plan.key_rows.numel()
    assert plan.max_q == int(q_len.max()) and plan.max_k == int(k_len.max())
    for j in range(plan.num_sequences):
        queries = range(int(plan.cu_q[j]), int(plan.cu_q[j + 1]))
        keys = plan.key_rows[int(plan.cu_k[j]):int(plan.cu_k[j + 1])].tolist()
        n_k, n_q = len(keys), len(queries)
        for i, query in enumerate(queries):  # bottom-right causal over the sequence = the tree rule
            visible = keys[: n_k - n_q + i + 1]
            assert sorted(visible) == torch.nonzero(mask[query]).flatten().tolist()
