"""What the attention kernels accept: head dims, dtypes, and what Triton's CPU interpreter gets wrong.

Shared by every attention kernel file so they refuse the same inputs with the same words.
"""

from __future__ import annotations

import os

import torch

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_attention_inputs(q: torch.Tensor) -> None:
    """Raise a clear error for a head dim or dtype the kernels do not run, or cannot run correctly here:
    the interpreter (``TRITON_INTERPRET=1``, CPU) computes bf16 ``tl.dot`` wrongly."""
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head dim {d} is not supported by the triton backend; use one of {SUPPORTED_HEAD_DIMS}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {q.dtype} is not supported by the triton backend; use fp16, bf16 or fp32")
    if q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise TypeError(
            "bf16 is not supported by the triton backend under Triton's CPU interpreter (its bf16 dots are "
            "wrong): use fp16 or fp32 here, the reference backend, or a CUDA GPU"
        )
