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
   them in chunks of ``BAR`` rows (128 on a GPU) with plain contiguous loads; per element it masks the
   causal rule (``pos <= q``) and the columns a selected tile already covers (one byte per column from
   ``bar_skip``).

Everything else is skipped without being loaded. Positions are *global* (``q_blocks`` / ``k_blocks``
map local blocks to global ones), so the same kernel computes one step of ring attention: a rank's
queries against the keys it holds at that step.

Forward (one program per query block and query head)
----------------------------------------------------
FlashAttention-2 online softmax in base 2 over the tiles, then the bars, in fp32: per row the running
maximum ``m``, the running sum ``l`` and the accumulator are rescaled by ``exp2(m_old - m_new)`` when a
new tile raises the maximum. The output is ``acc / l`` and the log-sum-exp ``lse = m + log2(l)``
(base 2, ``-inf`` for a row that saw nothing) is saved: it recomputes any probability as
``p = exp2(s - lse)`` and merges partial results. With ``MERGE`` the kernel folds its partial result
into a running fp32 output and lse in place (one ring step into the steps before it):

    lse = log2(2^lse_old + 2^lse_new),   out = out_old * 2^(lse_old - lse) + out_new * 2^(lse_new - lse).

Backward (FlashAttention-2, three kernels, no atomics)
------------------------------------------------------
``delta = rowsum(dO * O)``; with ``p`` recomputed from ``lse``: ``dV += p^T dO``, ``dP = dO V^T``,
``dS = p * (dP - delta)``, ``dK += dS^T Q * scale``, ``dQ += dS K * scale``.

- dQ: one program per (query block, head) walks the forward's tiles and bars.
- dK, dV of tiles: one program per (key block, kv head) walks the **transposed** index (query blocks per
  key block, diagonal first) for each of the G query heads sharing the kv head (grouped-query attention).
- dK, dV of bars: one program per (chunk of ``BAR`` bar columns, head, split) walks the query blocks from
  the first that can see the chunk, ``SPLIT`` programs interleaving over them; their fp32 partial sums
  are added afterwards, and autograd scatters ``d bar_k`` back into ``dK`` through the gather.

Precision: fp16 / bf16 inputs use tensor-core dots with fp32 accumulation; fp32 inputs use IEEE fp32
dots. Under ``TRITON_INTERPRET=1`` (CPU) everything runs through numpy: use fp32 / fp16 there.
"""

from __future__ import annotations

import math

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
def _bar_chunk(BAR_POS, BK, BV, h, c, nbar, skip_row, offs_d, stride_bh, stride_bt,
               NB, BLOCK: tl.constexpr, BAR: tl.constexpr):
    """Bar columns ``c .. c + BAR`` of head ``h``: positions, keys, values and which ones to use."""
    offs_c = c + tl.arange(0, BAR)
    valid = offs_c < nbar
    pos = tl.load(BAR_POS + h * NB + offs_c, mask=valid, other=0)
    skip = tl.load(skip_row + pos // BLOCK, mask=valid, other=1)
    rows = h * stride_bh + offs_c.to(tl.int64) * stride_bt
    bk = tl.load(BK + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    bv = tl.load(BV + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    return pos, valid & (skip == 0), bk, bv


# --------------------------------------------------------------------------------------- forward
@triton.jit
def _bsa_fwd(
    Q, K, V, BK, BV, O, LSE,
    Q_BLOCKS, K_BLOCKS, ROW_PTR, ROW_IDX, BAR_POS, BAR_COUNT, BAR_SKIP,
    NQ, NK, NQB, NKG, NB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_bh, stride_bt, qk_scale,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BAR: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_BARS: tl.constexpr, MERGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = m * BLOCK + offs_r
    in_range = rows < NQ
    q_block = tl.load(Q_BLOCKS + m)
    qpos = q_block * BLOCK + offs_r  # global positions of the block's queries
    q = _load_rows(Q + h * stride_qh, rows, stride_qt, offs_d, in_range, True)
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    start, full_end, end = _row_tiles(ROW_PTR, ROW_IDX, K_BLOCKS, h * NQB + m, q_block)
    for it in range(start, full_end):  # tiles every query of the block sees whole: no mask
        n = tl.load(ROW_IDX + it)
        keys = n * BLOCK + offs_r
        k = _load_rows(K, keys, stride_kt, offs_d, keys < NK, False)
        v = _load_rows(V, keys, stride_vt, offs_d, keys < NK, False)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
    for it in range(full_end, end):  # the diagonal tile: causal mask (and the ragged end of the keys)
        n = tl.load(ROW_IDX + it)
        keys = n * BLOCK + offs_r
        k = _load_rows(K, keys, stride_kt, offs_d, keys < NK, True)
        v = _load_rows(V, keys, stride_vt, offs_d, keys < NK, True)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        kpos = tl.load(K_BLOCKS + n) * BLOCK + offs_r
        visible = (kpos[None, :] <= qpos[:, None]) & (keys < NK)[None, :]
        s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
    if HAS_BARS:
        nbar = tl.load(BAR_COUNT + h * NQB + m)
        skip_row = BAR_SKIP + (h * NQB + m).to(tl.int64) * NKG
        for c in range(0, nbar, BAR):
            pos, use, bk, bv = _bar_chunk(BAR_POS, BK, BV, h, c, nbar, skip_row, offs_d,
                                          stride_bh, stride_bt, NB, BLOCK, BAR)
            s = tl.dot(q, tl.trans(bk), input_precision=DOT_PRECISION) * qk_scale
            visible = use[None, :] & (pos[None, :] <= qpos[:, None])
            s = tl.where(visible, s, float("-inf"))
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, bv, DOT_PRECISION)
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
def _bsa_bwd_dq(
    Q, K, V, BK, BV, DO, LSE, DELTA, DQ,
    Q_BLOCKS, K_BLOCKS, ROW_PTR, ROW_IDX, BAR_POS, BAR_COUNT, BAR_SKIP,
    NQ, NK, NQB, NKG, NB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_bh, stride_bt, qk_scale, scale,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BAR: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_BARS: tl.constexpr, ACCUMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = m * BLOCK + offs_r
    in_range = rows < NQ
    q_block = tl.load(Q_BLOCKS + m)
    qpos = q_block * BLOCK + offs_r
    q = _load_rows(Q + h * stride_qh, rows, stride_qt, offs_d, in_range, True)
    do = _load_rows(DO + h * stride_doh, rows, stride_dot, offs_d, in_range, True)
    lse = tl.load(LSE + h * NQ + rows, mask=in_range, other=0.0)
    delta = tl.load(DELTA + h * NQ + rows, mask=in_range, other=0.0)
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    dq = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    start, full_end, end = _row_tiles(ROW_PTR, ROW_IDX, K_BLOCKS, h * NQB + m, q_block)
    for it in range(start, full_end):
        n = tl.load(ROW_IDX + it)
        keys = n * BLOCK + offs_r
        k = _load_rows(K, keys, stride_kt, offs_d, keys < NK, False)
        v = _load_rows(V, keys, stride_vt, offs_d, keys < NK, False)
        dq = _dq_step(dq, q, do, lse, delta, k, v, None, qk_scale, False, DOT_PRECISION)
    for it in range(full_end, end):
        n = tl.load(ROW_IDX + it)
        keys = n * BLOCK + offs_r
        k = _load_rows(K, keys, stride_kt, offs_d, keys < NK, True)
        v = _load_rows(V, keys, stride_vt, offs_d, keys < NK, True)
        kpos = tl.load(K_BLOCKS + n) * BLOCK + offs_r
        visible = (kpos[None, :] <= qpos[:, None]) & (keys < NK)[None, :]
        dq = _dq_step(dq, q, do, lse, delta, k, v, visible, qk_scale, True, DOT_PRECISION)
    if HAS_BARS:
        nbar = tl.load(BAR_COUNT + h * NQB + m)
        skip_row = BAR_SKIP + (h * NQB + m).to(tl.int64) * NKG
        for c in range(0, nbar, BAR):
            pos, use, bk, bv = _bar_chunk(BAR_POS, BK, BV, h, c, nbar, skip_row, offs_d,
                                          stride_bh, stride_bt, NB, BLOCK, BAR)
            visible = use[None, :] & (pos[None, :] <= qpos[:, None])
            dq = _dq_step(dq, q, do, lse, delta, bk, bv, visible, qk_scale, True, DOT_PRECISION)
    dq = dq * scale
    dq_ptrs = DQ + h * stride_dqh + rows.to(tl.int64)[:, None] * stride_dqt + offs_d[None, :]
    if ACCUMULATE:
        dq += tl.load(dq_ptrs, mask=in_range[:, None], other=0.0)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=in_range[:, None])


@triton.jit
def _dkdv_step(dk, dv, k, v, Q, DO, LSE, DELTA, i, kpos, key_ok, offs_r, offs_d, NQ, Q_BLOCKS,
               stride_qt, stride_dot, qk_scale, BLOCK: tl.constexpr, MASKED: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """Add query block ``i``'s share of a key block's dK, dV (transposed scores ``[keys, queries]``)."""
    rows = i * BLOCK + offs_r
    in_range = rows < NQ
    q = _load_rows(Q, rows, stride_qt, offs_d, in_range, True)
    do = _load_rows(DO, rows, stride_dot, offs_d, in_range, True)
    lse = tl.load(LSE + rows, mask=in_range, other=0.0)
    delta = tl.load(DELTA + rows, mask=in_range, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    p_t = tl.exp2(s_t - lse[None, :])
    if MASKED:
        qpos = tl.load(Q_BLOCKS + i) * BLOCK + offs_r
        visible = (kpos[:, None] <= qpos[None, :]) & key_ok[:, None] & in_range[None, :]
        p_t = tl.where(visible, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bsa_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    Q_BLOCKS, K_BLOCKS, COL_PTR, COL_IDX,
    NQ, NK, NKB,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, qk_scale, scale,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    n = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    keys = n * BLOCK + offs_r
    key_ok = keys < NK
    k_block = tl.load(K_BLOCKS + n)
    kpos = k_block * BLOCK + offs_r
    k = _load_rows(K + kv_head * stride_kh, keys, stride_kt, offs_d, key_ok, True)
    v = _load_rows(V + kv_head * stride_vh, keys, stride_vt, offs_d, key_ok, True)
    dk = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    for g in range(GROUP):  # the query heads sharing this kv head
        h = kv_head * GROUP + g
        Qh = Q + h * stride_qh
        DOh = DO + h * stride_doh
        LSEh = LSE + h * NQ
        DELTAh = DELTA + h * NQ
        col = h * NKB + n
        start = tl.load(COL_PTR + col)
        end = tl.load(COL_PTR + col + 1)
        has = end > start
        first = tl.load(COL_IDX + start, mask=has, other=0)
        diag = has & (tl.load(Q_BLOCKS + first, mask=has, other=-1) == k_block)
        full_start = start + diag.to(tl.int32)
        for it in range(start, full_start):  # the diagonal tile: causal mask
            i = tl.load(COL_IDX + it)
            dk, dv = _dkdv_step(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, i, kpos, key_ok, offs_r, offs_d, NQ,
                                Q_BLOCKS, stride_qt, stride_dot, qk_scale, BLOCK, True, DOT_PRECISION)
        for it in range(full_start, end):
            i = tl.load(COL_IDX + it)
            dk, dv = _dkdv_step(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, i, kpos, key_ok, offs_r, offs_d, NQ,
                                Q_BLOCKS, stride_qt, stride_dot, qk_scale, BLOCK, False, DOT_PRECISION)
    dk = dk * scale
    dk_ptrs = DK + kv_head * stride_dkh + keys.to(tl.int64)[:, None] * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + kv_head * stride_dvh + keys.to(tl.int64)[:, None] * stride_dvt + offs_d[None, :]
    if ACCUMULATE:
        dk += tl.load(dk_ptrs, mask=key_ok[:, None], other=0.0)
        dv += tl.load(dv_ptrs, mask=key_ok[:, None], other=0.0)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _bsa_bwd_bars(
    Q, BK, BV, DO, LSE, DELTA, DBK, DBV,
    Q_BLOCKS, BAR_POS, BAR_SKIP, BAR_FIRST,
    NQ, NQB, NKG, NB, NCHUNK,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_bh, stride_bt, qk_scale,
    BLOCK: tl.constexpr, BAR: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dK, dV of one chunk of bar columns of one head, over every query block that can see it."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = c * BAR + tl.arange(0, BAR)
    pos = tl.load(BAR_POS + h * NB + offs_c, mask=offs_c < NB, other=_BAR_PAD)
    valid = pos != _BAR_PAD
    rows_b = h * stride_bh + offs_c.to(tl.int64) * stride_bt
    bk = tl.load(BK + rows_b[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    bv = tl.load(BV + rows_b[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    kblock = tl.where(valid, pos // BLOCK, 0)
    dk = tl.zeros([BAR, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BAR, HEAD_DIM], dtype=tl.float32)
    Qh = Q + h * stride_qh
    DOh = DO + h * stride_doh
    first = tl.load(BAR_FIRST + h * NCHUNK + c)
    for i in range(first + part, NQB, SPLIT):
        rows = i * BLOCK + offs_r
        in_range = rows < NQ
        qpos = tl.load(Q_BLOCKS + i) * BLOCK + offs_r
        q = _load_rows(Qh, rows, stride_qt, offs_d, in_range, True)
        do = _load_rows(DOh, rows, stride_dot, offs_d, in_range, True)
        lse = tl.load(LSE + h * NQ + rows, mask=in_range, other=0.0)
        delta = tl.load(DELTA + h * NQ + rows, mask=in_range, other=0.0)
        skip = tl.load(BAR_SKIP + (h * NQB + i).to(tl.int64) * NKG + kblock, mask=valid, other=1)
        use = valid & (skip == 0)
        s_t = tl.dot(bk, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BAR, BLOCK]
        p_t = tl.exp2(s_t - lse[None, :])
        visible = use[:, None] & (pos[:, None] <= qpos[None, :]) & in_range[None, :]
        p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(bv, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    out = (part * (NB * tl.num_programs(1)) + h * NB + offs_c).to(tl.int64)  # [SPLIT, H, NB, D] fp32
    mask = (offs_c < NB)[:, None]
    tl.store(DBK + out[:, None] * HEAD_DIM + offs_d[None, :], dk, mask=mask)
    tl.store(DBV + out[:, None] * HEAD_DIM + offs_d[None, :], dv, mask=mask)


# --------------------------------------------------------------------------------------- launchers
# (num_warps, num_stages) per kernel and the bar chunk, chosen with `python -m treeattn_lab bench sparse
# --tune` on an H200 (bench/results/sparse__*.json); the interpreter ignores warps and stages.
CONFIGS = {
    "fwd": (8, 3),
    "dq": (8, 2),
    "dkdv": (8, 2),
    "bars": (8, 2),
    "bar": 128,  # bar columns per chunk
}


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


def gather_bars(k, v, index):
    """The bar columns' keys and values per query head, ``[Hq, nb, D]`` each (differentiable gather).

    Columns are the global positions ``index.bar_pos``; on one GPU they index ``k`` directly. Padding
    reads row 0 (the kernels mask it).
    """
    hq = index.num_heads
    if index.bar_pos is None:
        empty = k.new_zeros(hq, 0, k.shape[-1])
        return empty, empty
    group = hq // k.shape[1]
    cols = torch.where(index.bar_pos == BAR_PAD, 0, index.bar_pos).long()  # [Hq, nb]
    kv_head = (torch.arange(hq, device=k.device) // group)[:, None]
    return k[cols, kv_head], v[cols, kv_head]


def _common(index, q):
    return dict(NQ=index.num_q, NQB=index.q_blocks.numel(),
                NKG=0 if index.bar_skip is None else index.bar_skip.shape[-1],
                NB=0 if index.bar_pos is None else index.bar_pos.shape[1])


def _bar_args(index, device):
    if index.bar_pos is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return dummy, dummy, dummy
    return index.bar_pos, index.bar_count, index.bar_skip


def sparse_forward(q, k, v, bar_k, bar_v, index, *, scale: float, state=None, config=None):
    """Forward of one block-sparse attention call; returns ``(out, lse2)`` with ``lse2 [Hq, Nq]`` base 2.

    ``bar_k, bar_v [Hq, nb, D]`` come from :func:`gather_bars` (empty when the index has no bars).
    With ``state=(out_fp32 [Nq, Hq, D], lse2)`` the call merges into that running state in place (a ring
    step) and returns it.
    """
    cfg = {**CONFIGS, **(config or {})}
    nq, hq, d = q.shape
    has_bars = index.bar_pos is not None and bar_k.shape[1] > 0
    if state is None:
        o = torch.empty_like(q)
        lse = torch.empty((hq, nq), device=q.device, dtype=torch.float32)
    else:
        o, lse = state
    bar_pos, bar_count, bar_skip = _bar_args(index, q.device)
    bk = bar_k if has_bars else q.new_zeros(1, 1, d)
    bv = bar_v if has_bars else q.new_zeros(1, 1, d)
    warps, stages = cfg["fwd"]
    _bsa_fwd[(index.q_blocks.numel(), hq)](
        q, k, v, bk, bv, o, lse,
        index.q_blocks, index.k_blocks, index.row_ptr, index.row_idx, bar_pos, bar_count, bar_skip,
        NK=index.num_k, **_common(index, q),
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=o.stride(0), stride_oh=o.stride(1),
        stride_bh=bk.stride(0), stride_bt=bk.stride(1), qk_scale=scale * LOG2E,
        GROUP=hq // k.shape[1], BLOCK=index.block_size, BAR=cfg["bar"], HEAD_DIM=d, HAS_BARS=has_bars,
        MERGE=state is not None, DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps, num_stages=stages,
    )
    return o, lse


def attention_delta(o, do, block: int = 64):
    """``rowsum(dO * O)`` as ``[Hq, Nq]`` fp32, the backward's per-row correction."""
    nq, hq, d = o.shape
    delta = torch.empty((hq, nq), device=o.device, dtype=torch.float32)
    _bsa_delta[(triton.cdiv(nq, block), hq)](o, do, delta, nq, o.stride(0), o.stride(1), do.stride(0),
                                             do.stride(1), BLOCK=block, HEAD_DIM=d)
    return delta


def sparse_backward(do, q, k, v, bar_k, bar_v, lse, delta, index, *, scale: float, dq=None, dk=None, dv=None,
                    accumulate_q: bool = False, accumulate_kv: bool = False, config=None):
    """Gradients of one block-sparse call given the *final* ``lse`` and ``delta`` (of the full attention).

    Returns ``(dq, dk, dv, d_bar_k, d_bar_v)``. Gradients are written into ``dq`` / ``dk`` / ``dv`` when
    given (any float dtype, e.g. the fp32 buffers of ring attention), added to their contents with
    ``accumulate_q`` / ``accumulate_kv``; otherwise fresh tensors of the inputs' dtype are returned.
    ``d_bar_k, d_bar_v`` are fp32 ``[Hq, nb, D]`` (None without bars).
    """
    cfg = {**CONFIGS, **(config or {})}
    nq, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    dot = _dot_precision(q.dtype)
    has_bars = index.bar_pos is not None and bar_k.shape[1] > 0
    bar_pos, bar_count, bar_skip = _bar_args(index, q.device)
    bk = bar_k if has_bars else q.new_zeros(1, 1, d)
    bv = bar_v if has_bars else q.new_zeros(1, 1, d)
    acc_q, acc_kv = accumulate_q and dq is not None, accumulate_kv and dk is not None
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    common = _common(index, q)
    bs = index.block_size
    warps, stages = cfg["dq"]
    _bsa_bwd_dq[(index.q_blocks.numel(), hq)](
        q, k, v, bk, bv, do, lse, delta, dq,
        index.q_blocks, index.k_blocks, index.row_ptr, index.row_idx, bar_pos, bar_count, bar_skip,
        NK=index.num_k, **common,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
        stride_dqt=dq.stride(0), stride_dqh=dq.stride(1), stride_bh=bk.stride(0), stride_bt=bk.stride(1),
        qk_scale=scale * LOG2E, scale=scale, GROUP=group, BLOCK=bs, BAR=cfg["bar"], HEAD_DIM=d,
        HAS_BARS=has_bars, ACCUMULATE=acc_q, DOT_PRECISION=dot, num_warps=warps, num_stages=stages,
    )
    warps, stages = cfg["dkdv"]
    _bsa_bwd_dkdv[(index.k_blocks.numel(), hkv)](
        q, k, v, do, lse, delta, dk, dv, index.q_blocks, index.k_blocks, index.col_ptr, index.col_idx,
        NQ=index.num_q, NK=index.num_k, NKB=index.k_blocks.numel(),
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
        stride_dkt=dk.stride(0), stride_dkh=dk.stride(1), stride_dvt=dv.stride(0), stride_dvh=dv.stride(1),
        qk_scale=scale * LOG2E, scale=scale, GROUP=group, BLOCK=bs, HEAD_DIM=d, ACCUMULATE=acc_kv,
        DOT_PRECISION=dot, num_warps=warps, num_stages=stages,
    )
    if not has_bars:
        return dq, dk, dv, None, None
    bar = cfg["bar"]
    nb = index.bar_pos.shape[1]
    nchunk = triton.cdiv(nb, bar)
    # the first local query block that can see each chunk (its smallest position)
    chunk_min = index.bar_pos[:, ::bar].long()  # [Hq, nchunk]
    q_last = (index.q_blocks.long() * bs + bs - 1).contiguous()
    first = torch.searchsorted(q_last, chunk_min.contiguous()).to(torch.int32).contiguous()
    # enough programs to fill the GPU: SPLIT programs share a chunk, interleaving over its query blocks
    split = cfg.get("split") or max(1, min(16, triton.cdiv(8 * _num_sms(q.device), nchunk * hq)))
    dbk = torch.empty((split, hq, nb, d), device=q.device, dtype=torch.float32)
    dbv = torch.empty_like(dbk)
    warps, stages = cfg["bars"]
    _bsa_bwd_bars[(nchunk, hq, split)](
        q, bk, bv, do, lse, delta, dbk, dbv, index.q_blocks, bar_pos, bar_skip, first,
        NQ=index.num_q, NQB=index.q_blocks.numel(), NKG=common["NKG"], NB=nb, NCHUNK=nchunk,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
        stride_bh=bk.stride(0), stride_bt=bk.stride(1), qk_scale=scale * LOG2E, BLOCK=bs, BAR=bar,
        HEAD_DIM=d, SPLIT=split, DOT_PRECISION=dot, num_warps=warps, num_stages=stages,
    )
    return dq, dk, dv, dbk.sum(0) * scale, dbv.sum(0)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


class BlockSparseAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward saves (q, k, v, bar_k, bar_v, o, lse); backward recomputes from lse."""

    @staticmethod
    def forward(ctx, q, k, v, bar_k, bar_v, index, scale, config):
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
        dq, dk, dv, dbk, dbv = sparse_backward(do, q, k, v, bar_k, bar_v, lse, delta, ctx.index,
                                               scale=ctx.scale, config=ctx.config)
        if dbk is not None:
            dbk, dbv = dbk.to(bar_k.dtype), dbv.to(bar_v.dtype)
        return dq, dk, dv, dbk, dbv, None, None, None


def triton_sparse_attention(q, k, v, index, *, scale=None, config=None, return_lse=False):
    """Block-sparse attention of ``q [N, Hq, D]`` over ``k, v [N, Hkv, D]`` through ``index`` (one GPU).

    Inputs are validated by ``treeattn_lab.ops``. ``config`` overrides entries of :data:`CONFIGS`
    (e.g. ``{"bar": 16}`` in small tests). With ``return_lse`` also returns the natural-log
    log-sum-exp ``[N, Hq]``.
    """
    check_inputs(q, k, v, index)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    bar_k, bar_v = gather_bars(k, v, index)
    o, lse2 = BlockSparseAttentionFunction.apply(q, k, v, bar_k.contiguous(), bar_v.contiguous(), index,
                                                 scale, config)
    if return_lse:
        return o, lse2.transpose(0, 1) / LOG2E
    return o
