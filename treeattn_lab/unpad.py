"""Padded batches back to rollouts: the ``[B, L]`` layout trainers produce, without its pads.

RL trainers hold a group of rollouts as ``input_ids [B, L]`` with an ``attention_mask [B, L]`` that is 1
at real tokens. The real tokens of a row form one contiguous run: right padding puts the run first, left
padding last, and a GRPO batch (prompts left-padded, completions right-padded, side by side) puts it in
the middle. :func:`unpad` returns each row's run, the rollout :meth:`RolloutTrie.from_padded
<treeattn_lab.trie.RolloutTrie.from_padded>` builds the trie of.

Instead of a mask a ``pad_id`` may name the padding: every other id is real. A pad id that also occurs as
a real token (a tokenizer whose pad is its eos) cannot be told from padding that way; pass the mask.
"""

from __future__ import annotations

import numbers

import torch


def unpad(input_ids, attention_mask=None, *, pad_id: int | None = None) -> list[torch.Tensor]:
    """The real tokens of each row of ``input_ids [B, L]``, row i -> a 1-D CPU tensor.

    Real tokens are where ``attention_mask`` (bool, or 0/1 numbers; same shape) is set, or, with
    ``pad_id`` instead, where the id differs from it. They must be one non-empty contiguous run per
    row. ``input_ids`` and ``attention_mask`` may be tensors or nested lists; neither is changed.
    """
    if attention_mask is not None and pad_id is not None:
        raise TypeError("pass attention_mask or pad_id, not both")
    if attention_mask is None and pad_id is None:
        raise TypeError("pass attention_mask or pad_id to say which tokens are padding")
    ids = _as_tensor("input_ids", input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, length], got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {ids.dtype}")
    if pad_id is None:
        real = _real_from_mask(attention_mask, ids.shape)
        empty, split = (
            "row {} of attention_mask has no ones",
            "row {} of attention_mask is not one contiguous run of ones",
        )
    else:
        if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral):
            raise TypeError(f"pad_id must be an int, got {type(pad_id).__name__}")
        real = ids != int(pad_id)
        empty = f"row {{}} holds only pad_id {int(pad_id)}"
        split = f"row {{}} has pad_id {int(pad_id)} between real tokens"
        split += " (where the pad id is also a real token, pass attention_mask instead)"
    rows = []
    for i in range(ids.shape[0]):
        run = real[i].nonzero()[:, 0]
        if run.numel() == 0:
            raise ValueError(empty.format(i) + ": every rollout needs at least one token")
        start, end = int(run[0]), int(run[-1]) + 1
        if run.numel() != end - start:
            raise ValueError(split.format(i))
        rows.append(ids[i, start:end])
    return rows


def _as_tensor(name: str, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a 2-D integer tensor (or nested lists), got {type(value).__name__}")
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{name} must be a 2-D integer tensor (or nested lists): {error}") from None


def _real_from_mask(attention_mask, shape: torch.Size) -> torch.Tensor:
    """``attention_mask`` as a bool tensor of ``shape``; only 0 and 1 (or False and True) allowed."""
    mask = _as_tensor("attention_mask", attention_mask)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; input_ids {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_complex or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1 (or False and True)")
    return mask == 1
