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
The online softmax of ``attention_core``: per row the running maximum, sum and fp32 accumulator over the
tile's key tiles in schedule order (full tiles, then partial ones), then ``out = acc / l`` and the base-2
log-sum-exp ``lse = m + log2(l)``, saved for the backward pass: it recomputes any probability as
``p = exp2(s - lse)``.

Backward (FlashAttention-2, two kernels, no atomics)
----------------------------------------------------
``delta = rowsum(dO * O)`` comes first (``attention_core.attention_delta``, one small Triton pass). One
kernel owns a key tile and a kv head and loops over the query tiles that see it and over the G query heads
sharing that kv head (grouped-query attention), so dK and dV need no atomics. With few kv heads that grid
is too small to fill the GPU (2 kv heads x 250 key tiles on 132 SMs), so the backward may instead *split
the groups* (:func:`should_split_groups`): run the kernel per query head over K/V repeated to Hq heads,
writing fp32 partial dK/dV per query head, and sum each group afterwards. A second kernel owns a query
tile and head and accumulates dQ over the forward schedule, recomputing the scores and ``dP`` the first
one had: seven matrix products per tile pair. Tiles go in DFS order, head by head, so neighbouring
programs share K/V rows in L2.

Loading tiles: pointers or TMA
------------------------------
Each step of an inner loop reads a ``[BLOCK, HEAD_DIM]`` tile of one head's rows (K and V in the forward
and dQ kernels, Q and dO in the dK/dV kernel). By default a kernel builds the tile's grid of pointers and
loads it (masked on partial tiles, which may hang over ``T``); Triton pipelines these loads as ``cp.async``
copies. A launch config with ``tma=True`` selects the Hopper path (the constexpr ``USE_TMA`` of the same
kernels), taken when :func:`~.attention_core.tma_usable` holds: an sm_90+ GPU (or the interpreter, which
emulates it) and 16-byte aligned, non-overlapping rows; otherwise the pointer loads run. Each program then
makes one TMA tensor descriptor per streamed tensor on the device, ``tl.make_tensor_descriptor`` over that
head's ``[T, HEAD_DIM]`` rows, and loads tiles with ``desc.load([row, 0])``. The copy engine moves the whole
tile to shared memory with no per-thread address arithmetic, and fills rows ``>= T`` with zeros, so no load
needs a mask; the score mask still hides those keys. The tiles a program loads only once (its own Q, dO or
K, V rows) stay pointer loads. Descriptors live in a small global scratch buffer that Triton requests from
the allocator of ``triton.set_allocator``. The tuned defaults (``kernels/tuning.py``) use TMA for the
head-dim-128 forward only.

Ops that torch.compile traces
-----------------------------
The kernels run as ``torch.library`` custom ops in the ``treeattn_lab`` namespace:
``tree_attention_fwd`` (out, base-2 lse), ``tree_attention_bwd`` (dq, dk, dv; the forward's registered
autograd calls it, so a compiled backward traces too) and ``tree_schedule`` (the CSR tensors of
:func:`tile_schedule`). Each has a fake implementation that gives its output shapes without running it;
the schedule's index length is data-dependent, so its fake returns a fresh dynamic size. Eagerly the
schedule is cached on the pack (:func:`schedule_for`); inside a compiled graph a cached schedule is read
and a missing one is built by the op on every call.

Precision: fp16 / bf16 inputs use tensor-core dots with fp32 accumulation; fp32 inputs use IEEE fp32
dots. Under ``TRITON_INTERPRET=1`` (CPU) everything runs through numpy: use fp32 / fp16 there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_core as core
from .tuning import TREE, TREE_FALLBACK, LaunchConfig, launch_config


# --------------------------------------------------------------------------------------- schedule
def _tile_classes(subtree_end: torch.Tensor, block_m: int, block_n: int):
    """``(full, partial)`` bool ``[query tiles, key tiles]``: the tile pairs that run unmasked and those
    that run with the element mask (every other pair is invisible). One bool per tile pair."""
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
    return full, visible & ~full


def tile_schedule(subtree_end: torch.Tensor, block_m: int, block_n: int) -> dict:
    """Which key tiles each query tile visits (and the transpose), as CSR arrays on the pack's device.

    Returns ``fwd_ptr [nQ, 3]`` (start, end of full tiles, end of all tiles) with ``fwd_idx`` the key
    tile ids, and ``bwd_ptr [nK, 3]`` / ``bwd_idx`` listing query tiles per key tile, plus counts.
    Memory is one bool per (query tile, key tile) pair while building.
    """
    full, partial = _tile_classes(subtree_end, block_m, block_n)
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
        "total_tiles": full.numel(),
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


# --------------------------------------------------------------------------------------- the rule
@triton.jit
def _visible(q_pos, k_pos, SE, T):
    """``[queries, keys]``: key ``k`` is visible from query ``q`` when ``k <= q < subtree_end[k]`` (keys
    ``>= T`` read ``subtree_end = 0``: never visible)."""
    se = tl.load(SE + k_pos, mask=k_pos < T, other=0)
    return (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] < se[None, :])


@triton.jit
def _visible_t(k_pos, q_pos, SE, T):
    """The same rule transposed, ``[keys, queries]``."""
    se = tl.load(SE + k_pos, mask=k_pos < T, other=0)
    return (k_pos[:, None] <= q_pos[None, :]) & (q_pos[None, :] < se[:, None])


@triton.jit
def _schedule_row(PTR, row):
    """``(start, full_end, end)`` of one row of a CSR schedule: full tiles first, then partial ones."""
    return tl.load(PTR + row * 3), tl.load(PTR + row * 3 + 1), tl.load(PTR + row * 3 + 2)


# --------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_tile(
    acc, m_i, l_i, q, k_src, v_src, SE, j, offs_m, T, stride_kt, stride_vt, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    k = core.load_rows(k_src, j * BLOCK_N, T, stride_kt, BLOCK_N, HEAD_DIM, USE_TMA, MASKED)
    v = core.load_rows(v_src, j * BLOCK_N, T, stride_vt, BLOCK_N, HEAD_DIM, USE_TMA, MASKED)
    if MASKED:  # keys >= T load as zeros: the mask must still hide them
        visible = _visible(offs_m, offs_n, SE, T)
    s = core.scores(q, k, qk_scale, DOT_PRECISION)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    return core.softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)


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
    q = core.load_rows(Q + head * stride_qh, tile * BLOCK_M, T, stride_qt, BLOCK_M, HEAD_DIM, False, True)
    k_src = core.row_source(K + kv_head * stride_kh, T, stride_kt, BLOCK_N, HEAD_DIM, USE_TMA)
    v_src = core.row_source(V + kv_head * stride_vh, T, stride_vt, BLOCK_N, HEAD_DIM, USE_TMA)
    m_i, l_i, acc = core.softmax_start(BLOCK_M, HEAD_DIM)
    start, full_end, end = _schedule_row(PTR, tile)
    for it in range(start, full_end):  # whole tiles every query sees: no mask
        j = tl.load(IDX + it)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_src, v_src, SE, j, offs_m, T, stride_kt, stride_vt,
                                  qk_scale, BLOCK_N, HEAD_DIM, False, DOT_PRECISION, USE_TMA)
    for it in range(full_end, end):  # diagonal and branch-boundary tiles: element mask
        j = tl.load(IDX + it)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_src, v_src, SE, j, offs_m, T, stride_kt, stride_vt,
                                  qk_scale, BLOCK_N, HEAD_DIM, True, DOT_PRECISION, USE_TMA)
    out = core.softmax_output(acc, l_i)
    tl.store(O + head * stride_oh + rows[:, None] * stride_ot + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=in_range[:, None])
    tl.store(LSE + head * T + offs_m, core.softmax_lse(m_i, l_i), mask=in_range)


# --------------------------------------------------------------------------------------- backward
@triton.jit
def _bwd_dkdv_tile(
    dk, dv, k, v, q_src, do_src, LSE, DELTA, SE, i, offs_n, T, stride_qt, stride_dot, qk_scale,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
    q = core.load_rows(q_src, i * BLOCK_M, T, stride_qt, BLOCK_M, HEAD_DIM, USE_TMA, MASKED)
    do = core.load_rows(do_src, i * BLOCK_M, T, stride_dot, BLOCK_M, HEAD_DIM, USE_TMA, MASKED)
    lse, delta = core.row_stats(LSE, DELTA, offs_m, T, MASKED)
    p_t = core.probabilities_t(k, q, lse, qk_scale, DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    if MASKED:
        p_t = tl.where(_visible_t(offs_n, offs_m, SE, T), p_t, 0.0)
    return core.dkdv_step(dk, dv, p_t, q, do, v, delta, DOT_PRECISION)


@triton.jit
def _tree_attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, SE, PTR, IDX,
    T, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    qk_scale, scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_n.to(tl.int64)
    in_range = offs_n < T
    k = core.load_rows(K + kv_head * stride_kh, tile * BLOCK_N, T, stride_kt, BLOCK_N, HEAD_DIM, False, True)
    v = core.load_rows(V + kv_head * stride_vh, tile * BLOCK_N, T, stride_vt, BLOCK_N, HEAD_DIM, False, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    start, full_end, end = _schedule_row(PTR, tile)
    for g in range(GROUP):  # the query heads that share this kv head
        head = kv_head * GROUP + g
        q_src = core.row_source(Q + head * stride_qh, T, stride_qt, BLOCK_M, HEAD_DIM, USE_TMA)
        do_src = core.row_source(DO + head * stride_doh, T, stride_dot, BLOCK_M, HEAD_DIM, USE_TMA)
        LSEh = LSE + head * T
        DELTAh = DELTA + head * T
        for it in range(start, full_end):
            i = tl.load(IDX + it)
            dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_src, do_src, LSEh, DELTAh, SE, i, offs_n, T, stride_qt,
                                    stride_dot, qk_scale, BLOCK_M, HEAD_DIM, False, DOT_PRECISION, USE_TMA)
        for it in range(full_end, end):
            i = tl.load(IDX + it)
            dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_src, do_src, LSEh, DELTAh, SE, i, offs_n, T, stride_qt,
                                    stride_dot, qk_scale, BLOCK_M, HEAD_DIM, True, DOT_PRECISION, USE_TMA)
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
    k = core.load_rows(k_src, j * BLOCK_N, T, stride_kt, BLOCK_N, HEAD_DIM, USE_TMA, MASKED)
    v = core.load_rows(v_src, j * BLOCK_N, T, stride_vt, BLOCK_N, HEAD_DIM, USE_TMA, MASKED)
    p = core.probabilities(q, k, lse, qk_scale, DOT_PRECISION)
    if MASKED:
        p = tl.where(_visible(offs_m, offs_n, SE, T), p, 0.0)
    return core.dq_step(dq, p, do, v, k, delta, DOT_PRECISION)


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
    q = core.load_rows(Q + head * stride_qh, tile * BLOCK_M, T, stride_qt, BLOCK_M, HEAD_DIM, False, True)
    do = core.load_rows(DO + head * stride_doh, tile * BLOCK_M, T, stride_dot, BLOCK_M, HEAD_DIM, False, True)
    lse = tl.load(LSE + head * T + offs_m, mask=in_range, other=0.0)
    delta = tl.load(DELTA + head * T + offs_m, mask=in_range, other=0.0)
    k_src = core.row_source(K + kv_head * stride_kh, T, stride_kt, BLOCK_N, HEAD_DIM, USE_TMA)
    v_src = core.row_source(V + kv_head * stride_vh, T, stride_vt, BLOCK_N, HEAD_DIM, USE_TMA)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    start, full_end, end = _schedule_row(PTR, tile)
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
def _forward(q, k, v, subtree_end, ptr, idx, launch, scale):
    T, hq, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((hq, T), device=q.device, dtype=torch.float32)
    _tree_attn_fwd[(triton.cdiv(T, launch.block_m), hq)](
        q, k, v, o, lse, subtree_end, ptr, idx,
        T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), scale * core.LOG2E,
        **_launch(launch, q.dtype, hq // k.shape[1], d, (k, v)),
    )
    return o, lse


def _launch(launch: LaunchConfig, dtype, group, head_dim, tiled):
    """Constexprs and launch options of one kernel; ``tiled``: the tensors its inner loop streams."""
    use_tma = launch.tma and core.tma_usable(*tiled)
    if use_tma and tiled[0].device.type == "cuda":
        core.ensure_scratch_allocator()
    return dict(GROUP=group, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, HEAD_DIM=head_dim,
                DOT_PRECISION=core.dot_precision(dtype), USE_TMA=use_tma, num_warps=launch.num_warps,
                num_stages=launch.num_stages)


def should_split_groups(T: int, hq: int, hkv: int, block_n: int, device: torch.device) -> bool:
    """Split GQA groups in the dK/dV kernel when one program per (key tile, kv head) is under 4 waves."""
    if hq == hkv:
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return triton.cdiv(T, block_n) * hkv < 4 * sms


def _backward(do, q, k, v, o, lse, subtree_end, schedule, dkdv_launch, dq_launch, scale, split_groups):
    """``(dq, dk, dv)``; ``schedule``: the six CSR tensors of :func:`tree_attention_fwd`."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    dkdv_ptr, dkdv_idx, dq_ptr, dq_idx = schedule[2:]
    do = do.contiguous()
    delta = core.attention_delta(o, do)  # [Hq, T] fp32, one Triton pass
    dq = torch.empty_like(q)
    if split_groups is None:
        split_groups = should_split_groups(T, hq, hkv, dkdv_launch.block_n, q.device)
    if split_groups and hq != hkv:  # per query head over repeated K/V, fp32 partials summed per group
        kk, vv = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
        dk, dv = (torch.empty((T, hq, d), device=q.device, dtype=torch.float32) for _ in range(2))
    else:
        kk, vv = k, v
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    _tree_attn_bwd_dkdv[(triton.cdiv(T, dkdv_launch.block_n), kk.shape[1])](
        q, kk, vv, do, lse, delta, dk, dv, subtree_end, dkdv_ptr, dkdv_idx,
        T, q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1),
        do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        scale * core.LOG2E, scale, **_launch(dkdv_launch, q.dtype, hq // kk.shape[1], d, (q, do)),
    )
    if kk is not k:
        dk, dv = (x.view(T, hkv, hq // hkv, d).sum(2).to(k.dtype) for x in (dk, dv))
    _tree_attn_bwd_dq[(triton.cdiv(T, dq_launch.block_m), hq)](
        q, k, v, do, lse, delta, dq, subtree_end, dq_ptr, dq_idx,
        T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
        scale * core.LOG2E, scale, **_launch(dq_launch, q.dtype, hq // hkv, d, (k, v)),
    )
    return dq, dk, dv


# --------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("treeattn_lab::tree_schedule", mutates_args=())
def tree_schedule_op(subtree_end: torch.Tensor, block_m: int, block_n: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fwd_ptr, fwd_idx, bwd_ptr, bwd_idx)`` of :func:`tile_schedule`, as an op: under
    ``torch.compile`` a pack whose schedule is not cached yet gets it from here, without host syncs."""
    full, partial = _tile_classes(subtree_end, block_m, block_n)
    return (*_csr(full, partial), *_csr(full.T, partial.T))


@tree_schedule_op.register_fake
def _(subtree_end, block_m, block_n):
    T = subtree_end.shape[0]
    visited = torch.library.get_ctx().new_dynamic_size()  # tiles visited: data-dependent
    fwd_ptr, bwd_ptr = (subtree_end.new_empty((triton.cdiv(T, b), 3), dtype=torch.int32)
                        for b in (block_m, block_n))
    idx = subtree_end.new_empty((visited,), dtype=torch.int32)
    return fwd_ptr, idx, bwd_ptr, torch.empty_like(idx)


@torch.library.custom_op("treeattn_lab::tree_attention_fwd", mutates_args=())
def tree_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor,
                       schedule: list[torch.Tensor], scale: float, launches: list[int],
                       split_groups: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse2 [Hq, T])`` of the forward kernel. ``schedule``: the CSR tensors of the three launches
    (forward ``fwd_ptr, fwd_idx``, dK/dV ``bwd_ptr, bwd_idx``, dQ ``fwd_ptr, fwd_idx``), ``launches`` their
    :func:`~.attention_core.launch_ints`; the backward's share rides along for its autograd."""
    return _forward(q, k, v, subtree_end, schedule[0], schedule[1], core.launches_of(launches)[0], scale)


@tree_attention_fwd.register_fake
def _(q, k, v, subtree_end, schedule, scale, launches, split_groups):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("treeattn_lab::tree_attention_bwd", mutates_args=())
def tree_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, subtree_end: torch.Tensor, schedule: list[torch.Tensor],
                       scale: float, launches: list[int], split_groups: bool | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the two backward kernels (arguments as :func:`tree_attention_fwd`'s)."""
    return _backward(do, q, k, v, o, lse, subtree_end, schedule, *core.launches_of(launches)[1:], scale,
                     split_groups)


@tree_attention_bwd.register_fake
def _(do, q, k, v, o, lse, subtree_end, schedule, scale, launches, split_groups):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


core.register_attention_autograd(tree_attention_fwd, tree_attention_bwd)


def schedule_for(pack, block_m: int, block_n: int) -> dict:
    """The tile schedule of ``pack`` for these tile sizes, built once and cached on the pack.

    Under ``torch.compile`` a cached schedule is read as it is; a missing one comes from the
    ``tree_schedule`` op (its CSR tensors only, no counts) and is not cached: the traced graph builds it
    on every call. Run the model once eagerly (or call this) before compiling to reuse it.
    """
    key = ("triton_tree_schedule", block_m, block_n, str(pack.device))
    if torch.compiler.is_compiling() and key not in pack._cache:
        tensors = tree_schedule_op(pack.subtree_end, block_m, block_n)
        return dict(zip(("fwd_ptr", "fwd_idx", "bwd_ptr", "bwd_idx"), tensors, strict=True),
                    block_m=block_m, block_n=block_n)
    return pack.cached(key, lambda: tile_schedule(pack.subtree_end, block_m, block_n))


def default_configs(head_dim: int, dtype: torch.dtype) -> dict[str, LaunchConfig]:
    """The tuned launches (``kernels/tuning.py``) for this head dim and dtype, per kernel."""
    # fp32 tiles are twice the bytes: the half-precision launches overflow shared memory at head dim 128
    return TREE_FALLBACK if dtype == torch.float32 else TREE.get(head_dim, TREE_FALLBACK)


def triton_tree_attention(q, k, v, pack, *, scale=None, fwd_config=None, dkdv_config=None, dq_config=None,
                          return_lse=False, split_groups=None):
    """Tree attention with the Triton kernels (inputs already validated by ``treeattn_lab.ops``).

    ``fwd_config`` / ``dkdv_config`` / ``dq_config`` override a kernel's launch with a
    :class:`~.tuning.LaunchConfig` (small tiles make small tests exercise many tiles; ``tma=True`` loads
    row tiles through TMA tensor descriptors where :func:`~.attention_core.tma_usable` allows, else the
    pointer loads run). With ``return_lse`` also returns the natural-log log-sum-exp ``[T, Hq]``.
    ``split_groups`` (None: :func:`should_split_groups` decides) runs the dK/dV kernel per query head
    instead of per kv head under grouped-query attention.
    """
    launches = [launch_config(config, f"{name}_config", default_configs(q.shape[-1], q.dtype)[name])
                for name, config in (("fwd", fwd_config), ("dkdv", dkdv_config), ("dq", dq_config))]
    launch_ints = core.launch_ints(*launches)

    def apply(q, k, v, scale):  # after the input checks: a refused call caches no schedule on the pack
        schedule = []
        for launch, rows in zip(launches, ("fwd", "bwd", "fwd"), strict=True):
            sched = schedule_for(pack, launch.block_m, launch.block_n)
            schedule += [sched[f"{rows}_ptr"], sched[f"{rows}_idx"]]
        o, lse = tree_attention_fwd(q, k, v, pack.subtree_end.contiguous(), schedule, scale, launch_ints,
                                    split_groups)
        return o, lse.detach()  # the log-sum-exp carries no gradient

    return core.run_attention(apply, q, k, v, scale=scale, return_lse=return_lse)
