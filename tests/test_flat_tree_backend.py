"""The ``"flat"`` tree-attention backend (causal SDPA per root-to-leaf rollout) and ``"auto"``'s choice of it.

Against the float64 einops reference on random forests, forward and backward, with every buffer the
backend allocates with ``torch.empty`` filled with NaN first (so a packed row that no rollout writes
fails); with the bucket overhead at 0 as well, so forests split into many buckets of distinct lengths.
"""

import itertools
from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from tests.conftest import (
    check_tree_backend,
    generator,
    head_configs,
    long_rollout_forests,
    orders,
    poisoned_allocations,
    randn,
    relative_error,
    rollout_forests,
    seeds,
    tree_backend_inputs,
)
from treeattn_lab import RolloutTrie, reference, tree_attention
from treeattn_lab.bench.tree import branching_rollouts
from treeattn_lab.ops import flat_tree
from treeattn_lab.ops.backends import choose_backend
from treeattn_lab.ops.tree import choose_tree_backend

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
overheads = st.sampled_from([None, 0])  # None: the default (few buckets); 0: one bucket per length


def _check_against_reference(pack, heads, seed, dtype, *, scale=None, overhead=None):
    patches = {} if overhead is None else {"BUCKET_OVERHEAD_PAIRS": overhead}
    return check_tree_backend(pack, heads, seed, dtype, "flat", TOL[dtype], scale=scale,
                              context=poisoned_allocations(flat_tree, **patches))


forests = st.one_of(rollout_forests(max_sequences=6, max_len=16), long_rollout_forests(30, 80))


@settings(max_examples=25)
@given(forests, orders, head_configs(), seeds,
       st.sampled_from([torch.float32, torch.float64]), st.one_of(st.none(), st.floats(0.1, 1.5)), overheads)
def test_flat_matches_reference_on_random_forests(seqs, order, heads, seed, dtype, scale, overhead):
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    _check_against_reference(pack, heads, seed, dtype, scale=scale, overhead=overhead)


@pytest.mark.parametrize("overhead", [None, 0])
@pytest.mark.parametrize("order", ["insertion", "size"])
def test_prefix_rollouts_single_token_nodes_and_duplicates(order, overhead):
    seqs = [list(range(30)), list(range(12)), list(range(12)) + [99], list(range(12)) + [99, 5],
            [7], [7, 8] + list(range(40, 55)), list(range(30)), [3]]
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    out = _check_against_reference(pack, (4, 2, 8), 3, torch.float64, scale=0.3, overhead=overhead)
    # the flat baseline of bench tree: every rollout its own padded sequence, causal SDPA
    q, k, v, _ = tree_backend_inputs(pack, (4, 2, 8), 3, torch.float64)
    padded = [pack.to_padded(x).transpose(1, 2) for x in (q, k, v)]
    flat = F.scaled_dot_product_attention(*padded, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out.detach(), pack.from_padded(flat.transpose(1, 2)), rtol=1e-12, atol=1e-12)


@settings(max_examples=20)
@given(rollout_forests(max_sequences=8, max_len=12), orders, overheads)
def test_plan_gives_every_packed_token_one_owner(seqs, order, overhead):
    trie = RolloutTrie.from_sequences(seqs)
    pack = trie.pack(order)
    if overhead is None:
        plan = flat_tree.flat_plan(pack)
    else:
        with mock.patch.object(flat_tree, "BUCKET_OVERHEAD_PAIRS", overhead):
            plan = flat_tree.flat_plan(pack)
    own = torch.cat([b.own_rows for b in plan.buckets])
    assert torch.equal(own.sort().values, torch.arange(pack.num_tokens))
    if plan.in_order:
        assert len(plan.buckets) == 1 and torch.equal(own, torch.arange(pack.num_tokens))
    paths = set()
    for b in plan.buckets:
        assert b.rows.numel() == b.rollouts * b.length
        assert torch.equal(b.rows[b.own_slots], b.own_rows)
        assert torch.equal(b.rows[b.shared_slots], b.shared_rows)
        real = torch.zeros(b.rows.numel(), dtype=torch.bool)
        real[b.own_slots] = real[b.shared_slots] = True
        for r in range(b.rollouts):  # a real prefix then padding; the real part is one rollout's path
            mask = real[r * b.length:(r + 1) * b.length]
            n = int(mask.sum())
            assert mask[:n].all() and not mask[n:].any()
            paths.add(tuple(b.rows[r * b.length: r * b.length + n].tolist()))
    leaves = {tuple(pack.seq_index(i).tolist()) for i in range(pack.num_sequences)
              if int(pack.seq_end_node[i]) in trie.leaves()}
    assert paths == leaves
    assert plan.padded_pairs() >= pack.attended_pairs()


@settings(max_examples=40)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.sampled_from([0, 50, 300, 10**6]))
def test_group_lengths_is_the_cheapest_contiguous_grouping(lengths, overhead):
    groups = flat_tree.group_lengths(lengths, overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    longest = [max(lengths[i] for i in g) for g in groups]
    assert longest == sorted(longest, reverse=True)
    for g in groups:
        assert g == sorted(g)
        assert all((lengths[i] == lengths[j]) <= (i in g) for i in g for j in range(len(lengths)))

    def cost(grouping):
        return sum(len(g) * max(g) * (max(g) + 1) // 2 + overhead for g in grouping)

    distinct = sorted(set(lengths))
    by_len = {n: [x for x in lengths if x == n] for n in distinct}
    def grouping(cuts):  # distinct lengths cut into contiguous runs
        edges = itertools.pairwise((0, *cuts, len(distinct)))
        return [sum((by_len[n] for n in distinct[a:b]), []) for a, b in edges]

    best = min(cost(grouping(cuts)) for r in range(len(distinct))
               for cuts in itertools.combinations(range(1, len(distinct)), r))
    assert cost([[lengths[i] for i in g] for g in groups]) == best


def test_group_lengths_edges():
    assert flat_tree.group_lengths([]) == []
    assert flat_tree.group_lengths([5, 5, 5]) == [[0, 1, 2]]
    assert flat_tree.group_lengths([3, 9, 3, 9], overhead_pairs=0) == [[1, 3], [0, 2]]
    assert flat_tree.group_lengths([3, 9, 3, 9], overhead_pairs=10**9) == [[0, 1, 2, 3]]


# ------------------------------------------------------------------------------------------ auto's choice
def test_auto_runs_low_sharing_packs_flat_on_cuda(monkeypatch):
    low = RolloutTrie.from_sequences(branching_rollouts(2, 8, [(4, 64)])).pack()  # ratio 1.01
    high = RolloutTrie.from_sequences(branching_rollouts(1, 256, [(8, 16)])).pack()  # ratio 4.6
    copies = RolloutTrie.from_sequences([list(range(40))] * 6 + [list(range(20))]).pack()  # copies, a prefix
    ratio = flat_tree.flat_pair_ratio
    assert ratio(low) < flat_tree.FLAT_BELOW_PAIR_RATIO < ratio(high)
    # the ratio over distinct root-to-leaf rollouts: copies and prefixes add no flat work
    assert ratio(copies) == 1.0 < copies.flat_attended_pairs() / copies.attended_pairs()
    # rollouts of unequal length: the padding counts (what sent data:grpo_math flat before it did)
    ragged = RolloutTrie.from_sequences([[1000 * i + t for t in range(n)]  # nothing shared, one bucket
                                         for i, n in enumerate((100, 60, 30, 10))]).pack()
    assert flat_tree.rollout_pair_ratio(ragged) < flat_tree.FLAT_BELOW_PAIR_RATIO < ratio(ragged)
    assert choose_tree_backend("auto", ragged, torch.device("cuda"), torch.bfloat16, 128) == "triton"
    for pack in (low, high, copies, ragged):
        assert ratio(pack) == pytest.approx(flat_tree.flat_plan(pack).padded_pairs() / pack.attended_pairs())
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert choose_tree_backend("auto", low, cuda, bf16, 128) == "flat"
    assert choose_tree_backend("auto", low, cuda, torch.float16, 128) == "flat"
    assert choose_tree_backend("auto", low, cuda, torch.float32, 128) == "triton"  # flash: half precision
    assert choose_tree_backend("auto", copies, cuda, bf16, 128) == "flat"
    assert choose_tree_backend("auto", high, cuda, bf16, 128) == "triton"
    for pack in (low, high):
        assert choose_tree_backend("auto", pack, "cpu", bf16, 128) == "reference"  # CPU: the reference
        assert choose_tree_backend("triton", pack, cuda, bf16, 128) == "triton"  # a named backend stays
        assert choose_tree_backend("flat", pack, "cpu", bf16, 128) == "flat"
    # decided once per pack: the cached ratio is reused
    monkeypatch.setattr(flat_tree, "_leaf_nodes", lambda pack: pytest.fail("recomputed the ratio"))
    assert choose_tree_backend("auto", low, cuda, bf16, 128) == "flat"
    assert choose_backend("auto", cuda, "sparse_attention", low_sharing=True) == "triton"  # tree only
    stats = RolloutTrie.from_sequences(branching_rollouts(2, 8, [(4, 64)])).stats()
    assert flat_tree.rollout_pair_ratio(low) == pytest.approx(stats["ideal_attention_ratio"])


# ------------------------------------------------------------------------------------- errors, inputs
@pytest.fixture(scope="module")
def pack():
    return RolloutTrie.from_sequences([[1, 2, 3, 4], [1, 2, 5], [6]]).pack()  # T = 6


def test_bad_inputs_raise_clearly(pack):
    g = generator(0)
    q, k, v = randn(g, 6, 4, 8), randn(g, 6, 2, 8), randn(g, 6, 2, 8)
    with pytest.raises(ValueError, match="pack has T=6"):
        tree_attention(q[:5], k[:5], v[:5], pack, backend="flat")
    with pytest.raises(TypeError, match="dtypes disagree"):
        tree_attention(q, k.float(), v, pack, backend="flat")
    with pytest.raises(ValueError, match=r"multiple of key/value heads \(4\)"):
        tree_attention(q[:, :2], randn(g, 6, 4, 8), randn(g, 6, 4, 8), pack, backend="flat")
    with pytest.raises(ValueError, match="3-D"):
        tree_attention(q[None], k, v, pack, backend="flat")
    with pytest.raises(TypeError, match="pack must be a TreePack"):
        tree_attention(q, k, v, [6], backend="flat")
    with pytest.raises(ValueError, match="scale must be a positive"):
        tree_attention(q, k, v, pack, scale=-1.0, backend="flat")
    with pytest.raises(ValueError, match="unknown backend 'flat'"):  # the other ops have no flat backend
        choose_backend("flat", torch.device("cpu"), "sparse_attention")


def test_one_tensor_as_q_k_and_v(pack):
    x = randn(generator(1), 6, 2, 8).requires_grad_()
    y = x.detach().clone().requires_grad_()
    tree_attention(x, x, x, pack, backend="flat").square().sum().backward()
    reference.tree_attention(y, y, y, pack.subtree_end).square().sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keeps_its_dtype(pack, dtype):
    q, k, v, do = tree_backend_inputs(pack, (4, 2, 16), 5, torch.float32)
    low = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = tree_attention(*low, pack, backend="flat")
    out.backward(do.to(dtype))
    ref = reference.tree_attention(q.double(), k.double(), v.double(), pack.subtree_end)
    assert out.dtype == dtype and all(x.grad.dtype == dtype for x in low)
    assert relative_error(out, ref) < 2e-2


@settings(max_examples=10)
@given(rollout_forests(max_sequences=5, max_len=10), seeds)
def test_inputs_are_not_mutated(seqs, seed):
    pack = RolloutTrie.from_sequences(seqs).pack()
    q, k, v, do = tree_backend_inputs(pack, (4, 2, 8), seed, torch.float32)
    q.requires_grad_()  # k and v frozen: they get no gradient
    before = [x.detach().clone() for x in (q, k, v, do)]
    fields = {n: getattr(pack, n).clone() for n in pack.__dataclass_fields__ if n != "_cache"}
    out = tree_attention(q, k, v, pack, backend="flat")
    out.backward(do)
    assert k.grad is None and v.grad is None and torch.isfinite(q.grad).all()
    out = out.detach()
    out.add_(1.0)  # a fresh tensor, not a view of an input
    for x, y in zip((q, k, v, do), before, strict=True):
        assert torch.equal(x.detach(), y)
    for n, t in fields.items():
        assert torch.equal(getattr(pack, n), t), n


def test_bench_rows_put_auto_beside_flat_sdpa():
    from treeattn_lab.bench.tree import TreeCase, auto_summary, run_case

    case = TreeCase("low sharing", branching_rollouts(2, 4, [(2, 12)]))
    rows = run_case(case, heads=2, dim=8, dtype=torch.float32, device=torch.device("cpu"),
                    backends=["flat", "gather-flat", "auto"], check=False)
    assert [r["backend"] for r in rows] == ["flat", "gather-flat", "auto"]
    assert rows[-1]["auto_picks"] == "reference"  # CPU: the reference
    (summary,) = auto_summary(rows)
    assert summary["auto_picks"] == "reference" and summary["auto_x_flat"] == rows[-1]["fwd_bwd_speedup"]
    assert "auto_x_triton" not in summary
