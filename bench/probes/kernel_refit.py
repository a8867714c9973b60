"""Refit a GPU run's cost model offline, per attention kernel, and record what ``auto`` plans with it.

``python bench/probes/kernel_refit.py RUN.json [OUT_DIR]``: ``RUN.json`` is the ``exp_walk.json`` of
``train_walk_probe.py``, whose cost model recorded its calibration timings. The timings are refitted by
this version's :meth:`CostModel.fit` (:func:`calibration.refit`), with the rectangle from which the run's
TinyLM 0.49B walks ran FA4 (the run had flash-attn-4, bf16, on Hopper). For the agentic and low_sharing
sets it records the plan of ``auto`` and its predicted seconds under the run's model and under the refitted
one, beside the run's measured rows, as ``train-kernel-refit__<run's device>...json`` in ``OUT_DIR``
(default ./bench/results). Nothing is measured."""

import json
import sys
from pathlib import Path

import torch

from treeattn_lab.bench.harness import command_line, write_results
from treeattn_lab.bench.train import LLAMA_05B, bench_trie
from treeattn_lab.engine import CostModel
from treeattn_lab.engine.block_attention import fa4_min_rectangle
from treeattn_lab.engine.calibration import refit
from treeattn_lab.engine.call_plan import auto_micro_batches
from treeattn_lab.reference import TinyLM


def plan_of(model: CostModel, name: str, engine: dict) -> dict:
    plan = auto_micro_batches(bench_trie(name, False), engine["block_tokens"], engine["token_budget"], model)
    calls = [{"mode": mb.mode, "block_tokens": mb.block_tokens, "predicted_s": p[mb.mode][0]}
             for mb, p in plan]
    return {"micro_batches": calls, "predicted_s": sum(c["predicted_s"] for c in calls)}


def measured_rows(run: dict) -> list[dict]:
    """The probe's rows as ``bench train`` rows of the agentic set."""
    token_ratio = bench_trie("agentic", False).stats()["token_ratio"]
    flat = next(r for r in run["rows"] if r["row"] == "flat")["step_s"]
    keep = ("step_s", "tokens_per_s", "peak_gib", "activation_gib", "choices", "recomputed_tokens")
    return [{"set": "agentic", "mode": r["row"], **{k: r[k] for k in keep}, "speedup": flat / r["step_s"],
             "token_ratio": token_ratio, "work_ratio": run["work_ratio"]} for r in run["rows"]]


def main(run_path: str, out_dir: str | None = None) -> None:
    run = json.loads(Path(run_path).read_text())
    engine = run["engine"]
    measured = CostModel.from_dict(run["cost_model"])
    report = measured.fit_info["calibration"]
    report.setdefault("fa4_rectangle", fa4_min_rectangle(LLAMA_05B.n_heads, LLAMA_05B.head_dim))
    refitted = refit(measured)
    plans = {name: {"run": plan_of(measured, name, engine), "refit": plan_of(refitted, name, engine)}
             for name in ("agentic", "low_sharing")}
    with torch.device("meta"):
        params = sum(p.numel() for p in TinyLM(LLAMA_05B).parameters())
    refit_record = {
        "fa4_rectangle": report["fa4_rectangle"],
        "residuals": {"sdpa_walks": refitted.fit_info["dfs"]["rel_rms_residual"],
                      "fa4_walks": refitted.fit_info["dfs"].get("fa4_walks", {}).get("rel_rms_residual"),
                      "one_fit": measured.fit_info["dfs"]["rel_rms_residual"]},
        "plans": plans, "cost_model": refitted.to_dict(),
    }
    notes = (f"The rows ran on one {run['env']['device']} (train_walk_probe.py, its calibration "
             f"{report['seconds']:g} s). The run's cost model fitted every dfs walk per call with one set of "
             "coefficients. refit holds what auto plans when the same recorded timings are fitted per "
             "attention kernel (kernel_refit.py, on a CPU, nothing measured): its plans were not run on a "
             "GPU. A calibration before version 7 timed dfs in one large block per trie, so its FA4-side "
             "walks are single calls.")
    command = (f"CALIBRATION_S={report['seconds']:g} python bench/probes/train_walk_probe.py; "
               f"{command_line().replace(run_path, 'exp_walk.json')}")
    path = write_results("train-kernel-refit", measured_rows(run), run["env"],
                         directory=None if out_dir is None else Path(out_dir),
                         extra={"command": command, **engine, "dtype": "torch.bfloat16", "params": params,
                                "config": LLAMA_05B.__dict__, "cost_model": run["cost_model"],
                                "refit": refit_record, "notes": notes})
    for name, both in plans.items():
        for which, plan in both.items():
            steps = ", ".join(f"{c['mode']}@{c['block_tokens']}: {c['predicted_s']:.3f}"
                              for c in plan["micro_batches"])
            print(f"{name:>12} {which:>5}: {plan['predicted_s']:.3f} s  [{steps}]")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
