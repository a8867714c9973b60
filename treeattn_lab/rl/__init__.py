"""Reinforcement-learning objectives for the engine: :mod:`treeattn_lab.rl.objectives`.

from treeattn_lab.engine import tree_backward, tree_logprobs
from treeattn_lab.rl import completion_masks, group_advantages, grpo_objective

old = tree_logprobs(model, trie)                    # the old policy (before the update)
ref = tree_logprobs(ref_model, trie)                # the reference policy
masks = completion_masks(trie.seq_lengths, prompt_lengths)
objective = grpo_objective(old, group_advantages(rewards, 8), masks, ref_logps=ref, beta=0.04,
                           epsilon_high=0.28, loss_type="dapo")
tree_backward(model, trie, objective=objective)     # .grad of the loss, exactly as flat training
"""

from .grpo import GRPO, GRPOConfig
from .objectives import (
    LOSS_TYPES,
    GRPOObjective,
    GRPOOptions,
    completion_masks,
    group_advantages,
    grpo_loss,
    grpo_objective,
    k3_kl,
    ppo_clip,
)
from .sample import SampleBatch, sample
from .tasks import AdditionTask, ByteTokenizer

__all__ = [
    "LOSS_TYPES",
    "GRPOObjective",
    "GRPOOptions",
    "completion_masks",
    "group_advantages",
    "grpo_loss",
    "grpo_objective",
    "k3_kl",
    "ppo_clip",
    "SampleBatch",
    "sample",
    "GRPO",
    "GRPOConfig",
    "AdditionTask",
    "ByteTokenizer",
]
