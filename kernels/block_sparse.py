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
query blocks in steps of ``BLOCK_M`` queries. A :class:`~.tuning.SparseConfig` holds the shapes, warps,
stages and bar steps (defaults: ``tuning.SPARSE`` and, for short calls, ``tuning.SPARSE_SHORT``).

Forward (one program per BLOCK_M queries and query head)
--------------------------------------------------------
The online softmax of ``attention_core`` over the tiles, then the bars. The output is ``acc / l`` and the
base-2 log-sum-exp ``lse`` (``-inf`` for a row that saw nothing) is saved: it recomputes any probability
as ``p = exp2(s - lse)`` and merges partial results. With ``MERGE`` the kernel folds its partial result
into a running fp32 output and lse in place (one ring step into the steps before it):

    lse = log2(2^lse_old + 2^lse_new),   out = out_old * 2^(lse_old - lse) + out_new * 2^(lse_new - lse).

Backward (FlashAttention-2, two kernels, no atomics)
----------------------------------------------------
``delta = rowsum(dO * O)`` (``attention_core.attention_delta``); with ``p`` recomputed from ``lse``:
``dV += p^T dO``, ``dP = dO V^T``, ``dS = p * (dP - delta)``, ``dK += dS^T Q * scale``,
``dQ += dS K * scale``.

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
already had, and no gradient needs an atomic add (every result is bitwise reproducible).

Ops that torch.compile traces
-----------------------------
A call runs as two ``torch.library`` custom ops, ``treeattn_lab::sparse_attention_fwd`` (which also gathers
and returns the bars) and ``_bwd`` (registered as its autograd), with fake implementations. Their
arguments are the tensors and ints of a :class:`~.block_sparse_call.SparseCall`, resolved on the host
from the index, its cached bar plan and the launch configs; under ``torch.compile`` the bar plan must be
cached already (:func:`prepare`, or one eager call).

Precision: fp16 / bf16 inputs use tensor-core dots with fp32 accumulation; fp32 inputs use IEEE fp32
dots. Under ``TRITON_INTERPRET=1`` (CPU) everything runs through numpy: use fp32 / fp16 there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_core as core
from .bar_columns import BAR_PAD, gather_bars
from .block_sparse_call import SparseCall, check_inputs, prepare, prepared, resolve_call, resolve_config

__all__ = ["check_inputs", "gather_bars", "prepare", "sparse_backward", "sparse_forward",
           "triton_sparse_attention"]

_BAR_PAD = tl.constexpr(BAR_PAD)  # BAR_PAD, readable inside kernels


# --------------------------------------------------------------------------------------- the rule
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
    k = core.gather_rows(K, keys, stride_kt, offs_d, keys < NK, MASKED)
    v = core.gather_rows(V, keys, stride_vt, offs_d, keys < NK, MASKED)
    visible = (qpos[:, None] >= 0) & (offs_n >= 0)[None, :]  # unmasked tiles: every pair (left unused)
    if MASKED:
        kpos = tl.load(K_BLOCKS + n) * BLOCK + sub + offs_n
        visible = (kpos[None, :] <= qpos[:, None]) & (keys < NK)[None, :]
    return k, v, visible


@triton.jit
def _bar_range(BAR_COUNT, BAR_CLEAN, BAR_SKIP, h, m, NQB, NKG, BAR: tl.constexpr):
    """Bars of query block ``m`` of head ``h``: their count, the clean prefix (whole chunks of ``BAR``)
    and the block's row of ``bar_skip`` (which key blocks its tiles hold)."""
    nbar = tl.load(BAR_COUNT + h * NQB + m)
    clean = tl.load(BAR_CLEAN + h * NQB + m)
    clean -= clean % BAR  # whole chunks only
    skip_row = BAR_SKIP + (h * NQB + m).to(tl.int64) * NKG
    return nbar, clean, skip_row


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
        s = core.scores(q, k, qk_scale, DOT_PRECISION)
        if MASKED:  # the diagonal tile: causal mask (and the ragged end of the keys)
            s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = core.softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
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
        s = core.scores(q, bk, qk_scale, DOT_PRECISION)
        if MASKED:
            s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = core.softmax_step(acc, m_i, l_i, s, bv, DOT_PRECISION)
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
    q = core.gather_rows(Q + h * stride_qh, rows, stride_qt, offs_d, in_range, True)
    K += (h // GROUP) * stride_kh
    V += (h // GROUP) * stride_vh
    m_i, l_i, acc = core.softmax_start(BLOCK_M, HEAD_DIM)
    start, full_end, end = _row_tiles(ROW_PTR, ROW_IDX, K_BLOCKS, h * NQB + m, q_block)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, qpos, K, V, K_BLOCKS, ROW_IDX, start, full_end, NK,
                               stride_kt, stride_vt, qk_scale, BLOCK, BLOCK_N, HEAD_DIM, False, DOT_PRECISION)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, qpos, K, V, K_BLOCKS, ROW_IDX, full_end, end, NK,
                               stride_kt, stride_vt, qk_scale, BLOCK, BLOCK_N, HEAD_DIM, True, DOT_PRECISION)
    if HAS_BARS:
        nbar, clean, skip_row = _bar_range(BAR_COUNT, BAR_CLEAN, BAR_SKIP, h, m, NQB, NKG, BAR)
        acc, m_i, l_i = _fwd_bars(acc, m_i, l_i, q, qpos, BAR_POS, BK, BV, skip_row, h, 0, clean, NB,
                                  stride_bh, stride_bt, qk_scale, BLOCK, BAR, HEAD_DIM, False, DOT_PRECISION)
        acc, m_i, l_i = _fwd_bars(acc, m_i, l_i, q, qpos, BAR_POS, BK, BV, skip_row, h, clean, nbar, NB,
                                  stride_bh, stride_bt, qk_scale, BLOCK, BAR, HEAD_DIM, True, DOT_PRECISION)
    out = core.softmax_output(acc, l_i)
    lse = core.softmax_lse(m_i, l_i)  # -inf where the row saw nothing
    o_ptrs = O + h * stride_oh + rows.to(tl.int64)[:, None] * stride_ot + offs_d[None, :]
    if MERGE:  # fold into the running (fp32 output, lse) of earlier ring steps
        lse_old = tl.load(LSE + h * NQ + rows, mask=in_range, other=float("-inf"))
        o_old = tl.load(o_ptrs, mask=in_range[:, None], other=0.0)
        out, lse = core.merge_states(out, lse, o_old, lse_old)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=in_range[:, None])
    tl.store(LSE + h * NQ + rows, lse, mask=in_range)


# --------------------------------------------------------------------------------------- backward
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
        p = core.probabilities(q, k, lse, qk_scale, DOT_PRECISION)
        if MASKED:
            p = tl.where(visible, p, 0.0)
        dq = core.dq_step(dq, p, do, v, k, delta, DOT_PRECISION)
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
        p = core.probabilities(q, bk, lse, qk_scale, DOT_PRECISION)
        if MASKED:
            p = tl.where(visible, p, 0.0)
        dq = core.dq_step(dq, p, do, bv, bk, delta, DOT_PRECISION)
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
    q = core.gather_rows(Q + h * stride_qh, rows, stride_qt, offs_d, in_range, True)
    do = core.gather_rows(DO + h * stride_doh, rows, stride_dot, offs_d, in_range, True)
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
        nbar, clean, skip_row = _bar_range(BAR_COUNT, BAR_CLEAN, BAR_SKIP, h, m, NQB, NKG, BAR)
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
def _dkdv_queries(dk, dv, k, v, kpos, key_ok, kblock, Q, DO, LSE, DELTA, Q_BLOCKS, COL_IDX, skip_base,
                  lo, hi, NQ, NKG, stride_qt, stride_dot, qk_scale, BLOCK: tl.constexpr,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                  FROM_LIST: tl.constexpr, SKIP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the share of query blocks ``lo .. hi`` (``COL_IDX[lo:hi]`` with FROM_LIST) to a key chunk's
    dK, dV, ``BLOCK_M`` queries at a time (transposed scores ``[keys, queries]``).

    MASKED evaluates the causal rule per element from the keys' positions ``kpos`` and drops keys not
    ``key_ok``; with SKIP (bar columns) also those inside a tile the query block selected.
    """
    NSUB = BLOCK // BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    for t in range(lo * NSUB, hi * NSUB):
        i = tl.load(COL_IDX + t // NSUB) if FROM_LIST else t // NSUB  # the query block
        sub = (t % NSUB) * BLOCK_M
        rows = i * BLOCK + sub + offs_m
        in_range = rows < NQ
        q = core.gather_rows(Q, rows, stride_qt, offs_d, in_range, True)
        do = core.gather_rows(DO, rows, stride_dot, offs_d, in_range, True)
        lse, delta = core.row_stats(LSE, DELTA, rows, NQ, True)
        p_t = core.probabilities_t(k, q, lse, qk_scale, DOT_PRECISION)
        if MASKED:
            qpos = tl.load(Q_BLOCKS + i) * BLOCK + sub + offs_m
            ok = key_ok
            if SKIP:
                ok = ok & (tl.load(skip_base + i * NKG + kblock, mask=key_ok, other=1) == 0)
            visible = (kpos[:, None] <= qpos[None, :]) & ok[:, None] & in_range[None, :]
            p_t = tl.where(visible, p_t, 0.0)
        dk, dv = core.dkdv_step(dk, dv, p_t, q, do, v, delta, DOT_PRECISION)
    return dk, dv


@triton.jit
def _tile_dkdv(tid, Q, K, V, DO, LSE, DELTA, DK, DV, Q_BLOCKS, K_BLOCKS, COL_PTR, COL_IDX,
               NQ, NK, NKB, NKG, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
               qk_scale, scale, GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, ACCUMULATE: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
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
    k = core.gather_rows(K + kv_head * stride_kh, keys, stride_kt, offs_d, key_ok, True)
    v = core.gather_rows(V + kv_head * stride_vh, keys, stride_vt, offs_d, key_ok, True)
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
        LSEh = LSE + h * NQ
        DELTAh = DELTA + h * NQ
        dk, dv = _dkdv_queries(dk, dv, k, v, kpos, key_ok, kpos, Qh, DOh, LSEh, DELTAh, Q_BLOCKS, COL_IDX,
                               COL_IDX, start, full_start, NQ, NKG, stride_qt, stride_dot, qk_scale, BLOCK,
                               BLOCK_M, HEAD_DIM, True, True, False, DOT_PRECISION)  # the diagonal tile
        dk, dv = _dkdv_queries(dk, dv, k, v, kpos, key_ok, kpos, Qh, DOh, LSEh, DELTAh, Q_BLOCKS, COL_IDX,
                               COL_IDX, full_start, end, NQ, NKG, stride_qt, stride_dot, qk_scale, BLOCK,
                               BLOCK_M, HEAD_DIM, False, True, False, DOT_PRECISION)
    dk = dk * scale
    dk_ptrs = DK + kv_head * stride_dkh + keys.to(tl.int64)[:, None] * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + kv_head * stride_dvh + keys.to(tl.int64)[:, None] * stride_dvt + offs_d[None, :]
    if ACCUMULATE:
        dk += tl.load(dk_ptrs, mask=key_ok[:, None], other=0.0)
        dv += tl.load(dv_ptrs, mask=key_ok[:, None], other=0.0)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _bar_dkdv(bid, Q, BK, BV, DO, LSE, DELTA, DBK, DBV, Q_BLOCKS, BAR_POS, BAR_SKIP, BAR_FIRST,
              BAR_CLEAN_FROM, NQ, NQB, NKG, NB, NCHUNK, HQ, stride_qt, stride_qh, stride_dot, stride_doh,
              stride_bh, stride_bt, qk_scale, scale, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
              BAR_KV: tl.constexpr, SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
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
    LSEh = LSE + h * NQ
    DELTAh = DELTA + h * NQ
    skip_base = BAR_SKIP + (h * NQB).to(tl.int64) * NKG
    dk, dv = _dkdv_queries(dk, dv, bk, bv, pos, valid, kblock, Qh, DOh, LSEh, DELTAh, Q_BLOCKS, BAR_FIRST,
                           skip_base, lo, mid, NQ, NKG, stride_qt, stride_dot, qk_scale, BLOCK, BLOCK_M,
                           HEAD_DIM, True, False, True, DOT_PRECISION)
    # from clean_from on, every real column is visible and in no tile; padding rows (zero keys and values)
    # collect garbage in dK, dV, zeroed below
    dk, dv = _dkdv_queries(dk, dv, bk, bv, pos, valid, kblock, Qh, DOh, LSEh, DELTAh, Q_BLOCKS, BAR_FIRST,
                           skip_base, mid, hi, NQ, NKG, stride_qt, stride_dot, qk_scale, BLOCK, BLOCK_M,
                           HEAD_DIM, False, False, False, DOT_PRECISION)
    dk = tl.where(valid[:, None], dk * scale, 0.0)
    dv = tl.where(valid[:, None], dv, 0.0)
    out = (part * (NB * HQ) + h * NB + offs_c).to(tl.int64)  # [SPLIT, H, NB, D] fp32
    mask = (offs_c < NB)[:, None]
    tl.store(DBK + out[:, None] * HEAD_DIM + offs_d[None, :], dk, mask=mask)
    tl.store(DBV + out[:, None] * HEAD_DIM + offs_d[None, :], dv, mask=mask)


@triton.jit
def _bsa_bwd_dkdv(
    Q, K, V, BK, BV, DO, LSE, DELTA, DK, DV, DBK, DBV,
    Q_BLOCKS, K_BLOCKS, COL_PTR, COL_IDX, BAR_POS, BAR_SKIP, BAR_FIRST, BAR_CLEAN_FROM,
    NQ, NK, NQB, NKB, NKG, NB, NCHUNK, HQ, BAR_PROGRAMS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_bh, stride_bt, qk_scale, scale,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAR_KV: tl.constexpr, SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BARS: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV in one launch: ``BAR_PROGRAMS`` bar programs (longest first), then the tile programs."""
    pid = tl.program_id(0)
    if HAS_BARS:
        if pid < BAR_PROGRAMS:
            _bar_dkdv(pid, Q, BK, BV, DO, LSE, DELTA, DBK, DBV, Q_BLOCKS, BAR_POS, BAR_SKIP, BAR_FIRST,
                      BAR_CLEAN_FROM, NQ, NQB, NKG, NB, NCHUNK, HQ, stride_qt, stride_qh, stride_dot,
                      stride_doh, stride_bh, stride_bt, qk_scale, scale, BLOCK, BLOCK_M, BAR_KV, SPLIT,
                      HEAD_DIM, DOT_PRECISION)
        else:
            _tile_dkdv(pid - BAR_PROGRAMS, Q, K, V, DO, LSE, DELTA, DK, DV, Q_BLOCKS, K_BLOCKS, COL_PTR,
                       COL_IDX, NQ, NK, NKB, NKG, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                       stride_vh, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                       qk_scale, scale, GROUP, BLOCK, BLOCK_M, BLOCK_N, HEAD_DIM, ACCUMULATE, DOT_PRECISION)
    else:
        _tile_dkdv(pid, Q, K, V, DO, LSE, DELTA, DK, DV, Q_BLOCKS, K_BLOCKS, COL_PTR, COL_IDX,
                   NQ, NK, NKB, NKG, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, qk_scale, scale,
                   GROUP, BLOCK, BLOCK_M, BLOCK_N, HEAD_DIM, ACCUMULATE, DOT_PRECISION)


# --------------------------------------------------------------------------------------- launches
def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _call(q, k, index, config) -> SparseCall:
    return resolve_call(index, config, q.device, q.shape[1] // k.shape[1], _num_sms(q.device))


def _common(c: SparseCall):
    return dict(NQ=c.num_q, NQB=c.q_blocks.numel(), NKG=c.num_key_groups, NB=c.num_bars)


def sparse_forward(q, k, v, bar_k, bar_v, index, *, scale: float, state=None, config=None):
    """Forward of one block-sparse attention call; returns ``(out, lse2)`` with ``lse2 [Hq, Nq]`` base 2.

    ``bar_k, bar_v [Hq, nb, D]`` come from :func:`gather_bars` (empty when the index has no bars).
    With ``state=(out_fp32 [Nq, Hq, D], lse2)`` the call merges into that running state in place (a ring
    step) and returns it.
    """
    return _forward(q, k, v, bar_k, bar_v, _call(q, k, index, config), scale, state)


def _forward(q, k, v, bar_k, bar_v, c: SparseCall, scale, state):
    bs, launch = c.block_size, c.fwd
    nq, hq, d = q.shape
    has_bars = c.index_bars and bar_k.shape[1] > 0
    if state is None:
        o = torch.empty_like(q)
        lse = torch.empty((hq, nq), device=q.device, dtype=torch.float32)
    else:
        o, lse = state
    bk = bar_k if has_bars else q.new_zeros(1, 1, d)
    bv = bar_v if has_bars else q.new_zeros(1, 1, d)
    _bsa_fwd[(c.q_blocks.numel() * (bs // launch.block_m), hq)](
        q, k, v, bk, bv, o, lse,
        c.q_blocks, c.k_blocks, c.row_ptr, c.row_idx, c.bar_pos, c.bar_count, c.bar_clean, c.bar_skip,
        NK=c.num_k, **_common(c),
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=o.stride(0), stride_oh=o.stride(1),
        stride_bh=bk.stride(0), stride_bt=bk.stride(1), qk_scale=scale * core.LOG2E,
        GROUP=hq // k.shape[1], BLOCK=bs, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        BAR=min(c.bar or launch.block_n, bs), HEAD_DIM=d, HAS_BARS=has_bars, MERGE=state is not None,
        DOT_PRECISION=core.dot_precision(q.dtype), num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return o, lse


def sparse_backward(do, q, k, v, bar_k, bar_v, lse, delta, index, *, scale: float, dq=None, dk=None, dv=None,
                    accumulate_q: bool = False, accumulate_kv: bool = False, config=None):
    """Gradients of one block-sparse call given the *final* ``lse`` and ``delta`` (of the full attention).

    Returns ``(dq, dk, dv, d_bar_k, d_bar_v)``. Gradients are written into ``dq`` / ``dk`` / ``dv`` when
    given (any float dtype, e.g. the fp32 buffers of ring attention), added to their contents with
    ``accumulate_q`` / ``accumulate_kv``; otherwise fresh tensors of the inputs' dtype are returned.
    ``d_bar_k, d_bar_v`` are fp32 ``[Hq, nb, D]`` (None without bars).
    """
    return _backward(do, q, k, v, bar_k, bar_v, lse, delta, _call(q, k, index, config), scale=scale, dq=dq,
                     dk=dk, dv=dv, accumulate_q=accumulate_q, accumulate_kv=accumulate_kv)


def _backward(do, q, k, v, bar_k, bar_v, lse, delta, c: SparseCall, *, scale, dq=None, dk=None, dv=None,
              accumulate_q=False, accumulate_kv=False):
    bs = c.block_size
    nq, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    dot = core.dot_precision(q.dtype)
    has_bars = c.index_bars and bar_k.shape[1] > 0
    bk = bar_k if has_bars else q.new_zeros(1, 1, d)
    bv = bar_v if has_bars else q.new_zeros(1, 1, d)
    acc_q, acc_kv = accumulate_q and dq is not None, accumulate_kv and dk is not None
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    common = _common(c)
    dq = torch.empty_like(q) if dq is None else dq
    launch = c.dq
    _bsa_bwd_dq[(c.q_blocks.numel() * (bs // launch.block_m), hq)](
        q, k, v, bk, bv, do, lse, delta, dq,
        c.q_blocks, c.k_blocks, c.row_ptr, c.row_idx, c.bar_pos, c.bar_count, c.bar_clean,
        c.bar_skip, NK=c.num_k, **common,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
        stride_dqt=dq.stride(0), stride_dqh=dq.stride(1), stride_bh=bk.stride(0), stride_bt=bk.stride(1),
        qk_scale=scale * core.LOG2E, scale=scale, GROUP=group, BLOCK=bs, BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n, BAR=min(c.bar or launch.block_n, bs), HEAD_DIM=d, HAS_BARS=has_bars,
        ACCUMULATE=acc_q, DOT_PRECISION=dot, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    nb, bar_kv = common["NB"], c.bar_kv
    nchunk = triton.cdiv(nb, bar_kv) if has_bars else 0
    split = c.split if has_bars else 1
    bar_programs = nchunk * hq * split
    if has_bars:  # fp32 partial sums per piece; written straight into the result without a split
        dbk = torch.empty((split, hq, nb, d), device=q.device, dtype=torch.float32)
        dbv = torch.empty_like(dbk)
    else:
        dbk = dbv = torch.zeros(1, device=q.device, dtype=torch.float32)
    launch = c.dkdv
    nkb = c.k_blocks.numel()
    _bsa_bwd_dkdv[(bar_programs + nkb * (bs // launch.block_n) * hkv,)](
        q, k, v, bk, bv, do, lse, delta, dk, dv, dbk, dbv,
        c.q_blocks, c.k_blocks, c.col_ptr, c.col_idx, c.bar_pos, c.bar_skip, c.bar_first,
        c.bar_clean_from, NQ=c.num_q, NK=c.num_k, NQB=common["NQB"], NKB=nkb, NKG=common["NKG"], NB=nb,
        NCHUNK=nchunk, HQ=hq, BAR_PROGRAMS=bar_programs,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
        stride_dkt=dk.stride(0), stride_dkh=dk.stride(1), stride_dvt=dv.stride(0), stride_dvh=dv.stride(1),
        stride_bh=bk.stride(0), stride_bt=bk.stride(1), qk_scale=scale * core.LOG2E, scale=scale, GROUP=group,
        BLOCK=bs, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BAR_KV=bar_kv, SPLIT=split, HEAD_DIM=d,
        HAS_BARS=has_bars, ACCUMULATE=acc_kv, DOT_PRECISION=dot, num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if not has_bars:
        return dq, dk, dv, None, None
    if split == 1:
        return dq, dk, dv, dbk[0], dbv[0]
    return dq, dk, dv, dbk.sum(0), dbv.sum(0)


# --------------------------------------------------------------------------------------- custom ops
# One call runs as two ``torch.library`` custom ops over a :class:`SparseCall`'s tensors and ints: the
# forward (which gathers the bar columns and returns them, for its backward) and the backward (which adds
# the bar columns' gradients into dK, dV at their rows); ``torch.compile(fullgraph=True)`` traces both.
def _bars_shape(q, c: SparseCall):
    return (q.shape[1], c.bar_cols.shape[1] if c.index_bars else 0, q.shape[2])


@torch.library.custom_op("treeattn_lab::sparse_attention_fwd", mutates_args=())
def sparse_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: list[torch.Tensor],
                         scale: float, sizes: list[int]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse2 [Hq, Nq], bar_k, bar_v)``; ``call`` / ``sizes``: :meth:`SparseCall.op_args`."""
    c = SparseCall.from_op_args(call, sizes)
    if c.index_bars:
        bar_k, bar_v = k[c.bar_cols, c.bar_heads], v[c.bar_cols, c.bar_heads]  # [Hq, nb, D]
    else:
        bar_k, bar_v = (k.new_zeros(_bars_shape(q, c)) for _ in range(2))
    o, lse = _forward(q, k, v, bar_k, bar_v, c, scale, None)
    return o, lse, bar_k, bar_v


@sparse_attention_fwd.register_fake
def _(q, k, v, call, scale, sizes):
    shape = _bars_shape(q, SparseCall.from_op_args(call, sizes))
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return torch.empty_like(q), lse, k.new_empty(shape), k.new_empty(shape)


@torch.library.custom_op("treeattn_lab::sparse_attention_bwd", mutates_args=())
def sparse_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         o: torch.Tensor, lse: torch.Tensor, bar_k: torch.Tensor, bar_v: torch.Tensor,
                         call: list[torch.Tensor], scale: float, sizes: list[int]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` (arguments as :func:`sparse_attention_fwd`'s, with its outputs)."""
    c = SparseCall.from_op_args(call, sizes)
    do = do.contiguous()
    delta = core.attention_delta(o, do)
    dq, dk, dv, dbk, dbv = _backward(do, q, k, v, bar_k, bar_v, lse, delta, c, scale=scale)
    if dbk is not None:  # padding rows are zero; columns shared by a kv head's query heads add up
        dk.index_put_((c.bar_cols, c.bar_heads), dbk.to(dk.dtype), accumulate=True)
        dv.index_put_((c.bar_cols, c.bar_heads), dbv.to(dv.dtype), accumulate=True)
    return dq, dk, dv


@sparse_attention_bwd.register_fake
def _(do, q, k, v, o, lse, bar_k, bar_v, call, scale, sizes):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


core.register_attention_autograd(sparse_attention_fwd, sparse_attention_bwd)


def triton_sparse_attention(q, k, v, index, *, scale=None, config=None, return_lse=False):
    """Block-sparse attention of ``q [N, Hq, D]`` over ``k, v [N, Hkv, D]`` through ``index`` (one GPU).

    Inputs are validated by ``treeattn_lab.ops``. ``config``: a :class:`~.tuning.SparseConfig` whose
    non-None fields override the tuned defaults (e.g. ``SparseConfig(bar=16)`` in small tests). With
    ``return_lse`` also returns the natural-log log-sum-exp ``[N, Hq]``. Under ``torch.compile`` the
    index's bar plan must be built beforehand (:func:`prepare`, or one eager call).
    """
    check_inputs(q, k, v, index)
    resolve_config(config, index)  # a bad config fails here, before any launch

    def apply(q, k, v, scale):
        group = q.shape[1] // k.shape[1]
        if torch.compiler.is_compiling() and not prepared(index, config, group):
            raise ValueError("a block-sparse index must be prepared before torch.compile traces a call: run "
                             "treeattn_lab.kernels.block_sparse.prepare(index, config, group) or one eager "
                             "call first")
        tensors, sizes = _call(q, k, index, config).op_args()
        o, lse, _, _ = sparse_attention_fwd(q, k, v, tensors, scale, sizes)
        return o, lse.detach()  # the log-sum-exp carries no gradient

    return core.run_attention(apply, q, k, v, scale=scale, return_lse=return_lse)
