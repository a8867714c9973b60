"""Where the learner's time goes in a GRPO step, flat against tree: each part timed on one batch.

The *learner* is phases 3 and 4 of :mod:`treeattn_lab.rl.grpo`: the log-prob passes of the old and the
reference policy, then per PPO epoch a forward + backward through the engine, gradient clipping and an
AdamW step. A trie divides the tokens that the engine's passes compute by the token ratio (flat tokens /
tree tokens); the learner's time falls by less wherever a part does not scale with tokens:

- the optimizer step and the clipping read every parameter once per epoch, whatever the batch;
- the tree loop lays each new trie out on the host (its pack and the plans of its passes) once per step;
- every model call pays host work (Python, one dispatch per op) that hardly grows with its tokens, a
  floor under the time of a small call;
- attention scales with attended (query, key) pairs, not tokens: a tree kernel computes the trie's pairs,
  the ``"flat"`` backend those of every distinct rollout (at most the flat loop's), and the dense
  ``"reference"`` backend (``"auto"`` on a CPU) every pair of the packed row, masking most of them away.

:func:`learner_parts` times the parts on a copy of a trainer, so the run it measures goes on unchanged;
:func:`seconds_by_size` times one forward + backward on the rollouts of the first k prompts, flat and tree,
against the tokens each computes (the intercept of a line through them is the floor of a call);
:func:`flop_ratios` says what the trie saves in FLOPs under each kind of attention.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..checks import check_int
from ..engine import tree_backward, tree_logprobs
from ..engine.time_fit import model_work
from ..trie import RolloutTrie
from .grpo import GRPO, Rollouts, timed

PARTS = ("layout", "logprobs", "forward_backward", "optimizer")  # disjoint: they add up to the learner


def fresh_trie(trie: RolloutTrie) -> RolloutTrie:
    """The same rollouts in a new trie, without the layouts a pass caches on a trie (its pack and plans),
    as a GRPO step meets the trie that sampling just made."""
    return RolloutTrie.from_sequences(trie.sequences())


def learner_parts(trainer: GRPO, rollouts: Rollouts, *, attention_backend: str | None = None,
                  repeats: int = 3) -> dict[str, float]:
    """Seconds of each learner part of one GRPO step of ``trainer``'s loop on the scored ``rollouts``:
    ``"logprobs"`` (the old and reference passes), ``"layout"`` (what the first pass over a new trie costs
    more than a pass over one laid out already: the pack and plans cached on the trie),
    ``"forward_backward"`` (``ppo_epochs`` engine passes) and ``"optimizer"`` (``ppo_epochs`` clips and
    AdamW steps); ``"logprobs"`` leaves out the layout, so the parts add up to the learner's time. Each is
    the median of ``repeats`` rounds, each round on a fresh copy of the trie (:func:`fresh_trie`); one
    round before them allocates the optimizer's state and is not counted. The rounds run on a copy of the
    model with its own AdamW. ``attention_backend`` replaces the config's (it matters to the tree loop
    only)."""
    check_int("repeats", repeats)
    config = trainer.config
    if attention_backend is not None:
        config = replace(config, attention_backend=attention_backend)
    twin = GRPO(copy.deepcopy(trainer.model), trainer.task, config, mode=trainer.mode, seed=trainer.seed,
                ref_model=trainer.ref_model)
    rounds: dict[str, list[float]] = {part: [] for part in PARTS}
    for _ in range(repeats + 1):
        batch = replace(rollouts.batch, trie=fresh_trie(rollouts.batch.trie))
        fresh = Rollouts(rollouts.problems, batch, rollouts.rewards, rollouts.advantages)
        times: dict[str, float] = {}
        with timed(times, "logprobs", twin.device):
            objective = twin.objective(fresh)
        for _ in range(config.ppo_epochs):
            with timed(times, "forward_backward", twin.device):
                twin.backward(fresh, objective)
            with timed(times, "optimizer", twin.device):
                torch.nn.utils.clip_grad_norm_(twin.model.parameters(), config.grad_clip)
                twin.optimizer.step()
        with torch.no_grad():  # one pass over a new trie against one over a trie laid out already
            with timed(times, "new", twin.device):
                tree_logprobs(twin.model, fresh_trie(batch.trie), **twin.engine)
            with timed(times, "laid_out", twin.device):
                tree_logprobs(twin.model, batch.trie, **twin.engine)
        times["layout"] = max(0.0, times.pop("new") - times.pop("laid_out"))
        times["logprobs"] = max(0.0, times["logprobs"] - times["layout"])
        for part in PARTS:
            rounds[part].append(times[part])
    return {part: statistics.median(values[1:]) for part, values in rounds.items()}


def seconds_by_size(model, trie: RolloutTrie, group_size: int, engines: dict[str, dict], *,
                    prompts: Sequence[int] = (1, 2, 4, 8, 16), repeats: int = 3) -> list[dict]:
    """One forward + backward (the NLL of every token, :func:`treeattn_lab.engine.tree_backward`) over the
    rollouts of the first k prompts of ``trie`` (``group_size`` rollouts each, prompt-major), for each k
    in ``prompts`` and each loop of ``engines`` (``{loop: tree_backward keyword arguments}``, e.g.
    :attr:`GRPO.engine`). Returns one row per (loop, k): ``{"loop", "prompts", "tokens", "seconds"}``, with
    ``tokens`` what the loop computes (flat tokens in engine mode ``"flat"``, else tree tokens) and
    ``seconds`` the median of ``repeats`` calls, each on a fresh trie, after one uncounted call. The
    gradients go to a copy of ``model``."""
    check_int("group_size", group_size)
    check_int("repeats", repeats)
    twin = copy.deepcopy(model)
    device = next(twin.parameters()).device
    rows = []
    for k in prompts:
        count = check_int("prompts[...]", k) * group_size
        if count > trie.num_sequences:
            raise ValueError(f"{k} prompts of {group_size} rollouts: the trie holds {trie.num_sequences}")
        sub = trie.subtrie(range(count))
        stats = sub.stats()
        for loop, engine in engines.items():
            seconds = []
            for _ in range(repeats + 1):
                call = fresh_trie(sub)
                times: dict[str, float] = {}
                with timed(times, "call", device):
                    tree_backward(twin, call, **engine)
                seconds.append(times["call"])
                twin.zero_grad(set_to_none=True)
            tokens = stats["flat_tokens"] if engine.get("mode") == "flat" else stats["tree_tokens"]
            rows.append({"loop": loop, "prompts": k, "tokens": tokens,
                         "seconds": statistics.median(seconds[1:])})
    return rows


def flop_ratios(model, trie: RolloutTrie) -> dict[str, float]:
    """Flat FLOPs over tree FLOPs of one forward + backward over ``trie``, for each way the tree loop may
    run attention, with the token ratio and attention's share of the flat loop's FLOPs beside them.

    FLOPs are :func:`treeattn_lab.engine.time_fit.model_work`'s: per token (every matmul weight: the
    linear layers and the LM head) and per attended pair. The flat loop computes every rollout's tokens
    and causal pairs. The tree loop computes the tree tokens, and as pairs: the trie's (``"tree_kernel"``),
    the causal pairs of every distinct root-to-leaf rollout (``"flat"`` backend: a rollout that another
    one contains is not run), or all T x T pairs of the packed row of T tokens (``"reference"``)."""
    work = model_work(model)
    stats = trie.stats()
    token, pair = work["flops_per_token"], work["flops_per_pair"]
    flat = stats["flat_tokens"] * token + stats["flat_attention_pairs"] * pair
    tree_tokens = stats["tree_tokens"] * token
    leaf_pairs = sum(n * (n + 1) // 2 for n in (trie.nodes[leaf].end_depth for leaf in trie.leaves()))
    return {
        "token_ratio": stats["token_ratio"],
        "attention_share_flat": stats["flat_attention_pairs"] * pair / flat,
        "tree_kernel": flat / (tree_tokens + stats["tree_attention_pairs"] * pair),
        "flat": flat / (tree_tokens + leaf_pairs * pair),
        "reference": flat / (tree_tokens + stats["tree_tokens"] ** 2 * pair),
    }


__all__ = ["PARTS", "flop_ratios", "fresh_trie", "learner_parts", "seconds_by_size"]
