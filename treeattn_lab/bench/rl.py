"""``python -m treeattn_lab bench rl``: one GRPO step, flat against the tree, phase by phase.

A step has three phases, each timed with its peak CUDA memory:

1. ``old_logps``: the policy's per-token log-probs, without autograd
   (:func:`treeattn_lab.engine.tree_logprobs`);
2. ``ref_logps``: the reference model's (a frozen copy of the policy);
3. ``train``: :func:`treeattn_lab.engine.tree_backward` with TRL's default GRPO loss
   (:func:`treeattn_lab.rl.grpo_objective`: ``loss_type="dapo"``, PPO-clip with ``epsilon`` 0.2 and
   ``epsilon_high`` 0.28, k3 KL with ``beta`` 0.04), then ``AdamW.step``.

Modes: ``flat`` (every phase on padded rollouts: the baseline), ``auto`` (the tree: the cost model,
calibrated on this device first, picks per micro-batch), and ``packed`` and ``dfs`` for reference. The
loss counts each rollout's tokens after its prompt, taken as its first trie node (the prefix its group
shares); advantages are group-normalised random rewards. Models: the bench-train TinyLM (about 0.49B
parameters on a GPU, bf16) and a random-weight Hugging Face Qwen2 of the same shape (``--models``).

Reported per (model, set, mode): seconds per phase and per step, flat tokens per second, speed-up over
flat and peak memory per phase. Checked targets: a whole step in ``auto`` runs at least 0.8 x token_ratio x
flat throughput on ``agentic`` and ``grpo_math``; ``tree_logprobs`` in dfs holds at most 25% of packed
mode's peak memory on ``agentic``. On a CPU (``--quick``) a tiny model on small subsets runs the same code.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from tqdm.auto import tqdm

from ..datasets import load_rollouts
from ..engine import MODES, calibrate, tree_backward, tree_logprobs
from ..reference import TinyLM
from ..rl import completion_masks, grpo_objective
from ..trie import RolloutTrie
from .harness import add_out_argument, choice_list, environment, positive_int, print_table, write_results
from .train import run_setup

SETS = ("grpo_math", "agentic", "tree_search", "low_sharing")
MODELS = ("tinylm", "qwen2")
STEP_MODES = ("flat", "auto") + tuple(m for m in MODES if m != "flat")
PHASES = ("old_logps", "ref_logps", "train")
GRPO = {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.04}


def build_model(name: str, cfg, device, dtype):
    """The TinyLM of ``cfg``, or a random-weight Hugging Face Qwen2 of the same shape."""
    torch.manual_seed(0)
    if name == "tinylm":
        return TinyLM(cfg).to(device, dtype)
    import transformers

    hf = transformers.Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        intermediate_size=cfg.ffn_dim,
        max_position_embeddings=32768,
    )
    return transformers.Qwen2ForCausalLM(hf).to(device, dtype)


def step_inputs(trie: RolloutTrie, seed: int = 0):
    """Completion masks (after each rollout's first trie node) and group-normalised advantages."""
    first = [trie.path(trie.seq_end_node[i])[0] for i in range(trie.num_sequences)]
    lengths = trie.seq_lengths
    prompts = [
        max(1, min(len(trie.nodes[n].tokens), length - 1)) for n, length in zip(first, lengths, strict=True)
    ]
    masks = completion_masks(lengths, prompts)
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(trie.num_sequences, generator=g, dtype=torch.float64)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(first):
        groups.setdefault(n, []).append(i)
    advantages = torch.zeros_like(rewards)
    for members in groups.values():
        r = rewards[members]
        advantages[members] = (r - r.mean()) / (r.std() + 1e-4 if len(members) > 1 else 1.0)
    return masks, advantages


def _measured(fn, device):
    """``(result, seconds, peak bytes or None, extra bytes or None)`` of ``fn()``: the CUDA peak allocated
    during the call, and that peak above what was allocated when it started (the phase's own memory, without
    the weights, optimizer state and inputs that every mode holds alike)."""
    resident = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    out = fn()
    peak = extra = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device))
        extra = peak - resident
    return out, time.perf_counter() - start, peak, extra


def grpo_step(policy, reference, optimizer, trie, masks, advantages, *, mode, **engine) -> dict:
    """One step (module docstring); per phase its seconds and peak bytes."""
    device = next(policy.parameters()).device
    row = {}
    old, row["old_logps_s"], row["old_logps_peak"], row["old_logps_extra"] = _measured(
        lambda: tree_logprobs(policy, trie, mode=mode, **engine), device
    )
    ref, row["ref_logps_s"], row["ref_logps_peak"], row["ref_logps_extra"] = _measured(
        lambda: tree_logprobs(reference, trie, mode=mode, **engine), device
    )
    objective = grpo_objective(old, advantages, masks, ref_logps=ref, **GRPO)

    def train():
        optimizer.zero_grad(set_to_none=True)
        result = tree_backward(policy, trie, objective=objective, mode=mode, **engine)
        optimizer.step()
        return result

    result, row["train_s"], row["train_peak"], row["train_extra"] = _measured(train, device)
    row["step_s"] = sum(row[f"{p}_s"] for p in PHASES)
    row["loss"] = result.loss
    row["choices"] = result.report.choices
    return row


def rl_rows(models: dict, sets, *, quick: bool, reps: int, **engine) -> list[dict]:
    """One row per (model, set, mode): the fastest of ``reps`` steps after a warm-up step."""
    rows = []
    jobs = [(m, s, mode) for m in models for s in sets for mode in STEP_MODES]
    for model_name, name, mode in tqdm(jobs, desc="bench rl", unit="step"):
        policy, reference, optimizer, cost_model = models[model_name]
        seqs = load_rollouts(name)
        if quick:
            seqs = [s[:200] for s in seqs[:8]]
        trie = RolloutTrie.from_sequences(seqs)
        masks, advantages = step_inputs(trie)
        runs = [
            grpo_step(
                policy,
                reference,
                optimizer,
                trie,
                masks,
                advantages,
                mode=mode,
                cost_model=cost_model,
                **engine,
            )
            for _ in range(1 + reps)
        ][1:]
        best = min(runs, key=lambda r: r["step_s"])
        stats = trie.stats()
        rows.append(
            {
                "model": model_name,
                "set": name,
                "mode": mode,
                "token_ratio": stats["token_ratio"],
                "flat_tokens": stats["flat_tokens"],
                "tokens_per_s": stats["flat_tokens"] / best["step_s"],
                **best,
            }
        )
    for r in rows:
        flat = next(x for x in rows if (x["model"], x["set"], x["mode"]) == (r["model"], r["set"], "flat"))
        r["speedup"] = r["tokens_per_s"] / flat["tokens_per_s"]
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """The targets, checked on the rows that exist (memory targets need CUDA peaks)."""
    checks = []
    for r in rows:
        if r["mode"] == "auto" and r["set"] in ("agentic", "grpo_math"):
            goal = 0.8 * r["token_ratio"]
            checks.append(
                {
                    "target": f"{r['model']} {r['set']}: auto step x flat",
                    "value": r["speedup"],
                    "goal": f">= {goal:.2f}",
                    "met": r["speedup"] >= goal,
                }
            )
    for model in sorted({r["model"] for r in rows}):
        by_mode = {r["mode"]: r for r in rows if r["model"] == model and r["set"] == "agentic"}
        if "dfs" in by_mode and "packed" in by_mode and by_mode["packed"].get("old_logps_extra"):
            ratio = by_mode["dfs"]["old_logps_extra"] / by_mode["packed"]["old_logps_extra"]
            checks.append(
                {
                    "target": f"{model} agentic: dfs / packed log-prob memory above the resident",
                    "value": ratio,
                    "goal": "<= 0.25",
                    "met": ratio <= 0.25,
                }
            )
    return checks


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m treeattn_lab bench rl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sets", type=choice_list(SETS), default=["grpo_math", "agentic"], help="comma list of rollout sets"
    )
    parser.add_argument(
        "--models", type=choice_list(MODELS), default=list(MODELS), help="comma list of models"
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, small subsets (default on a CPU)")
    parser.add_argument("--block-tokens", type=positive_int, default=None)
    parser.add_argument("--token-budget", type=positive_int, default=None)
    parser.add_argument("--reps", type=positive_int, default=2)
    parser.add_argument("--calibration-s", type=float, default=60.0)
    add_out_argument(parser)
    return parser.parse_args(argv)


COLUMNS = [
    ("model", "model"),
    ("set", "set"),
    ("mode", "mode"),
    ("token_ratio", "token ratio"),
    ("old_logps_s", "old s"),
    ("ref_logps_s", "ref s"),
    ("train_s", "train s"),
    ("step_s", "step s"),
    ("tokens_per_s", "flat tok/s"),
    ("speedup", "x flat"),
    ("old_logps_peak", "old peak B"),
    ("old_logps_extra", "old own B"),
    ("train_peak", "train peak B"),
    ("train_extra", "train own B"),
    ("choices", "auto chose"),
]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    quick, device, dtype, cfg, engine = run_setup(args)
    models = {}
    for name in args.models:
        policy = build_model(name, cfg, device, dtype)
        reference = copy.deepcopy(policy).requires_grad_(False)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        cost_model = calibrate(policy, **engine, seconds=args.calibration_s, use_cache=False, progress=False)
        models[name] = (policy, reference, optimizer, cost_model)
    rows = rl_rows(models, args.sets, quick=quick, reps=args.reps, **engine)
    checks = targets(rows)
    env = environment()
    print_table(f"GRPO step, {env['device']}, {str(dtype).removeprefix('torch.')}", COLUMNS, rows)
    print_table(
        "targets", [("target", "target"), ("value", "value"), ("goal", "goal"), ("met", "met")], checks
    )
    extra = {
        "dtype": str(dtype),
        "config": cfg.__dict__,
        "grpo": GRPO,
        "quick": quick,
        "targets": checks,
        **engine,
    }
    path = write_results("rl", rows, env, directory=args.out, extra=extra)
    print(f"wrote {path}")
    return 0
