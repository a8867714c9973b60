"""Tree attention in Triton: FlashAttention-2 over a DFS-preorder pack, skipping invisible tiles.

The rule
--------
A rollout trie packed in DFS preorder (see ``treeattn_lab.pack``) gives every token ``k`` the exclusive
end ``subtree_end[k]`` of its node's subtree, and packed query ``q`` attends key ``k`` exactly when

    k <= q < subtree_end[k].

The tile schedule
-----------------
Cut queries into tiles of BLOCK_M rows and keys into tiles of BLOCK_N columns. For a query tile
``[q0, q1)`` a key tile is

- *invisible* when no query of the tile sees any of its keys: it is never loaded;
- *full* when every query sees every key (``max k <= q0`` and ``min subtree_end >= q1``): computed
  with no mask at all, exactly like a dense FlashAttention tile;
- *partial* otherwise (the diagonal tiles, and tiles where a branch starts or ends): computed with the
  element mask evaluated from ``subtree_end``.

Why this is cheap to find: a key ``k < q0`` is visible from some query of the tile only if
``q0`` itself lies in k's subtree, i.e. only the ancestors of the tile's first query matter. Those are
the nodes on one root-to-node path, a handful of contiguous packed ranges. So each query tile visits
its diagonal tile(s) plus the tiles covering one path, and sibling branches cost nothing.

The schedule (a CSR list of key tiles per query tile, full tiles first, then partial ones) is built
once per pack on its device (:func:`tile_schedule`) and cached on the pack: every layer and head of a
model reuses it. The backward pass visits the transposed schedule (query tiles per key tile).

Forward (one program per query tile and query head)
---------------------------------------------------
Online softmax in base 2: scores are scaled by ``scale * log2(e)``; per row the running maximum ``m``,
the running sum ``l`` and the fp32 accumulator are rescaled by ``exp2(m_old - m_new)`` whenever a new
tile raises the maximum. At the end ``out = acc / l`` and the log-sum-exp ``lse = m + log2(l)`` (base 2)
is saved for the backward pass: it is all that is needed to recompute any probability,
``p = exp2(s - lse)``.

Backward (FlashAttention-2)
---------------------------
``delta = rowsum(dO * O)``; then with ``p`` recomputed from ``lse``:

    dV += p^T dO,   dP = dO V^T,   dS = p * (dP - delta),   dK += dS^T Q * scale,   dQ += dS K * scale.

One kernel owns a key tile and a kv head and loops over the query tiles that see it and over the G
query heads sharing that kv head (grouped-query attention), so dK and dV need no atomics. With few kv
heads that grid is too small to fill the GPU (2 kv heads x 250 key tiles on 132 SMs), so the backward
may instead *split the groups*: run the kernel per query head over K/V repeated to Hq heads, writing fp32
partial dK/dV per query head, and sum each group afterwards. A second kernel owns a query tile and head
and accumulates dQ over the forward schedule. ``delta`` comes from one small pass over O and dO first
(``block_sparse.attention_delta``, shared with the sparse kernels). Running the dQ kernel on a second
CUDA stream beside the dK/dV kernel, to fill the SMs its longest programs leave idle, changed an H200
step by -1.2% to +0.4% (medians of four alternating pairs, README): not kept.

That is seven matrix products per tile pair where FlashAttention-3 does five: ``dq_config="atomic"``
(or ``"atomic-tma"``: one TMA bulk reduce-add per tile) drops the dQ kernel and has the dK/dV kernel add
each tile's ``dS K`` into an fp32 dQ with atomics. On an H200 it ran 3% faster to 5% slower than the
two kernels, depending on the case (README): the larger kernel runs out of registers, which costs
what the two products save. Launch order matters too: tiles go in DFS order, head by head, so that
neighbouring programs share K/V rows in L2; launching the heaviest tiles first was 5-17% slower.

Loading tiles: pointers or TMA
------------------------------
Each step of an inner loop reads a ``[BLOCK, HEAD_DIM]`` tile of one head's rows (K and V in the forward
and dQ kernels, Q and dO in the dK/dV kernel). By default a kernel builds the tile's grid of pointers and
loads it (masked on partial tiles, which may hang over ``T``); Triton pipelines these loads as ``cp.async``
copies. A launch config whose 5th field is ``True`` selects the Hopper path (sm_90+, the constexpr
``USE_TMA`` of the same kernels): each program makes one TMA tensor descriptor per streamed tensor on the
device, ``tl.make_tensor_descriptor`` over that head's ``[T, HEAD_DIM]`` rows, and loads tiles with
``desc.load([row, 0])``. The copy engine moves the whole tile to shared memory with no per-thread address
arithmetic, and fills rows ``>= T`` with zeros, so no load needs a mask; the score mask still hides those
keys. The tiles a program loads only once (its own Q, dO or K, V rows) stay pointer loads. Descriptors
live in a small global scratch buffer that Triton requests from the allocator of ``triton.set_allocator``.
Timed on an H200 (``bench tree-tune``, every tile shape both ways, research cases; that run's JSON did
not come back from the machine, the figures are from its printed table, README): TMA makes the forward
1-3% faster and the backward kernels -1% to +2%, so the head-dim-128 forward default uses it and the
backward defaults keep pointer loads. (``tl.range(...,
warp_specialize=True)`` is not used: in Triton 3.6 on sm_90 it leaves these loops unchanged at 8 warps
and fails to compile them at 4.)

Precision: fp16 / bf16 inputs use tensor-core dots with fp32 accumulation; fp32 inputs use IEEE fp32
dots. Under ``TRITON_INTERPRET=1`` (CPU) everything runs through numpy: use fp32 / fp16 there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .block_sparse import attention_delta
from .limits import check_attention_inputs

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------- schedule
def tile_schedule(subtree_end: torch.Tensor, block_m: int, block_n: int) -> dict:
    """Which key tiles each query tile visits (and the transpose), as CSR arrays on the pack's device.

    Returns ``fwd_ptr [nQ, 3]`` (start, end of full tiles, end of all tiles) with ``fwd_idx`` the key
    tile ids, and ``bwd_ptr [nK, 3]`` / ``bwd_idx`` listing query tiles per key tile, plus counts.
    Memory is one bool per (query tile, key tile) pair while building.
    """
    dev = subtree_end.device
    T = subtree_end.numel()
    nq, nk = triton.cdiv(T, block_m), triton.cdiv(T, block_n)
    se = subtree_end.to(torch.int64)
    pad = nk * block_n - T
    tiles = torch.nn.functional.pad(se, (0, pad), value=0).view(nk, block_n)
    max_se = tiles.amax(1)
    min_se = torch.nn.functional.pad(se, (0, pad), value=T + 1).view(nk, block_n).amin(1)
    k_start = torch.arange(nk, device=dev) * block_n
    k_end = (k_start + block_n).clamp(max=T)
    q0 = torch.arange(nq, device=dev) * block_m
    q1 = (q0 + block_m).clamp(max=T)
    # a key tile is seen if it holds a key inside [q0, q1) or a key < q0 whose subtree reaches q0
    visible = (k_start[None, :] < q1[:, None]) & (
        (k_end[None, :] > q0[:, None]) | (max_se[None, :] > q0[:, None])
    )
    whole_k = k_end - k_start == block_n
    whole_q = q1 - q0 == block_m
    full = (
        visible
        & whole_q[:, None]
        & whole_k[None, :]
        & (k_end[None, :] - 1 <= q0[:, None])
        & (min_se[None, :] >= q1[:, None])
    )
    partial = visible & ~full
    fwd_ptr, fwd_idx = _csr(full, partial)
    bwd_ptr, bwd_idx = _csr(full.T, partial.T)
    return {
        "block_m": block_m,
        "block_n": block_n,
        "fwd_ptr": fwd_ptr,
        "fwd_idx": fwd_idx,
        "bwd_ptr": bwd_ptr,
        "bwd_idx": bwd_idx,
        "full_tiles": int(full.sum()),
        "partial_tiles": int(partial.sum()),
        "total_tiles": nq * nk,
    }


def _csr(full: torch.Tensor, partial: torch.Tensor):
    """Rows of column ids, each row's full columns first; ``ptr[r] = (start, full_end, end)``."""
    n_full, n_part = full.sum(1), partial.sum(1)
    rows_f, cols_f = full.nonzero(as_tuple=True)
    rows_p, cols_p = partial.nonzero(as_tuple=True)
    rows = torch.cat([rows_f, rows_p])
    cols = torch.cat([cols_f, cols_p])
    order = torch.sort(rows, stable=True).indices  # stable: full entries stay ahead in each row
    start = torch.cumsum(n_full + n_part, 0) - (n_full + n_part)
    ptr = torch.stack([start, start + n_full, start + n_full + n_part], dim=1)
    return ptr.to(torch.int32).contiguous(), cols[order].to(torch.int32).contiguous()


# --------------------------------------------------------------------------------------- tile loads
@triton.jit
def _rows_of(X, T, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """Where one head's ``[T, HEAD_DIM]`` rows are read from: the pointer ``X`` itself, or (``USE_TMA``) a
    TMA descriptor over them that loads ``[BLOCK, HEAD_DIM]`` tiles, zero-filling rows ``>= T``."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(X, shape=[T, HEAD_DIM], strides=[stride_t, 1],
                                        block_shape=[BLOCK, HEAD_DIM])
    else:
        src = X
    return src


@triton.jit
def _load_rows(src, row0, T, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr,
               MASKED: tl.constexpr):
    """Rows ``row0 .. row0 + BLOCK`` of one head (from :func:`_rows_of`), zero beyond ``T``.

    Pointer loads check ``rows < T`` only when ``MASKED`` (a tile that may hang over the end); a TMA load
    never needs the check: the copy engine fills out-of-range rows with zeros.
    """
    if USE_TMA:
        tile = src.load([row0, 0])
    else:
        offs = row0 + tl.arange(0, BLOCK)
        ptrs = src + offs.to(tl.int64)[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
        tile = tl.load(ptrs, mask=(offs < T)[:, None], other=0.0) if MASKED else tl.load(ptrs)
    return tile


# --------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_tile(
    acc, m_i, l_i, q, k_src, v_src, SE, j, offs_m, T, stride_kt, stride_vt, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_rows(k_src, j * BLOCK_N, T, stride_kt, BLOCK_N, HEAD_DIM, USE_TMA, MASKED)
    v = _load_rows(v_src, j * BLOCK_N, T, stride_vt, BLOCK_N, HEAD_DIM, USE_TMA, MASKED)
    if MASKED:  # keys >= T load as zeros: the mask (se = 0 there) must still hide them
        se = tl.load(SE + offs_n, mask=offs_n < T, other=0)
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < se[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _tree_attn_fwd(
    Q, K, V, O, LSE, SE, PTR, IDX,
    T, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m.to(tl.int64)
    in_range = offs_m < T
    q = _load_rows(Q + head * stride_qh, tile * BLOCK_M, T, stride_qt, BLOCK_M, HEAD_DIM, False, True)
    k_src = _rows_of(K + kv_head * stride_kh, T, stride_kt, BLOCK_N, HEAD_DIM, USE_TMA)
    v_src = _rows_of(V + kv_head * stride_vh, T, stride_vt, BLOCK_N, HEAD_DIM, USE_TMA)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start = tl.load(PTR + tile * 3)
    full_end = tl.load(PTR + tile * 3 + 1)
    end = tl.load(PTR + tile * 3 + 2)
    for it in range(start, full_end):  # whole tiles every query sees: no mask
        j = tl.load(IDX + it)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_src, v_src, SE, j, offs_m, T, stride_kt, stride_vt,
                                  qk_scale, BLOCK_N, HEAD_DIM, False, DOT_PRECISION, USE_TMA)
    for it in range(full_end, end):  # diagonal and branch-boundary tiles: element mask
        j = tl.load(IDX + it)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_src, v_src, SE, j, offs_m, T, stride_kt, stride_vt,
                                  qk_scale, BLOCK_N, HEAD_DIM, True, DOT_PRECISION, USE_TMA)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + head * stride_oh + rows[:, None] * stride_ot + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=in_range[:, None])
    tl.store(LSE + head * T + offs_m, m_i + tl.log2(l_safe), mask=in_range)


# --------------------------------------------------------------------------------------- backward
@triton.jit
def _bwd_dkdv_tile(
    dk, dv, k, v, q_src, do_src, LSE, DELTA, SE, dq_dst, i, offs_n, T, stride_qt, stride_dot, stride_dqt,
    qk_scale, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
):
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(q_src, i * BLOCK_M, T, stride_qt, BLOCK_M, HEAD_DIM, USE_TMA, MASKED)
    do = _load_rows(do_src, i * BLOCK_M, T, stride_dot, BLOCK_M, HEAD_DIM, USE_TMA, MASKED)
    if MASKED:
        in_range = offs_m < T
        lse = tl.load(LSE + offs_m, mask=in_range, other=0.0)
        delta = tl.load(DELTA + offs_m, mask=in_range, other=0.0)
    else:
        lse = tl.load(LSE + offs_m)
        delta = tl.load(DELTA + offs_m)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
    p_t = tl.exp2(s_t - lse[None, :])
    if MASKED:
        se = tl.load(SE + offs_n, mask=offs_n < T, other=0)
        visible = (offs_n[:, None] <= offs_m[None, :]) & (offs_m[None, :] < se[:, None])
        p_t = tl.where(visible, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    if ATOMIC_DQ:  # this tile's share of dQ = dS K, added into the fp32 dQ of its rows
        dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION)  # [BLOCK_M, HEAD_DIM]
        if DQ_TMA:  # one bulk reduce-add by the copy engine; rows >= T are dropped
            dq_dst.atomic_add([i * BLOCK_M, 0], dq)
        else:
            ptrs = dq_dst + offs_m.to(tl.int64)[:, None] * stride_dqt + tl.arange(0, HEAD_DIM)[None, :]
            if MASKED:
                tl.atomic_add(ptrs, dq, mask=(offs_m < T)[:, None], sem="relaxed")
            else:
                tl.atomic_add(ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _tree_attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, SE, PTR, IDX,
    T, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, DQ, stride_dqt, stride_dqh,
    qk_scale, scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_n.to(tl.int64)
    in_range = offs_n < T
    k = _load_rows(K + kv_head * stride_kh, tile * BLOCK_N, T, stride_kt, BLOCK_N, HEAD_DIM, False, True)
    v = _load_rows(V + kv_head * stride_vh, tile * BLOCK_N, T, stride_vt, BLOCK_N, HEAD_DIM, False, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    start = tl.load(PTR + tile * 3)
    full_end = tl.load(PTR + tile * 3 + 1)
    end = tl.load(PTR + tile * 3 + 2)
    for g in range(GROUP):  # the query heads that share this kv head
        head = kv_head * GROUP + g
        q_src = _rows_of(Q + head * stride_qh, T, stride_qt, BLOCK_M, HEAD_DIM, USE_TMA)
        do_src = _rows_of(DO + head * stride_doh, T, stride_dot, BLOCK_M, HEAD_DIM, USE_TMA)
        LSEh = LSE + head * T
        DELTAh = DELTA + head * T
        dq_dst = DQ + head * stride_dqh
        if DQ_TMA:
            dq_dst = tl.make_tensor_descriptor(dq_dst, shape=[T, HEAD_DIM], strides=[stride_dqt, 1],
                                               block_shape=[BLOCK_M, HEAD_DIM])
        for it in range(start, full_end):
            i = tl.load(IDX + it)
            dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_src, do_src, LSEh, DELTAh, SE, dq_dst, i, offs_n, T,
                                    stride_qt, stride_dot, stride_dqt, qk_scale, BLOCK_M, HEAD_DIM, False,
                                    DOT_PRECISION, USE_TMA, ATOMIC_DQ, DQ_TMA)
        for it in range(full_end, end):
            i = tl.load(IDX + it)
            dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_src, do_src, LSEh, DELTAh, SE, dq_dst, i, offs_n, T,
                                    stride_qt, stride_dot, stride_dqt, qk_scale, BLOCK_M, HEAD_DIM, True,
                                    DOT_PRECISION, USE_TMA, ATOMIC_DQ, DQ_TMA)
    tl.store(DK + kv_head * stride_dkh + rows[:, None] * stride_dkt + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=in_range[:, None])
    tl.store(DV + kv_head * stride_dvh + rows[:, None] * stride_dvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=in_range[:, None])


@triton.jit
def _bwd_dq_tile(
    dq, q, do, lse, delta, k_src, v_src, SE, j, offs_m, T, stride_kt, stride_vt, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_rows(k_src, j * BLOCK_N, T, stride_kt, BLOCK_N, HEAD_DIM, USE_TMA, MASKED)
    v = _load_rows(v_src, j * BLOCK_N, T, stride_vt, BLOCK_N, HEAD_DIM, USE_TMA, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        se = tl.load(SE + offs_n, mask=offs_n < T, other=0)
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < se[None, :])
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _tree_attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, SE, PTR, IDX,
    T, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    qk_scale, scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m.to(tl.int64)
    in_range = offs_m < T
    q = _load_rows(Q + head * stride_qh, tile * BLOCK_M, T, stride_qt, BLOCK_M, HEAD_DIM, False, True)
    do = _load_rows(DO + head * stride_doh, tile * BLOCK_M, T, stride_dot, BLOCK_M, HEAD_DIM, False, True)
    lse = tl.load(LSE + head * T + offs_m, mask=in_range, other=0.0)
    delta = tl.load(DELTA + head * T + offs_m, mask=in_range, other=0.0)
    k_src = _rows_of(K + kv_head * stride_kh, T, stride_kt, BLOCK_N, HEAD_DIM, USE_TMA)
    v_src = _rows_of(V + kv_head * stride_vh, T, stride_vt, BLOCK_N, HEAD_DIM, USE_TMA)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start = tl.load(PTR + tile * 3)
    full_end = tl.load(PTR + tile * 3 + 1)
    end = tl.load(PTR + tile * 3 + 2)
    for it in range(start, full_end):
        j = tl.load(IDX + it)
        dq = _bwd_dq_tile(dq, q, do, lse, delta, k_src, v_src, SE, j, offs_m, T, stride_kt, stride_vt,
                          qk_scale, BLOCK_N, HEAD_DIM, False, DOT_PRECISION, USE_TMA)
    for it in range(full_end, end):
        j = tl.load(IDX + it)
        dq = _bwd_dq_tile(dq, q, do, lse, delta, k_src, v_src, SE, j, offs_m, T, stride_kt, stride_vt,
                          qk_scale, BLOCK_N, HEAD_DIM, True, DOT_PRECISION, USE_TMA)
    tl.store(DQ + head * stride_dqh + rows[:, None] * stride_dqt + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=in_range[:, None])


# --------------------------------------------------------------------------------------- launchers
# Launch settings per kernel: (BLOCK_M, BLOCK_N, num_warps, num_stages[, tma]), chosen with
# `python -m treeattn_lab bench tree-tune` on an H200 (bench/results/); the interpreter ignores warps and
# stages. The optional 5th field (default False) asks for TMA tile loads (see :func:`tma_usable`).
CONFIGS = {  # head_dim -> {"fwd" | "dkdv" | "dq": config}
    64: {"fwd": (128, 128, 8, 3), "dkdv": (128, 128, 8, 2), "dq": (128, 128, 8, 2)},
    128: {"fwd": (128, 128, 8, 3, True), "dkdv": (128, 128, 8, 2), "dq": (128, 128, 8, 2)},
}
_SMALL_HEAD_CONFIG = {"fwd": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2), "dq": (64, 64, 4, 2)}
# dQ without its own kernel: the dK/dV kernel adds each tile's dS K into an fp32 dQ with atomics (pointer
# ``red.add`` per element, or on a CUDA sm_90+ GPU one TMA bulk reduce-add per tile), which saves
# recomputing S and dP (5 matrix products per tile pair instead of 7) at the cost of fp32 traffic to L2.
ATOMIC_DQ_MODES = ("atomic", "atomic-tma")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q, k, v):
    check_attention_inputs(q)


def parse_config(config, kernel: str) -> tuple[int, int, int, int, bool] | str:
    """A launch ``(BLOCK_M, BLOCK_N, num_warps, num_stages[, tma])`` checked, ``tma`` filled in (False);
    for the dQ kernel also one of :data:`ATOMIC_DQ_MODES`, returned as is."""
    if kernel == "dq" and isinstance(config, str):
        if config not in ATOMIC_DQ_MODES:
            raise ValueError(f"dq_config as a string must be one of {ATOMIC_DQ_MODES}, got {config!r}")
        return config
    if not isinstance(config, (tuple, list)) or len(config) not in (4, 5):
        raise ValueError(f"{kernel}_config must be (BLOCK_M, BLOCK_N, num_warps, num_stages[, tma])"
                         f"{' or one of ' + str(ATOMIC_DQ_MODES) if kernel == 'dq' else ''}, got {config!r}")
    block_m, block_n, warps, stages, *rest = config
    for name, size in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if not isinstance(size, int) or size < 16 or size & (size - 1):
            raise ValueError(f"{kernel}_config {name} must be a power of two >= 16, got {size!r}")
    tma = rest[0] if rest else False
    if not isinstance(tma, bool):
        raise TypeError(f"{kernel}_config's 5th field (tma) must be a bool, got {tma!r}")
    return block_m, block_n, warps, stages, tma


def tma_usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can read these ``[T, H, D]`` tensors through TMA tensor descriptors.

    Needs an sm_90+ GPU (Hopper's copy engine; Triton's CPU interpreter emulates descriptors, so there it
    runs too) and what a descriptor over one head's rows requires: 16-byte aligned base address, row
    stride and head stride, and rows that do not overlap (a row stride of at least ``D``: an input
    broadcast with ``expand`` has stride 0). A launch that asks for TMA where this is False runs the pointer
    loads (same results).
    """
    if not hasattr(tl, "make_tensor_descriptor"):  # Triton < 3.4
        return False
    device = tensors[0].device
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return all(x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0
               and (x.stride(1) * x.element_size()) % 16 == 0 and x.stride(0) >= x.shape[-1] for x in tensors)


def _tma_scratch(size: int, alignment: int, stream, _empty=torch.empty):
    # ``torch.empty`` bound at import: tests that fill every ``torch.empty`` with NaN must not reach this
    # int8 scratch (the kernel writes its descriptors there before reading them)
    return _empty(size, device="cuda", dtype=torch.int8)


def _ensure_scratch_allocator() -> None:
    """Descriptors made on the device (``tl.make_tensor_descriptor``) live in a global scratch buffer that
    Triton requests at launch from the allocator of ``triton.set_allocator``: install a torch one unless the
    caller installed their own. The setting is per thread (a ContextVar) and autograd runs the backward
    on a thread of its own, so this runs before every TMA launch."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)


def _forward(q, k, v, subtree_end, sched, launch, scale):
    T, hq, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((hq, T), device=q.device, dtype=torch.float32)
    _tree_attn_fwd[(triton.cdiv(T, sched["block_m"]), hq)](
        q, k, v, o, lse, subtree_end, sched["fwd_ptr"], sched["fwd_idx"],
        T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), scale * LOG2E,
        **_launch(sched, launch, q.dtype, hq // k.shape[1], d, (k, v)),
    )
    return o, lse


def _launch(sched, launch, dtype, group, head_dim, tiled):
    """Constexprs and launch options of one kernel; ``tiled``: the tensors its inner loop streams."""
    warps, stages, tma = launch
    use_tma = tma and tma_usable(*tiled)
    if use_tma and tiled[0].device.type == "cuda":
        _ensure_scratch_allocator()
    return dict(GROUP=group, BLOCK_M=sched["block_m"], BLOCK_N=sched["block_n"], HEAD_DIM=head_dim,
                DOT_PRECISION=_dot_precision(dtype), USE_TMA=use_tma, num_warps=warps, num_stages=stages)


def should_split_groups(T: int, hq: int, hkv: int, block_n: int, device: torch.device) -> bool:
    """Split GQA groups in the dK/dV kernel when one program per (key tile, kv head) is under 4 waves."""
    if hq == hkv:
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return triton.cdiv(T, block_n) * hkv < 4 * sms


def dq_reduce_by_tma(mode, dq: torch.Tensor) -> bool:
    """Whether atomic dQ (``mode`` from :data:`ATOMIC_DQ_MODES`) adds its tiles with TMA bulk reduce-adds:
    ``"atomic-tma"`` on a CUDA sm_90+ GPU with an aligned fp32 ``dq``. Triton's CPU interpreter has no
    descriptor reduce-add, so there, as on older GPUs, ``"atomic-tma"`` runs the pointer atomics."""
    return mode == "atomic-tma" and dq.device.type == "cuda" and tma_usable(dq)


def _backward(do, q, k, v, o, lse, subtree_end, dkdv_sched, dkdv_launch, dq_sched, dq_launch, scale,
              split_groups):
    T, hq, d = q.shape
    hkv = k.shape[1]
    do = do.contiguous()
    delta = attention_delta(o, do)  # [Hq, T] fp32, one Triton pass
    atomic_dq = isinstance(dq_launch, str)
    if atomic_dq:  # accumulated by the dK/dV kernel; zeros first, scaled and cast at the end
        dq = torch.zeros((T, hq, d), device=q.device, dtype=torch.float32)
        dq_tma = dq_reduce_by_tma(dq_launch, dq)
        if dq_tma:
            _ensure_scratch_allocator()
    else:
        dq, dq_tma = torch.empty_like(q), False
    if split_groups is None:
        split_groups = should_split_groups(T, hq, hkv, dkdv_sched["block_n"], q.device)
    if split_groups and hq != hkv:  # per query head over repeated K/V, fp32 partials summed per group
        kk, vv = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
        dk, dv = (torch.empty((T, hq, d), device=q.device, dtype=torch.float32) for _ in range(2))
    else:
        kk, vv = k, v
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    _tree_attn_bwd_dkdv[(triton.cdiv(T, dkdv_sched["block_n"]), kk.shape[1])](
        q, kk, vv, do, lse, delta, dk, dv, subtree_end, dkdv_sched["bwd_ptr"], dkdv_sched["bwd_idx"],
        T, q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        dq, dq.stride(0), dq.stride(1), scale * LOG2E, scale,
        **_launch(dkdv_sched, dkdv_launch, q.dtype, hq // kk.shape[1], d, (q, do)), ATOMIC_DQ=atomic_dq,
        DQ_TMA=dq_tma,
    )
    if kk is not k:
        dk, dv = (x.view(T, hkv, hq // hkv, d).sum(2).to(k.dtype) for x in (dk, dv))
    if atomic_dq:
        return dq.mul_(scale).to(q.dtype), dk, dv
    _tree_attn_bwd_dq[(triton.cdiv(T, dq_sched["block_m"]), hq)](
        q, k, v, do, lse, delta, dq, subtree_end, dq_sched["fwd_ptr"], dq_sched["fwd_idx"],
        T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
        scale * LOG2E, scale, **_launch(dq_sched, dq_launch, q.dtype, hq // hkv, d, (k, v)),
    )
    return dq, dk, dv


class TreeAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: forward saves (q, k, v, o, lse); backward recomputes probabilities from lse."""

    @staticmethod
    def forward(ctx, q, k, v, subtree_end, scale, fwd_plan, dkdv_plan, dq_plan, split_groups):
        o, lse = _forward(q, k, v, subtree_end, *fwd_plan, scale)
        ctx.save_for_backward(q, k, v, o, lse, subtree_end)
        ctx.scale, ctx.dkdv_plan, ctx.dq_plan, ctx.split_groups = scale, dkdv_plan, dq_plan, split_groups
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, subtree_end = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, subtree_end, *ctx.dkdv_plan, *ctx.dq_plan, ctx.scale,
                               ctx.split_groups)
        return dq, dk, dv, None, None, None, None, None, None


def schedule_for(pack, block_m: int, block_n: int) -> dict:
    """The tile schedule of ``pack`` for these tile sizes, built once and cached on the pack."""
    key = ("triton_tree_schedule", block_m, block_n, str(pack.device))
    if key not in pack._cache:
        pack._cache[key] = tile_schedule(pack.subtree_end, block_m, block_n)
    return pack._cache[key]


def triton_tree_attention(q, k, v, pack, *, scale=None, fwd_config=None, dkdv_config=None, dq_config=None,
                          return_lse=False, split_groups=None):
    """Tree attention with the Triton kernels (inputs already validated by ``treeattn_lab.ops``).

    ``fwd_config`` / ``dkdv_config`` / ``dq_config`` override a kernel's launch as
    ``(BLOCK_M, BLOCK_N, num_warps, num_stages[, tma])`` (tile sizes are powers of two >= 16; small tiles
    make small tests exercise many tiles; ``tma=True`` loads row tiles through TMA tensor descriptors where
    :func:`tma_usable` allows, else the pointer loads run). With ``return_lse`` also returns the
    natural-log log-sum-exp ``[T, Hq]``. ``split_groups`` (None: :func:`should_split_groups` decides) runs
    the dK/dV kernel per query head instead of per kv head under grouped-query attention.
    ``dq_config="atomic"`` or ``"atomic-tma"`` has the dK/dV kernel add dQ with fp32 atomics instead of
    running the dQ kernel (:data:`ATOMIC_DQ_MODES`); the order of those additions varies from run to run,
    so that dQ is not bitwise deterministic (the dQ kernel's is).
    """
    _check(q, k, v)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # fp32 tiles are twice the bytes: the half-precision configs overflow shared memory at head dim 128
    defaults = _SMALL_HEAD_CONFIG if q.dtype == torch.float32 else CONFIGS.get(d, _SMALL_HEAD_CONFIG)

    def plan(config, kernel):
        launch = parse_config(config or defaults[kernel], kernel)
        if isinstance(launch, str):  # dQ accumulated by the dK/dV kernel: no schedule of its own
            return None, launch
        bm, bn, warps, stages, tma = launch
        return schedule_for(pack, bm, bn), (warps, stages, tma)

    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o, lse2 = TreeAttentionFunction.apply(
        q, k, v, pack.subtree_end.contiguous(), scale,
        plan(fwd_config, "fwd"), plan(dkdv_config, "dkdv"), plan(dq_config, "dq"), split_groups,
    )
    if return_lse:
        return o, lse2.transpose(0, 1) / LOG2E
    return o
