"""Refit a GPU run's cost model offline, per attention kernel, and say what ``auto`` plans with it.

``python bench/probes/kernel_refit.py RUN.json OUT.json``: ``RUN.json`` is a run of
``train_walk_probe.py`` (or ``bench train``) whose cost model recorded its calibration timings. The
timings are refitted by this version's :meth:`CostModel.fit` (:func:`calibration.refit`), with the
rectangle from which the run's TinyLM 0.49B walks ran FA4 (the run had flash-attn-4, bf16, on Hopper).
For the agentic and low_sharing sets it records the plan of ``auto`` and its predicted seconds, under the
run's model and the refitted one, and the refitted model itself, as ``OUT.json``. Nothing is measured."""

import json
import sys

import torch

from treeattn_lab.bench.train import LLAMA_05B, bench_trie
from treeattn_lab.engine import CostModel
from treeattn_lab.engine.block_attention import FA4_MIN_WALK_WORK
from treeattn_lab.engine.calibration import refit
from treeattn_lab.engine.call_plan import auto_micro_batches

ENGINE = {"block_tokens": 4096, "token_budget": 32768}


def plan_of(model: CostModel, name: str) -> dict:
    plan = auto_micro_batches(bench_trie(name, False), ENGINE["block_tokens"], ENGINE["token_budget"], model)
    calls = [{"mode": mb.mode, "block_tokens": mb.block_tokens, "predicted_s": p[mb.mode][0]}
             for mb, p in plan]
    return {"micro_batches": calls, "predicted_s": sum(c["predicted_s"] for c in calls)}


def main(run_path: str, out_path: str) -> None:
    with open(run_path) as f:
        run = json.load(f)
    measured = CostModel.from_dict(run["cost_model"])
    width = LLAMA_05B.n_heads * LLAMA_05B.head_dim
    measured.fit_info["calibration"].setdefault("fa4_rectangle", -(-FA4_MIN_WALK_WORK // width))
    refitted = refit(measured)
    out = {
        "fa4_rectangle": measured.fit_info["calibration"]["fa4_rectangle"],
        "residuals": {"sdpa_walks": refitted.fit_info["dfs"]["rel_rms_residual"],
                      "fa4_walks": refitted.fit_info["dfs"].get("fa4_walks", {}).get("rel_rms_residual"),
                      "one_fit": measured.fit_info["dfs"]["rel_rms_residual"]},
        "plans": {name: {"run": plan_of(measured, name), "refit": plan_of(refitted, name)}
                  for name in ("agentic", "low_sharing")},
        "cost_model": refitted.to_dict(),
        "torch": torch.__version__,
    }
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    for name, plans in out["plans"].items():
        for which, plan in plans.items():
            steps = ", ".join(f"{c['mode']}@{c['block_tokens']}: {c['predicted_s']:.3f}"
                              for c in plan["micro_batches"])
            print(f"{name:>12} {which:>5}: {plan['predicted_s']:.3f} s  [{steps}]")


if __name__ == "__main__":
    main(*sys.argv[1:3])
