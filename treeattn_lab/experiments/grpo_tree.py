"""GRPO flat against GRPO over tries: the same reward, in less time for the log-prob and training phases?

Protocol, per seed (:mod:`treeattn_lab.rl.grpo`, :mod:`treeattn_lab.rl.tasks`):

1. A byte-level :class:`~treeattn_lab.reference.TinyLM` is warmed up with ``warmup_steps`` supervised steps
   on solved addition lines, so that RL starts from a reward above zero.
2. Step-0 gradients: one sampled batch, the loop's objective, its gradient through the flat and through
   the tree engine mode (float32); their relative difference ``|g_tree - g_flat| / |g_flat|`` is recorded.
3. Two copies of the warmed-up model train with the same loop and the same seed, one ``mode="flat"``, one
   ``mode="tree"``: the same problems every step and, at step 0, the same sampled batch. Their steps
   alternate (flat first on even steps, tree first on odd ones), so load on a shared machine hits both.
4. Greedy reward on ``eval_problems`` held-out problems, before RL and after each run.

Recorded per step: reward, loss, time per phase (sample, reward, log-probs, train), peak memory, and the
token ratio (flat tokens / tree tokens) of the batch that real sampling made. The summary compares the
final reward (the mean sampled reward of the last ``final_window`` steps, and the greedy evaluation) and
the log-prob + training time per step, flat against tree.

Modes: ``tiny`` (CI, seconds), ``quick`` (sized for a 2-core CPU: three seeds within ten minutes; run the
seeds one after another, or as separate processes joined with ``--merge``), ``full`` (sized for one H200).
A result file's ``rows`` are the per-(seed, loop) summary; ``steps`` holds every step's record.

    python -m treeattn_lab.experiments.grpo_tree --mode quick --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..reference import TinyLM, TinyLMConfig
from ..rl.grpo import GRPO, PHASES, GRPOConfig
from ..rl.tasks import VOCAB_SIZE, AdditionTask
from .cli_args import seed_list

BENCH_NAME = "grpo-tree"


def tiny_lm_config(**sizes) -> TinyLMConfig:
    """A byte-level TinyLM's configuration: 2 layers, 4 query heads over 2 key/value heads unless given."""
    return TinyLMConfig(**{"vocab_size": VOCAB_SIZE, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, **sizes})


@dataclass(frozen=True)
class ExperimentConfig:
    digits: int = 1
    shots: int = 8
    turns: int = 1
    model: TinyLMConfig = field(default_factory=lambda: tiny_lm_config(dim=128, ffn_dim=344))
    warmup_steps: int = 170
    warmup_lr: float = 3e-3
    steps: int = 40
    prompts_per_step: int = 16
    group_size: int = 8
    forks: tuple[int, ...] = ()
    lr: float = 1e-4
    ppo_epochs: int = 2
    beta: float = 0.04
    tree_mode: str = "packed"
    eval_problems: int = 64
    final_window: int = 10
    seeds: tuple[int, ...] = (0,)

    def task(self) -> AdditionTask:
        return AdditionTask(digits=self.digits, shots=self.shots, turns=self.turns)

    def grpo(self) -> GRPOConfig:
        return GRPOConfig(prompts_per_step=self.prompts_per_step, group_size=self.group_size,
                          forks=self.forks, lr=self.lr, ppo_epochs=self.ppo_epochs, beta=self.beta,
                          tree_mode=self.tree_mode)


MODES = {
    "tiny": ExperimentConfig(model=tiny_lm_config(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64),
                             shots=3, warmup_steps=20, steps=3, prompts_per_step=2, group_size=4,
                             eval_problems=8, final_window=2),
    "quick": ExperimentConfig(seeds=(0, 1, 2)),
    "full": ExperimentConfig(digits=2, shots=32, turns=2, forks=(2,),
                             model=tiny_lm_config(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1376),
                             warmup_steps=2000, steps=200, prompts_per_step=32,
                             group_size=16, lr=1e-4, eval_problems=256, final_window=20, seeds=(0, 1, 2)),
}
LOOPS = ("flat", "tree")


# ---------------------------------------------------------------------------------------------- one seed
def gradient_check(model, task, cfg: ExperimentConfig, seed: int) -> float:
    """``|g_tree - g_flat| / |g_flat|`` of the loop's objective on one sampled batch (float32). Where every
    group's rewards tie (all advantages 0, so no gradient), standard-normal advantages stand in."""
    grads = {}
    generator = torch.Generator().manual_seed(seed + 424_242)
    rollouts = None
    for loop in LOOPS:
        trainer = GRPO(copy.deepcopy(model), task, cfg.grpo(), mode=loop, seed=seed)
        if rollouts is None:
            rollouts = trainer.rollouts(0, generator=generator)
            trainer.score(rollouts)
            if not rollouts.advantages.any():
                rollouts.advantages = torch.randn(rollouts.advantages.shape, generator=generator)
        trainer.backward(rollouts, trainer.objective(rollouts))
        grads[loop] = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return float((grads["tree"] - grads["flat"]).norm() / grads["flat"].norm().clamp(min=1e-30))


def run_seed(cfg: ExperimentConfig, seed: int, device, progress: bool = True) -> dict:
    """The protocol of the module docstring for one seed: ``{"steps", "evals", "grad_rel_diff"}``."""
    from tqdm.auto import tqdm

    task = cfg.task()
    torch.manual_seed(seed)
    model = TinyLM(cfg.model).to(device)
    task.warm_up(model, steps=cfg.warmup_steps, lr=cfg.warmup_lr, seed=seed, progress=progress)
    held_out = task.problems(cfg.eval_problems, seed=10_000 + seed)
    evals = {"warm-up": task.evaluate(model, held_out)}
    grad_rel_diff = gradient_check(model, task, cfg, seed)
    trainers = {loop: GRPO(copy.deepcopy(model), task, cfg.grpo(), mode=loop, seed=seed) for loop in LOOPS}
    steps = []
    for step in tqdm(range(cfg.steps), desc=f"GRPO flat + tree, seed {seed}", disable=not progress):
        for loop in LOOPS if step % 2 == 0 else LOOPS[::-1]:
            record = trainers[loop].step()
            steps.append({"seed": seed, **{k: v for k, v in record.items() if k != "losses"}})
    for loop, trainer in trainers.items():
        evals[loop] = task.evaluate(trainer.model, held_out)
    return {"steps": steps, "evals": {seed: evals}, "grad_rel_diff": {seed: grad_rel_diff}}


# ---------------------------------------------------------------------------------------------- summary
def _learner_s(row: dict) -> float:
    return row["times_s"]["logprobs"] + row["times_s"]["train"]


def summarize(steps: list[dict], evals: dict, final_window: int) -> list[dict]:
    """One row per (seed, loop) of the per-step records: final rewards, mean time per phase and per step,
    token ratio, memory."""
    out = []
    for seed in sorted({r["seed"] for r in steps}):
        for loop in LOOPS:
            mine = [r for r in steps if r["seed"] == seed and r["mode"] == loop]
            mine.sort(key=lambda r: r["step"])
            if not mine:
                continue
            timed = mine[1:] if len(mine) > 1 else mine  # step 0 pays one-time costs (allocations, caches)
            out.append({
                "seed": seed,
                "loop": loop,
                "final_reward": statistics.fmean(r["reward"] for r in mine[-final_window:]),
                "first_reward": mine[0]["reward"],
                "eval_before": evals[seed]["warm-up"],
                "eval_after": evals[seed][loop],
                **{f"{p}_s": statistics.fmean(r["times_s"][p] for r in timed) for p in PHASES},
                "learner_s": statistics.fmean(_learner_s(r) for r in timed),
                "step_s": statistics.fmean(r["step_s"] for r in timed),
                "token_ratio": statistics.fmean(r["token_ratio"] for r in mine),
                "peak_memory_bytes": max((r["peak_memory_bytes"] or 0) for r in mine) or None,
            })
    return out


def headline(summary: list[dict], grad_rel_diff: dict) -> dict:
    """Flat against tree over seeds: final rewards (mean and range), learner time per step, its speed-up."""
    by = {loop: [s for s in summary if s["loop"] == loop] for loop in LOOPS}
    out = {}
    for loop, rows in by.items():
        finals = [s["final_reward"] for s in rows]
        out[loop] = {"final_reward": statistics.fmean(finals), "final_min": min(finals),
                     "final_max": max(finals), "eval_after": statistics.fmean(s["eval_after"] for s in rows),
                     "learner_s": statistics.fmean(s["learner_s"] for s in rows),
                     "step_s": statistics.fmean(s["step_s"] for s in rows)}
    out["learner_speedup"] = out["flat"]["learner_s"] / out["tree"]["learner_s"]
    out["step_speedup"] = out["flat"]["step_s"] / out["tree"]["step_s"]
    out["token_ratio"] = statistics.fmean(s["token_ratio"] for s in summary)
    out["max_grad_rel_diff"] = max(grad_rel_diff.values())
    spread = max(out[loop]["final_max"] - out[loop]["final_min"] for loop in LOOPS)
    out["reward_gap"] = out["tree"]["final_reward"] - out["flat"]["final_reward"]
    out["same_reward_within_spread"] = abs(out["reward_gap"]) <= spread
    return out


def run_experiment(cfg: ExperimentConfig | str = "quick", *, device=None, progress: bool = True) -> dict:
    """Every seed of ``cfg``; returns ``{"config", "steps", "evals", "grad_rel_diff", "summary", "headline",
    "seconds", "device"}``."""
    cfg = MODES[cfg] if isinstance(cfg, str) else cfg
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    steps, evals, grads = [], {}, {}
    for seed in cfg.seeds:
        part = run_seed(cfg, seed, device, progress)
        steps += part["steps"]
        evals.update(part["evals"])
        grads.update(part["grad_rel_diff"])
    return _result(asdict(cfg), steps, evals, grads, time.perf_counter() - start, str(device))


def _result(config: dict, steps, evals, grads, seconds: float, device: str) -> dict:
    summary = summarize(steps, evals, config["final_window"])
    return {"config": config, "steps": steps, "evals": evals, "grad_rel_diff": grads, "summary": summary,
            "headline": headline(summary, grads), "seconds": seconds, "device": device}


def merge_results(results: list[dict]) -> dict:
    """One result from runs of the same configuration with different seeds (one process per seed)."""
    if not results:
        raise ValueError("merge_results needs at least one result")
    settings = [{k: v for k, v in r["config"].items() if k != "seeds"} for r in results]
    if any(s != settings[0] for s in settings):
        raise ValueError("results to merge must come from the same configuration apart from the seeds")
    seeds = [s for r in results for s in r["config"]["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"results to merge repeat a seed: {sorted(seeds)}")
    # JSON turns the int seed keys into strings; normalise both forms
    evals = {int(k): v for r in results for k, v in r["evals"].items()}
    grads = {int(k): v for r in results for k, v in r["grad_rel_diff"].items()}
    steps = [row for r in results for row in r["steps"]]
    return _result({**results[0]["config"], "seeds": sorted(seeds)}, steps, evals, grads,
                   sum(r["seconds"] for r in results), results[0]["device"])


# ---------------------------------------------------------------------------------------------- command line
COLUMNS = [("seed", "seed"), ("loop", "loop"), ("first_reward", "reward step 0"),
           ("final_reward", "final reward"), ("eval_before", "greedy before"), ("eval_after", "greedy after"),
           ("logprobs_s", "log-probs s"), ("train_s", "train s"), ("sample_s", "sample s"),
           ("step_s", "step s"), ("token_ratio", "token ratio")]


def main(argv: list[str] | None = None) -> int:
    from ..bench.harness import add_out_argument, environment, positive_int, print_table, write_results

    parser = argparse.ArgumentParser(prog="python -m treeattn_lab.experiments.grpo_tree", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--seeds", type=seed_list, default=None, help="comma list, e.g. 0,1,2")
    parser.add_argument("--steps", type=positive_int, default=None, help="override the mode's GRPO steps")
    parser.add_argument("--device", default=None)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="merge saved results of this mode run with different seeds; trains nothing")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    cfg = MODES[args.mode]
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    if args.seeds:
        cfg = replace(cfg, seeds=args.seeds)
    if args.merge:
        saved = [json.loads(Path(f).read_text()) for f in args.merge]
        result, env = merge_results(saved), saved[0]["environment"]
        result["merged_from"] = [r.get("command") for r in saved]  # the per-seed runs, as they were run
        mode = {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k != "seeds"}
        if {k: v for k, v in result["config"].items() if k != "seeds"} != mode:
            parser.error(f"the results to merge were not run in --mode {args.mode} (with its --steps)")
    else:
        result, env = run_experiment(cfg, device=args.device, progress=not args.no_progress), environment()
    print_table(f"GRPO flat vs tree ({args.mode}, {result['device']}, {result['seconds']:.0f} s)", COLUMNS,
                result["summary"])
    print("headline:", json.dumps(result["headline"], indent=1))
    if not args.no_save:
        # the summary is the file's table (rows); the per-step records go with it as "steps"
        path = write_results(f"{BENCH_NAME}-{args.mode}", result["summary"], env, directory=args.out,
                             extra={k: v for k, v in result.items() if k != "summary"})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
