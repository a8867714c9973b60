"""Which backend runs an op: the one place that decides, for every attention op and the scan.

Every op has the same three backends: ``"reference"`` (the einops definition, any device), ``"flex"``
(PyTorch FlexAttention with the op's ``mask_mod``) and ``"triton"`` (the op's kernel in ``kernels/``).
``"auto"`` picks the fastest available: triton on CUDA, else flex on CUDA, else the reference.
Tree attention also has ``"flat"`` (causal SDPA per rollout, ``ops/flat_tree.py``), which ``"auto"``
picks on CUDA when the caller reports that the pack shares little (``low_sharing``), and ``"varlen"``
(FlashAttention's varlen kernel, one sequence per leaf, ``ops/varlen_tree.py``), and ``"fa4"``
(FlashAttention-4 through FlexAttention, ``ops/fa4_tree.py``) where a Hopper-class GPU and the
``[hopper]`` extra allow it; ``"auto"`` picks it there first (``ops/tree.py``).
"""

from __future__ import annotations

import torch

from ..runtime import module_found
from .fa4_tree import FA4_NEEDS, fa4_available

BACKENDS = ("reference", "flex", "triton")
KERNELS = {  # op -> its kernel module in kernels/ (installed as treeattn_lab.kernels)
    "tree_attention": "tree_attention",
    "sparse_attention": "block_sparse",
    "dilated_attention": "dilated_attention",
    "gated_scan": "scan",
}
NO_FLEX = ("gated_scan",)  # a recurrence, not attention
# backends only some ops have (plain torch, always available)
OP_BACKENDS = {"tree_attention": ("flat", "varlen")}
# backends that need a package and a GPU: op -> backend -> its availability test on a device
OPTIONAL_BACKENDS = {"tree_attention": {"fa4": fa4_available}}
OPTIONAL_NEEDS = {"fa4": FA4_NEEDS}


# Module presence is a fact of the install: marked (in place) so that torch.compile reads it once, as a
# constant, instead of tracing importlib's find_spec, which dynamo refuses.
torch.compiler.assume_constant_result(module_found)


def available_backends(device="cpu", op: str = "tree_attention") -> list[str]:
    """Backends that can run ``op`` on ``device`` (forward at least)."""
    if op not in KERNELS:
        raise ValueError(f"unknown op {op!r}; choose one of {tuple(KERNELS)}")
    out = ["reference"]
    if op not in NO_FLEX and module_found("torch.nn.attention.flex_attention"):
        out.append("flex")
    kernel = f"treeattn_lab.kernels.{KERNELS[op]}"
    if module_found("triton") and module_found(kernel):
        out.append("triton")
    optional = [name for name, usable in OPTIONAL_BACKENDS.get(op, {}).items() if usable(device)]
    return out + list(OP_BACKENDS.get(op, ())) + optional


def choose_backend(backend: str, device: torch.device, op: str = "tree_attention", *,
                   low_sharing: bool = False) -> str:
    """The backend that runs ``op`` for the caller's ``backend`` (``"auto"`` or a name); a clear error
    when the name is unknown or unavailable here. ``low_sharing``: the tree pack shares so little that
    flat attention per rollout is faster (``ops.flat_tree.prefers_flat``); ``"auto"`` then runs it flat
    on CUDA."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    avail = available_backends(device, op)
    if backend == "auto":
        if torch.device(device).type == "cuda":
            for name in (("flat",) if low_sharing else ()) + ("triton", "flex"):
                if name in avail:
                    return name
        return "reference"
    names = BACKENDS + OP_BACKENDS.get(op, ()) + tuple(OPTIONAL_BACKENDS.get(op, {}))
    if backend not in names:
        raise ValueError(f"unknown backend {backend!r}; choose one of {('auto',) + names}")
    if backend not in avail:
        needs = f": it needs {OPTIONAL_NEEDS[backend]}" if backend in OPTIONAL_NEEDS else ""
        raise ValueError(f"backend {backend!r} of {op} is not available on {device} here{needs}")
    return backend
