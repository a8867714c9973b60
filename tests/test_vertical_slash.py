"""Vertical-slash patterns: block rounding against brute force, the kernel index, estimation, recall."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from treeattn_lab.patterns.vertical_slash import (
    VerticalSlashPattern,
    causal_row_probs,
    estimate,
    estimate_top_p,
    line_scores,
    recall,
    synthetic_pattern,
)


def brute_force_tiles(pattern, n):
    """Tiles crossed by a slash, from the element-level slash mask (no formulas)."""
    bs = pattern.block_size
    pos = torch.arange(n)
    offset = pos[:, None] - pos[None, :]
    nb = -(-n // bs)
    out = torch.zeros(pattern.num_heads, nb, nb, dtype=torch.bool)
    for h in range(pattern.num_heads):
        on = torch.zeros(n, n, dtype=torch.bool)
        for s in pattern.slash[h].tolist():
            if s >= 0:
                on |= offset == s
        padded = torch.zeros(nb * bs, nb * bs, dtype=torch.bool)
        padded[:n, :n] = on
        out[h] = padded.view(nb, bs, nb, bs).any(3).any(1)
    return out


@st.composite
def patterns(draw, max_tokens=150):
    n = draw(st.integers(1, max_tokens))
    heads = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([16, 32]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    nv, ns = draw(st.integers(0, 8)), draw(st.integers(0, 6))
    vertical = torch.randint(-1, n, (heads, nv), generator=gen)
    slash = torch.randint(-1, n, (heads, ns), generator=gen)
    return VerticalSlashPattern(vertical, slash, bs), n


@settings(max_examples=25)
@given(patterns())
def test_block_map_and_dense_mask_match_brute_force(case):
    pattern, n = case
    assert torch.equal(pattern.block_map(n), brute_force_tiles(pattern, n))
    dense = pattern.dense_mask(n)
    lines = pattern.line_mask(n)
    assert not (lines & ~dense).any(), "block rounding must keep every line pair"
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert not (dense & ~causal).any()
    # dense = causal & (selected tile | column)
    bs = pattern.block_size
    tiles = pattern.block_map(n).repeat_interleave(bs, 1).repeat_interleave(bs, 2)[:, :n, :n]
    assert torch.equal(dense, causal & (tiles | pattern.vertical_map(n)[:, None, :]))
    assert pattern.num_pairs(n) == int(dense.sum())


@settings(max_examples=20)
@given(patterns(), st.data())
def test_block_index_tiles_plus_bars_is_the_dense_mask(case, data):
    pattern, n = case
    index = pattern.block_index(n)
    dense = pattern.dense_mask(n)
    tiles = index.block_mask()
    bars = index.bar_mask()
    bar_cols = torch.zeros_like(dense)
    if index.bar_pos is not None:
        cols = index.bar_pos.long()
        for h in range(pattern.num_heads):
            for j, c in enumerate(cols[h].tolist()):
                if c < n:
                    bar_cols[h][:, c] |= bars[h, :, j]
    assert not (tiles & bar_cols).any(), "a pair is computed twice"
    assert torch.equal(tiles | bar_cols, dense)
    # the transposed CSR lists the same tiles
    nq = index.q_blocks.numel()
    rows = {(h, i, int(j)) for h in range(pattern.num_heads) for i in range(nq)
            for j in index.row_idx[index.row_ptr[h * nq + i]:index.row_ptr[h * nq + i + 1]]}
    nk = index.k_blocks.numel()
    cols = {(h, int(i), j) for h in range(pattern.num_heads) for j in range(nk)
            for i in index.col_idx[index.col_ptr[h * nk + j]:index.col_ptr[h * nk + j + 1]]}
    assert rows == cols
    # a ring step's index (some query blocks against some key blocks) is the matching sub-mask
    nb = pattern.num_blocks(n)
    qb = sorted(data.draw(st.sets(st.integers(0, nb - 1), min_size=1)))
    kb = sorted(data.draw(st.sets(st.integers(0, nb - 1), min_size=1)))
    sub = pattern.block_index(n, q_blocks=torch.tensor(qb), k_blocks=torch.tensor(kb), bars=False)
    qpos, kpos = sub.positions()
    assert torch.equal(sub.block_mask(), tiles[:, qpos][:, :, kpos])


def test_patterns_are_normalized_copies():
    vertical = torch.tensor([[5, 3, -1, 3], [-1, -1, -1, -1]])
    before = vertical.clone()
    p = VerticalSlashPattern(vertical, [[2, 0], [7, 7]], 16)
    assert torch.equal(vertical, before), "inputs must not be modified"
    assert p.vertical.tolist() == [[3, 5], [-1, -1]]
    assert p.slash.tolist() == [[0, 2], [7, -1]]
    assert p.counts()[0].tolist() == [2, 0]


@pytest.mark.parametrize(("vertical", "slash", "block_size", "error", "match"), [
    ([[0.5]], [[0]], 16, TypeError, "integer"),
    ([0, 1], [[0]], 16, ValueError, "2-D"),
    ([[0]], [[0], [1]], 16, ValueError, "heads"),
    ([[-2]], [[0]], 16, ValueError, ">= 0"),
    ([[0]], [[0]], 24, ValueError, "power of two"),
    ([[0]], [[0]], 8, ValueError, "power of two"),
])
def test_bad_patterns_are_refused(vertical, slash, block_size, error, match):
    with pytest.raises(error, match=match):
        VerticalSlashPattern(vertical, slash, block_size)


def test_out_of_range_lines_are_refused():
    p = VerticalSlashPattern([[3, 40]], [[0]], 16)
    with pytest.raises(ValueError, match="vertical entry 40 is out of range for 32 tokens"):
        p.dense_mask(32)


def planted(n=160, heads=2, d=32, column=70, offset=37, seed=0):
    """q, k where head 0 attends mostly to one key column and head 1 mostly along one diagonal."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(n + offset, d, generator=gen), dim=-1)
    q = torch.randn(n, heads, d, generator=gen) * 0.1
    k = torch.randn(n, heads, d, generator=gen) * 0.1
    q[:, 0] += u[0] * 8
    k[column, 0] += u[0] * 8  # every query matches this key
    q[:, 1] += u[:n] * 8
    k[:, 1] += u[offset:offset + n] * 8  # key j matches query j + offset
    return q, k


def test_estimate_finds_planted_column_and_diagonal_and_keeps_forced_lines():
    q, k = planted()
    p = estimate(q, k, last_q=32, n_vertical=4, n_slash=4, sinks=2, local=2, block_size=16)
    assert 70 in p.vertical[0].tolist()
    assert 37 in p.slash[1].tolist()
    assert {0, 1} <= set(p.vertical[1].tolist()) and {0, 1} <= set(p.slash[0].tolist())
    assert p.vertical.shape == (2, 4) and p.slash.shape == (2, 4)
    vertical, slash = line_scores(q, k, last_q=32)
    torch.testing.assert_close(vertical.sum(1), torch.full((2,), 32.0))
    torch.testing.assert_close(slash.sum(1), torch.full((2,), 32.0))


def test_estimate_top_p_adapts_per_head_and_respects_caps():
    q, k = planted()
    p = estimate_top_p(q, k, p=0.9, last_q=32, sinks=1, local=1, block_size=16)
    nv, ns = p.counts()
    assert nv[0] < nv[1], "the focused head (one column) needs fewer columns"
    assert ns[1] < ns[0], "the diagonal head needs fewer offsets"
    vertical, slash = line_scores(q, k, last_q=32)
    for h in range(2):
        cols = p.vertical[h][p.vertical[h] >= 0]
        assert vertical[h, cols].sum() >= 0.9 * vertical[h].sum() - 1e-4
    capped = estimate_top_p(q, k, p=1.0, max_vertical=5, max_slash=3, last_q=32, sinks=1, local=1,
                            block_size=16)
    assert (capped.counts()[0] <= 5).all() and (capped.counts()[1] <= 3).all()
    with pytest.raises(ValueError, match="p must lie"):
        estimate_top_p(q, k, p=1.5)


def test_recall_is_one_for_dense_and_grows_with_budget():
    q, k = planted(seed=3)
    n = q.shape[0]
    everything = VerticalSlashPattern(torch.arange(n).expand(2, -1), torch.zeros(2, 1, dtype=torch.long), 16)
    torch.testing.assert_close(recall(everything, q, k), torch.ones(2), rtol=1e-5, atol=1e-5)
    budgets = [estimate(q, k, n_vertical=b, n_slash=b, sinks=1, local=1, block_size=16) for b in (2, 8, 32)]
    scores = [recall(p, q, k).mean().item() for p in budgets]
    assert scores[0] <= scores[1] + 1e-6 <= scores[2] + 2e-6
    # recall on a subset of rows equals the brute-force mass on those rows
    rows = torch.tensor([5, 80, 159])
    p = budgets[1]
    probs = torch.softmax((torch.einsum("thd,shd->hts", q, k) / 32 ** 0.5).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")), -1)
    want = (probs * p.dense_mask(n))[:, rows].sum(-1).mean(-1)
    torch.testing.assert_close(recall(p, q, k, rows=rows), want, rtol=1e-5, atol=1e-5)
    lines_only = (probs * p.line_mask(n)).sum(-1).mean(-1)
    torch.testing.assert_close(recall(p, q, k, rounded=False), lines_only, rtol=1e-5, atol=1e-5)
    assert (recall(p, q, k, rounded=False) <= recall(p, q, k) + 1e-6).all()


def test_synthetic_pattern_is_seeded_and_shaped():
    a = synthetic_pattern(4096, 3, n_vertical=100, n_slash=80, sinks=10, local=20, block_size=64, seed=5)
    b = synthetic_pattern(4096, 3, n_vertical=100, n_slash=80, sinks=10, local=20, block_size=64, seed=5)
    assert torch.equal(a.vertical, b.vertical) and torch.equal(a.slash, b.slash)
    assert a.vertical.shape == (3, 100) and a.slash.shape == (3, 80)
    assert (a.vertical[:, :10] == torch.arange(10)).all() and (a.slash[:, :20] == torch.arange(20)).all()
    far = synthetic_pattern(4096, 3, n_vertical=100, n_slash=80, sinks=10, local=20, far_slash=1.0,
                            block_size=64, seed=5)
    assert far.density(4096) > a.density(4096), "scattered slashes cross more tiles"


def test_causal_row_probs_match_a_float64_softmax_under_grouped_query_attention():
    gen = torch.Generator().manual_seed(11)
    n, hq, hkv, d = 37, 6, 2, 8
    q, k = torch.randn(n, hq, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
    rows = torch.tensor([0, 1, 17, 36])
    got = causal_row_probs(q, k, rows, scale=0.3)
    kk = k.double().repeat_interleave(hq // hkv, dim=1)  # query head h reads key head h // (hq // hkv)
    scores = torch.einsum("rhd,shd->hrs", q.double()[rows], kk) * 0.3
    scores = scores.masked_fill(torch.arange(n)[None, None, :] > rows[None, :, None], float("-inf"))
    torch.testing.assert_close(got.double(), scores.softmax(-1), rtol=1e-5, atol=1e-6)
    assert got.shape == (hq, rows.numel(), n) and (got[:, 0, 1:] == 0).all()
    vertical, slash = line_scores(q, k, last_q=100)  # more queries than tokens: every row counts
    torch.testing.assert_close(vertical.sum(1), torch.full((hq,), float(n)), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(slash.sum(1), torch.full((hq,), float(n)), rtol=1e-5, atol=1e-4)
