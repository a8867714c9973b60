"""A short subset of ``bench train --sets agentic`` for a lease with little device time left: the rows
flat, packed, dfs-budget and auto (after a 20 s calibration), one warm-up and one timed step each, every
row written to ``$OUT/exp_walk.json`` as it finishes. ``bench train`` is the full measurement."""
import json, os, time, torch
from treeattn_lab.bench.train import LLAMA_05B, bench_trie, timed_steps, row_settings, work_ratio
from treeattn_lab.bench.harness import environment
from treeattn_lab.engine import calibrate
from treeattn_lab.engine.call_plan import auto_micro_batches
from treeattn_lab.reference import TinyLM
OUT = os.environ.get("OUT", "/tmp")
t0 = time.time()
torch.manual_seed(0)
model = TinyLM(LLAMA_05B).cuda().to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
engine = {"block_tokens": 4096, "token_budget": 32768}
out = {"env": environment(), "rows": [], "engine": engine}
def save():
    json.dump(out, open(os.path.join(OUT, "exp_walk.json"), "w"), indent=1, default=str)
trie = bench_trie("agentic", False)
stats = trie.stats()
out["work_ratio"] = work_ratio(model, stats)
def step(row, **kw):
    with row_settings(model, row, engine) as (mode, settings):
        r = timed_steps(model, opt, trie, mode=mode, reps=1, warmup=1, **settings, **kw)
    r = {k: v for k, v in r.items() if k != "loss"}
    r.update(row=row, tokens_per_s=stats["flat_tokens"] / r["step_s"], t=time.time() - t0)
    out["rows"].append(r); save(); print(r, flush=True)
for row in ("flat", "packed", "dfs-budget"):
    step(row)
cm = calibrate(model, **engine, seconds=20, use_cache=False, progress=False)
out["cost_model"] = cm.to_dict(); save()
plan = auto_micro_batches(trie, 4096, 32768, cm)
out["auto_plan"] = [(mb.mode, mb.block_tokens, p) for mb, p in plan]; save()
print("auto plan", out["auto_plan"], flush=True)
step("auto", cost_model=cm)
flat = out["rows"][0]["step_s"]
for r in out["rows"]:
    print(f"{r['row']:>10} {r['step_s']:.3f} s  x flat {flat / r['step_s']:.2f}  peak {r['peak_gib'] or 0:.1f} GiB  {r['choices']}")
print("work ratio", out["work_ratio"], "token ratio", stats["token_ratio"], "elapsed", time.time() - t0)
