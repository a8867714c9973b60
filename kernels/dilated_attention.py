"""Dilated attention with a window and initial tokens in Triton (RAT+ inference), forward and backward.

The rule
--------
Query ``t`` sees key ``p`` when ``p <= t`` and (``t - p <= W``, or ``p < P``, or ``(p + 1) % D == 0`` and
``p < t - W``); see ``treeattn_lab.patterns.dilated``. A mask kernel (FlexAttention with this
``mask_mod``) gains almost nothing: the strided columns ``D-1, 2D-1, ...`` cross every 128 x 128 block, so
every block below the diagonal is "partial" and computed in full. The work that matters is only about
``1 / D`` of the causal triangle.

Three disjoint parts, one online softmax
----------------------------------------
The visible keys of query ``t`` split into three ranges, each contiguous in its own key array:

- strided: the *compact* keys ``j`` (position ``p_j = j D + D - 1``) with ``P // D <= j < (t - W) // D``.
  Gathering them needs no copy: compact row ``j`` is row ``j D + D - 1`` of ``k`` and ``v``, so the
  kernel reads ``k`` with a row stride D times larger. Against compact keys the pattern is plain causal
  attention with a shallow diagonal (D queries per key), so almost every tile is full (no mask);
- initial: positions ``p < min(P, t - W)`` (the first P keys, those not already in the window);
- window: positions ``t - W <= p <= t``.

Attending each part separately and merging the results by log-sum-exp
(``treeattn_lab.reference.merge_attention_states``: weights ``exp(lse_part - lse)``) gives exactly the
attention over the union. The kernel does that merge on the fly: one program owns a query tile and a
head, runs FlashAttention's online softmax over the strided tiles, then the initial tiles, then the
window tiles, in one pass, so the output is written once and the log-sum-exp it saves is the union's.

For a query tile ``[t0, t1)`` the strided part needs compact tiles up to ``(t1 - 1 - W) // D``; those
wholly below ``(t0 - W) // D`` are seen by every row and computed without a mask, the one or two at the
tile's diagonal are masked. Window tiles cover ``[t0 - W, t1)``, initial tiles ``[0, P)``: both masked
(they are a small, fixed amount of work per query tile).

Work: about ``N (N / D / 2 + W + P)`` pairs instead of ``N^2 / 2``, i.e. about D-fold less at long N.

Backward (FlashAttention-2)
---------------------------
``delta = rowsum(dO * O)`` (``attention_core.attention_delta``, one Triton pass per batch row); with
``p = exp2(s - lse)`` recomputed from the saved log-sum-exp (the union's, so each part's probabilities
come out already normalized):

    dV += p^T dO,   dP = dO V^T,   dS = p * (dP - delta),   dK += dS^T Q * scale,   dQ += dS K * scale.

- dQ: one program per query tile and head, the same three loops as the forward pass.
- dK, dV: one launch whose programs each own a key tile and a kv head (looping over the G query heads
  that share it) of one of the three parts: initial tiles (seen by every later query), compact tiles
  (seen by every query ``>= p_j + W + 1``: long loops first, like the causal backward) and window tiles
  (seen by the next ``W`` queries). Each part writes its own buffer; a compact key's gradient is then its
  window gradient plus its strided one, added at rows ``D-1, 2D-1, ...`` (fp32, one rounding).

The kernels run as ``torch.library`` custom ops (``treeattn_lab::dilated_attention_fwd`` / ``_bwd``, the
backward registered as the forward's autograd) with fake implementations: ``torch.compile(fullgraph=True)``
traces a model that calls them. The pattern needs no host work: three ints.

Layout: ``[B, N, H, head_dim]`` (a 3-D input is batch 1), any strides with a contiguous last dim;
grouped-query attention with ``Hq = G * Hkv``. Precision: fp16 / bf16 dots with fp32 accumulation, fp32
inputs use IEEE fp32 dots. Under ``TRITON_INTERPRET=1`` (CPU) test fp32 / fp16 only (the interpreter's
bf16 dots are wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_core as core
from .tuning import DILATED, DILATED_FALLBACK, LaunchConfig, launch_config

# sizes and the pattern change from call to call: one compiled kernel serves them all
_RUNTIME_INTS = ["N", "NC", "HQ", "DIL", "WIN", "INIT"]


# --------------------------------------------------------------------------------------- the rule
@triton.jit
def _part_bounds(t, PART: tl.constexpr, DIL, WIN, INIT):
    """Key range ``[lo, hi)`` of part ``PART`` for query positions ``t`` (index into that part's keys)."""
    behind = tl.maximum(t - WIN, 0)  # keys p < t - W lie behind the window
    if PART == 0:  # strided: compact keys
        lo = tl.zeros_like(t) + INIT // DIL
        hi = tl.maximum(behind // DIL, lo)
    elif PART == 1:  # initial: positions below P, not in the window
        lo = tl.zeros_like(t)
        hi = tl.minimum(behind, INIT)
    else:  # window: positions t - W .. t
        lo = behind
        hi = t + 1
    return lo, hi


@triton.jit
def _key_rows(idx, PART: tl.constexpr, DIL):
    """Row in k / v of key ``idx`` of part ``PART``: compact key j is row j D + D - 1."""
    if PART == 0:
        return idx.to(tl.int64) * DIL + (DIL - 1)
    return idx.to(tl.int64)


@triton.jit
def _key_tile(K, V, j, n_keys, offs_d, stride_kt, stride_vt, DIL, PART: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr):
    """Key tile ``j`` of part ``PART``: its key indices and their rows of k and v (with ``MASKED``, zero
    beyond the part's ``n_keys``)."""
    idx = j * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = _key_rows(idx, PART, DIL)
    in_range = idx < n_keys
    k = core.gather_rows(K, rows, stride_kt, offs_d, in_range, MASKED)
    v = core.gather_rows(V, rows, stride_vt, offs_d, in_range, MASKED)
    return idx, k, v


# --------------------------------------------------------------------------------------- the schedule
@triton.jit
def _query_program(N, HQ, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The query tile and head of this program: ``(b, head, kv_head, bh, t_first, t_last, offs_m)``."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    head = bh % HQ
    kv_head = head // GROUP
    t_first = tile * BLOCK_M
    t_last = tl.minimum(t_first + BLOCK_M, N) - 1
    offs_m = t_first + tl.arange(0, BLOCK_M)
    return b, head, kv_head, bh, t_first, t_last, offs_m


@triton.jit
def _strided_tiles(t_first, t_last, DIL, WIN, INIT, BLOCK_N: tl.constexpr):
    """Compact-key tiles of a query tile ``[t_first, t_last]``: ``[first, full_lo)`` the unaligned first
    tile (masked), ``[full_lo, full_hi)`` seen whole by every row (no mask), ``[full_hi, end)`` the
    diagonal of the compact keys (masked)."""
    j0 = INIT // DIL
    c_first = tl.maximum(t_first - WIN, 0) // DIL
    c_last = tl.maximum(t_last - WIN, 0) // DIL
    full_lo = tl.cdiv(j0, BLOCK_N)
    full_hi = tl.maximum(c_first // BLOCK_N, full_lo)
    return j0 // BLOCK_N, full_lo, full_hi, tl.cdiv(c_last, BLOCK_N)


# --------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_tile(
    acc, m_i, l_i, q, K, V, j, lo, hi, n_keys, offs_d, stride_kt, stride_vt, qk_scale, DIL,
    PART: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    idx, k, v = _key_tile(K, V, j, n_keys, offs_d, stride_kt, stride_vt, DIL, PART, BLOCK_N, MASKED)
    s = core.scores(q, k, qk_scale, DOT_PRECISION)
    if MASKED:
        visible = (idx[None, :] >= lo[:, None]) & (idx[None, :] < hi[:, None])
        s = tl.where(visible, s, float("-inf"))
    return core.softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _dilated_fwd(
    Q, K, V, O, LSE,
    N, NC, HQ, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
    qk_scale, DIL, WIN, INIT,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b, head, kv_head, bh, t_first, t_last, offs_m = _query_program(N, HQ, GROUP, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_m < N
    q = core.gather_rows(Q + b.to(tl.int64) * stride_qb + head * stride_qh, offs_m, stride_qt, offs_d,
                         in_range, True)
    K += b.to(tl.int64) * stride_kb + kv_head * stride_kh
    V += b.to(tl.int64) * stride_vb + kv_head * stride_vh
    m_i, l_i, acc = core.softmax_start(BLOCK_M, HEAD_DIM)

    # strided part: compact keys [INIT // DIL, (t - W) // DIL); whole tiles below the first row's bound
    lo, hi = _part_bounds(offs_m, 0, DIL, WIN, INIT)
    first, full_lo, full_hi, end = _strided_tiles(t_first, t_last, DIL, WIN, INIT, BLOCK_N)
    for j in range(first, tl.minimum(full_lo, end)):  # unaligned first tile
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, j, lo, hi, NC, offs_d, stride_kt, stride_vt,
                                  qk_scale, DIL, 0, BLOCK_N, True, DOT_PRECISION)
    for j in range(full_lo, full_hi):  # every row sees every key: no mask
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, j, lo, hi, NC, offs_d, stride_kt, stride_vt,
                                  qk_scale, DIL, 0, BLOCK_N, False, DOT_PRECISION)
    for j in range(full_hi, end):  # the diagonal of the compact keys
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, j, lo, hi, NC, offs_d, stride_kt, stride_vt,
                                  qk_scale, DIL, 0, BLOCK_N, True, DOT_PRECISION)
    # initial part: positions [0, min(P, t - W))
    lo, hi = _part_bounds(offs_m, 1, DIL, WIN, INIT)
    for j in range(0, tl.cdiv(tl.minimum(tl.maximum(t_last - WIN, 0), INIT), BLOCK_N)):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, j, lo, hi, N, offs_d, stride_kt, stride_vt,
                                  qk_scale, DIL, 1, BLOCK_N, True, DOT_PRECISION)
    # window part: positions [t - W, t]
    lo, hi = _part_bounds(offs_m, 2, DIL, WIN, INIT)
    for j in range(tl.maximum(t_first - WIN, 0) // BLOCK_N, t_last // BLOCK_N + 1):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, j, lo, hi, N, offs_d, stride_kt, stride_vt,
                                  qk_scale, DIL, 2, BLOCK_N, True, DOT_PRECISION)

    out = core.softmax_output(acc, l_i)
    tl.store(O + b.to(tl.int64) * stride_ob + head * stride_oh + offs_m.to(tl.int64)[:, None] * stride_ot
             + offs_d[None, :], out.to(O.dtype.element_ty), mask=in_range[:, None])
    tl.store(LSE + bh.to(tl.int64) * N + offs_m, core.softmax_lse(m_i, l_i), mask=in_range)


# --------------------------------------------------------------------------------------- backward: dQ
@triton.jit
def _dq_tile(
    dq, q, do, lse, delta, K, V, j, lo, hi, n_keys, offs_d, stride_kt, stride_vt, qk_scale, DIL,
    PART: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    idx, k, v = _key_tile(K, V, j, n_keys, offs_d, stride_kt, stride_vt, DIL, PART, BLOCK_N, MASKED)
    p = core.probabilities(q, k, lse, qk_scale, DOT_PRECISION)
    if MASKED:
        visible = (idx[None, :] >= lo[:, None]) & (idx[None, :] < hi[:, None])
        p = tl.where(visible, p, 0.0)
    return core.dq_step(dq, p, do, v, k, delta, DOT_PRECISION)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _dilated_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    N, NC, HQ, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh, stride_dqb, stride_dqt, stride_dqh,
    qk_scale, scale, DIL, WIN, INIT,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b, head, kv_head, bh, t_first, t_last, offs_m = _query_program(N, HQ, GROUP, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_m < N
    rows_m = offs_m.to(tl.int64)[:, None]
    q = core.gather_rows(Q + b.to(tl.int64) * stride_qb + head * stride_qh, offs_m, stride_qt, offs_d,
                         in_range, True)
    do = core.gather_rows(DO + b.to(tl.int64) * stride_dob + head * stride_doh, offs_m, stride_dot, offs_d,
                          in_range, True)
    lse = tl.load(LSE + bh.to(tl.int64) * N + offs_m, mask=in_range, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * N + offs_m, mask=in_range, other=0.0)
    K += b.to(tl.int64) * stride_kb + kv_head * stride_kh
    V += b.to(tl.int64) * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    lo, hi = _part_bounds(offs_m, 0, DIL, WIN, INIT)
    first, full_lo, full_hi, end = _strided_tiles(t_first, t_last, DIL, WIN, INIT, BLOCK_N)
    for j in range(first, tl.minimum(full_lo, end)):
        dq = _dq_tile(dq, q, do, lse, delta, K, V, j, lo, hi, NC, offs_d, stride_kt, stride_vt, qk_scale,
                      DIL, 0, BLOCK_N, True, DOT_PRECISION)
    for j in range(full_lo, full_hi):
        dq = _dq_tile(dq, q, do, lse, delta, K, V, j, lo, hi, NC, offs_d, stride_kt, stride_vt, qk_scale,
                      DIL, 0, BLOCK_N, False, DOT_PRECISION)
    for j in range(full_hi, end):
        dq = _dq_tile(dq, q, do, lse, delta, K, V, j, lo, hi, NC, offs_d, stride_kt, stride_vt, qk_scale,
                      DIL, 0, BLOCK_N, True, DOT_PRECISION)
    lo, hi = _part_bounds(offs_m, 1, DIL, WIN, INIT)
    for j in range(0, tl.cdiv(tl.minimum(tl.maximum(t_last - WIN, 0), INIT), BLOCK_N)):
        dq = _dq_tile(dq, q, do, lse, delta, K, V, j, lo, hi, N, offs_d, stride_kt, stride_vt, qk_scale,
                      DIL, 1, BLOCK_N, True, DOT_PRECISION)
    lo, hi = _part_bounds(offs_m, 2, DIL, WIN, INIT)
    for j in range(tl.maximum(t_first - WIN, 0) // BLOCK_N, t_last // BLOCK_N + 1):
        dq = _dq_tile(dq, q, do, lse, delta, K, V, j, lo, hi, N, offs_d, stride_kt, stride_vt, qk_scale,
                      DIL, 2, BLOCK_N, True, DOT_PRECISION)
    tl.store(DQ + b.to(tl.int64) * stride_dqb + head * stride_dqh + rows_m * stride_dqt + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=in_range[:, None])


# --------------------------------------------------------------------------------------- backward: dK, dV
@triton.jit
def _dkdv_tile(
    dk, dv, k, v, Q, DO, LSE, DELTA, i, idx, N, offs_d, stride_qt, stride_dot, qk_scale, DIL, WIN, INIT,
    PART: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m.to(tl.int64)
    in_range = offs_m < N
    q = core.gather_rows(Q, rows, stride_qt, offs_d, in_range, MASKED)
    do = core.gather_rows(DO, rows, stride_dot, offs_d, in_range, MASKED)
    lse, delta = core.row_stats(LSE, DELTA, offs_m, N, MASKED)
    p_t = core.probabilities_t(k, q, lse, qk_scale, DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    if MASKED:
        lo, hi = _part_bounds(offs_m, PART, DIL, WIN, INIT)
        visible = (idx[:, None] >= lo[None, :]) & (idx[:, None] < hi[None, :]) & in_range[None, :]
        p_t = tl.where(visible, p_t, 0.0)
    return core.dkdv_step(dk, dv, p_t, q, do, v, delta, DOT_PRECISION)


@triton.jit
def _dkdv_part(
    Q, K, V, DO, LSE, DELTA, DK, DV, key_tile, b, kv_head,
    N, NC, HQ, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    qk_scale, scale, DIL, WIN, INIT,
    PART: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV of one key tile of one part, over the query tiles that see it (and the group's heads)."""
    idx = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if PART == 0:
        n_keys = NC
    elif PART == 1:
        n_keys = tl.minimum(INIT, N)
    else:
        n_keys = N
    in_range = idx < n_keys
    rows = _key_rows(idx, PART, DIL)
    k = core.gather_rows(K + b.to(tl.int64) * stride_kb + kv_head * stride_kh, rows, stride_kt, offs_d,
                         in_range, True)
    v = core.gather_rows(V + b.to(tl.int64) * stride_vb + kv_head * stride_vh, rows, stride_vt, offs_d,
                         in_range, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    k0 = key_tile * BLOCK_N
    n_q_tiles = tl.cdiv(N, BLOCK_M)
    # compact keys: query tiles [q_start, q_full) masked, [q_full, q_full_end) whole (no mask), then a
    # last partial tile masked; initial and window keys: [q_start, q_end) all masked
    if PART == 0:  # compact key j is seen by queries t >= (j + 1) D + W
        q_start = ((k0 + 1) * DIL + WIN) // BLOCK_M
        whole = (k0 >= INIT // DIL) & (k0 + BLOCK_N <= NC)
        q_full = tl.minimum(tl.maximum(tl.cdiv((k0 + BLOCK_N) * DIL + WIN, BLOCK_M), q_start), n_q_tiles)
        q_full = tl.where(whole, q_full, n_q_tiles)
        q_full_end = tl.maximum(N // BLOCK_M, q_full)
    elif PART == 1:  # initial key p is seen by queries t >= p + W + 1
        q_start = (k0 + WIN + 1) // BLOCK_M
        q_full = n_q_tiles
    else:  # window key p is seen by queries p .. p + W
        q_start = k0 // BLOCK_M
        q_full = tl.minimum(tl.cdiv(k0 + BLOCK_N + WIN, BLOCK_M), n_q_tiles)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        bh = b * HQ + head
        Qh = Q + b.to(tl.int64) * stride_qb + head * stride_qh
        DOh = DO + b.to(tl.int64) * stride_dob + head * stride_doh
        LSEh = LSE + bh.to(tl.int64) * N
        DELTAh = DELTA + bh.to(tl.int64) * N
        for i in range(q_start, q_full):
            dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, i, idx, N, offs_d, stride_qt, stride_dot,
                                qk_scale, DIL, WIN, INIT, PART, BLOCK_M, True, DOT_PRECISION)
        if PART == 0:
            for i in range(q_full, q_full_end):
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, i, idx, N, offs_d, stride_qt,
                                    stride_dot, qk_scale, DIL, WIN, INIT, PART, BLOCK_M, False, DOT_PRECISION)
            for i in range(q_full_end, n_q_tiles):
                dk, dv = _dkdv_tile(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, i, idx, N, offs_d, stride_qt,
                                    stride_dot, qk_scale, DIL, WIN, INIT, PART, BLOCK_M, True, DOT_PRECISION)
    out_rows = idx.to(tl.int64)[:, None]
    tl.store(DK + b.to(tl.int64) * stride_dkb + kv_head * stride_dkh + out_rows * stride_dkt
             + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=in_range[:, None])
    tl.store(DV + b.to(tl.int64) * stride_dvb + kv_head * stride_dvh + out_rows * stride_dvt
             + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=in_range[:, None])


@triton.jit(do_not_specialize=[*_RUNTIME_INTS, "HKV", "N_INIT_TILES", "N_STRIDED_TILES",
                               "FIRST_STRIDED_TILE"])
def _dilated_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK_S, DV_S, DK_I, DV_I, DK_W, DV_W,
    N, NC, HQ, HKV, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
    stride_sb, stride_st, stride_sh, stride_ib, stride_it, stride_ih, stride_wb, stride_wt, stride_wh,
    qk_scale, scale, DIL, WIN, INIT, N_INIT_TILES, N_STRIDED_TILES, FIRST_STRIDED_TILE,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Programs ``[0, N_INIT_TILES)``: initial tiles; then compact tiles (longest first); then window."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    kv_head = bh % HKV
    if pid < N_INIT_TILES:
        _dkdv_part(Q, K, V, DO, LSE, DELTA, DK_I, DV_I, pid, b, kv_head,
                   N, NC, HQ, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                   stride_ib, stride_it, stride_ih, stride_ib, stride_it, stride_ih,
                   qk_scale, scale, DIL, WIN, INIT, 1, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION)
    elif pid < N_INIT_TILES + N_STRIDED_TILES:
        _dkdv_part(Q, K, V, DO, LSE, DELTA, DK_S, DV_S, FIRST_STRIDED_TILE + pid - N_INIT_TILES, b, kv_head,
                   N, NC, HQ, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                   stride_sb, stride_st, stride_sh, stride_sb, stride_st, stride_sh,
                   qk_scale, scale, DIL, WIN, INIT, 0, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION)
    else:
        _dkdv_part(Q, K, V, DO, LSE, DELTA, DK_W, DV_W, pid - N_INIT_TILES - N_STRIDED_TILES, b, kv_head,
                   N, NC, HQ, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_vb, stride_vt, stride_vh, stride_dob, stride_dot, stride_doh,
                   stride_wb, stride_wt, stride_wh, stride_wb, stride_wt, stride_wh,
                   qk_scale, scale, DIL, WIN, INIT, 2, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION)


# --------------------------------------------------------------------------------------- launchers
def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _meta(launch: LaunchConfig, dtype, group, head_dim):
    return dict(GROUP=group, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, HEAD_DIM=head_dim,
                DOT_PRECISION=core.dot_precision(dtype), num_warps=launch.num_warps,
                num_stages=launch.num_stages)


def _forward(q, k, v, pattern, scale, launch):
    B, N, hq, d = q.shape
    dil, win, init = pattern
    o = torch.empty_like(q)
    lse = torch.empty((B, hq, N), device=q.device, dtype=torch.float32)
    _dilated_fwd[(triton.cdiv(N, launch.block_m), B * hq)](
        q, k, v, o, lse, N, N // dil, hq, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        scale * core.LOG2E, dil, win, init, **_meta(launch, q.dtype, hq // k.shape[2], d),
    )
    return o, lse


def _backward(do, q, k, v, o, lse, pattern, scale, dkdv_launch, dq_launch):
    B, N, hq, d = q.shape
    hkv = k.shape[2]
    dil, win, init = pattern
    nc = N // dil
    do = do if do.stride(-1) == 1 else do.contiguous()
    delta = torch.empty((B, hq, N), device=q.device, dtype=torch.float32)
    for b in range(B):  # rowsum(dO * O) per batch row, one Triton pass each
        core.attention_delta(o[b], do[b], out=delta[b])
    dq = torch.empty_like(q)
    _dilated_bwd_dq[(triton.cdiv(N, dq_launch.block_m), B * hq)](
        q, k, v, do, lse, delta, dq, N, nc, hq, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dq), scale * core.LOG2E, scale, dil, win, init, **_meta(dq_launch, q.dtype, hq // hkv, d),
    )
    block_n = dkdv_launch.block_n
    n_init = min(init, N)
    dk_w, dv_w = torch.empty_like(k), torch.empty_like(v)  # window part, every position
    dk_i, dv_i = (torch.empty((B, max(n_init, 1), hkv, d), device=q.device, dtype=torch.float32)
                  for _ in range(2))
    dk_s, dv_s = (torch.empty((B, max(nc, 1), hkv, d), device=q.device, dtype=torch.float32)
                  for _ in range(2))
    n_init_tiles = triton.cdiv(n_init, block_n)
    first_strided = (init // dil) // block_n
    n_strided_tiles = max(triton.cdiv(nc, block_n) - first_strided, 0)
    n_window_tiles = triton.cdiv(N, block_n)
    _dilated_bwd_dkdv[(n_init_tiles + n_strided_tiles + n_window_tiles, B * hkv)](
        q, k, v, do, lse, delta, dk_s, dv_s, dk_i, dv_i, dk_w, dv_w, N, nc, hq, hkv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk_s), *_strides(dk_i),
        *_strides(dk_w), scale * core.LOG2E, scale, dil, win, init, n_init_tiles, n_strided_tiles,
        first_strided,
        **_meta(dkdv_launch, q.dtype, hq // hkv, d),
    )
    # a key's gradient is the sum over the parts it belongs to (fp32, then one rounding)
    j0 = init // dil
    for grad, strided, initial in ((dk_w, dk_s, dk_i), (dv_w, dv_s, dv_i)):
        if nc > j0:
            rows = grad[:, dil - 1 :: dil][:, j0:nc]
            rows.copy_(rows.float() + strided[:, j0:nc])
        if n_init:
            grad[:, :n_init] = grad[:, :n_init].float() + initial[:, :n_init]
    return dq, dk_w, dv_w


@torch.library.custom_op("treeattn_lab::dilated_attention_fwd", mutates_args=())
def dilated_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pattern: list[int],
                          launches: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse2 [B, Hq, N])`` over ``[B, N, H, head_dim]``; ``pattern``: ``[dilation, window,
    initial]``, ``launches``: the forward, dK/dV and dQ launches (:func:`~.attention_core.launch_ints`).
    A custom op (with the backward below as its autograd) so that ``torch.compile`` traces it."""
    return _forward(q, k, v, pattern, scale, core.launches_of(launches)[0])


@dilated_attention_fwd.register_fake
def _(q, k, v, scale, pattern, launches):
    B, N, hq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, hq, N), dtype=torch.float32)


@torch.library.custom_op("treeattn_lab::dilated_attention_bwd", mutates_args=())
def dilated_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          o: torch.Tensor, lse: torch.Tensor, scale: float, pattern: list[int],
                          launches: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` (arguments as :func:`dilated_attention_fwd`'s)."""
    return _backward(do, q, k, v, o, lse, pattern, scale, *core.launches_of(launches)[1:])


@dilated_attention_bwd.register_fake
def _(do, q, k, v, o, lse, scale, pattern, launches):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


core.register_attention_autograd(dilated_attention_fwd, dilated_attention_bwd)


def _launches(head_dim: int, fwd_config, dkdv_config, dq_config) -> list[LaunchConfig]:
    """The three launches: the callers' :class:`~.tuning.LaunchConfig`, else the tuned defaults."""
    defaults = DILATED.get(head_dim, DILATED_FALLBACK)
    launches = []
    for name, config in (("fwd", fwd_config), ("dkdv", dkdv_config), ("dq", dq_config)):
        launch = launch_config(config, f"{name}_config", defaults[name])
        if launch.tma:
            raise ValueError(f"{name}_config: the dilated kernels have no TMA path (tma=True)")
        launches.append(launch)
    return launches


def triton_dilated_attention(q, k, v, *, dilation: int, window: int = 0, initial: int = 0, scale=None,
                             fwd_config=None, dkdv_config=None, dq_config=None, return_lse: bool = False):
    """Dilated attention with the Triton kernels (inputs already validated by ``treeattn_lab.ops``).

    ``q [N, Hq, d]`` or ``[B, N, Hq, d]``, ``k, v`` likewise with ``Hkv`` heads. ``*_config`` override a
    kernel's launch with a :class:`~.tuning.LaunchConfig` (small tiles make small tests cross many
    tiles). With ``return_lse`` also returns the natural-log log-sum-exp ``[..., N, Hq]``.
    """
    batched = q.dim() == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    launches = _launches(q.shape[-1], fwd_config, dkdv_config, dq_config)
    pattern = [int(dilation), int(window), int(initial)]

    def apply(q, k, v, scale):
        o, lse = dilated_attention_fwd(q, k, v, scale, pattern, core.launch_ints(*launches))
        return o, lse.detach()  # the log-sum-exp carries no gradient

    result = core.run_attention(apply, q, k, v, scale=scale, return_lse=return_lse)
    if batched:
        return result
    return (result[0][0], result[1][0]) if return_lse else result[0]
