"""Launch configs of every kernel here: one type, :class:`LaunchConfig`, and the tuned tables.

A launch of an attention kernel is a tile shape, warps and pipeline stages, and for the tree kernels
whether row tiles load through TMA descriptors. The scan adds its own fields in :class:`ScanConfig` (the
same type, extended). The block-sparse op runs three launches and sizes its bar-column steps:
:class:`SparseConfig` holds those. Triton's interpreter (CPU) ignores warps and stages.

The tables below are the defaults the kernels start from, each entry naming the run under
``bench/results/`` that chose it (``python -m treeattn_lab bench tree-tune``, ``bench sparse --tune``,
``bench dilated --tune`` / ``--tune-scan`` / ``--scan-config`` on an H200); the fallbacks were not
measured: they are the shapes that fit shared memory for any supported head dim and dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_sizes(kind: str, sizes, *, pow2: bool, minimum: int) -> None:
    for name, size in sizes:
        if not _is_int(size) or size < minimum or (pow2 and size & (size - 1)):
            rule = f"a power of two >= {minimum}" if pow2 else f"an int >= {minimum}"
            raise ValueError(f"{kind} {name} must be {rule}, got {size!r}")


def _check_warps(kind: str, num_warps: int) -> None:
    if num_warps & (num_warps - 1):
        raise ValueError(f"{kind} num_warps must be a power of two (Triton launches 1, 2, 4, ... warps), "
                         f"got {num_warps}")


@dataclass(frozen=True)
class LaunchConfig:
    """One kernel launch. ``block_m``: rows a program owns (queries; keys in a dK/dV kernel, which steps
    ``block_m`` queries at a time); ``block_n``: columns it steps through (keys; ``tl.dot`` needs both
    to be powers of two >= 16); ``num_warps``, ``num_stages``: Triton's launch options; ``tma``: load the
    streamed row tiles through TMA descriptors where :func:`~.attention_core.tma_usable` allows (the tree
    kernels; the other kernels refuse ``tma=True``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False

    def __post_init__(self):
        _check_sizes("launch config", (("block_m", self.block_m), ("block_n", self.block_n)), pow2=True,
                     minimum=16)
        _check_sizes("launch config", (("num_warps", self.num_warps), ("num_stages", self.num_stages)),
                     pow2=False, minimum=1)
        _check_warps("launch config", self.num_warps)
        if not isinstance(self.tma, bool):
            raise TypeError(f"launch config tma must be a bool, got {self.tma!r}")

    def replace(self, **changes) -> LaunchConfig:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ScanConfig(LaunchConfig):
    """A launch of the gated scan: ``block_m`` time steps per chunk (any positive int), ``block_n``
    channels per chain (a power of two), warps, stages, and the scan's own fields: ``unroll``, rows per
    unrolled group of the row loop (capped at ``block_m``); ``window``, predecessors one look-back step
    reads (a power of two: its ``[window, block_n]`` map tiles are most of the kernel's registers);
    ``programs_per_sm``, programs per multiprocessor of a persistent launch (0: one program per chunk)."""

    num_warps: int = 4
    num_stages: int = 1
    unroll: int = 8
    window: int = 16
    programs_per_sm: int = 0

    def __post_init__(self):
        _check_sizes("scan config", (("block_m", self.block_m), ("unroll", self.unroll)), pow2=False,
                     minimum=1)
        _check_sizes("scan config", (("block_n", self.block_n), ("window", self.window)), pow2=True,
                     minimum=1)
        _check_sizes("scan config", (("num_warps", self.num_warps), ("num_stages", self.num_stages)),
                     pow2=False, minimum=1)
        _check_warps("scan config", self.num_warps)
        _check_sizes("scan config", (("programs_per_sm", self.programs_per_sm),), pow2=False, minimum=0)
        if self.tma is not False:
            raise ValueError("scan config tma must be False: the scan has no TMA path")


@dataclass(frozen=True)
class SparseConfig:
    """The block-sparse op's launches and bar steps; a field left None takes the tuned default.

    ``fwd`` and ``dq`` programs own ``block_m`` queries and step ``block_n`` keys at a time; ``dkdv``
    programs own ``block_n`` keys and step ``block_m`` queries. ``bar``: bar columns per step of the
    forward and dQ (default: their ``block_n``); ``bar_kv``: bar columns per dK/dV bar program (default:
    the dK/dV ``block_n``); ``split``: pieces per bar chunk's query range (default: enough to keep the
    longest bar program short next to the launch's total work). Shapes are capped at the index's block."""

    fwd: LaunchConfig | None = None
    dq: LaunchConfig | None = None
    dkdv: LaunchConfig | None = None
    bar: int | None = None
    bar_kv: int | None = None
    split: int | None = None

    def __post_init__(self):
        for name in ("fwd", "dq", "dkdv"):
            launch = getattr(self, name)
            if launch is not None:
                launch_config(launch, f"SparseConfig.{name}")
                if launch.tma:
                    raise ValueError(f"SparseConfig.{name}: the block-sparse kernels have no TMA path")
        for name in ("bar", "bar_kv", "split"):
            value = getattr(self, name)
            if value is not None:
                _check_sizes("SparseConfig", ((name, value),), pow2=name != "split",
                             minimum=1 if name == "split" else 16)

    def over(self, base: SparseConfig) -> SparseConfig:
        """``base`` with this config's non-None fields in place of its own."""
        changes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) is not None}
        return dataclasses.replace(base, **changes)


def launch_config(config, name: str, default: LaunchConfig | None = None) -> LaunchConfig:
    """``config`` if it is a :class:`LaunchConfig` (``default`` when None); a TypeError naming ``name``
    for anything else (tuples included)."""
    if config is None and default is not None:
        return default
    if type(config) is not LaunchConfig:
        raise TypeError(f"{name} must be a treeattn_lab.kernels.tuning.LaunchConfig (e.g. "
                        f"LaunchConfig(64, 64, 4, 2)) or None, got {type(config).__name__} {config!r}")
    return config


def _attention_table(fwd, dkdv, dq) -> dict[str, LaunchConfig]:
    return {"fwd": LaunchConfig(*fwd), "dkdv": LaunchConfig(*dkdv), "dq": LaunchConfig(*dq)}


# ---------------------------------------------------------------------------------------------- tree
# head_dim -> kernel -> launch, bf16 / fp16. Shapes: bench/results/tree-tune__NVIDIA-H200__torch-2.11.0-
# cu130__triton-3.6.0.json. The head-dim-128 forward's TMA loads: a `bench tree-tune` sweep with no file
# under bench/results/; bench/results/tree-tma__NVIDIA-H200__torch-2.11.0-cu130__triton-3.6.0.json is
# `bench tree` run with them.
TREE = {
    64: _attention_table((128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 2)),
    128: _attention_table((128, 128, 8, 3, True), (128, 128, 8, 2), (128, 128, 8, 2)),
}
# head dims 16 / 32 and fp32 inputs (whose tiles are twice the bytes: the tables above overflow shared
# memory at head dim 128)
TREE_FALLBACK = _attention_table((64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2))

# ---------------------------------------------------------------------------------------------- dilated
# For dkdv ``block_m`` tiles queries, ``block_n`` keys. bench/results/dilated__NVIDIA-H200__torch-2.11.0-
# cu130__triton-3.6.0.json (128K tokens, D=16, W=256, P=4, bf16, head dim 128); head dim 64 reuses them.
DILATED = {
    64: _attention_table((128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 2)),
    128: _attention_table((128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 2)),
}
DILATED_FALLBACK = _attention_table((64, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 2))

# ---------------------------------------------------------------------------------------------- sparse
# Calls over more than SPARSE_SHORT_QUERIES queries: no saved run chose these; they are shapes that spill
# no registers on sm_90 (ptxas, Triton 3.6), the start `bench sparse --tune` times alternatives against.
SPARSE = SparseConfig(fwd=LaunchConfig(128, 64, 8, 3), dq=LaunchConfig(128, 64, 8, 2),
                      dkdv=LaunchConfig(32, 128, 8, 2))
# Shorter calls: bench/results/sparse-tune__NVIDIA-H200__torch-2.11.0-cu130__triton-3.6.0.json ("tune",
# 32K tokens).
SPARSE_SHORT_QUERIES = 65536
SPARSE_SHORT = SparseConfig(fwd=LaunchConfig(64, 64, 4, 3), dq=LaunchConfig(64, 32, 4, 2),
                            dkdv=LaunchConfig(32, 64, 4, 2), bar_kv=64, split=4)

# ---------------------------------------------------------------------------------------------- scan
# bench/results/scan-narrow-2__NVIDIA-H200__torch-2.11.0-cu130__triton-3.6.0.json
SCAN = ScanConfig(48, 512, 4, 1, unroll=16, window=8, programs_per_sm=6)
