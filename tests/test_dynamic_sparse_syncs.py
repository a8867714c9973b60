"""Dynamic sparse attention reads nothing back to the host in a layer call, and its shortcuts are exact.

A host sync (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, a data-dependent ``nonzero`` or boolean
mask index) stalls the GPU's queue and stops a CUDA graph from capturing the step. :class:`SyncCounter`
counts them on the CPU, where the same Python runs, at the dispatcher: ``aten._local_scalar_dense`` (what
``item`` / ``int`` / ``float`` / ``bool`` reach), ``nonzero``-like ops and boolean-mask indexing, plus
``Tensor.tolist`` (which reads memory without dispatching). The shortcuts that remove the syncs (the
estimator's trusted pattern constructor, the fixed-capacity CSR index, the batch side by side as heads)
are checked against the validated constructor, ``nonzero`` and the per-sequence reference.
"""

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from treeattn_lab.ops.dynamic_sparse import (
    DynamicSparseAttention,
    PairStats,
    SparseBudget,
    fixed_pattern_attention,
)
from treeattn_lab.ops.sparse import sparse_attention
from treeattn_lab.patterns.vertical_slash import VerticalSlashPattern, estimate
from treeattn_lab.patterns.vertical_slash.block_index import _csr

_READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "masked_select",
          "unique", "_unique2", "unique_consecutive", "equal"}
_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


class SyncCounter(TorchDispatchMode):
    """Counts host syncs (``syncs``, by op name) and every aten op (``ops``) run inside it."""

    def __init__(self):
        super().__init__()
        self.syncs = collections.Counter()
        self.ops = 0
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        self.ops += 1
        indices = args[1] if name in _INDEXING and len(args) > 1 else ()
        if name in _READS:
            self.syncs[name] += 1
        elif any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            self.syncs["boolean mask index"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter, tolist = self, self._tolist

        def counted_tolist(t):
            counter.syncs["tolist"] += 1
            return tolist(t)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.syncs.values())


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton path: compiled on a GPU


def qkv(seed, batch, n, hq, hkv, d, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, h, d, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
            for h in (hq, hkv, hkv)]


BUDGET = SparseBudget(5, 4, sinks=2, local=2, last_q=8, block_size=16)


def test_the_counter_sees_every_kind_of_sync():
    t = torch.tensor([[3, 1, -1]])
    with SyncCounter() as c:
        int(t.max())
        bool((t > 0).any())
        t.tolist()
        t.nonzero()
        t[t > 0]
        VerticalSlashPattern(t, t, 16)  # the validated constructor reads its entries back
    assert c.syncs["_local_scalar_dense"] >= 2 and c.syncs["tolist"] == 1
    assert c.syncs["nonzero"] == 1 and c.syncs["boolean mask index"] == 1
    assert c.total > 5


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_layer_call_reads_nothing_back_forward_or_backward(backend):
    q, k, v = qkv(1, 2, 80, 2, 1, 16)
    attention = DynamicSparseAttention(BUDGET, backend=backend)
    attention(q, k, v)  # first call: anything cached once per process (kernel compilation) is built
    with SyncCounter() as forward:
        out = attention(q, k, v)
    with SyncCounter() as backward:
        out.sum().backward()
    assert forward.total == 0, forward.syncs
    assert backward.total == 0, backward.syncs
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))
    with SyncCounter() as read:
        fraction = attention.stats.fraction
    assert read.total == 1 and 0.0 < fraction < 1.0  # the pair count is read once, when asked for
    with SyncCounter() as again:
        assert attention.stats.fraction == fraction
    assert again.total == 0


def test_the_batch_runs_as_one_call_not_a_loop_over_sequences():
    """The aten ops of a layer call (launches, on a GPU) do not depend on the batch size."""
    counts = []
    for batch in (2, 5):
        attention = DynamicSparseAttention(BUDGET, backend="triton")
        with SyncCounter() as c:
            attention(*qkv(2, batch, 70, 4, 2, 16))
        counts.append(c.ops)
    assert counts[0] == counts[1], f"aten ops per layer call grow with the batch: {counts}"


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_fixed_pattern_reads_its_entries_once(backend):
    """A user's pattern is checked once (entries read back); later calls under it read nothing."""
    vertical = torch.tensor([[0, 5, -1], [3, 9, 40]], device=DEVICE)
    slash = torch.tensor([[0, 1], [0, -1]], device=DEVICE)
    pattern = VerticalSlashPattern(vertical, slash, 16)
    attention = fixed_pattern_attention(pattern, backend=backend)
    q, k, v = qkv(3, 2, 50, 2, 1, 16)
    with SyncCounter() as first:
        attention(q, k, v)
    with SyncCounter() as later:
        out = attention(q, k, v)
    assert first.total > 0 and later.total == 0, (first.syncs, later.syncs)
    fresh = VerticalSlashPattern(vertical, slash, 16)  # checked afresh, the reference's own copy
    want = torch.stack([sparse_attention(q[b], k[b], v[b], fresh, backend="reference") for b in range(2)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="slash entry 40|vertical entry 40"):
        pattern.check_tokens(40)  # the bound kept still refuses a shorter sequence
    copy = pattern.to("meta")
    assert copy is not pattern and copy.device.type == "meta" and copy.block_size == 16


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(17, 150), heads=st.integers(1, 5),
       nv=st.integers(0, 12), ns=st.integers(1, 12), bs=st.sampled_from([16, 32]))
def test_the_trusted_constructor_equals_the_validated_one(seed, n, heads, nv, ns, bs):
    """Random top-k-like rows (distinct, in range, unsorted): the same lines, masks and kernel index."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.stack([torch.randperm(n, generator=g)[: min(nv, n)] for _ in range(heads)])
    slash = torch.stack([torch.randperm(n, generator=g)[: min(ns, n)] for _ in range(heads)])
    before = (vertical.clone(), slash.clone())
    trusted = VerticalSlashPattern._from_top_k(vertical, slash, bs, num_tokens=n)
    checked = VerticalSlashPattern(vertical, slash, bs)
    assert torch.equal(vertical, before[0]) and torch.equal(slash, before[1]), "inputs were mutated"
    assert torch.equal(trusted.vertical, checked.vertical) and torch.equal(trusted.slash, checked.slash)
    assert torch.equal(trusted.dense_mask(n), checked.dense_mask(n))
    assert trusted.num_pairs(n) == checked.num_pairs(n)
    a, b = trusted.block_index(n), checked.block_index(n)
    assert a.num_q == b.num_q == a.num_k == n and a.num_tiles == b.num_tiles
    for name in ("row_ptr", "row_idx", "col_ptr", "col_idx", "bar_pos", "bar_count", "bar_skip"):
        assert _equal_or_none(getattr(a, name), getattr(b, name)), name
    # a shorter sequence than the estimate's falls back to reading the entries, and refuses any too large
    largest = max(int(x.max()) for x in (vertical, slash) if x.numel())
    if largest == n - 1:
        with pytest.raises(ValueError, match="out of range"):
            trusted.check_tokens(n - 1)
    else:
        trusted.check_tokens(n - 1)


def _equal_or_none(x, y):
    return x is None and y is None or torch.equal(x, y)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(9, 120), hq=st.sampled_from([1, 2, 4]),
       nv=st.integers(0, 9), ns=st.integers(1, 9))
def test_estimate_builds_the_pattern_the_validated_constructor_would(seed, n, hq, nv, ns):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, hq, 8, generator=g), torch.randn(n, 1, 8, generator=g)
    got = estimate(q, k, last_q=5, n_vertical=nv, n_slash=ns, sinks=min(2, nv), local=1, block_size=16)
    from treeattn_lab.patterns.vertical_slash.estimator import _forced, line_scores

    vs, ss = line_scores(q, k, last_q=5)
    want = VerticalSlashPattern(_forced(vs, min(2, nv)).topk(min(nv, n), dim=1).indices,
                                _forced(ss, 1).topk(min(ns, n), dim=1).indices, 16)
    assert torch.equal(got.vertical, want.vertical) and torch.equal(got.slash, want.slash)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 9), cols=st.integers(0, 9),
       density=st.floats(0.0, 1.0))
def test_fixed_capacity_csr_equals_nonzero(seed, rows, cols, density):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, cols, generator=g) < density
    ptr, idx = _csr(mask, cols)
    assert ptr.dtype == idx.dtype == torch.int32 and idx.numel() == rows * cols
    assert torch.equal(ptr[1:].long(), torch.cumsum(mask.sum(1), 0)) and int(ptr[0]) == 0
    assert torch.equal(idx[: int(ptr[-1])].long(), mask.nonzero()[:, 1])
    assert not idx[int(ptr[-1]):].any(), "the slack after the last row must be zeros"


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(20, 90), batch=st.integers(1, 3),
       heads=st.sampled_from([(2, 1), (3, 3), (4, 2)]))
def test_the_batched_call_equals_each_sequence_under_its_own_pattern(seed, n, batch, heads):
    """Values and gradients of one batched call against per-sequence reference sparse attention under the
    patterns estimated from each sequence alone (float64: exact up to summation order)."""
    hq, hkv = heads
    q, k, v = qkv(seed, batch, n, hq, hkv, 8, dtype=torch.float64)
    attention = DynamicSparseAttention(SparseBudget(4, 3, sinks=1, local=1, last_q=6, block_size=16),
                                       backend="reference")
    out = attention(q, k, v)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    patterns = [attention.pattern_for(q[b].detach(), k[b].detach()) for b in range(batch)]
    ref = torch.stack([sparse_attention(*(x[b] for x in ref_leaves), p, backend="reference")
                       for b, p in enumerate(patterns)])
    ref_grads = torch.autograd.grad(ref, ref_leaves, do)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    stats = PairStats()
    for p in patterns:
        stats.record(p, n)
    assert attention.stats == stats and attention.stats.calls == batch


def test_trusted_constructor_refuses_what_is_not_top_k_indices():
    lines = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="integer tensor"):
        VerticalSlashPattern._from_top_k(lines.float(), lines, 16, num_tokens=4)
    with pytest.raises(TypeError, match="integer tensor"):
        VerticalSlashPattern._from_top_k(lines, lines[0], 16, num_tokens=4)
    with pytest.raises(ValueError, match="heads"):
        VerticalSlashPattern._from_top_k(lines, lines[:1], 16, num_tokens=4)
    with pytest.raises(ValueError, match="block_size"):
        VerticalSlashPattern._from_top_k(lines, lines, 24, num_tokens=4)
    with pytest.raises(TypeError, match="num_tokens"):
        VerticalSlashPattern._from_top_k(lines, lines, 16, num_tokens=4.0)
    with pytest.raises(TypeError, match="integer tensor"):
        VerticalSlashPattern._from_top_k(lines.bool(), lines, 16, num_tokens=4)
    with pytest.raises(ValueError, match="slash has 3 entries per head"):
        VerticalSlashPattern._from_top_k(lines[:, :2], lines, 16, num_tokens=2)
