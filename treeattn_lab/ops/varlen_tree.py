"""Tree attention as variable-length FlashAttention: one sequence per leaf, queries straight from the pack.

The idea
--------
In DFS preorder the tokens between two consecutive leaves belong to the second leaf's rollout: leaf ``j``
*owns* the packed range ``[node_end(leaf j-1), node_end(leaf j))``, the tail of its rollout that no earlier
rollout holds (``ops/flat_tree.py`` explains why). These ranges tile the pack in order. So the packed
queries, *as they are*, are a variable-length batch: sequence ``j`` has the queries of leaf ``j``'s owned
range, and its keys are leaf ``j``'s whole rollout (shared prefix + owned tail), gathered out of the pack.

With the queries at the end of their key sequence, causal attention aligned to the bottom-right corner
(query ``i`` of ``n_q`` sees keys ``0 .. n_k - n_q + i``) is exactly the tree rule: each query sees its
ancestors and the earlier tokens of its own rollout. Every visible (query, key) pair is computed once:
the work is the tree's attended pairs, not the flat rollouts' (the shared prefix's queries run once), and
the kernel is FlashAttention's own varlen kernel, at FlashAttention's speed per pair: through torch's
public ``torch.nn.attention.varlen.varlen_attn`` (a custom op with its backward, which ``torch.compile``
traces) where the installed torch takes ``window_size`` (causal), ``scale`` and ``enable_gqa``, else
through the private ``aten._flash_attention_forward`` / ``_backward`` with ``cum_seq_q`` / ``cum_seq_k``.
The plan is host work, cached on the pack by the first eager call; a compiled call needs it cached.

Costs beyond the attention: a gather of K and V into rollout order (the flat token count, ``sum of rollout
lengths``) and, in the backward, the sum of the gathered copies' gradients back into the pack
(``index_select``'s backward). Outputs, ``dq`` and the log-sum-exp come back packed: nothing to scatter.

Where it runs
-------------
CUDA with fp16 / bf16 and head dims FlashAttention takes (multiples of 8 up to 256). Elsewhere (the CPU,
for learning and tests) the same plan runs through the einops reference with the block-diagonal,
bottom-right causal mask spelled out, which is what the flash kernel computes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .. import reference
from .flat_tree import leaf_rollouts, require_cached

__all__ = [
    "FLASH_HEAD_DIMS",
    "VarlenPlan",
    "runs_flash",
    "varlen_mask",
    "varlen_plan",
    "varlen_tree_attention",
]

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_HEAD_DIMS = range(8, 257, 8)


@dataclass(frozen=True)
class VarlenPlan:
    """Sequence ``j`` = leaf ``j`` in DFS preorder: queries ``cu_q[j] .. cu_q[j+1]`` of the pack, keys the
    packed rows ``key_rows[cu_k[j] .. cu_k[j+1]]`` (its rollout). ``cu_q`` / ``cu_k`` are int32."""

    key_rows: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @property
    def num_sequences(self) -> int:
        return self.cu_q.numel() - 1


def _build_plan(pack) -> VarlenPlan:
    rollouts = leaf_rollouts(pack)
    q_len = torch.tensor([owned for _, owned in rollouts], dtype=torch.int64)
    k_len = torch.tensor([rows.numel() for rows, _ in rollouts], dtype=torch.int64)
    if int(q_len.sum()) != pack.num_tokens:
        raise RuntimeError("the leaves' owned ranges do not cover the pack: is it in DFS preorder?")
    zero = torch.zeros(1, dtype=torch.int64)
    cu_q, cu_k = (torch.cat([zero, n.cumsum(0)]).to(torch.int32) for n in (q_len, k_len))
    rows = torch.cat([rows for rows, _ in rollouts])
    return VarlenPlan(rows.to(pack.device), cu_q.to(pack.device), cu_k.to(pack.device),
                      int(q_len.max()), int(k_len.max()))


def varlen_plan(pack) -> VarlenPlan:
    """The leaf sequences of ``pack``, built once per pack and device and cached on the pack (under
    ``torch.compile`` it must be cached already: :func:`~.flat_tree.require_cached`)."""
    key = ("varlen_plan", str(pack.device))
    require_cached(pack, key, "the varlen backend's sequence plan")
    return pack.cached(key, lambda: _build_plan(pack))


def varlen_mask(plan: VarlenPlan) -> torch.Tensor:
    """``[T, sum of rollout lengths]`` bool: query ``i`` sees gathered key ``s`` when both are in sequence
    ``j`` and ``s - cu_k[j] <= (n_k - n_q) + (i - cu_q[j])`` (causal, aligned bottom-right)."""
    cu_q, cu_k = plan.cu_q.long(), plan.cu_k.long()
    seq_q = torch.repeat_interleave(torch.arange(plan.num_sequences, device=cu_q.device), cu_q.diff())
    seq_k = torch.repeat_interleave(torch.arange(plan.num_sequences, device=cu_q.device), cu_k.diff())
    # a key's "time" is its index in its rollout; a query's is its index counted from the rollout's start
    q_time = torch.arange(cu_q[-1], device=cu_q.device) - cu_q[seq_q] + (cu_k.diff() - cu_q.diff())[seq_q]
    k_time = torch.arange(cu_k[-1], device=cu_q.device) - cu_k[seq_k]
    return (seq_q[:, None] == seq_k[None, :]) & (k_time[None, :] <= q_time[:, None])


def _public_varlen_attn():
    """``torch.nn.attention.varlen.varlen_attn`` when the installed torch has it with the arguments this
    backend passes (``window_size`` for causal, ``scale``, ``enable_gqa``), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    wanted = {"window_size", "scale", "enable_gqa"}
    return varlen_attn if wanted <= inspect.signature(varlen_attn).parameters.keys() else None


VARLEN_ATTN = _public_varlen_attn()


class _FlashVarlen(torch.autograd.Function):
    """FlashAttention's varlen forward and backward (causal, bottom-right) on packed q and gathered k, v,
    through the private aten ops: the path for a torch whose public ``varlen_attn`` lacks the arguments
    above."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, rng, unused)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse, rng, unused = ctx.saved_tensors
        plan = ctx.plan
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, 0.0, True,
            rng, unused, scale=ctx.scale)
        return dq, dk, dv, None, None


def _flash_varlen(q, keys, values, plan: VarlenPlan, scale):
    """Causal varlen FlashAttention, bottom-right aligned: flash aligns causal attention to the bottom-right
    corner when a sequence has fewer queries than keys. ``window_size=(-1, 0)`` is how the public API says
    causal; grouped-query heads pass as they are."""
    if VARLEN_ATTN is None:
        return _FlashVarlen.apply(q, keys, values, plan, scale)
    return VARLEN_ATTN(q, keys, values, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale=scale,
                       window_size=(-1, 0), enable_gqa=q.shape[1] != keys.shape[1])


def runs_flash(q: torch.Tensor) -> bool:
    """Whether FlashAttention's kernel takes ``q`` (else the reference computes the same plan)."""
    return q.is_cuda and q.dtype in FLASH_DTYPES and q.shape[-1] in FLASH_HEAD_DIMS


def varlen_tree_attention(q, k, v, pack, *, scale=None):
    """Tree attention over ``pack`` as varlen causal attention, one sequence per leaf (module docstring).

    Inputs as for ``treeattn_lab.tree_attention`` (already validated there). Differentiable in q, k, v.
    On CUDA the inputs must be fp16 / bf16 with a head dim FlashAttention takes; on the CPU any float
    dtype runs through the reference (a ``T x flat tokens`` mask: small packs only).
    """
    if q.is_cuda and not runs_flash(q):
        raise ValueError(f"the varlen backend runs FlashAttention on CUDA: it needs fp16 or bf16 and a head "
                         f"dim that is a multiple of 8 up to 256, got {q.dtype} and {q.shape[-1]}; use "
                         f"backend='triton' or 'flex'")
    plan = varlen_plan(pack)
    scale = None if scale is None else float(scale)
    keys, values = k.index_select(0, plan.key_rows), v.index_select(0, plan.key_rows)
    if q.is_cuda:
        return _flash_varlen(q.contiguous(), keys, values, plan, scale)
    return reference.masked_attention(q, keys, values, varlen_mask(plan), scale=scale)
