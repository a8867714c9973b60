"""``treeattn_lab.tree_attention``: backend choice and the flex backend against the reference (CPU)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import (
    generator,
    head_configs,
    long_rollout_forests,
    orders,
    randn,
    rollout_forests,
    seeds,
)
from treeattn_lab import RolloutTrie, available_backends, reference, tree_attention
from treeattn_lab.ops.flex_tree import tree_block_mask
from treeattn_lab.ops.tree import choose_backend

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

F32 = dict(rtol=1e-5, atol=1e-5)


def qkv(pack, heads, seed, dtype=torch.float32):
    hq, hkv, d = heads
    g = generator(seed)
    T = pack.num_tokens
    return randn(g, T, hq, d, dtype=dtype), randn(g, T, hkv, d, dtype=dtype), randn(g, T, hkv, d, dtype=dtype)


# forests long enough to cross FlexAttention's 128-token blocks, with T rarely a multiple of 128
long_forests = st.one_of(rollout_forests(), long_rollout_forests())


@given(long_forests, orders, head_configs(), seeds, st.one_of(st.none(), st.floats(0.1, 1.5)))
def test_flex_equals_reference(seqs, order, heads, seed, scale):
    pack = RolloutTrie.from_sequences(seqs).pack(order)
    q, k, v = qkv(pack, heads, seed)
    ref = tree_attention(q, k, v, pack, scale=scale, backend="reference")
    flex = tree_attention(q, k, v, pack, scale=scale, backend="flex")
    assert flex.shape == q.shape and flex.dtype == q.dtype
    torch.testing.assert_close(flex, ref, **F32)
    # the block mask is built once per pack and device, then reused
    key = ("flex_block_mask", "cpu")
    mask = pack._cache[key]
    again = tree_attention(q, k, v, pack, scale=scale, backend="flex")
    assert pack._cache[key] is mask and tree_block_mask(pack) is mask
    torch.testing.assert_close(again, flex, rtol=0, atol=0)


@pytest.mark.parametrize("T", [127, 128, 129, 200, 257])
@pytest.mark.parametrize("heads", [(4, 2, 16), (2, 2, 8), (3, 1, 4)])
def test_flex_across_block_boundaries(T, heads):
    """Long chains and forks that straddle 128-token blocks, T a multiple of 128 or not."""
    g = torch.Generator().manual_seed(T * 31 + heads[0])
    trunk = torch.randint(0, 1000, (T // 2,), generator=g).tolist()
    seqs = [
        trunk + torch.randint(0, 1000, (T - T // 2 - 3,), generator=g).tolist(),
        trunk[:5],
        trunk + [1, 2],
    ]
    seqs.append(torch.randint(0, 1000, (3,), generator=g).tolist())
    pack = RolloutTrie.from_sequences(seqs).pack("size")
    q, k, v = qkv(pack, heads, seed=T)
    torch.testing.assert_close(
        tree_attention(q, k, v, pack, backend="flex"),
        tree_attention(q, k, v, pack, backend="reference"),
        **F32,
    )
    # every rollout matches its own causal attention
    out = tree_attention(q, k, v, pack, backend="flex")
    for i in range(pack.num_sequences):
        idx = pack.seq_index(i)
        flat = reference.causal_attention(q[idx][None], k[idx][None], v[idx][None])[0]
        torch.testing.assert_close(out[idx], flat, **F32)


@given(rollout_forests(max_sequences=4, max_len=10), head_configs(), seeds)
def test_auto_on_cpu_is_reference(seqs, heads, seed):
    pack = RolloutTrie.from_sequences(seqs).pack()
    q, k, v = qkv(pack, heads, seed, dtype=torch.float64)
    assert choose_backend("auto", torch.device("cpu")) == "reference"
    auto = tree_attention(q, k, v, pack)
    assert torch.equal(auto, reference.tree_attention(q, k, v, pack.subtree_end))
    assert torch.equal(tree_attention(q, k, v, pack, backend="auto"), auto)


def test_available_backends():
    names = available_backends("cpu")
    assert names[0] == "reference" and "flex" in names
    assert set(names) <= {"reference", "flex", "triton", "flat", "varlen"}


def test_module_presence_is_a_constant_torch_compile_reads_once():
    from treeattn_lab.runtime import module_found

    assert module_found("triton") and not module_found("no_such_package.sub.module")
    listed = torch.compile(lambda x: (x, available_backends(x.device)), fullgraph=True, backend="eager")
    assert listed(torch.zeros(2))[1] == available_backends("cpu")


def test_unknown_backend():
    pack = RolloutTrie.from_sequences([[1, 2, 3]]).pack()
    q = k = v = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        tree_attention(q, k, v, pack, backend="cuda")
    with pytest.raises(ValueError, match="unknown backend"):
        tree_attention(q, k, v, pack, backend="Reference")
    with pytest.raises(TypeError, match="backend must be a string"):
        tree_attention(q, k, v, pack, backend=None)


@given(rollout_forests(max_sequences=4, max_len=10), st.sampled_from(["reference", "flex", "auto"]), seeds)
def test_tree_attention_does_not_mutate_inputs(seqs, backend, seed):
    pack = RolloutTrie.from_sequences(seqs).pack()
    q, k, v = qkv(pack, (4, 2, 8), seed)
    before = [x.clone() for x in (q, k, v)]
    fields = {n: getattr(pack, n).clone() for n in pack.__dataclass_fields__ if n != "_cache"}
    out = tree_attention(q, k, v, pack, backend=backend)
    for x, y in zip((q, k, v), before, strict=True):
        assert torch.equal(x, y)
    for n, t in fields.items():
        assert torch.equal(getattr(pack, n), t), n
    # the output is a fresh tensor, not a view of an input
    out.add_(1.0)
    for x, y in zip((q, k, v), before, strict=True):
        assert torch.equal(x, y)


def test_reference_backward_does_not_mutate_inputs():
    pack = RolloutTrie.from_sequences([[1, 2, 3, 4], [1, 2, 5]]).pack()
    q, k, v = (x.requires_grad_() for x in qkv(pack, (2, 1, 4), seed=9, dtype=torch.float64))
    before = [x.detach().clone() for x in (q, k, v)]
    tree_attention(q, k, v, pack, backend="reference").square().sum().backward()
    for x, y in zip((q, k, v), before, strict=True):
        assert torch.equal(x.detach(), y) and x.grad is not None and torch.isfinite(x.grad).all()


def test_every_op_chooses_its_backend_in_one_place():
    from treeattn_lab.ops.backends import KERNELS, available_backends, choose_backend

    for op in KERNELS:
        avail = available_backends("cpu", op)
        assert avail[0] == "reference" and ("flex" in avail) == (op != "gated_scan")
        assert choose_backend("auto", torch.device("cpu"), op) == "reference"
        with pytest.raises(ValueError, match="unknown backend"):
            choose_backend("fast", torch.device("cpu"), op)
    with pytest.raises(ValueError, match="unknown op"):
        available_backends("cpu", "attention")


def test_scale_accepts_numpy_floats_and_refuses_non_numbers():
    import numpy as np

    pack = RolloutTrie.from_sequences([[1, 2, 3]]).pack()
    q, k, v = (torch.randn(3, 2, 8, dtype=torch.float64) for _ in range(3))
    a = tree_attention(q, k, v, pack, scale=np.float32(0.5), backend="reference")
    b = tree_attention(q, k, v, pack, scale=0.5, backend="reference")
    torch.testing.assert_close(a, b)
    with pytest.raises(TypeError, match="scale must be a float"):
        tree_attention(q, k, v, pack, scale="0.5", backend="reference")
