"""How to run a rollout trie through a model: DFS materialization, micro-batching, cost model and fallback.

- :func:`tree_backward` (``tree_backward.py``): the training entry point; fills ``.grad`` with the
  gradient of any objective of the rollouts' log-probs exactly as flat training would.
- :func:`tree_logprobs` (``logprobs.py``): per-token log-probs (and entropies) without autograd.
- :func:`hf_tree_attention` (``hf_attention.py``): a Hugging Face model over a pack with tree attention.
- :func:`compile_layers` (``adapters.py``): ``torch.compile`` every decoder layer of a model for the engine.
- ``adapters.py``: the model door (TinyLM, Hugging Face causal LMs); ``attention.py``: the attentions it
  hands the model; ``loss_plan.py``: the loss written once per tree token; ``lm_head.py``: the head by
  chunks of rows; ``call_plan.py``: argument checks, micro-batches and modes of a call;
  ``rollout_terms.py``: objectives that are sums of per-rollout terms, trained in one pass.
- ``microbatch.py``: dynamic micro-batching; ``modes.py`` and ``dfs.py``: flat, packed and DFS runs;
  ``block_attention.py``: a DFS block's attention over the stored prefix (its rule, mask and kernel);
  ``cost_model.py``: predicted time and memory per mode and the ``"auto"`` choice; ``time_fit.py``: the
  work features and the fit of a mode's time, ``max(host, device)`` per micro-batch;
  ``calibration.py``: the measurements it is fitted on; ``nnls.py``: the non-negative least squares solver.
"""

from .adapters import adapt, compile_layers
from .calibration import calibrate
from .cost_model import CostModel, MicroBatchShape
from .hf_attention import hf_tree_attention
from .logprobs import tree_logprobs
from .microbatch import MicroBatch, plan_micro_batches
from .modes import MODES
from .tree_backward import TreeBackwardReport, TreeBackwardResult, tree_backward

__all__ = [
    "MODES",
    "CostModel",
    "MicroBatch",
    "MicroBatchShape",
    "TreeBackwardReport",
    "TreeBackwardResult",
    "adapt",
    "calibrate",
    "compile_layers",
    "plan_micro_batches",
    "hf_tree_attention",
    "tree_backward",
    "tree_logprobs",
]
