"""A short subset of ``bench train --sets agentic`` for a lease with little device time left: the rows
flat, packed, dfs-budget and auto (after a calibration of ``$CALIBRATION_S`` seconds, default 20), one
warm-up and one timed step each, every row written to ``$OUT/exp_walk.json`` as it finishes. ``bench
train`` is the full measurement."""

import json
import os
import time

import torch

from treeattn_lab.bench.harness import environment
from treeattn_lab.bench.train import LLAMA_05B, bench_trie, row_settings, timed_steps, work_ratio
from treeattn_lab.engine import calibrate
from treeattn_lab.engine.call_plan import auto_micro_batches
from treeattn_lab.reference import TinyLM

ENGINE = {"block_tokens": 4096, "token_budget": 32768}


def main() -> None:
    out_path = os.path.join(os.environ.get("OUT", "."), "exp_walk.json")
    start = time.time()
    torch.manual_seed(0)
    model = TinyLM(LLAMA_05B).cuda().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    trie = bench_trie("agentic", False)
    stats = trie.stats()
    out = {"env": environment(), "rows": [], "engine": ENGINE, "work_ratio": work_ratio(model, stats)}

    def save() -> None:
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1, default=str)

    def step(row: str, **engine) -> None:
        with row_settings(model, row, ENGINE) as (mode, settings):
            r = timed_steps(model, optimizer, trie, mode=mode, reps=1, warmup=1, **settings, **engine)
        r = {k: v for k, v in r.items() if k != "loss"}
        r.update(row=row, tokens_per_s=stats["flat_tokens"] / r["step_s"], t=time.time() - start)
        out["rows"].append(r)
        save()
        print(r, flush=True)

    for row in ("flat", "packed", "dfs-budget"):
        step(row)
    seconds = float(os.environ.get("CALIBRATION_S", 20))
    cost_model = calibrate(model, **ENGINE, seconds=seconds, use_cache=False, progress=True)
    out["cost_model"] = cost_model.to_dict()
    plan = auto_micro_batches(trie, ENGINE["block_tokens"], ENGINE["token_budget"], cost_model)
    out["auto_plan"] = [(mb.mode, mb.block_tokens, p) for mb, p in plan]
    save()
    print("auto plan", out["auto_plan"], flush=True)
    step("auto", cost_model=cost_model)
    flat = out["rows"][0]["step_s"]
    for r in out["rows"]:
        print(f"{r['row']:>10} {r['step_s']:.3f} s  x flat {flat / r['step_s']:.2f}  "
              f"peak {r['peak_gib'] or 0:.1f} GiB  {r['choices']}")
    print("work ratio", out["work_ratio"], "token ratio", stats["token_ratio"], "s", time.time() - start)


if __name__ == "__main__":
    main()
