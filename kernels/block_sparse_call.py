"""The host side of one block-sparse call: its launch configs, the index's tensors and its bar plan.

The kernels of ``block_sparse.py`` read a :class:`~treeattn_lab.patterns.vertical_slash.BlockSparseIndex`,
the bar plan and gather rows built from it (``bar_columns.py``, cached with the index) and three launch
configs. :func:`resolve_call` collects what one call's launches read into a :class:`SparseCall` of
tensors and ints only, so that it travels as the arguments of the ``torch.library`` custom ops
(:meth:`SparseCall.op_args` / :meth:`SparseCall.from_op_args`) that ``torch.compile`` traces.
"""

from __future__ import annotations

import math
from collections import namedtuple

import torch

from . import attention_core as core
from . import tuning
from .bar_columns import _PLANS, bar_plan, bar_tensors, gather_index
from .limits import check_attention_inputs
from .tuning import SparseConfig


def resolve_config(config, index) -> dict:
    """The launches and bar steps of one call: ``config`` (a :class:`~.tuning.SparseConfig`, None fields
    left to the defaults) over ``tuning.SPARSE`` (``tuning.SPARSE_SHORT`` for calls of at most
    ``tuning.SPARSE_SHORT_QUERIES`` queries), tile sizes capped at the index's block size."""
    if config is not None and not isinstance(config, SparseConfig):
        raise TypeError(f"config must be a treeattn_lab.kernels.tuning.SparseConfig or None, got "
                        f"{type(config).__name__} {config!r}")
    base = tuning.SPARSE
    if index.num_q <= tuning.SPARSE_SHORT_QUERIES:
        base = tuning.SPARSE_SHORT.over(base)
    cfg = config.over(base) if config is not None else base
    block = index.block_size
    # a program never spans more than one block of the index
    out = {name: getattr(cfg, name).replace(block_m=min(getattr(cfg, name).block_m, block),
                                            block_n=min(getattr(cfg, name).block_n, block))
           for name in ("fwd", "dq", "dkdv")}
    out["bar"] = cfg.bar
    out["bar_kv"] = min(cfg.bar_kv or out["dkdv"].block_n, block)  # like a key block's dK/dV program
    out["split"] = cfg.split
    return out


def check_inputs(q, k, v, index) -> None:
    """The triton backend's own limits (shapes against the index; head dims; dtypes)."""
    check_attention_inputs(q)
    if q.shape[0] != index.num_q or k.shape[0] != index.num_k:
        raise ValueError(f"the index covers {index.num_q} queries x {index.num_k} keys, got q with "
                         f"{q.shape[0]} and k with {k.shape[0]} tokens")
    if q.shape[1] != index.num_heads:
        raise ValueError(f"the index has {index.num_heads} heads but q has {q.shape[1]}")


def prepare(index, config=None, group: int = 1) -> None:
    """Build and cache everything the kernels derive from ``index`` (a benchmark times it apart; a call
    under ``torch.compile`` needs it done), for ``group`` query heads per kv head."""
    cfg = resolve_config(config, index)
    if index.bar_pos is not None:
        bar_plan(index, cfg["bar_kv"])
        gather_index(index, group)


def prepared(index, config, group: int) -> bool:
    """Whether :func:`prepare` (or an eager call) has cached what a call with ``config`` reads."""
    if index.bar_pos is None:
        return True
    plans = _PLANS.get(index, {})
    return ("bar_plan", resolve_config(config, index)["bar_kv"]) in plans and ("gather", group) in plans


def bar_split(plan, index, bar_kv: int, num_sms: int) -> int:
    """Pieces per bar chunk: the longest bar program at most half of one SM's fair share of the launch."""
    units = bar_kv / index.block_size  # a (query block, chunk) pair against a tile pair
    total = index.num_tiles + plan.pairs * units
    longest = plan.longest * units
    return max(1, min(16, math.ceil(2 * longest * num_sms / max(total, 1))))


_TENSORS = (
    "q_blocks", "k_blocks",  # global block ids of the local queries and keys
    "row_ptr", "row_idx", "col_ptr", "col_idx",  # tiles: CSR rows per (head, query block), the transpose
    "bar_pos", "bar_count", "bar_skip",  # bar columns: the index's,
    "bar_clean", "bar_first", "bar_clean_from",  # the bar plan's,
    "bar_cols", "bar_heads",  # the gather rows
)
_SIZES = ("block_size", "num_q", "num_k", "index_bars", "bar", "bar_kv", "split")
_LAUNCHES = ("fwd", "dq", "dkdv")


class SparseCall(namedtuple("SparseCall", _TENSORS + _SIZES + _LAUNCHES)):
    """What the launches of one call read. Index tensors as in ``BlockSparseIndex``; ``bar_clean``,
    ``bar_first``, ``bar_clean_from`` from its bar plan; ``bar_cols`` / ``bar_heads`` the gather rows
    (int32 dummies when the index has no bar part, ``index_bars`` False). ``bar``: bar columns per forward
    and dQ step (0: each launch's ``block_n``), ``bar_kv`` per dK/dV bar program, ``split`` pieces per bar
    chunk; ``fwd``, ``dq``, ``dkdv`` the launches."""

    __slots__ = ()

    @property
    def num_key_groups(self) -> int:
        """Global key blocks ``bar_skip`` covers (0 without bars)."""
        return self.bar_skip.shape[-1] if self.index_bars else 0

    @property
    def num_bars(self) -> int:
        """Bar columns per head (0 without bars)."""
        return self.bar_pos.shape[1] if self.index_bars else 0

    def op_args(self) -> tuple[list[torch.Tensor], list[int]]:
        """``(tensors, ints)``: the fields in order, launches as :func:`~.attention_core.launch_ints`."""
        n = len(_TENSORS)
        return list(self[:n]), [int(x) for x in self[n:-3]] + core.launch_ints(*self[-3:])

    @classmethod
    def from_op_args(cls, tensors, ints) -> SparseCall:
        sizes = dict(zip(_SIZES, ints[:len(_SIZES)], strict=True))
        sizes["index_bars"] = bool(sizes["index_bars"])
        launches = dict(zip(_LAUNCHES, core.launches_of(ints[len(_SIZES):]), strict=True))
        return cls(*tensors, **sizes, **launches)


def resolve_call(index, config, device, group: int, num_sms: int) -> SparseCall:
    """The :class:`SparseCall` of ``index`` under ``config`` for ``group`` query heads per kv head."""
    cfg = resolve_config(config, index)
    bar_kv = cfg["bar_kv"]
    (bar_pos, bar_count, bar_clean, bar_skip, bar_first, bar_clean_from), plan = bar_tensors(index, device,
                                                                                             bar_kv)
    if index.bar_pos is None:
        cols = heads = bar_pos
        split = 1
    else:
        cols, heads = gather_index(index, group)
        split = cfg["split"] or bar_split(plan, index, bar_kv, num_sms) if bar_pos.shape[1] else 1
    return SparseCall(q_blocks=index.q_blocks, k_blocks=index.k_blocks, row_ptr=index.row_ptr,
                      row_idx=index.row_idx, col_ptr=index.col_ptr, col_idx=index.col_idx, bar_pos=bar_pos,
                      bar_count=bar_count, bar_skip=bar_skip, bar_clean=bar_clean, bar_first=bar_first,
                      bar_clean_from=bar_clean_from, bar_cols=cols, bar_heads=heads,
                      block_size=index.block_size, num_q=index.num_q, num_k=index.num_k,
                      index_bars=index.bar_pos is not None,
                      bar=cfg["bar"] or 0, bar_kv=bar_kv, split=split, fwd=cfg["fwd"], dq=cfg["dq"],
                      dkdv=cfg["dkdv"])
