"""RL objectives over per-rollout log-probs: GRPO advantages, PPO-clip (DAPO's asymmetric clip), k3 KL.

Rollouts are ragged: rollout i has log-probs ``logp_i [n_i]`` (what :func:`treeattn_lab.engine.tree_logprobs`
returns: ``logp_i[t - 1] = log p(x_i[t] | x_i[<t])``) and a mask ``m_i [n_i]`` that is 1 on the tokens the
loss counts (the completion) and 0 elsewhere (the prompt). With old-policy log-probs ``old_i``, reference
log-probs ``ref_i`` and one advantage ``A_i`` per rollout:

    ratio      r_it = exp(logp_it - old_it)                         ("token" importance sampling)
               r_i  = exp(sum_t m_it (logp_it - old_it) / sum_t m_it)   ("sequence", as in GSPO)
    PPO-clip   l_it = -min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)
    k3 KL      k_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1
    per token  L_it = l_it + beta k_it

and the loss aggregates ``m_it L_it`` over G rollouts by ``loss_type``:

    "grpo"            1/G sum_i (sum_t m_it L_it / max(1, sum_t m_it))      per-sequence mean
    "bnpo", "dapo"    sum_it m_it L_it / max(1, sum_it m_it)                token mean over the group
    "dr_grpo"         sum_it m_it L_it / (G * max_completion_length)        constant length (Dr. GRPO)

These are TRL's ``GRPOTrainer`` definitions (``loss_type``, ``epsilon``/``epsilon_high``, ``beta``,
``importance_sampling_level``) for one process and one accumulation step (``"dapo"`` divides by the
batch's completion tokens, TRL's ``num_items_in_batch``). :func:`grpo_objective` closes over everything
but the current log-probs, which is the form :func:`treeattn_lab.engine.tree_backward` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..checks import check_int

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4  # added to the standard deviation before dividing (TRL's constant)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "group") -> torch.Tensor:
    """GRPO advantages of rewards ``[G * k]`` laid out group by group (k = ``group_size`` rollouts each):

        A_i = (R_i - mean_{j in group(i)} R_j) / (std + 1e-4)

    with ``std`` the unbiased standard deviation of the group (``scale="group"``) or of the whole batch
    (``"batch"``); ``"none"`` does not divide (Dr. GRPO).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.dtype.is_floating_point:
        raise TypeError("rewards must be a 1-D floating-point tensor")
    check_int("group_size", group_size)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    grouped = rewards.view(-1, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    std = (
        grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1) if scale == "group" else rewards.std()
    )
    return centred / (std + STD_EPS)


def ppo_clip(logp, old_logp, advantage, *, epsilon_low: float = 0.2, epsilon_high: float | None = None):
    """Per-token PPO-clip loss ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, ``r = exp(logp - old)``.

    ``epsilon_high`` None: symmetric clipping at ``epsilon_low``; a larger one is DAPO's clip-higher.
    """
    return _clipped(torch.exp(logp - old_logp), advantage, epsilon_low, epsilon_high)


def _clipped(ratio, advantage, epsilon_low: float, epsilon_high: float | None):
    high = epsilon_low if epsilon_high is None else epsilon_high
    return -torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - epsilon_low, 1 + high) * advantage)


def k3_kl(logp, ref_logp):
    """Per-token k3 estimator of KL(policy || reference): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def completion_masks(seq_lengths: Sequence[int], prompt_lengths: Sequence[int]) -> list[torch.Tensor]:
    """Masks ``[n_i - 1]`` that count the tokens after each rollout's prompt: ``m_i[t - 1] = t >= p_i``."""
    if len(seq_lengths) != len(prompt_lengths):
        raise ValueError(f"got {len(prompt_lengths)} prompt lengths for {len(seq_lengths)} rollouts")
    masks = []
    for i, (n, p) in enumerate(zip(seq_lengths, prompt_lengths, strict=True)):
        if not 1 <= p <= n:
            raise ValueError(f"prompt length {p} of rollout {i} is not within 1..{n}")
        masks.append(torch.arange(1, n, dtype=torch.float64) >= p)
    return masks


def _flatten(name: str, values, lengths: list[int], like: torch.Tensor) -> torch.Tensor:
    if len(values) != len(lengths):
        raise ValueError(f"{name} has {len(values)} rollouts, the log-probs {len(lengths)}")
    for i, (v, n) in enumerate(zip(values, lengths, strict=True)):
        if not isinstance(v, torch.Tensor) or v.shape != (n,):
            raise ValueError(f"{name}[{i}] must be a tensor of shape [{n}], got {getattr(v, 'shape', v)!r}")
    return torch.cat([v.detach() for v in values]).to(like.device, like.dtype)


def grpo_loss(
    logps: Sequence[torch.Tensor],
    old_logps: Sequence[torch.Tensor],
    advantages: torch.Tensor,
    masks: Sequence[torch.Tensor],
    *,
    ref_logps: Sequence[torch.Tensor] | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "grpo",
    importance_sampling: str = "token",
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """The GRPO/DAPO/Dr. GRPO loss of the module docstring, a scalar differentiable in ``logps`` only."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling not in ("token", "sequence"):
        raise ValueError(f"importance_sampling must be 'token' or 'sequence', got {importance_sampling!r}")
    if beta and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference policy's log-probs)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length")
    lengths = [lp.numel() for lp in logps]
    logp = torch.cat(list(logps))
    old = _flatten("old_logps", old_logps, lengths, logp)
    mask = _flatten("masks", [m.to(torch.float64) for m in masks], lengths, logp)
    adv = advantages.detach().to(logp.device, logp.dtype)
    if adv.shape != (len(lengths),):
        raise ValueError(f"advantages must have shape [{len(lengths)}], got {tuple(adv.shape)}")
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(logp.device)
    counts = logp.new_zeros(len(lengths)).index_add(0, owner, mask)
    log_ratio = logp - old
    if importance_sampling == "sequence":
        seq = logp.new_zeros(len(lengths)).index_add(0, owner, log_ratio * mask) / counts.clamp(min=1.0)
        log_ratio = seq[owner]
    per_token = _clipped(torch.exp(log_ratio), adv[owner], epsilon_low, epsilon_high)
    if beta:
        per_token = per_token + beta * k3_kl(logp, _flatten("ref_logps", ref_logps, lengths, logp))
    masked = per_token * mask
    if loss_type == "grpo":
        per_rollout = logp.new_zeros(len(lengths)).index_add(0, owner, masked)
        return (per_rollout / counts.clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return masked.sum() / (len(lengths) * max_completion_length)
    return masked.sum() / mask.sum().clamp(min=1.0)


def grpo_objective(old_logps, advantages, masks, **options) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """``logps -> grpo_loss(logps, old_logps, advantages, masks, **options)``, for ``tree_backward``."""

    def objective(logps):
        return grpo_loss(logps, old_logps, advantages, masks, **options)

    return objective


__all__ = [
    "LOSS_TYPES",
    "completion_masks",
    "grpo_loss",
    "grpo_objective",
    "group_advantages",
    "k3_kl",
    "ppo_clip",
]
