"""Several ranks: partitioning rollout tries across GPUs, data-parallel training on them, ring attention.

- :mod:`.costs`, :mod:`.partitioners`, :mod:`.balance`: what a rank pays for its rollouts, the
  partitioners, and :func:`.balance.balance` (the partition and its report).
- :mod:`.agreement`: the process group, and how ranks agree on their inputs before computing together.
- :mod:`.step`: :func:`plan_shares`, :func:`run_step` and :func:`distributed_tree_backward`, training on a
  trie over ranks; :mod:`.probe`: the cost model refined on the real rollouts.
- :mod:`.cpu_ranks`: :func:`spawn`, gloo ranks as fresh CPU processes (tests, notebooks, demos).
- :mod:`.layouts`, :mod:`.ring`, :mod:`.simulate`: sparse ring attention, its layouts and its work.

Runners live outside the library: ``treeattn_lab.bench.multi_gpu_train`` (torchrun training),
``treeattn_lab.bench.ring`` (the ring against one device) and ``treeattn_lab.bench.balance``.
"""

from .agreement import RankFailureError, RankMismatchError, init_distributed
from .cpu_ranks import spawn
from .probe import refine_cost_model
from .ring import ring_sparse_attention
from .step import DistributedStepResult, StepPlan, distributed_tree_backward, plan_shares, run_step

__all__ = [
    "DistributedStepResult",
    "RankFailureError",
    "RankMismatchError",
    "StepPlan",
    "distributed_tree_backward",
    "init_distributed",
    "plan_shares",
    "refine_cost_model",
    "ring_sparse_attention",
    "run_step",
    "spawn",
]
