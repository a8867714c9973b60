"""RL objectives over per-rollout log-probs: GRPO advantages, PPO-clip (DAPO's asymmetric clip), k3 KL.

Rollouts are ragged: rollout i has log-probs ``logp_i [n_i]`` (what :func:`treeattn_lab.engine.tree_logprobs`
returns: ``logp_i[t - 1] = log p(x_i[t] | x_i[<t])``) and a mask ``m_i [n_i]`` that is 1 on the tokens the
loss counts (the completion) and 0 elsewhere (the prompt). With old-policy log-probs ``old_i``, reference
log-probs ``ref_i`` and one advantage ``A_i`` per rollout:

    ratio      r_it = exp(logp_it - old_it)                         ("token" importance sampling)
               r_i  = exp(sum_t m_it (logp_it - old_it) / sum_t m_it)   ("sequence", as in GSPO)
    PPO-clip   l_it = -min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)
    k3 KL      k_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1
               k_it * r_it (or r_i) with ``kl_importance_weight``: the unbiased reverse-KL gradient
    per token  L_it = l_it + beta k_it

and the loss aggregates ``m_it L_it`` over G rollouts by ``loss_type``:

    "grpo"            1/G sum_i (sum_t m_it L_it / max(1, sum_t m_it))      per-sequence mean
    "bnpo", "dapo"    sum_it m_it L_it / max(1, sum_it m_it)                token mean over the group
    "dr_grpo"         sum_it m_it L_it / (G * max_completion_length)        constant length (Dr. GRPO)

These are TRL's ``GRPOTrainer`` definitions (``loss_type``, ``epsilon``/``epsilon_high``, ``beta``,
``importance_sampling_level``, ``use_bias_correction_kl``) for one process and one accumulation step
(``"dapo"`` divides by the batch's completion tokens, TRL's ``num_items_in_batch``).
:func:`grpo_objective` closes over everything but the current log-probs, which is the form
:func:`treeattn_lab.engine.tree_backward` takes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..checks import check_int

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4  # added to the standard deviation before dividing (TRL's constant)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "group") -> torch.Tensor:
    """GRPO advantages of rewards ``[G * k]`` laid out group by group (k = ``group_size`` rollouts each):

        A_i = (R_i - mean_{j in group(i)} R_j) / (std + 1e-4)

    with ``std`` the unbiased standard deviation of the group (``scale="group"``) or of the whole batch
    (``"batch"``); ``"none"`` does not divide (Dr. GRPO). A standard deviation needs two members, so
    ``scale="group"`` needs ``group_size >= 2`` and ``"batch"`` two rewards in all.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.dtype.is_floating_point:
        raise TypeError("rewards must be a 1-D floating-point tensor")
    check_int("group_size", group_size)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if scale == "group" and group_size < 2:
        raise ValueError(
            "scale='group' divides by each group's standard deviation, which needs group_size >= 2, "
            f"got {group_size} (scale='batch' or 'none' take groups of one)"
        )
    if scale == "batch" and rewards.numel() < 2:
        raise ValueError(
            f"scale='batch' divides by the batch's standard deviation, which needs >= 2 rewards, "
            f"got {rewards.numel()}"
        )
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


def _check_finite(name: str, values: torch.Tensor, counted: torch.Tensor, lengths: list[int]) -> None:
    """Refuse a NaN or infinite value where the loss reads it (``counted``): it would reach every gradient."""
    bad = counted & ~torch.isfinite(values)
    if bool(bad.any()):
        rollout = int(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[bad][0])
        raise ValueError(f"{name}[{rollout}] holds NaN or infinite values where the loss counts it")


def _advantage_tensor(advantages, rollouts: int) -> torch.Tensor:
    """One float64 advantage per rollout, from a tensor or a sequence of numbers."""
    if not isinstance(advantages, torch.Tensor):
        if isinstance(advantages, (str, bytes)) or not isinstance(advantages, Sequence):
            raise TypeError(
                f"advantages must be a tensor or a sequence of numbers, got {type(advantages).__name__}"
            )
        try:
            advantages = torch.tensor(list(advantages), dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"advantages must be a tensor or a sequence of numbers: {error}") from None
    advantages = advantages.detach().to(torch.float64)
    if advantages.shape != (rollouts,):
        raise ValueError(f"advantages must have shape [{rollouts}], got {tuple(advantages.shape)}")
    return advantages


@dataclass(frozen=True)
class GRPOOptions:
    """The settings of the loss (module docstring); TRL's names are ``beta``, ``epsilon``
    (= ``epsilon_low``), ``epsilon_high``, ``loss_type``, ``importance_sampling_level``,
    ``use_bias_correction_kl`` (= ``kl_importance_weight``)."""

    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "grpo"
    importance_sampling: str = "token"
    max_completion_length: int | None = None
    kl_importance_weight: bool = False

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling not in ("token", "sequence"):
            raise ValueError(
                f"importance_sampling must be 'token' or 'sequence', got {self.importance_sampling!r}"
            )
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        bounds = {"beta": self.beta, "epsilon_low": self.epsilon_low, "epsilon_high": self.epsilon_high}
        for name, value in bounds.items():
            if value is not None and not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _token_terms(logp, old, ref, mask, owner, rollouts: int, o: GRPOOptions):
    """``(ratio, kl)`` per token for flattened rollouts (``owner``: each token's rollout; ``kl`` None
    without ``beta``), the KL already importance-weighted when ``kl_importance_weight``.

    ``old`` None: the current policy (``old = logp`` detached: ratio 1, gradient of the log-prob). Off the
    mask, old and reference log-probs are replaced by the current ones, so values there never matter
    (not even an overflow of ``exp``: a masked NaN would still poison the gradient).
    """
    current = logp.detach()
    counted = mask > 0
    old = current if old is None else torch.where(counted, old, current)
    log_ratio = logp - old
    if o.importance_sampling == "sequence":
        counts = logp.new_zeros(rollouts).index_add(0, owner, mask).clamp(min=1.0)
        log_ratio = (logp.new_zeros(rollouts).index_add(0, owner, log_ratio * mask) / counts)[owner]
    ratio = torch.exp(log_ratio)
    if not o.beta:
        return ratio, None
    kl = k3_kl(logp, torch.where(counted, ref, current))
    return ratio, (kl * ratio if o.kl_importance_weight else kl)


def _token_losses(logp, old, ref, adv, mask, owner, rollouts: int, o: GRPOOptions):
    """``L_it`` of the module docstring for flattened rollouts, ``adv`` per token (:func:`_token_terms`)."""
    ratio, kl = _token_terms(logp, old, ref, mask, owner, rollouts, o)
    per_token = _clipped(ratio, adv, o.epsilon_low, o.epsilon_high)
    return per_token if kl is None else per_token + o.beta * kl


class GRPOObjective:
    """``objective(logps)``: the loss of the module docstring for fixed old/reference log-probs
    (``old_logps=None``: on-policy, the current log-probs detached), advantages and masks; also a sum
    of per-rollout terms, ``rollout_term(i, logps[i])`` (``rollout_terms`` sums several in one batch),
    which lets :func:`treeattn_lab.engine.tree_backward` train every micro-batch in one pass."""

    def __init__(self, old_logps, advantages, masks, *, ref_logps=None, **options):
        self.options = o = GRPOOptions(**options)
        if o.beta and ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps (the reference policy's log-probs)")
        self.lengths = lengths = [m.numel() for m in masks]
        G, like = len(lengths), torch.zeros(0, dtype=torch.float64)
        advantages = _advantage_tensor(advantages, G)
        _check_finite("advantages", advantages, torch.ones(G, dtype=torch.bool), [1] * G)
        mask = _flatten("masks", [m.to(torch.float64) for m in masks], lengths, like)
        counts = [float(m.sum()) for m in mask.split(lengths)]
        if o.loss_type == "grpo":
            denominators = [G * max(1.0, c) for c in counts]
        elif o.loss_type == "dr_grpo":
            denominators = [float(G * o.max_completion_length)] * G
        else:
            denominators = [max(1.0, sum(counts))] * G
        owner = torch.repeat_interleave(torch.arange(G), torch.tensor(lengths, dtype=torch.int64))
        # per token, rollouts concatenated (float64, CPU); moved to a device once (see _on)
        self.flat = {
            "old": None if old_logps is None else _flatten("old_logps", old_logps, lengths, like),
            "ref": _flatten("ref_logps", ref_logps, lengths, like) if o.beta else None,
            "mask": mask,
            "advantage": advantages[owner],
            "weight": mask / torch.tensor(denominators, dtype=torch.float64)[owner],
        }
        for name in ("old", "ref"):
            if self.flat[name] is not None:
                _check_finite(f"{name}_logps", self.flat[name], mask > 0, lengths)
        self._cache: dict = {}

    @property
    def num_rollouts(self) -> int:
        """How many rollouts the objective scores (``tree_backward`` checks it against the trie)."""
        return len(self.lengths)

    def _on(self, device, dtype) -> dict:
        """``self.flat`` on ``device`` in ``dtype``, whole (``"flat"``) and split per rollout."""
        key = (str(device), dtype)
        if key not in self._cache:
            whole = {k: None if v is None else v.to(device, dtype) for k, v in self.flat.items()}
            split = {k: None if v is None else v.split(self.lengths) for k, v in whole.items()}
            self._cache[key] = {"flat": whole, "split": split}
        return self._cache[key]

    def _check(self, i: int, logp: torch.Tensor) -> None:
        if logp.shape != (self.lengths[i],):
            raise ValueError(f"logps[{i}] must have shape [{self.lengths[i]}], got {tuple(logp.shape)}")

    def _loss(self, logp, values, owner, rollouts: int):
        per_token = _token_losses(
            logp,
            values["old"],
            values["ref"],
            values["advantage"],
            values["mask"],
            owner,
            rollouts,
            self.options,
        )
        return (per_token * values["weight"]).sum()

    def rollout_term(self, i: int, logp: torch.Tensor) -> torch.Tensor:
        """Rollout ``i``'s share of the loss: the loss is the sum of these over the rollouts."""
        return self.rollout_terms([i], [logp])

    def rollout_terms(self, rollouts: Sequence[int], logps: Sequence[torch.Tensor]) -> torch.Tensor:
        """``sum_r rollout_term(rollouts[r], logps[r])``, computed as one batch."""
        if len(rollouts) != len(logps):
            raise ValueError(f"got {len(logps)} log-prob tensors for {len(rollouts)} rollouts")
        for i, lp in zip(rollouts, logps, strict=True):
            self._check(i, lp)
        logp = torch.cat(list(logps))
        values, owner = self._gathered(tuple(rollouts), logp.device, logp.dtype)
        return self._loss(logp, values, owner, len(rollouts))

    def _gathered(self, rollouts: tuple[int, ...], device, dtype):
        """``(values, owner)`` of ``rollouts``: the per-token fields of :meth:`_on`, those rollouts'
        tokens in that order, and each token's place in ``rollouts``; made once per rollout tuple (every
        PPO epoch scores the same micro-batches)."""
        key = ("gathered", rollouts, str(device), dtype)
        if key not in self._cache:
            on = self._on(device, dtype)
            if list(rollouts) == list(range(len(self.lengths))):
                values = on["flat"]
            else:
                split = on["split"].items()
                values = {k: None if v is None else torch.cat([v[i] for i in rollouts]) for k, v in split}
            lengths = torch.tensor([self.lengths[i] for i in rollouts], dtype=torch.int64)
            owner = torch.repeat_interleave(torch.arange(len(rollouts)), lengths).to(device)
            self._cache[key] = (values, owner)
        return self._cache[key]

    @torch.no_grad()
    def metrics(self, logps: Sequence[torch.Tensor]) -> dict[str, float]:
        """TRL's logged statistics of the loss at ``logps``: the masked mean of the (weighted) k3 KL
        (with ``beta``), and the fraction of counted tokens clipped below (``ratio < 1 - eps_low`` with
        a negative advantage), above (``ratio > 1 + eps_high``, positive advantage) or either; with
        sequence-level ratios the fractions are over rollouts. ``low_min`` / ``high_max``: the extreme
        per-rollout fractions."""
        logp = torch.cat([lp.detach().to("cpu", torch.float64) for lp in logps])
        v = self.flat
        G, o = len(self.lengths), self.options
        owner = torch.repeat_interleave(torch.arange(G), torch.tensor(self.lengths))
        ratio, kl = _token_terms(logp, v["old"], v["ref"], v["mask"], owner, G, o)
        high = o.epsilon_low if o.epsilon_high is None else o.epsilon_high
        adv, mask = v["advantage"], v["mask"]
        flags = {"low": (ratio < 1 - o.epsilon_low) & (adv < 0), "high": (ratio > 1 + high) & (adv > 0)}
        flags["region"] = flags["low"] | flags["high"]
        counts = torch.zeros(G, dtype=torch.float64).index_add(0, owner, mask)
        out = {} if kl is None else {"kl": float((kl * mask).sum() / mask.sum().clamp(min=1.0))}
        per_rollout = {}
        for name, flag in flags.items():
            per_rollout[name] = torch.zeros(G, dtype=torch.float64).index_add(0, owner, flag * mask) / counts
            if o.importance_sampling == "sequence":
                out[f"clip_ratio/{name}_mean"] = float(per_rollout[name].nanmean())
            else:
                out[f"clip_ratio/{name}_mean"] = float((flag * mask).sum() / mask.sum().clamp(min=1.0))
        low, high = (per_rollout[n][~per_rollout[n].isnan()] for n in ("low", "high"))
        # with every mask zero no rollout counts a token: nothing was clipped
        out["clip_ratio/low_min"] = float(low.min()) if low.numel() else 0.0
        out["clip_ratio/high_max"] = float(high.max()) if high.numel() else 0.0
        return out

    def __call__(self, logps: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(logps) != len(self.lengths):
            raise ValueError(
                f"got log-probs of {len(logps)} rollouts for an objective of {len(self.lengths)}"
            )
        return self.rollout_terms(range(len(self.lengths)), logps)


def grpo_objective(old_logps, advantages, masks, **options) -> GRPOObjective:
    """The loss as a function of the current log-probs only (the form ``tree_backward`` takes)."""
    return GRPOObjective(old_logps, advantages, masks, **options)


def grpo_loss(logps, old_logps, advantages, masks, **options) -> torch.Tensor:
    """The GRPO/DAPO/Dr. GRPO loss of the module docstring, a scalar differentiable in ``logps`` only.
    ``options``: :class:`GRPOOptions` and ``ref_logps``."""
    return GRPOObjective(old_logps, advantages, masks, **options)(logps)


__all__ = [
    "LOSS_TYPES",
    "GRPOObjective",
    "GRPOOptions",
    "completion_masks",
    "grpo_loss",
    "grpo_objective",
    "group_advantages",
    "k3_kl",
    "ppo_clip",
]
