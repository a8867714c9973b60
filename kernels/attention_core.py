"""The FlashAttention-2 core that every attention kernel here is built from.

Each attention kernel (``tree_attention.py``, ``block_sparse.py``, ``dilated_attention.py``) is a *tile
schedule* (which key tiles a query tile visits, which are whole and which need a mask) and a *visibility
rule* (the element mask of the partial tiles). Everything else is the same arithmetic, kept here once:

Forward, per query tile, in base 2 (scores scaled by ``scale * log2(e)`` so ``exp2`` replaces ``exp``):

    s = q k^T * qk_scale;  m_new = max(m, rowmax(s));  p = exp2(s - m_new);  a = exp2(m - m_new)
    l = l * a + rowsum(p);  acc = acc * a + p v                                   (:func:`softmax_step`)

and at the end ``out = acc / l`` and ``lse = m + log2(l)`` (:func:`softmax_output`, :func:`softmax_lse`; a
row that saw no key keeps ``l = 0``: it outputs zeros with ``lse = -inf``). Masked scores are ``-inf``
before the step; a row whose maximum is still ``-inf`` uses 0 in its place so no ``-inf - -inf`` appears.

Two partial results over disjoint keys merge by their log-sum-exps (:func:`merge_states`):
``lse = log2(2^lse_a + 2^lse_b)``, ``out = out_a 2^(lse_a - lse) + out_b 2^(lse_b - lse)``.

Backward, with ``p = exp2(s - lse)`` recomputed from the saved log-sum-exp and ``delta = rowsum(dO * O)``
(:func:`attention_delta`, one Triton pass before the gradient kernels):

    dV += p^T dO,   dP = dO V^T,   dS = p * (dP - delta),   dK += dS^T Q,   dQ += dS K

(:func:`dq_step` for a query tile over a key tile, :func:`dkdv_step` for a key tile over a query tile,
whose scores are the transposed ``[keys, queries]``); the kernels multiply dK and dQ by ``scale`` once,
when they store them.

Rows are read by :func:`load_rows` (contiguous rows ``row0 ..``, from a pointer or a TMA descriptor made by
:func:`row_source`) or :func:`gather_rows` (rows at given indices). The TMA path is taken only on an
sm_90+ GPU with 16-byte aligned, non-overlapping rows (:func:`tma_usable`); elsewhere the pointer loads run.

Precision: fp16 / bf16 inputs use tensor-core dots with fp32 accumulation (:func:`dot_precision`), fp32
inputs IEEE fp32 dots. On the host, :func:`run_attention` does what every op does around its kernels:
check the inputs, default the scale to ``1 / sqrt(head_dim)``, make the last dim contiguous, and turn the
kernels' base-2 ``[..., H, N]`` log-sum-exp into the natural-log ``[..., N, H]`` one. Each op's kernels run
as ``torch.library`` custom ops; :func:`register_attention_autograd` ties a forward op to its backward op.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .limits import check_attention_inputs

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for inputs of ``dtype``: IEEE for fp32, tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------- row loads
@triton.jit
def row_source(X, T, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """Where one head's ``[T, HEAD_DIM]`` rows are read from: the pointer ``X`` itself, or (``USE_TMA``) a
    TMA descriptor over them that loads ``[BLOCK, HEAD_DIM]`` tiles, zero-filling rows ``>= T``."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(X, shape=[T, HEAD_DIM], strides=[stride_t, 1],
                                        block_shape=[BLOCK, HEAD_DIM])
    else:
        src = X
    return src


@triton.jit
def load_rows(src, row0, T, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr,
              MASKED: tl.constexpr):
    """Rows ``row0 .. row0 + BLOCK`` of one head (from :func:`row_source`), zero beyond ``T``.

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


@triton.jit
def gather_rows(base, rows, stride, offs_d, in_range, MASKED: tl.constexpr):
    """The rows ``rows`` (any order) of one head at ``base``; with ``MASKED``, zero where not ``in_range``."""
    ptrs = base + rows.to(tl.int64)[:, None] * stride + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=in_range[:, None], other=0.0)
    return tl.load(ptrs)


# --------------------------------------------------------------------------------------- forward steps
@triton.jit
def scores(q, k, qk_scale, DOT_PRECISION: tl.constexpr):
    """``q k^T`` scaled for base 2: ``[rows of q, rows of k]`` fp32."""
    return tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale


@triton.jit
def softmax_start(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The running state before any key: ``m = -inf``, ``l = 0``, ``acc = 0`` (in that order: the order
    the kernels' loops carry them)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
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
def softmax_output(acc, l_i):
    """The normalized output ``acc / l`` of the running state (zeros for a row that saw no key)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_safe[:, None]


@triton.jit
def softmax_lse(m_i, l_i):
    """The base-2 log-sum-exp ``m + log2(l)`` of the running state (``-inf`` for a row that saw no key)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return m_i + tl.log2(l_safe)


@triton.jit
def merge_states(out, lse, out_old, lse_old):
    """Fold ``(out, lse)`` into ``(out_old, lse_old)``, partial results over disjoint keys (base 2)."""
    top = tl.maximum(lse_old, lse)
    top = tl.where(top == float("-inf"), 0.0, top)
    w_old = tl.exp2(lse_old - top)
    w_new = tl.exp2(lse - top)
    total = w_old + w_new
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = (out_old * (w_old / total_safe)[:, None] + out * (w_new / total_safe)[:, None])
    lse = tl.where(total == 0.0, float("-inf"), top + tl.log2(total_safe))
    return out, lse


# --------------------------------------------------------------------------------------- backward steps
@triton.jit
def row_stats(LSE, DELTA, offs, n, MASKED: tl.constexpr):
    """The saved ``lse`` and ``delta`` of rows ``offs`` (with ``MASKED``, 0 for rows ``>= n``)."""
    if MASKED:
        in_range = offs < n
        lse = tl.load(LSE + offs, mask=in_range, other=0.0)
        delta = tl.load(DELTA + offs, mask=in_range, other=0.0)
    else:
        lse = tl.load(LSE + offs)
        delta = tl.load(DELTA + offs)
    return lse, delta


@triton.jit
def probabilities(q, k, lse, qk_scale, DOT_PRECISION: tl.constexpr):
    """``p = exp2(s - lse)`` of queries ``q`` against keys ``k``, ``[queries, keys]`` (unmasked)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    return tl.exp2(s - lse[:, None])


@triton.jit
def dq_step(dq, p, do, v, k, delta, DOT_PRECISION: tl.constexpr):
    """``dq + dS K`` for probabilities ``p [queries, keys]`` (zero where masked); unscaled."""
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def probabilities_t(k, q, lse, qk_scale, DOT_PRECISION: tl.constexpr):
    """The transposed ``p^T = exp2(s^T - lse)``, ``[keys, queries]`` (unmasked)."""
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    return tl.exp2(s_t - lse[None, :])


@triton.jit
def dkdv_step(dk, dv, p_t, q, do, v, delta, DOT_PRECISION: tl.constexpr):
    """``(dk + dS^T Q, dv + p^T dO)`` for ``p_t [keys, queries]`` (zero where masked); dk unscaled."""
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attention_delta(O, DO, DELTA, NQ, stride_ot, stride_oh, stride_dot, stride_doh,
                     BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``delta[h, t] = sum_d dO * O`` in fp32, one program per (query block, head)."""
    m = tl.program_id(0)
    h = tl.program_id(1)
    rows = m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = rows < NQ
    o = gather_rows(O + h * stride_oh, rows, stride_ot, offs_d, in_range, True).to(tl.float32)
    do = gather_rows(DO + h * stride_doh, rows, stride_dot, offs_d, in_range, True).to(tl.float32)
    tl.store(DELTA + h * NQ + rows, tl.sum(o * do, 1), mask=in_range)


def attention_delta(o: torch.Tensor, do: torch.Tensor, block: int = 64, out: torch.Tensor | None = None):
    """``rowsum(dO * O)`` of ``o, do [N, H, D]`` as ``[H, N]`` fp32 (into ``out``, contiguous, if given)."""
    nq, hq, d = o.shape
    delta = torch.empty((hq, nq), device=o.device, dtype=torch.float32) if out is None else out
    _attention_delta[(triton.cdiv(nq, block), hq)](o, do, delta, nq, o.stride(0), o.stride(1), do.stride(0),
                                                   do.stride(1), BLOCK=block, HEAD_DIM=d)
    return delta


# --------------------------------------------------------------------------------------- TMA
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


def tma_scratch(size: int, alignment: int, stream, _empty=torch.empty):
    """The allocator :func:`ensure_scratch_allocator` installs (``torch.empty`` bound at import: tests that
    fill every ``torch.empty`` with NaN must not reach this int8 scratch, where descriptors are written)."""
    return _empty(size, device="cuda", dtype=torch.int8)


def ensure_scratch_allocator() -> None:
    """Descriptors made on the device (``tl.make_tensor_descriptor``) live in a global scratch buffer that
    Triton requests at launch from the allocator of ``triton.set_allocator``: install a torch one unless the
    caller installed their own. The setting is per thread (a ContextVar) and autograd runs the backward
    on a thread of its own, so this runs before every TMA launch."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(tma_scratch)


# --------------------------------------------------------------------------------------- host side
def run_attention(apply, q, k, v, *, scale=None, return_lse: bool = False):
    """What every op does around its kernels: check ``q`` (head dim, dtype), default ``scale`` to
    ``1 / sqrt(head_dim)``, give q, k, v a contiguous last dim, run ``apply(q, k, v, scale) -> (out, lse2)``
    with ``lse2 [..., H, N]`` base 2, and return ``out`` or ``(out, lse [..., N, H])`` in natural log."""
    check_attention_inputs(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out, lse2 = apply(q, k, v, scale)
    if return_lse:
        return out, lse2.transpose(-1, -2) / LOG2E
    return out


# --------------------------------------------------------------------------------------- custom ops
# The attention kernels run as ``torch.library`` custom ops (namespace ``treeattn_lab``): a forward op
# ``(q, k, v, *rest) -> (out, lse2, ...)`` and a backward op ``(do, q, k, v, out, lse2, ..., *rest) ->
# (dq, dk, dv)``, each with a fake implementation, so ``torch.compile(fullgraph=True)`` traces a model
# calling them, backward included. Launch configs travel as int lists, five ints per launch.
def launch_ints(*launches) -> list[int]:
    """``[block_m, block_n, num_warps, num_stages, tma]`` of each :class:`~.tuning.LaunchConfig`, joined."""
    return [int(x) for launch in launches for x in (launch.block_m, launch.block_n, launch.num_warps,
                                                   launch.num_stages, launch.tma)]


def launches_of(ints) -> list:
    """The :class:`~.tuning.LaunchConfig` list that :func:`launch_ints` wrote."""
    from .tuning import LaunchConfig

    return [LaunchConfig(*ints[i:i + 4], bool(ints[i + 4])) for i in range(0, len(ints), 5)]


def register_attention_autograd(forward_op, backward_op) -> None:
    """Register ``backward_op`` as ``forward_op``'s autograd. ``forward_op(q, k, v, *rest)`` returns
    ``(out, lse2, *saved)``; ``backward_op(do, q, k, v, out, lse2, *saved, *rest)`` returns ``(dq, dk, dv)``.
    The forward saves q, k, v, its outputs and the tensors among ``rest`` (a list of tensors stays a list);
    only ``out`` gets a gradient."""
    from torch.utils import _pytree

    def setup_context(ctx, inputs, output):
        q, k, v, *rest = inputs
        flat, ctx.rest_spec = _pytree.tree_flatten(rest)
        ctx.tensor_at = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        ctx.rest_flat = [None if i in ctx.tensor_at else x for i, x in enumerate(flat)]
        ctx.num_outputs = len(output)
        ctx.save_for_backward(q, k, v, *output, *(flat[i] for i in ctx.tensor_at))

    def backward(ctx, do, *_):
        saved = ctx.saved_tensors
        outputs, tensors = saved[3:3 + ctx.num_outputs], saved[3 + ctx.num_outputs:]
        flat = list(ctx.rest_flat)
        for i, x in zip(ctx.tensor_at, tensors, strict=True):
            flat[i] = x
        rest = _pytree.tree_unflatten(flat, ctx.rest_spec)
        dq, dk, dv = backward_op(do, *saved[:3], *outputs, *rest)
        no_grads = [[None] * len(x) if isinstance(x, list) and x and isinstance(x[0], torch.Tensor) else None
                    for x in rest]
        return dq, dk, dv, *no_grads

    forward_op.register_autograd(backward, setup_context=setup_context)
