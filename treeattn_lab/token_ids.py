"""Token ids as the library takes them: a list of Python ints from a list, a sequence of integer-like
values or a 1-D integer tensor, checked to lie in int64's non-negative range, with errors that name the
offending sequence or node."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch


def token_ids(seq, what: str) -> list[int]:
    """Validate the token ids of ``what`` ("sequence 3", "node 5") and return them as a list of Python
    ints (never mutating the input); empty is allowed here."""
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1:
            raise ValueError(f"{what} is a {seq.dim()}-D tensor; expected a 1-D integer tensor")
        if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
            raise TypeError(f"{what} has dtype {seq.dtype}; token ids must be an integer dtype")
        tokens = seq.detach().cpu().tolist()
    elif isinstance(seq, (str, bytes)) or not isinstance(seq, Iterable):
        raise TypeError(f"{what} is a {type(seq).__name__}; expected a list of ints or a 1-D integer tensor")
    elif isinstance(seq, list) and all(type(t) is int for t in seq):  # plain ints: nothing to convert
        tokens = list(seq)
    else:
        tokens = [as_integer(t, f"{what} holds", "token ids") for t in seq]
    if tokens and not (min(tokens) >= 0 and max(tokens) < 2**63):
        bad = next(t for t in tokens if not 0 <= t < 2**63)
        raise ValueError(f"{what} holds the token id {bad}; ids must lie in [0, 2**63) (int64)")
    return tokens


def as_integer(value, context: str, kind: str) -> int:
    """``value`` as a Python int; ints and numpy integers pass, bools, floats and strings do not."""
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        try:
            return operator.index(value)
        except TypeError:  # e.g. a float 0-D tensor, which has __index__ but refuses it
            pass
    raise TypeError(f"{context} {value!r} of type {type(value).__name__}; {kind} must be integers")


def rollout_token_ids(seq, index: int) -> list[int]:
    """One rollout's token ids (at least one) as a list of Python ints."""
    tokens = token_ids(seq, f"sequence {index}")
    if len(tokens) == 0:
        raise ValueError(f"sequence {index} is empty; every rollout needs at least one token")
    return tokens
