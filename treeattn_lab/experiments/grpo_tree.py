"""GRPO flat against GRPO over tries: the same reward, in less time for the log-prob and training phases?

Protocol, per seed (:mod:`treeattn_lab.rl.grpo`, :mod:`treeattn_lab.rl.tasks`):

1. A byte-level :class:`~treeattn_lab.reference.TinyLM` is warmed up with ``warmup_steps`` supervised steps
   on solved addition lines, so that RL starts from a reward above zero; a share ``warmup_error`` of those
   lines is one too high (:mod:`treeattn_lab.rl.tasks`), which leaves the model a gap that only the
   checked reward shows.
2. Step-0 gradients: one sampled batch, the loop's objective, its gradient through the flat and through
   the tree engine mode (float32) and through the flat mode in float64; the relative differences
   tree-flat, flat-float64 and tree-float64 are recorded (:func:`gradient_check`).
3. Two copies of the warmed-up model train with the same loop and the same seed, one ``mode="flat"``, one
   ``mode="tree"``: the same problems every step and, at step 0, the same sampled batch. Their steps
   alternate (flat first on even steps, tree first on odd ones), so load on a shared machine hits both.
4. Greedy reward on ``eval_problems`` held-out problems, before RL and after each run.

The tree loop runs tree attention with ``attention_backend``. On a CPU, ``"auto"`` is the reference, which
scores every (query, key) pair of the packed row and masks most of them away: for many short rollouts,
more pairs than the flat loop computes. ``"flat"`` gathers each rollout out of the pack and runs causal
attention per rollout (:mod:`treeattn_lab.ops.flat_tree`), so attention costs what it costs flat while
every other layer runs once per tree token; the quick mode, sized for a CPU, uses it.

Recorded per step: reward, loss, time per phase (sample, reward, log-probs, train), peak memory, and the
token ratio (flat tokens / tree tokens) of the batch that real sampling made. The summary compares the
final reward (the mean sampled reward of the last ``final_window`` steps, and the greedy evaluation with
its gain over the warm-up's, per seed) and the log-prob + training time per step, flat against tree.

Time per phase and per step is summarised twice: the mean over every step after the first (the first pays
one-time costs: allocations, caches, compilation), and the median, which also passes over the odd step
that compiles again or autotunes for a new shape.

Modes: ``tiny`` (CI, seconds), ``quick`` (sized for a 2-core CPU: three seeds within ten minutes, one
torch thread each; run the seeds one after another, or as separate processes joined with ``--merge``),
``full`` (sized for one H200: one seed per process, at 32 prompts x 16 rollouts a step so that the
learner phases carry real work; give each process its own ``--out`` folder, since the file name holds no
seed, and join the files with ``--merge``).
A result file's ``rows`` are the per-(seed, loop) summary; ``steps`` holds every step's record,
``steps_done`` the GRPO steps each seed took and ``stopped_early`` whether a seed took fewer than
``config["steps"]``.

``--budget-s S`` bounds the GRPO steps of a run that a time limit may kill: after each step, when the wall
time since the run began would pass ``S`` seconds by the end of another step and the final evaluation, no
new GRPO step starts and the seed is evaluated and summarised as it stands. It binds per step only: every
seed still warms up, checks its step-0 gradients and takes at least one step, so a budgeted run is one
seed per process. A run of several seeds writes its result file after each seed, for the seeds done
(atomically, like the last).

``--threads N`` sets torch's CPU threads (a result's environment records the count it ran with): on a CPU
shared with other work, one thread per process keeps threads from waiting on each other.

    python -m treeattn_lab.experiments.grpo_tree --mode quick --seeds 0,1,2 --threads 1
    python -m treeattn_lab.experiments.grpo_tree --mode full --seeds 0 --budget-s 480
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

from ..checks import check_finite
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
    warmup_error: float = 0.0  # share of warm-up lines one too high (AdditionTask.warm_up's error_rate)
    steps: int = 40
    prompts_per_step: int = 16
    group_size: int = 8
    forks: tuple[int, ...] = ()
    lr: float = 1e-4
    ppo_epochs: int = 2
    beta: float = 0.04
    tree_mode: str = "packed"
    attention_backend: str = "auto"  # the tree loop's tree attention (module docstring)
    eval_problems: int = 64
    final_window: int = 10
    seeds: tuple[int, ...] = (0,)

    def task(self) -> AdditionTask:
        return AdditionTask(digits=self.digits, shots=self.shots, turns=self.turns)

    def grpo(self) -> GRPOConfig:
        return GRPOConfig(prompts_per_step=self.prompts_per_step, group_size=self.group_size,
                          forks=self.forks, lr=self.lr, ppo_epochs=self.ppo_epochs, beta=self.beta,
                          tree_mode=self.tree_mode, attention_backend=self.attention_backend)


MODES = {
    "tiny": ExperimentConfig(model=tiny_lm_config(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64),
                             shots=3, warmup_steps=20, steps=3, prompts_per_step=2, group_size=4,
                             eval_problems=8, final_window=2),
    # One digit, 8 shots: prompts of about 50 tokens shared by 8 rollouts of 2 to 3 tokens. With 60% of the
    # warm-up lines one too high, 300 steps leave a model that samples the right sum about half the time
    # but ranks the wrong one first on most problems (greedy reward about 0.2): a gap every problem shares.
    "quick": ExperimentConfig(warmup_steps=300, warmup_error=0.6, steps=30, prompts_per_step=16, group_size=8,
                              lr=1e-4, eval_problems=256, attention_backend="flat", seeds=(0, 1, 2)),
    "full": ExperimentConfig(digits=2, shots=32, turns=2, forks=(2,),
                             model=tiny_lm_config(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1376),
                             warmup_steps=2000, steps=48, prompts_per_step=32,
                             group_size=16, lr=1e-4, eval_problems=256, final_window=10, seeds=(0, 1, 2)),
}
LOOPS = ("flat", "tree")


# ---------------------------------------------------------------------------------------------- one seed
# Both loops sum in float32, in different orders: the tree's gradient counts as exact when its distance to
# the float64 gradient is at most this many times the flat loop's.
EXACTNESS_MARGIN = 2.0


def gradient_check(model, task, cfg: ExperimentConfig, seed: int) -> dict:
    """The loop's objective on one sampled batch, its gradient through the flat and the tree engine mode
    (float32) and through the flat mode in float64: ``{"tree_vs_flat", "flat_vs_fp64", "tree_vs_fp64"}``,
    each ``|g_a - g_b| / |g_b|``. The float64 gradient tells rounding from error: on a trained model,
    GRPO's advantages of both signs cancel and either float32 loop can sit well above 1e-5 from it. Where
    every group's rewards tie (all advantages 0, so no gradient), standard-normal advantages stand in."""
    grads = {}
    generator = torch.Generator().manual_seed(seed + 424_242)
    rollouts = None
    for name, loop, dtype in (("flat", "flat", torch.float32), ("tree", "tree", torch.float32),
                              ("fp64", "flat", torch.float64)):
        trainer = GRPO(copy.deepcopy(model).to(dtype), task, cfg.grpo(), mode=loop, seed=seed)
        if rollouts is None:
            rollouts = trainer.rollouts(0, generator=generator)
            trainer.score(rollouts)
            if not rollouts.advantages.any():
                rollouts.advantages = torch.randn(rollouts.advantages.shape, generator=generator)
        trainer.backward(rollouts, trainer.objective(rollouts))
        grads[name] = torch.cat([p.grad.double().flatten() for p in trainer.model.parameters()
                                 if p.grad is not None])

    def rel(a, b):
        return float((grads[a] - grads[b]).norm() / grads[b].norm().clamp(min=1e-30))

    return {"tree_vs_flat": rel("tree", "flat"), "flat_vs_fp64": rel("flat", "fp64"),
            "tree_vs_fp64": rel("tree", "fp64")}


def as_exact_as_flat(check: dict) -> bool:
    """The tree's gradient is within :data:`EXACTNESS_MARGIN` times the flat loop's rounding of float64."""
    return check["tree_vs_fp64"] <= EXACTNESS_MARGIN * check["flat_vs_fp64"]


def run_seed(cfg: ExperimentConfig, seed: int, device, progress: bool = True,
             deadline: float | None = None) -> dict:
    """The protocol of the module docstring for one seed: ``{"steps", "evals", "grad_check"}``.

    ``deadline`` (a :func:`time.perf_counter` reading): after each step, no new step starts when another
    step as long as the last one, then the final evaluation (twice the warm-up evaluation), would end
    past it."""
    from ..progress import progress_bar

    task = cfg.task()
    torch.manual_seed(seed)
    model = TinyLM(cfg.model).to(device)
    task.warm_up(model, steps=cfg.warmup_steps, lr=cfg.warmup_lr, seed=seed, error_rate=cfg.warmup_error,
                 progress=progress)
    held_out = task.problems(cfg.eval_problems, seed=10_000 + seed)
    eval_start = time.perf_counter()
    evals = {"warm-up": task.evaluate(model, held_out)}
    final_eval_s = len(LOOPS) * (time.perf_counter() - eval_start)
    grad_check = gradient_check(model, task, cfg, seed)
    trainers = {loop: GRPO(copy.deepcopy(model), task, cfg.grpo(), mode=loop, seed=seed) for loop in LOOPS}
    steps = []
    with progress_bar(total=cfg.steps, desc=f"GRPO flat + tree, seed {seed}", disable=not progress) as bar:
        for step in range(cfg.steps):
            step_start = time.perf_counter()
            for loop in LOOPS if step % 2 == 0 else LOOPS[::-1]:
                record = trainers[loop].step()
                steps.append({"seed": seed, **{k: v for k, v in record.items() if k != "losses"}})
            bar.update()
            now = time.perf_counter()
            if deadline is not None and now + (now - step_start) + final_eval_s > deadline:
                break
    for loop, trainer in trainers.items():
        evals[loop] = task.evaluate(trainer.model, held_out)
    return {"steps": steps, "evals": {seed: evals}, "grad_check": {seed: grad_check}}


# ---------------------------------------------------------------------------------------------- summary
def _learner_s(row: dict) -> float:
    return row["times_s"]["logprobs"] + row["times_s"]["train"]


def summarize(steps: list[dict], evals: dict, final_window: int) -> list[dict]:
    """One row per (seed, loop) of the per-step records: final rewards, time per phase and per step (means,
    and medians of the learner time and the step), token ratio, memory, steps taken."""
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
                "eval_gain": evals[seed][loop] - evals[seed]["warm-up"],
                **{f"{p}_s": statistics.fmean(r["times_s"][p] for r in timed) for p in PHASES},
                "learner_s": statistics.fmean(_learner_s(r) for r in timed),
                "step_s": statistics.fmean(r["step_s"] for r in timed),
                "learner_median_s": statistics.median(_learner_s(r) for r in timed),
                "step_median_s": statistics.median(r["step_s"] for r in timed),
                "steps": len(mine),
                "token_ratio": statistics.fmean(r["token_ratio"] for r in mine),
                "peak_memory_bytes": max((r["peak_memory_bytes"] or 0) for r in mine) or None,
            })
    return out


def headline(summary: list[dict], grad_check: dict) -> dict:
    """Flat against tree over seeds: final rewards (mean and range), the held-out greedy reward before and
    after RL and its gain (mean and range over seeds), learner time per step and its speed-up, of the means
    and of the medians; the largest step-0 gradient differences (:func:`gradient_check`) and whether every
    seed's tree gradient was as exact as flat's."""
    by = {loop: [s for s in summary if s["loop"] == loop] for loop in LOOPS}
    out = {}
    for loop, rows in by.items():
        finals = [s["final_reward"] for s in rows]
        gains = [s["eval_after"] - s["eval_before"] for s in rows]
        out[loop] = {"final_reward": statistics.fmean(finals), "final_min": min(finals),
                     "final_max": max(finals),
                     "eval_before": statistics.fmean(s["eval_before"] for s in rows),
                     "eval_after": statistics.fmean(s["eval_after"] for s in rows),
                     "eval_gain": statistics.fmean(gains), "eval_gain_min": min(gains),
                     "eval_gain_max": max(gains),
                     "learner_s": statistics.fmean(s["learner_s"] for s in rows),
                     "learner_median_s": statistics.fmean(s["learner_median_s"] for s in rows),
                     "step_s": statistics.fmean(s["step_s"] for s in rows)}
    out["learner_speedup"] = out["flat"]["learner_s"] / out["tree"]["learner_s"]
    out["learner_speedup_median"] = out["flat"]["learner_median_s"] / out["tree"]["learner_median_s"]
    out["step_speedup"] = out["flat"]["step_s"] / out["tree"]["step_s"]
    out["token_ratio"] = statistics.fmean(s["token_ratio"] for s in summary)
    for key in ("tree_vs_flat", "flat_vs_fp64", "tree_vs_fp64"):
        out[f"max_grad_{key}"] = max(c[key] for c in grad_check.values())
    out["tree_grad_as_exact_as_flat"] = all(as_exact_as_flat(c) for c in grad_check.values())
    spread = max(out[loop]["final_max"] - out[loop]["final_min"] for loop in LOOPS)
    out["reward_gap"] = out["tree"]["final_reward"] - out["flat"]["final_reward"]
    out["same_reward_within_spread"] = abs(out["reward_gap"]) <= spread
    return out


def check_budget(budget_s) -> float | None:
    """``budget_s`` as a float > 0, or None (no budget); a bool, a non-number, NaN or infinity is refused."""
    return None if budget_s is None else check_finite("budget_s", budget_s, positive=True)


def run_experiment(cfg: ExperimentConfig | str = "quick", *, device=None, progress: bool = True,
                   budget_s: float | None = None, on_seed=None) -> dict:
    """Every seed of ``cfg``; returns ``{"config", "steps", "evals", "grad_check", "steps_done",
    "stopped_early", "summary", "headline", "seconds", "device"}``.

    ``budget_s``: the wall-time budget of the whole run, in seconds (module docstring). ``on_seed``: called
    after each seed with the result of the seeds done so far (they are its ``config["seeds"]``)."""
    cfg = MODES[cfg] if isinstance(cfg, str) else cfg
    budget_s = check_budget(budget_s)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    deadline = None if budget_s is None else start + budget_s
    steps, evals, grads, result = [], {}, {}, None
    for done, seed in enumerate(cfg.seeds, start=1):
        part = run_seed(cfg, seed, device, progress, deadline)
        steps += part["steps"]
        evals.update(part["evals"])
        grads.update(part["grad_check"])
        config = {**asdict(cfg), "seeds": list(cfg.seeds[:done])}
        result = _result(config, steps, evals, grads, time.perf_counter() - start, str(device))
        if on_seed is not None:
            on_seed(result)
    return result


def _result(config: dict, steps, evals, grads, seconds: float, device: str) -> dict:
    summary = summarize(steps, evals, config["final_window"])
    done = {seed: 1 + max(r["step"] for r in steps if r["seed"] == seed) for seed in sorted(evals)}
    return {"config": config, "steps": steps, "evals": evals, "grad_check": grads, "steps_done": done,
            "stopped_early": any(n < config["steps"] for n in done.values()), "summary": summary,
            "headline": headline(summary, grads), "seconds": seconds, "device": device}


def merge_results(results: list[dict]) -> dict:
    """One result from runs of the same configuration with different seeds (one process per seed)."""
    if not results:
        raise ValueError("merge_results needs at least one result")
    settings = [{k: v for k, v in r["config"].items() if k != "seeds"} for r in results]
    if any(s != settings[0] for s in settings):
        raise ValueError("results to merge must come from the same configuration apart from the seeds")
    lacking = [i for i, r in enumerate(results) if "grad_check" not in r]
    if lacking:
        raise ValueError(f"results {lacking} have no 'grad_check' (the float32 and float64 step-0 gradient "
                         f"check): run those seeds again with this version")
    seeds = [s for r in results for s in r["config"]["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"results to merge repeat a seed: {sorted(seeds)}")
    # JSON turns the int seed keys into strings; normalise both forms
    evals = {int(k): v for r in results for k, v in r["evals"].items()}
    grads = {int(k): v for r in results for k, v in r["grad_check"].items()}
    steps = [row for r in results for row in r["steps"]]
    return _result({**results[0]["config"], "seeds": sorted(seeds)}, steps, evals, grads,
                   sum(r["seconds"] for r in results), results[0]["device"])


# ---------------------------------------------------------------------------------------------- command line
COLUMNS = [("seed", "seed"), ("loop", "loop"), ("first_reward", "reward step 0"),
           ("final_reward", "final reward"), ("eval_before", "greedy before"), ("eval_after", "greedy after"),
           ("eval_gain", "greedy gain"),
           ("logprobs_s", "log-probs s"), ("train_s", "train s"), ("sample_s", "sample s"),
           ("learner_median_s", "learner median s"), ("step_s", "step s"), ("token_ratio", "token ratio"),
           ("steps", "steps")]


def budget_seconds(text: str) -> float:
    """``--budget-s``: a finite number of seconds > 0."""
    try:
        return check_budget(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    from ..bench.harness import (
        add_out_argument,
        environment,
        positive_int,
        print_table,
        result_path,
        write_results,
    )

    parser = argparse.ArgumentParser(prog="python -m treeattn_lab.experiments.grpo_tree", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--seeds", type=seed_list, default=None, help="comma list, e.g. 0,1,2")
    parser.add_argument("--steps", type=positive_int, default=None, help="override the mode's GRPO steps")
    parser.add_argument("--budget-s", type=budget_seconds, default=None,
                        help="start no GRPO step that would end (with the final evaluation) past this many "
                             "seconds of the run; the seeds are still evaluated and saved")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch's CPU threads (default: torch's own choice)")
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
    if args.merge and args.budget_s is not None:
        parser.error("--budget-s bounds a run's GRPO steps; --merge trains nothing")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    saved = [json.loads(Path(f).read_text()) for f in args.merge or ()]
    # merged: where the runs ran, not here
    env = saved[0]["environment"] if saved else {**environment(), "torch_threads": torch.get_num_threads()}

    def save(result: dict) -> Path:
        # the summary is the file's table (rows); the per-step records go with it as "steps"
        return write_results(f"{BENCH_NAME}-{args.mode}", result["summary"], env, directory=args.out,
                             extra={k: v for k, v in result.items() if k != "summary"})

    if saved:
        result = merge_results(saved)
        result["merged_from"] = [r.get("command") for r in saved]  # the per-seed runs, as they were run
        mode = {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k != "seeds"}
        if {k: v for k, v in result["config"].items() if k != "seeds"} != mode:
            parser.error(f"the results to merge were not run in --mode {args.mode} (with its --steps)")
    else:
        result = run_experiment(cfg, device=args.device, progress=not args.no_progress,
                                budget_s=args.budget_s, on_seed=None if args.no_save else save)
    print_table(f"GRPO flat vs tree ({args.mode}, {result['device']}, {result['seconds']:.0f} s)", COLUMNS,
                result["summary"])
    print("headline:", json.dumps(result["headline"], indent=1))
    if result["stopped_early"]:
        print(f"stopped early by --budget-s: GRPO steps done per seed {result['steps_done']} of {cfg.steps}")
    if not args.no_save:  # a run's last on_seed call wrote this result already
        print(f"wrote {save(result) if saved else result_path(f'{BENCH_NAME}-{args.mode}', env, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
