"""Block-sparse attention in Triton: causal attention over a few tiles plus a few gathered key columns.

What is computed
----------------
A vertical-slash pattern (``treeattn_lab.patterns.vertical_slash``) reaches the kernel as a
:class:`~treeattn_lab.patterns.vertical_slash.BlockSparseIndex`. Queries and keys are cut into blocks of
``BLOCK`` tokens (128 on a GPU). For query block ``i`` of head ``h`` the kernel visits

1. **tiles**: the key blocks some slash of the head crosses (a CSR row of block ids, ascending). A tile
   off the diagonal is seen whole by every query of the block: it runs with no mask at all, exactly like
   a dense FlashAttention tile. The diagonal tile (the row's last entry) runs with the causal mask.
2. **bars**: the head's vertical columns that lie in no selected tile. They were gathered beforehand
   into a dense per-head buffer ``bar_k, bar_v [H, nb, D]`` (sorted by position), so the kernel reads
   them in chunks with plain contiguous loads.

Everything else is skipped without being loaded. Positions are *global* (``q_blocks`` / ``k_blocks``
map local blocks to global ones), so the same kernel computes one step of ring attention: a rank's
queries against the keys it holds at that step.

Clean and masked bar chunks
---------------------------
A bar column needs an element mask only where it is not simply visible: a column after the block's
first query (causal rule), one inside a tile the row already selected (``bar_skip``: it must not count
twice) or padding. Bars are sorted by position, so for query block ``i`` the first ``clean[h, i]`` of
them are visible to every query of the block and lie in no selected tile: those chunks run unmasked,
like off-diagonal tiles, and only the chunk or two near the diagonal evaluate the mask (a byte lookup
in ``bar_skip`` per column). The same holds transposed: a chunk of bars is clean for every query block
from ``clean_from[h, c]`` on. Both are computed once per index (:func:`bar_plan`, cached with it).

Tile shapes
-----------
The index's 128-token blocks are the *schedule*; the programs work on smaller pieces of them so that
their fp32 accumulators and score tiles fit the registers (a 128 x 128 score tile next to two 128 x 128
accumulators spills): a program owns ``BLOCK_M`` rows of a query block and walks each tile in steps of
``BLOCK_N`` keys (forward, dQ); the dK/dV program owns ``BLOCK_N`` keys of a key block and walks the
query blocks in steps of ``BLOCK_M`` queries. :data:`CONFIGS` holds the shapes, warps and stages.

Forward (one program per BLOCK_M queries and query head)
--------------------------------------------------------
FlashAttention-2 online softmax in base 2 over the tiles, then the bars, in fp32: per row the running
maximum ``m``, the running sum ``l`` and the accumulator are rescaled by ``exp2(m_old - m_new)`` when a
new step raises the maximum. The output is ``acc / l`` and the log-sum-exp ``lse = m + log2(l)``
(base 2, ``-inf`` for a row that saw nothing) is saved: it recomputes any probability as
``p = exp2(s - lse)`` and merges partial results. With ``MERGE`` the kernel folds its partial result
into a running fp32 output and lse in place (one ring step into the steps before it):

    lse = log2(2^lse_old + 2^lse_new),   out = out_old * 2^(lse_old - lse) + out_new * 2^(lse_new - lse).

Backward (FlashAttention-2, two kernels, no atomics by default)
---------------------------------------------------------------
``delta = rowsum(dO * O)``; with ``p`` recomputed from ``lse``: ``dV += p^T dO``, ``dP = dO V^T``,
``dS = p * (dP - delta)``, ``dK += dS^T Q * scale``, ``dQ += dS K * scale``.

- dQ: one program per (BLOCK_M queries, head) walks the forward's tiles and bars (like the forward,
  late query blocks first: they see the most bars, and the longest programs should start first).
- dK, dV: one launch whose programs are of two kinds. *Bar programs* come first (they are the longest:
  the first chunk is seen by nearly every query block), one per (chunk of bar columns, query head,
  split): a chunk of gathered bar columns is a key block like any other, walked over the contiguous
  range of query blocks that see it (masked until ``clean_from``, plain after); with ``SPLIT > 1`` the
  range is cut in ``SPLIT`` pieces whose fp32 partial sums are added afterwards. *Tile programs*, one
  per (BLOCK_N keys of a key block, kv head), walk the **transposed** index (query blocks per key
  block, diagonal first) for each of the G query heads sharing the kv head (grouped-query attention).
  The bar gradients ``d bar_k, d bar_v`` are scattered back into dK, dV through the gather's rows.

That is 7 dots per (query block, key block) pair: dQ recomputes the scores and dP the dK/dV programs
already had. With ``dq_atomic`` the dK/dV programs also compute ``dS K`` and add it to an fp32 dQ with
atomics (as FlashAttention-2/3 do), 5 dots per pair and no dQ kernel, at the price of atomic traffic and
a dQ that is not bitwise reproducible; the ring's fp32 dQ receives the atomics directly.

Precision: fp16 / bf16 inputs use tensor-core dots with fp32 accumulation; fp32 inputs use IEEE fp32
dots. Under ``TRITON_INTERPRET=1`` (CPU) everything runs through numpy: use fp32 / fp16 there.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .limits import check_attention_inputs

LOG2E = 1.4426950408889634
BAR_PAD = 2**31 - 1  # padding position in an index's bar_pos (never <= any query)
_BAR_PAD = tl.constexpr(BAR_PAD)  # the same, readable inside kernels


# --------------------------------------------------------------------------------------- helpers
@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
    """Fold scores ``s`` (base-2 scaled, ``-inf`` where masked) and values ``v`` into the running state."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_rows(base, rows, stride, offs_d, in_range, MASKED: tl.constexpr):
    ptrs = base + rows.to(tl.int64)[:, None] * stride + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=in_range[:, None], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _row_tiles(ROW_PTR, ROW_IDX, K_BLOCKS, row, q_block):
    """(start, full_end, end) of a CSR row of key tiles; the diagonal tile, if listed, is the last."""
    start = tl.load(ROW_PTR + row)
    end = tl.load(ROW_PTR + row + 1)
    has = end > start
    last = tl.load(ROW_IDX + tl.maximum(end - 1, 0), mask=has, other=0)
    diag = has & (tl.load(K_BLOCKS + last, mask=has, other=-1) == q_block)
    return start, end - diag.to(tl.int32), end


@triton.jit
def _bar_rows(BAR_POS, BK, BV, h, c, nbar, skip_row, qpos, offs_d, stride_bh, stride_bt, NB,
              BLOCK: tl.constexpr, BAR: tl.constexpr, MASKED: tl.constexpr):
    """Bar columns ``c .. c + BAR`` of head ``h``: keys, values and (MASKED) which pairs with the queries at
    ``qpos`` count (real columns, not inside a selected tile, causal).

    Unmasked chunks lie wholly in the clean prefix: every column is real, visible and not in a tile.
    """
    offs_c = c + tl.arange(0, BAR)
    rows = h * stride_bh + offs_c.to(tl.int64) * stride_bt
    if MASKED:
        valid = offs_c < nbar
        pos = tl.load(BAR_POS + h * NB + offs_c, mask=valid, other=_BAR_PAD)
        skip = tl.load(skip_row + pos // BLOCK, mask=valid, other=1)
        bk = tl.load(BK + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        bv = tl.load(BV + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        return bk, bv, (valid & (skip == 0))[None, :] & (pos[None, :] <= qpos[:, None])
    bk = tl.load(BK + rows[:, None] + offs_d[None, :])
    bv = tl.load(BV + rows[:, None] + offs_d[None, :])
    return bk, bv, (offs_c[None, :] >= 0) & (qpos[:, None] >= 0)  # every pair (left unused)


@triton.jit
def _key_subtile(t, qpos, K, V, K_BLOCKS, ROW_IDX, NK, stride_kt, stride_vt, offs_n, offs_d,
                 BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Step ``t`` of a query block's walk over its tiles ``BLOCK_N`` keys at a time: keys, values and
    (MASKED: the diagonal tile) which pairs are visible (causal, and within the ragged end of the keys)."""
    NSUB: tl.constexpr = BLOCK // BLOCK_N
    n = tl.load(ROW_IDX + t // NSUB)
    sub = (t % NSUB) * BLOCK_N
    keys = n * BLOCK + sub + offs_n
    k = _load_rows(K, keys, stride_kt, offs_d, keys < NK, MASKED)
    v = _load_rows(V, keys, stride_vt, offs_d, keys < NK, MASKED)
    visible = (qpos[:, None] >= 0) & (offs_n >= 0)[None, :]  # unmasked tiles: every pair (left unused)
    if MASKED:
        kpos = tl.load(K_BLOCKS + n) * BLOCK + sub + offs_n
        visible = (kpos[None, :] <= qpos[:, None]) & (keys < NK)[None, :]
    return k, v, visible


# --------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, qpos, K, V, K_BLOCKS, ROW_IDX, lo, hi, NK, stride_kt, stride_vt, qk_scale,
               BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """Fold the tiles ``ROW_IDX[lo:hi]`` into the running state, ``BLOCK_N`` keys at a time."""
    NSUB = BLOCK // BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for t in range(lo * NSUB, hi * NSUB):
        k, v, visible = _key_subtile(t, qpos, K, V, K_BLOCKS, ROW_IDX, NK, stride_kt, stride_vt, offs_n,
                                     offs_d, BLOCK, BLOCK_N, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:  # the diagonal tile: causal mask (and the ragged end of the keys)
            s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _fwd_bars(acc, m_i, l_i, q, qpos, BAR_POS, BK, BV, skip_row, h, lo, hi, NB, stride_bh, stride_bt,
              qk_scale, BLOCK: tl.constexpr, BAR: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """Fold the bar columns ``lo .. hi`` of head ``h`` into the running state, ``BAR`` at a time."""
    offs_d = tl.arange(0, HEAD_DIM)
    for c in range(lo, hi, BAR):
        bk, bv, visible = _bar_rows(BAR_POS, BK, BV, h, c, hi, skip_row, qpos, offs_d, stride_bh, stride_bt,
                                    NB, BLOCK, BAR, MASKED)
        s = tl.dot(q, tl.trans(bk), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, bv, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _bsa_fwd(
    Q, K, V, BK, BV, O, LSE,
    Q_BLOCKS, K_BLOCKS, ROW_PTR, ROW_IDX, BAR_POS, BAR_COUNT, BAR_CLEAN, BAR_SKIP,
    NQ, NK, NQB, NKG, NB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_bh, stride_bt, qk_scale,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAR: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BARS: tl.constexpr, MERGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    m = NQB - 1 - pid // (BLOCK // BLOCK_M)  # the query block (late ones first: they see the most bars)
    offs_r = (pid % (BLOCK // BLOCK_M)) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = m * BLOCK + offs_r
    in_range = rows < NQ
    q_block = tl.load(Q_BLOCKS + m)
    qpos = q_block * BLOCK + offs_r  # global positions of the program's queries
    q = _load_rows(Q + h * stride_qh, rows, stride_qt, offs_d, in_range, True)
    K += (h // GROUP) * stride_kh
    V += (h // GROUP) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start, full_end, end = _row_tiles(ROW_PTR, ROW_IDX, K_BLOCKS, h * NQB + m, q_block)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, qpos, K, V, K_BLOCKS, ROW_IDX, start, full_end, NK,
                               stride_kt, stride_vt, qk_scale, BLOCK, BLOCK_N, HEAD_DIM, False, DOT_PRECISION)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, qpos, K, V, K_BLOCKS, ROW_IDX, full_end, end, NK,
                               stride_kt, stride_vt, qk_scale, BLOCK, BLOCK_N, HEAD_DIM, True, DOT_PRECISION)
    if HAS_BARS:
        nbar = tl.load(BAR_COUNT + h * NQB + m)
        clean = tl.load(BAR_CLEAN + h * NQB + m)
        clean -= clean % BAR  # whole chunks only
        skip_row = BAR_SKIP + (h * NQB + m).to(tl.int64) * NKG
        acc, m_i, l_i = _fwd_bars(acc, m_i, l_i, q, qpos, BAR_POS, BK, BV, skip_row, h, 0, clean, NB,
                                  stride_bh, stride_bt, qk_scale, BLOCK, BAR, HEAD_DIM, False, DOT_PRECISION)
        acc, m_i, l_i = _fwd_bars(acc, m_i, l_i, q, qpos, BAR_POS, BK, BV, skip_row, h, clean, nbar, NB,
                                  stride_bh, stride_bt, qk_scale, BLOCK, BAR, HEAD_DIM, True, DOT_PRECISION)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = m_i + tl.log2(l_safe)  # -inf where the row saw nothing
    o_ptrs = O + h * stride_oh + rows.to(tl.int64)[:, None] * stride_ot + offs_d[None, :]
    if MERGE:  # fold into the running (fp32 output, lse) of earlier ring steps
        lse_old = tl.load(LSE + h * NQ + rows, mask=in_range, other=float("-inf"))
        o_old = tl.load(o_ptrs, mask=in_range[:, None], other=0.0)
        top = tl.maximum(lse_old, lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.exp2(lse_old - top)
        w_new = tl.exp2(lse - top)
        total = w_old + w_new
        total_safe = tl.where(total == 0.0, 1.0, total)
        out = (o_old * (w_old / total_safe)[:, None] + out * (w_new / total_safe)[:, None])
        lse = tl.where(total == 0.0, float("-inf"), top + tl.log2(total_safe))
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=in_range[:, None])
    tl.store(LSE + h * NQ + rows, lse, mask=in_range)


# --------------------------------------------------------------------------------------- backward
@triton.jit
def _bsa_delta(O, DO, DELTA, NQ, stride_ot, stride_oh, stride_dot, stride_doh,
               BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``delta[h, t] = sum_d dO * O`` in fp32, one program per (query block, head)."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    rows = m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = rows < NQ
    o = _load_rows(O + h * stride_oh, rows, stride_ot, offs_d, in_range, True).to(tl.float32)
    do = _load_rows(DO + h * stride_doh, rows, stride_dot, offs_d, in_range, True).to(tl.float32)
    tl.store(DELTA + h * NQ + rows, tl.sum(o * do, 1), mask=in_range)


@triton.jit
def _dq_step(dq, q, do, lse, delta, k, v, visible, qk_scale, MASKED: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, qpos, K, V, K_BLOCKS, ROW_IDX, lo, hi, NK, stride_kt, stride_vt,
              qk_scale, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the tiles ``ROW_IDX[lo:hi]``'s share of dQ, ``BLOCK_N`` keys at a time."""
    NSUB = BLOCK // BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for t in range(lo * NSUB, hi * NSUB):
        k, v, visible = _key_subtile(t, qpos, K, V, K_BLOCKS, ROW_IDX, NK, stride_kt, stride_vt, offs_n,
                                     offs_d, BLOCK, BLOCK_N, MASKED)
        dq = _dq_step(dq, q, do, lse, delta, k, v, visible, qk_scale, MASKED, DOT_PRECISION)
    return dq


@triton.jit
def _dq_bars(dq, q, do, lse, delta, qpos, BAR_POS, BK, BV, skip_row, h, lo, hi, NB, stride_bh, stride_bt,
             qk_scale, BLOCK: tl.constexpr, BAR: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    """Add the bar columns ``lo .. hi``'s share of dQ, ``BAR`` at a time."""
    offs_d = tl.arange(0, HEAD_DIM)
    for c in range(lo, hi, BAR):
        bk, bv, visible = _bar_rows(BAR_POS, BK, BV, h, c, hi, skip_row, qpos, offs_d, stride_bh, stride_bt,
                                    NB, BLOCK, BAR, MASKED)
        dq = _dq_step(dq, q, do, lse, delta, bk, bv, visible, qk_scale, MASKED, DOT_PRECISION)
    return dq


@triton.jit
def _bsa_bwd_dq(
    Q, K, V, BK, BV, DO, LSE, DELTA, DQ,
    Q_BLOCKS, K_BLOCKS, ROW_PTR, ROW_IDX, BAR_POS, BAR_COUNT, BAR_CLEAN, BAR_SKIP,
    NQ, NK, NQB, NKG, NB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_bh, stride_bt, qk_scale, scale,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAR: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BARS: tl.constexpr, ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    m = NQB - 1 - pid // (BLOCK // BLOCK_M)  # late query blocks first, as in the forward
    offs_r = (pid % (BLOCK // BLOCK_M)) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = m * BLOCK + offs_r
    in_range = rows < NQ
    q_block = tl.load(Q_BLOCKS + m)
    qpos = q_block * BLOCK + offs_r
    q = _load_rows(Q + h * stride_qh, rows, stride_qt, offs_d, in_range, True)
    do = _load_rows(DO + h * stride_doh, rows, stride_dot, offs_d, in_range, True)
    lse = tl.load(LSE + h * NQ + rows, mask=in_range, other=0.0)
    delta = tl.load(DELTA + h * NQ + rows, mask=in_range, other=0.0)
    K += (h // GROUP) * stride_kh
    V += (h // GROUP) * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start, full_end, end = _row_tiles(ROW_PTR, ROW_IDX, K_BLOCKS, h * NQB + m, q_block)
    dq = _dq_tiles(dq, q, do, lse, delta, qpos, K, V, K_BLOCKS, ROW_IDX, start, full_end, NK, stride_kt,
                   stride_vt, qk_scale, BLOCK, BLOCK_N, HEAD_DIM, False, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse, delta, qpos, K, V, K_BLOCKS, ROW_IDX, full_end, end, NK, stride_kt,
                   stride_vt, qk_scale, BLOCK, BLOCK_N, HEAD_DIM, True, DOT_PRECISION)
    if HAS_BARS:
        nbar = tl.load(BAR_COUNT + h * NQB + m)
        clean = tl.load(BAR_CLEAN + h * NQB + m)
        clean -= clean % BAR
        skip_row = BAR_SKIP + (h * NQB + m).to(tl.int64) * NKG
        dq = _dq_bars(dq, q, do, lse, delta, qpos, BAR_POS, BK, BV, skip_row, h, 0, clean, NB, stride_bh,
                      stride_bt, qk_scale, BLOCK, BAR, HEAD_DIM, False, DOT_PRECISION)
        dq = _dq_bars(dq, q, do, lse, delta, qpos, BAR_POS, BK, BV, skip_row, h, clean, nbar, NB, stride_bh,
                      stride_bt, qk_scale, BLOCK, BAR, HEAD_DIM, True, DOT_PRECISION)
    dq = dq * scale
    dq_ptrs = DQ + h * stride_dqh + rows.to(tl.int64)[:, None] * stride_dqt + offs_d[None, :]
    if ACCUMULATE:
        dq += tl.load(dq_ptrs, mask=in_range[:, None], other=0.0)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=in_range[:, None])


@triton.jit
def _dkdv_queries(dk, dv, k, v, kpos, key_ok, kblock, Q, DO, LSE, DELTA, DQ, Q_BLOCKS, COL_IDX, skip_base,
                  lo, hi, NQ, NKG, stride_qt, stride_dot, stride_dqt, qk_scale, scale, BLOCK: tl.constexpr,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                  FROM_LIST: tl.constexpr, SKIP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Add the share of query blocks ``lo .. hi`` (``COL_IDX[lo:hi]`` with FROM_LIST) to a key chunk's
    dK, dV, ``BLOCK_M`` queries at a time (transposed scores ``[keys, queries]``).

    MASKED evaluates the causal rule per element from the keys' positions ``kpos`` and drops keys not
    ``key_ok``; with SKIP (bar columns) also those inside a tile the query block selected. ATOMIC_DQ
    also adds the queries' dQ share ``dS K * scale`` into the fp32 ``DQ`` with atomics.
    """
    NSUB = BLOCK // BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    for t in range(lo * NSUB, hi * NSUB):
        i = tl.load(COL_IDX + t // NSUB) if FROM_LIST else t // NSUB  # the query block
        sub = (t % NSUB) * BLOCK_M
        rows = i * BLOCK + sub + offs_m
        in_range = rows < NQ
        q = _load_rows(Q, rows, stride_qt, offs_d, in_range, True)
        do = _load_rows(DO, rows, stride_dot, offs_d, in_range, True)
        lse = tl.load(LSE + rows, mask=in_range, other=0.0)
        delta = tl.load(DELTA + rows, mask=in_range, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        p_t = tl.exp2(s_t - lse[None, :])
        if MASKED:
            qpos = tl.load(Q_BLOCKS + i) * BLOCK + sub + offs_m
            ok = key_ok
            if SKIP:
                ok = ok & (tl.load(skip_base + i * NKG + kblock, mask=key_ok, other=1) == 0)
            visible = (kpos[:, None] <= qpos[None, :]) & ok[:, None] & in_range[None, :]
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * scale
            dq_ptrs = DQ + rows.to(tl.int64)[:, None] * stride_dqt + offs_d[None, :]
            tl.atomic_add(dq_ptrs, dq, mask=in_range[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _tile_dkdv(tid, Q, K, V, DO, LSE, DELTA, DQ, DK, DV, Q_BLOCKS, K_BLOCKS, COL_PTR, COL_IDX,
               NQ, NK, NKB, NKG, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
               qk_scale, scale, GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, ACCUMULATE: tl.constexpr,
               ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A tile program: dK, dV of ``BLOCK_N`` keys of one key block and kv head, over every query head
    of its group and the query blocks whose tiles hold the key block (the transposed index)."""
    NPART = BLOCK // BLOCK_N
    n = (tid // NPART) % NKB
    kv_head = tid // (NPART * NKB)
    offs_n = (tid % NPART) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    keys = n * BLOCK + offs_n
    key_ok = keys < NK
    k_block = tl.load(K_BLOCKS + n)
    kpos = k_block * BLOCK + offs_n
    k = _load_rows(K + kv_head * stride_kh, keys, stride_kt, offs_d, key_ok, True)
    v = _load_rows(V + kv_head * stride_vh, keys, stride_vt, offs_d, key_ok, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(GROUP):  # the query heads sharing this kv head
        h = kv_head * GROUP + g
        col = h * NKB + n
        start = tl.load(COL_PTR + col)
        end = tl.load(COL_PTR + col + 1)
        has = end > start
        first = tl.load(COL_IDX + start, mask=has, other=0)
        full_start = start + (has & (tl.load(Q_BLOCKS + first, mask=has, other=-1) == k_block)).to(tl.int32)
        Qh = Q + h * stride_qh
        DOh = DO + h * stride_doh
        DQh = DQ + h * stride_dqh
        LSEh = LSE + h * NQ
        DELTAh = DELTA + h * NQ
        dk, dv = _dkdv_queries(dk, dv, k, v, kpos, key_ok, kpos, Qh, DOh, LSEh, DELTAh, DQh, Q_BLOCKS,
                               COL_IDX, COL_IDX, start, full_start, NQ, NKG, stride_qt, stride_dot,
                               stride_dqt, qk_scale, scale, BLOCK, BLOCK_M, HEAD_DIM, True, True, False,
                               ATOMIC_DQ, DOT_PRECISION)  # the diagonal tile: causal mask
        dk, dv = _dkdv_queries(dk, dv, k, v, kpos, key_ok, kpos, Qh, DOh, LSEh, DELTAh, DQh, Q_BLOCKS,
                               COL_IDX, COL_IDX, full_start, end, NQ, NKG, stride_qt, stride_dot, stride_dqt,
                               qk_scale, scale, BLOCK, BLOCK_M, HEAD_DIM, False, True, False, ATOMIC_DQ,
                               DOT_PRECISION)
    dk = dk * scale
    dk_ptrs = DK + kv_head * stride_dkh + keys.to(tl.int64)[:, None] * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + kv_head * stride_dvh + keys.to(tl.int64)[:, None] * stride_dvt + offs_d[None, :]
    if ACCUMULATE:
        dk += tl.load(dk_ptrs, mask=key_ok[:, None], other=0.0)
        dv += tl.load(dv_ptrs, mask=key_ok[:, None], other=0.0)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _bar_dkdv(bid, Q, BK, BV, DO, LSE, DELTA, DQ, DBK, DBV, Q_BLOCKS, BAR_POS, BAR_SKIP, BAR_FIRST,
              BAR_CLEAN_FROM, NQ, NQB, NKG, NB, NCHUNK, HQ, stride_qt, stride_qh, stride_dot, stride_doh,
              stride_dqt, stride_dqh, stride_bh, stride_bt, qk_scale, scale, BLOCK: tl.constexpr,
              BLOCK_M: tl.constexpr, BAR_KV: tl.constexpr, SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr,
              ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A bar program: d bar_k, d bar_v of ``BAR_KV`` gathered columns of one query head, over its piece
    of the contiguous range of query blocks that see them; written in fp32 to ``DBK[part, h]``."""
    part = bid % SPLIT
    h = (bid // SPLIT) % HQ
    c = bid // (SPLIT * HQ)
    offs_c = c * BAR_KV + tl.arange(0, BAR_KV)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = tl.load(BAR_POS + h * NB + offs_c, mask=offs_c < NB, other=_BAR_PAD)
    valid = pos != _BAR_PAD
    kblock = tl.where(valid, pos // BLOCK, 0)
    rows_b = h * stride_bh + offs_c.to(tl.int64) * stride_bt
    bk = tl.load(BK + rows_b[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    bv = tl.load(BV + rows_b[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    first = tl.load(BAR_FIRST + h * NCHUNK + c)
    clean_from = tl.load(BAR_CLEAN_FROM + h * NCHUNK + c)
    per = (NQB - first + SPLIT - 1) // SPLIT
    lo = tl.minimum(first + part * per, NQB)
    hi = tl.minimum(lo + per, NQB)
    mid = tl.minimum(tl.maximum(clean_from, lo), hi)
    dk = tl.zeros([BAR_KV, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BAR_KV, HEAD_DIM], dtype=tl.float32)
    Qh = Q + h * stride_qh
    DOh = DO + h * stride_doh
    DQh = DQ + h * stride_dqh
    LSEh = LSE + h * NQ
    DELTAh = DELTA + h * NQ
    skip_base = BAR_SKIP + (h * NQB).to(tl.int64) * NKG
    dk, dv = _dkdv_queries(dk, dv, bk, bv, pos, valid, kblock, Qh, DOh, LSEh, DELTAh, DQh, Q_BLOCKS,
                           BAR_FIRST, skip_base, lo, mid, NQ, NKG, stride_qt, stride_dot, stride_dqt,
                           qk_scale, scale, BLOCK, BLOCK_M, HEAD_DIM, True, False, True, ATOMIC_DQ,
                           DOT_PRECISION)
    # from clean_from on, every real column is visible and in no tile; padding rows (zero keys and values)
    # collect garbage in dK, dV, zeroed below, and add nothing to dQ (their key row is zero)
    dk, dv = _dkdv_queries(dk, dv, bk, bv, pos, valid, kblock, Qh, DOh, LSEh, DELTAh, DQh, Q_BLOCKS,
                           BAR_FIRST, skip_base, mid, hi, NQ, NKG, stride_qt, stride_dot, stride_dqt,
                           qk_scale, scale, BLOCK, BLOCK_M, HEAD_DIM, False, False, False, ATOMIC_DQ,
                           DOT_PRECISION)
    dk = tl.where(valid[:, None], dk * scale, 0.0)
    dv = tl.where(valid[:, None], dv, 0.0)
    out = (part * (NB * HQ) + h * NB + offs_c).to(tl.int64)  # [SPLIT, H, NB, D] fp32
    mask = (offs_c < NB)[:, None]
    tl.store(DBK + out[:, None] * HEAD_DIM + offs_d[None, :], dk, mask=mask)
    tl.store(DBV + out[:, None] * HEAD_DIM + offs_d[None, :], dv, mask=mask)


@triton.jit
def _bsa_bwd_dkdv(
    Q, K, V, BK, BV, DO, LSE, DELTA, DQ, DK, DV, DBK, DBV,
    Q_BLOCKS, K_BLOCKS, COL_PTR, COL_IDX, BAR_POS, BAR_SKIP, BAR_FIRST, BAR_CLEAN_FROM,
    NQ, NK, NQB, NKB, NKG, NB, NCHUNK, HQ, BAR_PROGRAMS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dqt,
    stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_bh, stride_bt, qk_scale, scale,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAR_KV: tl.constexpr, SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BARS: tl.constexpr,
    ACCUMULATE: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV (and with ATOMIC_DQ dQ) in one launch: ``BAR_PROGRAMS`` bar programs (longest first),
    then the tile programs."""
    pid = tl.program_id(0)
    if HAS_BARS:
        if pid < BAR_PROGRAMS:
            _bar_dkdv(pid, Q, BK, BV, DO, LSE, DELTA, DQ, DBK, DBV, Q_BLOCKS, BAR_POS, BAR_SKIP, BAR_FIRST,
                      BAR_CLEAN_FROM, NQ, NQB, NKG, NB, NCHUNK, HQ, stride_qt, stride_qh, stride_dot,
                      stride_doh, stride_dqt, stride_dqh, stride_bh, stride_bt, qk_scale, scale, BLOCK,
                      BLOCK_M, BAR_KV, SPLIT, HEAD_DIM, ATOMIC_DQ, DOT_PRECISION)
        else:
            _tile_dkdv(pid - BAR_PROGRAMS, Q, K, V, DO, LSE, DELTA, DQ, DK, DV, Q_BLOCKS, K_BLOCKS, COL_PTR,
                       COL_IDX, NQ, NK, NKB, NKG, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                       stride_vh, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh,
                       stride_dvt, stride_dvh, qk_scale, scale, GROUP, BLOCK, BLOCK_M, BLOCK_N, HEAD_DIM,
                       ACCUMULATE, ATOMIC_DQ, DOT_PRECISION)
    else:
        _tile_dkdv(pid, Q, K, V, DO, LSE, DELTA, DQ, DK, DV, Q_BLOCKS, K_BLOCKS, COL_PTR, COL_IDX,
                   NQ, NK, NKB, NKG, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt,
                   stride_dvh, qk_scale, scale, GROUP, BLOCK, BLOCK_M, BLOCK_N, HEAD_DIM, ACCUMULATE,
                   ATOMIC_DQ, DOT_PRECISION)


# --------------------------------------------------------------------------------------- launchers
# Per kernel (BLOCK_M, BLOCK_N, num_warps, num_stages): forward and dQ programs own BLOCK_M queries and
# step BLOCK_N keys at a time; dK/dV programs own BLOCK_N keys and step BLOCK_M queries at a time. "bar":
# bar columns per step of the forward and dQ (default: their BLOCK_N); "bar_kv": bar columns per dK/dV
# bar program (default: its BLOCK_N); "split": pieces per bar chunk's query range (default: enough to
# keep the longest bar program short next to the launch's total work); "dq_atomic": the dK/dV programs
# also add dQ (fp32 atomics, 5 dots per tile instead of 7, not bitwise deterministic) and no dQ kernel
# runs. Shapes are capped at the index's block size. None of these spills registers on sm_90 (ptxas,
# Triton 3.6); `python -m treeattn_lab bench sparse --tune` times alternatives on an H200. The
# interpreter ignores warps and stages.
CONFIGS = {
    "fwd": (128, 64, 8, 3),
    "dq": (128, 64, 8, 2),
    "dkdv": (32, 128, 8, 2),
    "bar": None,
    "bar_kv": None,
    "split": None,
    "dq_atomic": False,
}
# Calls with at most SHORT_QUERIES queries start from CONFIGS updated with SHORT_CONFIGS: the best
# combination `bench sparse --tune --tune-tokens 32768` found on an H200 (8.49 ms fwd+bwd against 9.62 ms
# for CONFIGS at 32K tokens; bench/results/sparse-tune__NVIDIA-H200__*.json, "tune").
SHORT_QUERIES = 65536
SHORT_CONFIGS = {"fwd": (64, 64, 4, 3), "dq": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "bar_kv": 64,
                 "split": 4}
_SHAPES = ("fwd", "dq", "dkdv")


def _resolve(config, index) -> dict:
    """:data:`CONFIGS` (with :data:`SHORT_CONFIGS` for short calls) updated with ``config``, checked,
    tile sizes capped at the index's block size."""
    config = dict(config or {})
    unknown = sorted(set(config) - set(CONFIGS))
    if unknown:
        raise ValueError(f"unknown block-sparse config keys {unknown}; known: {sorted(CONFIGS)}")
    block = index.block_size
    short = SHORT_CONFIGS if index.num_q <= SHORT_QUERIES else {}
    cfg = {**CONFIGS, **short, **config}
    for name in _SHAPES:
        shape = cfg[name]
        if not isinstance(shape, tuple | list) or len(shape) != 4 or not all(
                isinstance(x, int) and x > 0 for x in shape):
            raise ValueError(f"config {name!r} must be (BLOCK_M, BLOCK_N, num_warps, num_stages), "
                             f"got {shape!r}")
    if not isinstance(cfg["dq_atomic"], bool):
        raise ValueError(f"config 'dq_atomic' must be True or False, got {cfg['dq_atomic']!r}")
    for name in ("bar", "bar_kv", "split"):
        if cfg[name] is not None and (not isinstance(cfg[name], int) or cfg[name] < 1):
            raise ValueError(f"config {name!r} must be a positive int or None, got {cfg[name]!r}")
    sizes = [(f"{n} tile", x) for n in _SHAPES for x in cfg[n][:2]] + [(n, cfg[n]) for n in ("bar", "bar_kv")]
    for name, value in sizes:
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"config {name} size {value} must be a power of two >= 16 (tl.dot needs 16)")
    for name in _SHAPES:  # a program never spans more than one block of the index
        bm, bn, warps, stages = cfg[name]
        cfg[name] = (min(bm, block), min(bn, block), warps, stages)
    cfg["bar_kv"] = min(cfg["bar_kv"] or cfg["dkdv"][1], block)  # like a key block's dK/dV program
    return cfg


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def check_inputs(q, k, v, index) -> None:
    """The triton backend's own limits (shapes against the index; head dims; dtypes)."""
    check_attention_inputs(q)
    if q.shape[0] != index.num_q or k.shape[0] != index.num_k:
        raise ValueError(f"the index covers {index.num_q} queries x {index.num_k} keys, got q with "
                         f"{q.shape[0]} and k with {k.shape[0]} tokens")
    if q.shape[1] != index.num_heads:
        raise ValueError(f"the index has {index.num_heads} heads but q has {q.shape[1]}")


# --------------------------------------------------------------------------------------- bar plans
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # index -> {key: plan}, dies with the index


def _cached(index, key, build):
    plans = _PLANS.setdefault(index, {})
    if key not in plans:
        plans[key] = build()
    return plans[key]


@dataclass
class BarPlan:
    """What the kernels read about an index's bar columns besides the index itself (built once).

    ``clean [H, nQ]``: per query block, how many leading bars every query of the block sees and no
    selected tile covers (their chunks run unmasked). Per chunk of ``bar_kv`` bars, ``first [H, nc]``:
    the first query block that sees the chunk; ``clean_from [H, nc]``: from which query block on the
    chunk is clean for every later block. ``pairs`` / ``longest``: (query block, chunk) pairs in all /
    in the longest chunk, which size the dK/dV launch.
    """

    clean: torch.Tensor
    first: torch.Tensor
    clean_from: torch.Tensor
    pairs: int
    longest: int


def _bar_conflicts(index, h: int) -> torch.Tensor:
    """``[nQ, nb]`` bool: bar ``b`` of head ``h`` needs a mask in query block ``i`` (after its first
    query, inside a tile the row selected, or padding)."""
    pos = index.bar_pos[h].long()
    q_first = index.q_blocks.long() * index.block_size
    kblock = torch.where(pos == BAR_PAD, 0, pos // index.block_size)
    in_tile = index.bar_skip[h].index_select(1, kblock).bool()  # [nQ, nb]
    return in_tile | (pos[None, :] > q_first[:, None])  # padding (BAR_PAD) is after every query


def bar_plan(index, bar_kv: int) -> BarPlan:
    """The :class:`BarPlan` of ``index`` for dK/dV chunks of ``bar_kv`` bars (cached with the index)."""
    return _cached(index, ("bar_plan", bar_kv), lambda: _build_bar_plan(index, bar_kv))


def _build_bar_plan(index, bar_kv: int) -> BarPlan:
    heads, nb = index.bar_pos.shape
    nqb = index.q_blocks.numel()
    bs = index.block_size
    nchunk = triton.cdiv(nb, bar_kv)
    q_last = index.q_blocks.long() * bs + bs - 1
    if nqb:
        q_last[-1] -= nqb * bs - index.num_q  # the ragged last block
    blocks = torch.arange(nqb, device=q_last.device)
    clean, clean_from = [], []
    for h in range(heads):
        conflicts = _bar_conflicts(index, h)
        none = ~conflicts.any(1)
        clean.append(torch.where(none, nb, conflicts.to(torch.uint8).argmax(1)))
        real = index.bar_pos[h] != BAR_PAD  # padding rows are zeroed at the end, no mask needed
        per_chunk = torch.nn.functional.pad(conflicts & real, (0, nchunk * bar_kv - nb))
        per_chunk = per_chunk.view(nqb, nchunk, bar_kv).any(2)  # [nQ, nc]
        clean_from.append(torch.where(per_chunk, blocks[:, None], -1).amax(0) + 1)
    chunk_min = index.bar_pos[:, ::bar_kv].long()  # [H, nc]: the smallest position of each chunk
    first = torch.searchsorted(q_last, chunk_min.contiguous())
    clean_from = torch.maximum(torch.stack(clean_from), first)
    seen = nqb - first
    return BarPlan(clean=torch.stack(clean).to(torch.int32).contiguous(),
                   first=first.to(torch.int32).contiguous(),
                   clean_from=clean_from.to(torch.int32).contiguous(), pairs=int(seen.sum()),
                   longest=int(seen.max()))


def _gather_rows(index, group: int):
    """Key rows and kv heads ``[Hq, nb]``, ``[Hq, 1]`` of the bar columns (padding reads row 0)."""
    def build():
        cols = torch.where(index.bar_pos == BAR_PAD, 0, index.bar_pos).long()
        kv_head = (torch.arange(index.num_heads, device=cols.device) // group)[:, None]
        return cols, kv_head

    return _cached(index, ("gather", group), build)


def gather_bars(k, v, index):
    """The bar columns' keys and values per query head, ``[Hq, nb, D]`` each (differentiable gather).

    Columns are the global positions ``index.bar_pos``; on one GPU they index ``k`` directly. Padding
    reads row 0 (the kernels mask it).
    """
    if index.bar_pos is None:
        empty = k.new_zeros(index.num_heads, 0, k.shape[-1])
        return empty, empty
    cols, kv_head = _gather_rows(index, index.num_heads // k.shape[1])
    return k[cols, kv_head], v[cols, kv_head]


def prepare(index, config=None) -> None:
    """Build and cache everything the kernels derive from ``index`` (a benchmark times it apart)."""
    cfg = _resolve(config, index)
    if index.bar_pos is not None:
        bar_plan(index, cfg["bar_kv"])


# --------------------------------------------------------------------------------------- launches
def _bar_args(index, device, bar_kv):
    """Bar tensors for a launch (dummies without bars) and the plan."""
    if index.bar_pos is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return (dummy,) * 6, None
    plan = bar_plan(index, bar_kv)
    return (index.bar_pos, index.bar_count, plan.clean, index.bar_skip, plan.first, plan.clean_from), plan


def _common(index):
    return dict(NQ=index.num_q, NQB=index.q_blocks.numel(),
                NKG=0 if index.bar_skip is None else index.bar_skip.shape[-1],
                NB=0 if index.bar_pos is None else index.bar_pos.shape[1])


def sparse_forward(q, k, v, bar_k, bar_v, index, *, scale: float, state=None, config=None):
    """Forward of one block-sparse attention call; returns ``(out, lse2)`` with ``lse2 [Hq, Nq]`` base 2.

    ``bar_k, bar_v [Hq, nb, D]`` come from :func:`gather_bars` (empty when the index has no bars).
    With ``state=(out_fp32 [Nq, Hq, D], lse2)`` the call merges into that running state in place (a ring
    step) and returns it.
    """
    bs = index.block_size
    cfg = _resolve(config, index)
    bm, bn, warps, stages = cfg["fwd"]
    nq, hq, d = q.shape
    has_bars = index.bar_pos is not None and bar_k.shape[1] > 0
    if state is None:
        o = torch.empty_like(q)
        lse = torch.empty((hq, nq), device=q.device, dtype=torch.float32)
    else:
        o, lse = state
    (bar_pos, bar_count, bar_clean, bar_skip, _, _), _ = _bar_args(index, q.device, cfg["bar_kv"])
    bk = bar_k if has_bars else q.new_zeros(1, 1, d)
    bv = bar_v if has_bars else q.new_zeros(1, 1, d)
    _bsa_fwd[(index.q_blocks.numel() * (bs // bm), hq)](
        q, k, v, bk, bv, o, lse,
        index.q_blocks, index.k_blocks, index.row_ptr, index.row_idx, bar_pos, bar_count, bar_clean, bar_skip,
        NK=index.num_k, **_common(index),
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=o.stride(0), stride_oh=o.stride(1),
        stride_bh=bk.stride(0), stride_bt=bk.stride(1), qk_scale=scale * LOG2E,
        GROUP=hq // k.shape[1], BLOCK=bs, BLOCK_M=bm, BLOCK_N=bn, BAR=min(cfg["bar"] or bn, bs), HEAD_DIM=d,
        HAS_BARS=has_bars, MERGE=state is not None, DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps,
        num_stages=stages,
    )
    return o, lse


def attention_delta(o, do, block: int = 64):
    """``rowsum(dO * O)`` as ``[Hq, Nq]`` fp32, the backward's per-row correction."""
    nq, hq, d = o.shape
    delta = torch.empty((hq, nq), device=o.device, dtype=torch.float32)
    _bsa_delta[(triton.cdiv(nq, block), hq)](o, do, delta, nq, o.stride(0), o.stride(1), do.stride(0),
                                             do.stride(1), BLOCK=block, HEAD_DIM=d)
    return delta


def _split(plan, index, bar_kv: int, device) -> int:
    """Pieces per bar chunk: the longest bar program at most half of one SM's fair share of the launch."""
    units = bar_kv / index.block_size  # a (query block, chunk) pair against a tile pair
    total = index.num_tiles + plan.pairs * units
    longest = plan.longest * units
    return max(1, min(16, math.ceil(2 * longest * _num_sms(device) / max(total, 1))))


def sparse_backward(do, q, k, v, bar_k, bar_v, lse, delta, index, *, scale: float, dq=None, dk=None, dv=None,
                    accumulate_q: bool = False, accumulate_kv: bool = False, config=None):
    """Gradients of one block-sparse call given the *final* ``lse`` and ``delta`` (of the full attention).

    Returns ``(dq, dk, dv, d_bar_k, d_bar_v)``. Gradients are written into ``dq`` / ``dk`` / ``dv`` when
    given (any float dtype, e.g. the fp32 buffers of ring attention), added to their contents with
    ``accumulate_q`` / ``accumulate_kv``; otherwise fresh tensors of the inputs' dtype are returned.
    ``d_bar_k, d_bar_v`` are fp32 ``[Hq, nb, D]`` (None without bars).
    """
    bs = index.block_size
    cfg = _resolve(config, index)
    nq, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    dot = _dot_precision(q.dtype)
    has_bars = index.bar_pos is not None and bar_k.shape[1] > 0
    bar_kv = cfg["bar_kv"]
    bar_tensors, plan = _bar_args(index, q.device, bar_kv)
    bar_pos, bar_count, bar_clean, bar_skip, bar_first, bar_clean_from = bar_tensors
    bk = bar_k if has_bars else q.new_zeros(1, 1, d)
    bv = bar_v if has_bars else q.new_zeros(1, 1, d)
    acc_q, acc_kv = accumulate_q and dq is not None, accumulate_kv and dk is not None
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    common = _common(index)
    atomic = cfg["dq_atomic"]
    if atomic:  # the dK/dV launch adds dQ into fp32: the caller's fp32 buffer, or a fresh one
        dq_out = dq
        if dq is not None and dq.dtype == torch.float32:
            dq_acc = dq if acc_q else dq.zero_()
        else:
            dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    else:
        dq = dq_acc = torch.empty_like(q) if dq is None else dq
        bm, bn, warps, stages = cfg["dq"]
        _bsa_bwd_dq[(index.q_blocks.numel() * (bs // bm), hq)](
            q, k, v, bk, bv, do, lse, delta, dq,
            index.q_blocks, index.k_blocks, index.row_ptr, index.row_idx, bar_pos, bar_count, bar_clean,
            bar_skip, NK=index.num_k, **common,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
            stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
            stride_dqt=dq.stride(0), stride_dqh=dq.stride(1), stride_bh=bk.stride(0), stride_bt=bk.stride(1),
            qk_scale=scale * LOG2E, scale=scale, GROUP=group, BLOCK=bs, BLOCK_M=bm, BLOCK_N=bn,
            BAR=min(cfg["bar"] or bn, bs), HEAD_DIM=d, HAS_BARS=has_bars, ACCUMULATE=acc_q, DOT_PRECISION=dot,
            num_warps=warps, num_stages=stages,
        )
    nb = common["NB"]
    nchunk = triton.cdiv(nb, bar_kv) if has_bars else 0
    split = (cfg["split"] or _split(plan, index, bar_kv, q.device)) if has_bars else 1
    bar_programs = nchunk * hq * split
    if has_bars:  # fp32 partial sums per piece; written straight into the result without a split
        dbk = torch.empty((split, hq, nb, d), device=q.device, dtype=torch.float32)
        dbv = torch.empty_like(dbk)
    else:
        dbk = dbv = torch.zeros(1, device=q.device, dtype=torch.float32)
    bm, bn, warps, stages = cfg["dkdv"]
    nkb = index.k_blocks.numel()
    _bsa_bwd_dkdv[(bar_programs + nkb * (bs // bn) * hkv,)](
        q, k, v, bk, bv, do, lse, delta, dq_acc, dk, dv, dbk, dbv,
        index.q_blocks, index.k_blocks, index.col_ptr, index.col_idx, bar_pos, bar_skip, bar_first,
        bar_clean_from, NQ=index.num_q, NK=index.num_k, NQB=common["NQB"], NKB=nkb, NKG=common["NKG"], NB=nb,
        NCHUNK=nchunk, HQ=hq, BAR_PROGRAMS=bar_programs,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
        stride_dqt=dq_acc.stride(0), stride_dqh=dq_acc.stride(1), stride_dkt=dk.stride(0),
        stride_dkh=dk.stride(1), stride_dvt=dv.stride(0), stride_dvh=dv.stride(1), stride_bh=bk.stride(0),
        stride_bt=bk.stride(1), qk_scale=scale * LOG2E, scale=scale, GROUP=group, BLOCK=bs, BLOCK_M=bm,
        BLOCK_N=bn, BAR_KV=bar_kv, SPLIT=split, HEAD_DIM=d, HAS_BARS=has_bars, ACCUMULATE=acc_kv,
        ATOMIC_DQ=atomic, DOT_PRECISION=dot, num_warps=warps, num_stages=stages,
    )
    if atomic and dq_out is None:
        dq = dq_acc.to(q.dtype)
    elif atomic and dq_acc is not dq_out:  # a caller's buffer of another dtype
        dq = dq_out.add_(dq_acc) if acc_q else dq_out.copy_(dq_acc)
    elif atomic:
        dq = dq_out
    if not has_bars:
        return dq, dk, dv, None, None
    if split == 1:
        return dq, dk, dv, dbk[0], dbv[0]
    return dq, dk, dv, dbk.sum(0), dbv.sum(0)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


class BlockSparseAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward gathers the bars and saves (q, k, v, bar_k, bar_v, o, lse); backward
    recomputes from lse and adds the bar columns' gradients into dK, dV at their rows."""

    @staticmethod
    def forward(ctx, q, k, v, index, scale, config):
        bar_k, bar_v = (x.contiguous() for x in gather_bars(k, v, index))
        o, lse = sparse_forward(q, k, v, bar_k, bar_v, index, scale=scale, config=config)
        ctx.save_for_backward(q, k, v, bar_k, bar_v, o, lse)
        ctx.index, ctx.scale, ctx.config = index, scale, config
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, bar_k, bar_v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        delta = attention_delta(o, do)
        index = ctx.index
        dq, dk, dv, dbk, dbv = sparse_backward(do, q, k, v, bar_k, bar_v, lse, delta, index,
                                               scale=ctx.scale, config=ctx.config)
        if dbk is not None:  # padding rows are zero; columns shared by a kv head's query heads add up
            cols, kv_head = _gather_rows(index, q.shape[1] // k.shape[1])
            dk.index_put_((cols, kv_head), dbk.to(dk.dtype), accumulate=True)
            dv.index_put_((cols, kv_head), dbv.to(dv.dtype), accumulate=True)
        return dq, dk, dv, None, None, None


def triton_sparse_attention(q, k, v, index, *, scale=None, config=None, return_lse=False):
    """Block-sparse attention of ``q [N, Hq, D]`` over ``k, v [N, Hkv, D]`` through ``index`` (one GPU).

    Inputs are validated by ``treeattn_lab.ops``. ``config`` overrides entries of :data:`CONFIGS`
    (e.g. ``{"bar": 16}`` in small tests). With ``return_lse`` also returns the natural-log
    log-sum-exp ``[N, Hq]``.
    """
    check_inputs(q, k, v, index)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o, lse2 = BlockSparseAttentionFunction.apply(q, k, v, index, scale, config)
    if return_lse:
        return o, lse2.transpose(0, 1) / LOG2E
    return o
