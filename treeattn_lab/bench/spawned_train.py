"""The data-parallel step on spawned gloo CPU ranks: a self-check with fault injection, and a small demo.

Both run as one rank each, through :func:`treeattn_lab.distributed.spawn`:

- :func:`check_step` (and :func:`check_cases`, several cases on the same ranks): a float64 TinyLM on given
  rollouts with seeded token weights through :func:`treeattn_lab.distributed.distributed_tree_backward`,
  returning this rank's gradients, losses and timeline for a test to compare with single-process
  ``tree_backward``; optional faults make one rank disagree, fail, hang, exit or carry another model.
- :func:`demo_step`: the tiny TinyLM on a few rollouts of a bundled set, per partitioner the plan and the
  last step's timeline, and the gradient error against one rank training the whole trie alone.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from ..distributed.cpu_ranks import run_cases
from ..distributed.partitioners import ANCHOR, BEST
from ..distributed.step import distributed_tree_backward, plan_shares, run_step
from ..engine import tree_backward
from ..reference import TinyLM, TinyLMConfig
from ..trie import RolloutTrie
from .train import TINY


def check_model(vocab: int, dtype: torch.dtype, seed: int, dim: int = 32) -> TinyLM:
    """The small TinyLM :func:`check_step` trains, seeded."""
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=vocab, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    return TinyLM(cfg).to(dtype)


def check_step(
    seqs: list[list[int]],
    *,
    vocab: int = 50,
    seed: int = 0,
    steps: int = 1,
    corrupt_rank: int | None = None,
    short_rank: int | None = None,
    fail_rank: int | None = None,
    hang_rank: int | None = None,
    hang_s: float = 0.0,
    exit_rank: int | None = None,
    model_rank: int | None = None,
    model_change: dict | None = None,
    barrier_timeout_s: float = 30.0,
    **kwargs,
) -> dict:
    """One rank of a self-check (run it through :func:`treeattn_lab.distributed.spawn`): a float64 TinyLM
    on ``seqs`` with seeded random token weights, ``steps`` calls of ``distributed_tree_backward``.
    Returns this rank's gradients (a dict of tensors), losses and timeline.

    Fault injection: ``corrupt_rank`` changes one token weight on that rank, ``short_rank`` drops one,
    ``fail_rank`` makes that rank's model raise, ``hang_rank`` sleeps ``hang_s`` seconds before the step,
    ``exit_rank`` leaves the process with code 0 before the step, and ``model_rank`` builds its model with
    ``model_change`` (``seed``, ``dtype`` or ``dim`` of :func:`check_model`) instead."""
    rank = dist.get_rank()
    model_args = {"vocab": vocab, "dtype": torch.float64, "seed": seed}
    if rank == model_rank:
        model_args.update(model_change or {})
    model = check_model(**model_args)
    trie = RolloutTrie.from_sequences(seqs)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in seqs]
    if rank == corrupt_rank:
        weights[-1] = weights[-1].clone()
        weights[-1][-1] += 1.0
    if rank == short_rank:
        weights = weights[:-1]
    if rank == fail_rank:

        def broken(*args):
            raise RuntimeError("injected failure in the model's forward")

        model.embed.register_forward_pre_hook(broken)  # every mode of the engine embeds the tokens
    if rank == hang_rank:
        time.sleep(hang_s)
    if rank == exit_rank:
        sys.exit(0)
    result = None
    for _ in range(steps):
        result = distributed_tree_backward(
            model, trie, weights, barrier_timeout_s=barrier_timeout_s, **kwargs
        )
    return {
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "losses": result.losses,
        "timeline": result.timeline(),
        "sequences": [s.sequences for s in result.balance.shares],
        "predicted_engine": None if result.local is None else result.local.predicted_s,
        "modes": None if result.local is None else result.local.modes,
    }


def check_cases(cases: list[dict]) -> list[dict]:
    """:func:`check_step` for each case in turn on the same ranks; each case's outcome is ``{"ok": True,
    "value": ...}`` or ``{"ok": False, "error": type name, "message": ...}``. A case that breaks the group
    (a hung or lost rank) should come last."""
    return run_cases(check_step, cases)


def demo_step(
    set_name: str = "tree_search",
    *,
    max_rollouts: int = 16,
    stride: int = 3,
    max_tokens: int = 256,
    partitioners: tuple[str, ...] = (ANCHOR, BEST),
    mode: str = "auto",
    block_tokens: int = 64,
    token_budget: int | None = 512,
    steps: int = 2,
) -> dict:
    """One rank of a small real run (through :func:`treeattn_lab.distributed.spawn`): the tiny TinyLM
    (fp32) on ``max_rollouts`` rollouts of a bundled set (every ``stride``-th, cut to ``max_tokens``). Per
    partitioner: the plan's numbers and the last step's timeline; then the largest relative gradient
    error against this rank running the whole trie alone."""
    from ..datasets import load_rollouts

    seqs = [s[:max_tokens] for s in load_rollouts(set_name)[::stride][:max_rollouts]]
    trie = RolloutTrie.from_sequences(seqs)
    torch.manual_seed(0)  # the same weights on every rank
    model = TinyLM(TINY)
    engine = {"mode": mode, "block_tokens": block_tokens, "token_budget": token_budget}
    out = {"timelines": {}, "plans": {}}
    for name in partitioners:
        plan = plan_shares(trie, partitioner=name, **engine)
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            result = run_step(model, plan)
        out["timelines"][name] = result.timeline()
        out["plans"][name] = plan.balance.row()
    together = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    tree_backward(model, trie, None, **engine)
    out["grad_rel_error"] = max(
        float((together[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
        for n, p in model.named_parameters()
    )
    return out
