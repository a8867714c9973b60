"""A drop-in for TRL's ``GRPOTrainer`` that runs every batch through the rollout trie.

    from treeattn_lab.integrations.trl import TreeGRPOTrainer   # pip install "treeattn_lab[trl]"

    trainer = TreeGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                              tree_mode="auto", block_tokens=2048, token_budget=None)
    trainer.train()

TRL hands the loss a batch of rows ``[left-padded prompt | right-padded completion]``; the G completions of
one prompt share it. :class:`TreeGRPOTrainer` changes two things and keeps everything else (generation,
rewards, advantages, logging, the optimizer):

- the per-token log-probs TRL computes without autograd (the old policy's when the step is off-policy,
  the reference model's when ``beta > 0``) come from :func:`treeattn_lab.engine.tree_logprobs` over the
  trie of the batch's rows (:meth:`RolloutTrie.from_padded`, pads dropped): each shared token once;
- the loss: :func:`treeattn_lab.engine.tree_backward` with TRL's own loss
  (:class:`treeattn_lab.rl.objectives.GRPOObjective`: ``loss_type`` grpo/bnpo/dapo/dr_grpo,
  ``epsilon``/``epsilon_high``, ``beta`` with the k3 KL, token or sequence importance sampling, and
  TRL's normalisation for gradient accumulation) fills ``.grad`` exactly as the stock trainer's
  backward would. The loss returned to ``Trainer`` carries the same value and no gradient of its own.
  TRL's ``kl`` and ``clip_ratio/*`` metrics are logged (from this process's batch); ``entropy`` is not
  (the training pass computes no entropies).

What the tree cannot reproduce is refused when the trainer is built: other loss types, entropy masks or
bonuses, off-policy masks, vLLM importance-sampling corrections, sampling temperatures other than 1
(TRL divides the logits by it inside its fused head), ``delta`` clipping, MoE auxiliary losses;
multimodal and tool-masked batches are refused when they arrive. So is more than one process: the tree
fills ``.grad`` outside DDP's forward, where no all-reduce averages it across ranks.

Under ``torch.no_grad()`` (``Trainer.evaluate`` and ``prediction_step``) the loss is the same objective
of :func:`treeattn_lab.engine.tree_logprobs`'s log-probs, with no backward.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from ..engine import tree_backward, tree_logprobs
from ..rl.objectives import LOSS_TYPES, completion_masks, grpo_objective
from ..trie import RolloutTrie

_UNSUPPORTED_INPUTS = ("tool_mask", "pixel_values", "image_grid_thw", "token_type_ids", "mm_token_type_ids")


class _Scaled:
    """``factor * objective`` for an objective with per-rollout terms (keeps the one-pass protocol)."""

    def __init__(self, objective, factor: float):
        self.objective, self.factor = objective, factor
        self.num_rollouts = objective.num_rollouts

    def __call__(self, logps):
        return self.factor * self.objective(logps)

    def rollout_term(self, i, logp):
        return self.factor * self.objective.rollout_term(i, logp)

    def rollout_terms(self, rollouts, logps):
        return self.factor * self.objective.rollout_terms(rollouts, logps)


class _Done(torch.autograd.Function):
    """A loss value for ``Trainer.training_step`` whose backward adds nothing (``.grad`` is already full)."""

    @staticmethod
    def forward(ctx, value, anchor):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None


def _check_trainer(trainer) -> None:
    args = trainer.args
    refusals = [
        (trainer.loss_type not in LOSS_TYPES, f"loss_type {trainer.loss_type!r} (supported: {LOSS_TYPES})"),
        (trainer.top_entropy_quantile < 1.0, "top_entropy_quantile < 1 (entropy masks)"),
        (getattr(trainer, "_entropy_bonus_enabled", False), "an entropy bonus"),
        (trainer.off_policy_mask_threshold is not None, "off_policy_mask_threshold"),
        (
            trainer.use_vllm and trainer.vllm_importance_sampling_correction,
            "vLLM importance-sampling correction",
        ),
        (
            trainer.temperature != 1.0,
            f"temperature={trainer.temperature} (the tree's head uses temperature 1)",
        ),
        (args.delta is not None, "delta (two-sided clipping)"),
        (trainer.aux_loss_enabled, "MoE auxiliary losses"),
        (
            trainer.accelerator.num_processes > 1,
            f"{trainer.accelerator.num_processes} processes (the tree fills .grad outside DDP's forward, so "
            "ranks' gradients would not be averaged: TreeGRPOTrainer supports one process)",
        ),
    ]
    refused = [what for bad, what in refusals if bad]
    if refused:
        raise ValueError(
            f"TreeGRPOTrainer cannot reproduce {', '.join(refused)}; use trl.GRPOTrainer for these"
        )


def _ragged(padded, prompt_lengths, completion_lengths):
    """Per rollout ``[p + c - 1]`` from TRL's ``[B, C]`` completion values (the prompt's slots: zeros)."""
    if padded is None:
        return None
    out = []
    for row, p, c in zip(padded, prompt_lengths, completion_lengths, strict=True):
        values = torch.zeros(p + c - 1, dtype=torch.float64)
        values[p - 1 :] = row[:c].detach().to("cpu", torch.float64)
        out.append(values)
    return out


class TreeGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with log-probs and loss computed over the trie of each batch (module docstring).

    ``tree_mode``, ``block_tokens``, ``token_budget`` and ``attention_backend`` are
    :func:`treeattn_lab.engine.tree_backward`'s; every other argument is ``GRPOTrainer``'s.
    """

    def __init__(
        self,
        *args,
        tree_mode="auto",
        block_tokens=2048,
        token_budget=None,
        attention_backend="auto",
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        _check_trainer(self)
        self.tree_options = {
            "mode": tree_mode,
            "block_tokens": block_tokens,
            "token_budget": token_budget,
            "attention_backend": attention_backend,
        }

    # ------------------------------------------------------------------ log-probs without autograd
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        *args,
        compute_entropy=False,
        compute_aux_loss=False,
        **kwargs,
    ):
        extra = [
            k
            for k, v in kwargs.items()
            if v is not None and k not in ("batch_size", "num_images", "num_tiles")
        ]
        if torch.is_grad_enabled() or compute_aux_loss or extra:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                *args,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **kwargs,
            )
        model = self.accelerator.unwrap_model(model)
        trie = RolloutTrie.from_padded(input_ids, attention_mask)
        out = tree_logprobs(model, trie, entropy=compute_entropy, **self.tree_options)
        logps, entropies = out if compute_entropy else (out, None)
        completion = attention_mask[:, -logits_to_keep:].sum(1).tolist()

        def padded(values):
            rows = torch.zeros(len(values), logits_to_keep, dtype=values[0].dtype, device=input_ids.device)
            for r, (v, c) in enumerate(zip(values, completion, strict=True)):
                rows[r, :c] = v[v.numel() - c :]
            return rows

        return padded(logps), (padded(entropies) if compute_entropy else None), None

    # ------------------------------------------------------------------ the loss
    def _loss_scale(self, mask_tokens: float, inputs) -> float:
        """TRL's normalisation beyond the loss type's own: gradient accumulation, DAPO's batch count."""
        train = self.model.training
        accumulation = self.current_gradient_accumulation_steps if train else 1.0
        if self.loss_type != "dapo":
            return 1.0 / accumulation
        normalizer = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
        if train:
            normalizer = (
                normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            )
        return max(mask_tokens, 1.0) / normalizer

    def _compute_loss(self, model, inputs):
        unsupported = [k for k in _UNSUPPORTED_INPUTS if inputs.get(k) is not None]
        if unsupported:
            raise ValueError(f"TreeGRPOTrainer does not handle batches with {unsupported}")
        prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        trie = RolloutTrie.from_padded(ids, torch.cat([prompt_mask, completion_mask], dim=1))
        prompt_lengths = prompt_mask.sum(1).tolist()
        completion_lengths = completion_mask.sum(1).tolist()
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError("TreeGRPOTrainer takes one advantage per completion (advantages of shape [B])")
        objective = grpo_objective(
            _ragged(inputs.get("old_per_token_logps"), prompt_lengths, completion_lengths),
            advantages,
            completion_masks(trie.seq_lengths, prompt_lengths),
            ref_logps=_ragged(inputs.get("ref_per_token_logps"), prompt_lengths, completion_lengths),
            beta=self.beta,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            loss_type=self.loss_type,
            importance_sampling=self.importance_sampling_level,
            max_completion_length=self.max_completion_length,
            kl_importance_weight=bool(self.args.use_bias_correction_kl),
        )
        scaled = _Scaled(objective, self._loss_scale(float(completion_mask.sum()), inputs))
        unwrapped = self.accelerator.unwrap_model(model)
        anchor = next(p for p in model.parameters() if p.requires_grad)
        if torch.is_grad_enabled():
            result = tree_backward(unwrapped, trie, objective=scaled, **self.tree_options)
            logps, loss = result.logps, result.loss
        else:  # evaluation: the loss's value only
            logps = tree_logprobs(unwrapped, trie, **self.tree_options)
            loss = float(scaled(logps))
        mode = "train" if self.model.training else "eval"
        for key, value in objective.metrics(logps).items():  # TRL's, but this process's only
            self._metrics[mode][key].append(value)
        value = torch.tensor(loss, device=anchor.device, dtype=torch.float32)
        return _Done.apply(value, anchor) if torch.is_grad_enabled() else value


__all__ = ["TreeGRPOTrainer"]
