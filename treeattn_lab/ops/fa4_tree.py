"""FlashAttention-4 for tree attention: the tree ``mask_mod`` run by FA4's CuTe DSL kernels.

What runs
---------
FlexAttention compiles a ``mask_mod`` and a ``BlockMask`` (which 128 x 128 blocks are empty, full or
partial) into a fused kernel. With ``kernel_options={"BACKEND": "FLASH"}`` the compiled call does not
generate a Triton kernel: it hands the same mask to FlashAttention-4 (the ``flash-attn-4`` package, written
in NVIDIA's CuTe DSL), forward and backward. FA4 takes the block mask as *block sparsity*: empty blocks are
never visited, full blocks run with no mask, and only partial blocks evaluate the tree rule
``k <= q < subtree_end[k]`` element by element (``subtree_end`` is a captured int32 tensor the generated
mask code indexes).

Why it is fast on Hopper
------------------------
FA4 is written for the GPU's asynchronous machinery, which Triton exposes only in part: producer warps only
issue TMA copies (the Tensor Memory Accelerator moves whole tiles to shared memory) while consumer warpgroups
only compute, with asynchronous warpgroup matrix multiplies (``wgmma``) and mbarriers that tell consumers a
stage is ready; the producers hand most of their registers to the consumers (``setmaxnreg``). Notebook 03
measures it beside the lab's Triton kernel.

Where it runs
-------------
CUDA GPUs of compute capability 9.0 (Hopper) or newer, fp16 / bf16, head dims that are multiples of 8 up to
256, with ``flash_attn.cute`` importable (``pip install 'treeattn_lab[hopper]'``). The block mask is the one
the flex backend builds and caches on the pack. The first two pack sizes compile; the second compiles
with dynamic sizes, which every later size reuses, so a training run with changing packs does not compile
once per pack.
"""

from __future__ import annotations

import functools

import torch

from ..runtime import module_found
from .flex import flex_attention
from .flex_tree import tree_block_mask

__all__ = ["FA4_DTYPES", "FA4_MAX_HEAD_DIM", "FA4_MIN_CAPABILITY", "FA4_NEEDS", "fa4_available",
           "fa4_importable", "fa4_takes", "fa4_tree_attention", "runs_fa4"]

FA4_MIN_CAPABILITY = (9, 0)
FA4_DTYPES = (torch.float16, torch.bfloat16)
FA4_MAX_HEAD_DIM = 256
FA4_NEEDS = "FlashAttention-4 (pip install 'treeattn_lab[hopper]') on a CUDA GPU of compute capability >= 9.0"


@functools.cache
def fa4_importable() -> bool:
    """Whether FlashAttention-4's CuTe DSL package (``flash_attn.cute``) is installed."""
    return module_found("flash_attn.cute")


@torch.compiler.assume_constant_result  # a fact of the machine: torch.compile reads it once, as a constant
def fa4_available(device) -> bool:
    """Whether the ``"fa4"`` backend can run on ``device``: a CUDA GPU of compute capability >= 9.0 with
    ``flash_attn.cute`` importable."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FA4_MIN_CAPABILITY and fa4_importable()


def fa4_takes(device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FA4 runs inputs of ``dtype`` and ``head_dim`` on ``device``: fp16 / bf16 on a capable GPU, a
    head dim that is a multiple of 8 up to 256."""
    return (dtype in FA4_DTYPES and head_dim % 8 == 0 and head_dim <= FA4_MAX_HEAD_DIM
            and fa4_available(device))


def runs_fa4(q: torch.Tensor) -> bool:
    """Whether FA4 takes ``q`` (:func:`fa4_takes`)."""
    return fa4_takes(q.device, q.dtype, q.shape[-1])


def fa4_tree_attention(q, k, v, pack, *, scale=None):
    """Tree attention of packed ``q [T, Hq, D]`` over ``k, v [T, Hkv, D]`` by FlashAttention-4 (inputs
    already validated by ``treeattn_lab.ops``). Differentiable in q, k and v."""
    if not runs_fa4(q):
        raise ValueError(f"the fa4 backend needs {FA4_NEEDS}, fp16 or bf16, and a head dim that is a "
                         f"multiple of 8 up to {FA4_MAX_HEAD_DIM}; got {q.dtype}, head dim {q.shape[-1]} on "
                         f"{q.device}; use backend='triton'")
    return flex_attention(q, k, v, lambda: tree_block_mask(pack), scale=scale, kernel="flash")
