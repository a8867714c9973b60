"""Data-parallel training on a rollout trie over several GPUs, timed: the anchor's partition and this lab's.

Under torchrun (one process per GPU; NCCL on GPUs, gloo on CPUs)::

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 -m treeattn_lab.bench.multi_gpu_train \\
        --set grpo_math --out bench/results

calibrates the cost model on each GPU (rank 0's is used everywhere), refines it on a probe of the
real rollouts (:func:`treeattn_lab.distributed.probe.refine_cost_model`; ``--no-refine`` skips it), then
times training steps (:func:`treeattn_lab.distributed.step.run_step` + AdamW) for the anchor partitioner
and this lab's, records each rank's measured compute time beside its predictions (the refined model's and
the calibration's alone), times the same step on one GPU alone for the throughput ratio, checks the
targets (:func:`targets`) and writes ``multi-gpu-train-<K>x__<device>__*.json``. Each row also counts
every rank's micro-batches and those the model predicts host-bound, and gives the prediction of the
device terms alone (``predicted_makespan_device_only_s``: the cost model without its host floor), so the
host term's share of the prediction error shows. ``NCCL_NVLS_ENABLE=0``
(NVLink multicast off) is also set by :func:`treeattn_lab.distributed.init_distributed` when unset. On a
CPU, ``--model tiny`` on a small subset runs the same code with gloo.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..datasets import DATASETS, load_rollouts
from ..distributed.agreement import init_distributed, monitor_group
from ..distributed.balance import ANCHOR, BEST, PARTITIONERS, EngineCost, balance
from ..distributed.probe import predicted_for_modes_run, refine_cost_model
from ..distributed.step import plan_shares, run_step, sync
from ..engine import CostModel, calibrate, tree_backward
from ..reference import TinyLM
from ..trie import RolloutTrie
from .harness import add_out_argument, environment, positive_int, print_table, write_results
from .train import LLAMA_05B, TINY

# the lab's TinyLM at the size of `bench train` (0.49B, Llama-style) and a tiny one for CPUs
MODELS = {"llama-0.5b": LLAMA_05B, "tiny": TINY}
PREDICTION_GOAL = 0.10  # |measured makespan / predicted - 1|
SPEEDUP_GOAL = 0.9  # throughput against one device, per rank


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node K -m treeattn_lab.bench.multi_gpu_train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--set", default="grpo_math", choices=DATASETS)
    parser.add_argument(
        "--model",
        default=None,
        choices=sorted(MODELS),
        help="default: llama-0.5b (bf16) on GPUs, tiny (fp32) on CPUs",
    )
    parser.add_argument("--partitioners", default=f"{ANCHOR},{BEST}")
    parser.add_argument("--mode", default="auto", choices=("auto", "flat", "packed", "dfs"))
    parser.add_argument("--block-tokens", type=positive_int, default=None,
                        help="default 4096 (GPU), 64 (CPU)")
    parser.add_argument("--token-budget", type=positive_int, default=None,
                        help="default 32768 (GPU), 512 (CPU)")
    parser.add_argument("--max-rollouts", type=positive_int, default=None, help="default all (GPU), 16 (CPU)")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=None, help="cut rollouts; default none (GPU), 256 (CPU)"
    )
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--calibration-s", type=float, default=None, help="default 60 (GPU), 5 (CPU)")
    parser.add_argument(
        "--refine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rescale the calibrated cost model on a probe of these rollouts before planning "
        "(refine_cost_model; the calibration's own predictions are reported beside); default on",
    )
    parser.add_argument("--no-single", action="store_true", help="skip the one-device baseline")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="collective timeout")
    parser.add_argument("--barrier-timeout-s", type=float, default=600.0)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    args.partitioners = args.partitioners.split(",")
    if any(p not in PARTITIONERS for p in args.partitioners):
        parser.error(f"--partitioners: choose from {sorted(PARTITIONERS)}")
    return args


def _device_defaults(args, cuda: bool) -> dict:
    """The run's settings: the options given, else the GPU's or the CPU's defaults."""
    return {
        "model": args.model or ("llama-0.5b" if cuda else "tiny"),
        "dtype": torch.bfloat16 if cuda else torch.float32,
        "block_tokens": args.block_tokens or (4096 if cuda else 64),
        "token_budget": args.token_budget or (32768 if cuda else 512),
        "max_rollouts": args.max_rollouts or (None if cuda else 16),
        "max_tokens": args.max_tokens or (None if cuda else 256),
        "calibration_s": args.calibration_s if args.calibration_s is not None else (60.0 if cuda else 5.0),
    }


def _cost_models(model, trie, args, run: dict, *, rank: int) -> tuple[CostModel, CostModel, dict | None]:
    """``(calibrated, planning model, probe summary)``: rank 0's calibration on every rank, then refined
    on a probe of the rollouts unless ``--no-refine``."""
    local = calibrate(
        model,
        block_tokens=run["block_tokens"],
        token_budget=run["token_budget"],
        seconds=run["calibration_s"],
        use_cache=False,
        progress=rank == 0,
    )
    shared = [local.to_dict()]
    dist.broadcast_object_list(shared, src=0, group=monitor_group(None))
    calibrated = CostModel.from_dict(shared[0])
    if not args.refine:
        return calibrated, calibrated, None
    refined, probe = refine_cost_model(
        model,
        trie,
        calibrated,
        mode=args.mode,
        block_tokens=run["block_tokens"],
        token_budget=run["token_budget"],
    )
    return calibrated, refined, probe


def _device_only(cost_model: CostModel) -> CostModel:
    """``cost_model`` without its host floor: every micro-batch costs its device term."""
    data = cost_model.to_dict()
    data["host"] = {m: [0.0] * len(h) for m, h in data["host"].items()}
    return CostModel.from_dict(data)


def _predictions(shares, calibrated: CostModel, plan_model: CostModel, shape: dict) -> dict:
    """Per rank: the calibration's prediction of what the plan runs, with and without the host floor;
    and its micro-batches and host-bound ones (as the planning model predicts them)."""
    device_only = _device_only(calibrated)
    with_host = [predicted_for_modes_run(calibrated, plan_model, s.micro_batches, **shape) for s in shares]
    without = [predicted_for_modes_run(device_only, plan_model, s.micro_batches, **shape) for s in shares]
    return {
        "per_rank_predicted_calibrated_s": with_host,
        "predicted_makespan_device_only_s": max(without),
        "per_rank_micro_batches": [len(s.micro_batches) for s in shares],
        "per_rank_host_bound": [s.host_bound for s in shares],
    }


def _timed_steps(model, optimizer, step, *, steps: int, warmup: int) -> list:
    """Run ``step()`` (returning a result) warmup + steps times, all ranks starting together:
    ``[(seconds, result)]`` of the timed ones."""
    device = next(model.parameters()).device
    out = []
    for i in range(warmup + steps):
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        result = step()
        optimizer.step()
        sync(device)
        if i >= warmup:
            out.append((time.perf_counter() - t0, result))
    return out


def _partitioner_row(name, model, optimizer, trie, args, run, engine, calibrated, world) -> tuple[dict, list]:
    """One partitioner's timed steps over the ranks: the row, and the last step's timeline."""
    plan = plan_shares(trie, partitioner=name, barrier_timeout_s=args.barrier_timeout_s, **engine)
    timed = _timed_steps(
        model,
        optimizer,
        lambda: run_step(model, plan, barrier_timeout_s=args.barrier_timeout_s),
        steps=args.steps,
        warmup=args.warmup,
    )
    step_s = _median([t for t, _ in timed])
    per_rank = [_median([r.rank_seconds[q] for _, r in timed]) for q in range(world)]
    makespan = _median([r.measured_makespan for _, r in timed])
    report = plan.balance
    shape = {"mode": args.mode, "block_tokens": run["block_tokens"], "token_budget": run["token_budget"]}
    predicted = _predictions(report.shares, calibrated, engine["cost_model"], shape)
    calibrated_per_rank = predicted["per_rank_predicted_calibrated_s"]
    row = {
        "partitioner": name,
        "ranks": world,
        "step_s": step_s,
        "tokens_per_s": sum(trie.seq_lengths) / step_s,
        "measured_makespan_s": makespan,
        "predicted_makespan_s": report.makespan,
        "prediction_error": makespan / report.makespan - 1,
        "measured_imbalance": max(per_rank) / (sum(per_rank) / world),
        "predicted_imbalance": report.imbalance,
        "reduce_s": _median([r.reduce_seconds for _, r in timed]),
        "plan_s": plan.seconds,
        "replicated_tokens": report.replicated_tokens,
        "per_rank_measured_s": per_rank,
        "per_rank_predicted_s": report.costs,
        "predicted_makespan_calibrated_s": max(calibrated_per_rank),
        "prediction_error_calibrated": makespan / max(calibrated_per_rank) - 1,
        **predicted,
        "prediction_error_device_only": makespan / predicted["predicted_makespan_device_only_s"] - 1,
        "modes": sorted({m for _, r in timed if r.local for m in r.local.modes}),
    }
    return row, timed[-1][1].timeline()


def _single_device_row(model, optimizer, trie, args, run, engine, calibrated) -> dict:
    """Every rank trains the whole trie alone on its own device, at the same time: the baseline."""
    cost_model, block_tokens, token_budget = engine["cost_model"], run["block_tokens"], run["token_budget"]
    single_plan = balance(
        trie,
        1,
        BEST,
        cost=EngineCost(cost_model, mode=args.mode, block_tokens=block_tokens),
        token_budget=token_budget,
    )
    timed = _timed_steps(
        model,
        optimizer,
        lambda: tree_backward(model, trie, None, **engine),
        steps=args.steps,
        warmup=args.warmup,
    )
    step_s = _median([t for t, _ in timed])
    compute = _median([r.report.time_s for _, r in timed])
    shape = {"mode": args.mode, "block_tokens": block_tokens, "token_budget": token_budget}
    predicted = _predictions(single_plan.shares, calibrated, cost_model, shape)
    calibrated_single = predicted["per_rank_predicted_calibrated_s"][0]
    return {
        "partitioner": "one device",
        "ranks": 1,
        "step_s": step_s,
        "tokens_per_s": sum(trie.seq_lengths) / step_s,
        "measured_makespan_s": compute,
        "predicted_makespan_s": single_plan.makespan,
        "prediction_error": compute / single_plan.makespan - 1,
        "predicted_makespan_calibrated_s": calibrated_single,
        "prediction_error_calibrated": compute / calibrated_single - 1,
        **predicted,
        "prediction_error_device_only": compute / predicted["predicted_makespan_device_only_s"] - 1,
        "modes": sorted({m for _, r in timed for m in r.report.modes}),
    }


def targets(rows: list[dict], *, world: int, set_name: str, refined: bool) -> list[dict]:
    """The run's targets for this lab's partitioner: its measured makespan within 10% of the prediction
    (the refined model's, when refined, and the calibration's), and a throughput of at least 0.9 x the
    ranks x one device's."""
    best = next((r for r in rows if r["partitioner"] == BEST), None)
    if best is None:
        return []

    def target(text, value, goal, met):
        return {"target": f"{BEST}: {text}", "value": value, "goal": goal, "met": met}

    checks = []
    if refined:
        checks.append(
            target(
                "measured makespan within 10% of the prediction (model refined on a probe of these rollouts)",
                best["prediction_error"],
                PREDICTION_GOAL,
                abs(best["prediction_error"]) <= PREDICTION_GOAL,
            )
        )
    checks.append(
        target(
            "measured makespan within 10% of the calibration's prediction",
            best["prediction_error_calibrated"],
            PREDICTION_GOAL,
            abs(best["prediction_error_calibrated"]) <= PREDICTION_GOAL,
        )
    )
    if "speedup_vs_one_device" in best:
        goal = SPEEDUP_GOAL * world
        speedup = best["speedup_vs_one_device"]
        checks.append(
            target(f"throughput >= {goal:g} x one device ({set_name})", speedup, goal, speedup >= goal)
        )
    return checks


COLUMNS = [
    ("partitioner", "partitioner"),
    ("step_s", "step s"),
    ("tokens_per_s", "flat tok/s"),
    ("speedup_vs_one_device", "x one device"),
    ("measured_makespan_s", "makespan s"),
    ("predicted_makespan_s", "predicted s"),
    ("prediction_error", "error"),
    ("predicted_makespan_calibrated_s", "calib. pred. s"),
    ("prediction_error_calibrated", "calib. error"),
    ("prediction_error_device_only", "no-host error"),
    ("measured_imbalance", "imbalance"),
    ("predicted_imbalance", "predicted imb."),
    ("reduce_s", "all-reduce s"),
    ("plan_s", "plan s"),
]


def _report(rows, checks, extra: dict, *, args, run: dict, world: int) -> None:
    """Rank 0: the tables, and the results file."""
    env = environment()
    env.update(
        world_size=world, backend=dist.get_backend(), nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE")
    )
    title = (
        f"{args.set} on {world} x {env['device']}, TinyLM {run['model']} "
        f"{str(run['dtype']).removeprefix('torch.')}, mode {args.mode}, block {run['block_tokens']}, "
        f"budget {run['token_budget']}"
    )
    print_table(title, COLUMNS, rows)
    print_table(
        "targets", [("target", "target"), ("value", "value"), ("goal", "goal"), ("met", "met")], checks
    )
    settings = {k: (str(v) if k == "dtype" else v) for k, v in run.items() if k != "calibration_s"}
    path = write_results(
        f"multi-gpu-train-{world}x",
        rows,
        env,
        directory=Path(args.out) if args.out else None,
        extra={"set": args.set, "mode": args.mode, **settings, **extra, "targets": checks},
    )
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    rank, world, device = init_distributed(timeout_s=args.timeout_s)
    run = _device_defaults(args, device.type == "cuda")
    seqs = load_rollouts(args.set)[: run["max_rollouts"]]
    trie = RolloutTrie.from_sequences([s[: run["max_tokens"]] for s in seqs] if run["max_tokens"] else seqs)
    torch.manual_seed(0)
    model = TinyLM(MODELS[run["model"]]).to(device, run["dtype"])
    for p in model.parameters():  # identical weights everywhere, as DDP does at start
        dist.broadcast(p.data, src=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    calibrated, cost_model, probe = _cost_models(model, trie, args, run, rank=rank)
    engine = {
        "mode": args.mode,
        "block_tokens": run["block_tokens"],
        "token_budget": run["token_budget"],
        "cost_model": cost_model,
    }
    rows, timelines = [], {}
    for name in args.partitioners:
        row, timelines[name] = _partitioner_row(
            name, model, optimizer, trie, args, run, engine, calibrated, world
        )
        rows.append(row)
    if not args.no_single:
        rows.append(_single_device_row(model, optimizer, trie, args, run, engine, calibrated))
        for r in rows[:-1]:
            r["speedup_vs_one_device"] = rows[-1]["step_s"] / r["step_s"]
    for r in rows:
        r["prediction_from"] = "refined" if probe else "calibrated"
    checks = targets(rows, world=world, set_name=args.set, refined=probe is not None)
    if rank == 0:
        extra = {
            "flat_tokens": sum(trie.seq_lengths),
            "cost_model": cost_model.to_dict(),
            "cost_model_calibrated": calibrated.to_dict(),
            "refinement_probe": probe,
            "timelines": timelines,
        }
        _report(rows, checks, extra, args=args, run=run, world=world)
    dist.barrier(group=monitor_group(None))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
