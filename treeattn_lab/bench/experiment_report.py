"""Renderers of the experiments' result files for the results document (``bench/report.py``)."""

from __future__ import annotations

from .markdown import fmt, mapping, pivot, records, render_rows


def render_rat(p: dict) -> list[str]:
    """The RAT+ experiment: validation loss per model and inference pattern, and its gap to dense."""

    def loss(group):
        r = group[0]
        spread = f", seeds {fmt(r['min'])}-{fmt(r['max'])}" if r.get("seeds", 1) > 1 else ""
        return f"{fmt(r['val_loss'])} ({r['gap_vs_dense']:+.1%}{spread})"

    out = [f"Configuration: {mapping(p.get('config', {}))}.", "",
           "Validation loss, nats/byte (relative to the same model at D=1 after the same steps):", ""]
    return out + pivot(p["summary"], ("dilation", "window", "initial", "adapted"), "model", loss,
                       {"dilation": "D", "window": "W", "initial": "P"})


def render_recall(p: dict) -> list[str]:
    """Recall of attention mass by estimated vertical-slash patterns, per layer and budget."""
    verdict = [{"layer / kind": k, **v} for k, v in p.get("verdict", {}).items()]
    out = [f"Training: {mapping({k: v for k, v in p['config'].items() if not isinstance(v, dict)})}.", "",
           "At the default budget:", ""]
    out += records(verdict, ("layer / kind", "recall_mean", "recall_min", "density", "mean_meets_target",
                             "min_meets_target"))
    out += ["Mean recall per budget (lines per head):", ""]
    return out + pivot(p["rows"], ("budget",), "kind",
                       lambda g: " / ".join(f"{layer_name(r['layer'])} {fmt(r['recall_mean'])}" for r in g))


def layer_name(layer) -> str:
    return f"layer {layer}" if isinstance(layer, int) else f"layers {layer}"


def render_grpo(p: dict) -> list[str]:
    """The GRPO loop flat against the tree: per seed and loop, rewards and seconds per phase; over the
    seeds, each loop's means and ranges (the held-out greedy gain among them), then the comparisons."""
    head = {k: v for k, v in p.get("headline", {}).items() if not isinstance(v, dict)}
    loops = {k: v for k, v in p.get("headline", {}).items() if isinstance(v, dict)}
    out = [f"Configuration: {mapping({k: v for k, v in p.get('config', {}).items() if k != 'model'})}.", ""]
    if p.get("stopped_early"):
        out += [f"Stopped early by `--budget-s`: GRPO steps done per seed {mapping(p.get('steps_done', {}))} "
                f"of {p.get('config', {}).get('steps')}.", ""]
    out += render_rows(p)
    for loop, values in loops.items():
        out += [f"The {loop} loop over the seeds: {mapping(values)}.", ""]
    if head:
        out += [f"Over the seeds: {mapping(head)}", ""]
    if p.get("grad_check"):
        seeds = "; ".join(f"seed {seed}: " + ", ".join(f"{k.replace('_vs_', ' vs ')} {fmt(v)}"
                                                       for k, v in c.items())
                          for seed, c in p["grad_check"].items())
        out += [f"Step-0 gradients, relative differences (float32 unless named): {seeds}.", ""]
    elif p.get("grad_rel_diff"):
        out += [f"Step-0 gradients, tree against flat (relative difference per seed): "
                f"{mapping(p['grad_rel_diff'])}", ""]
    return out


def render_sparse_training(p: dict) -> list[str]:
    """Training with dynamic sparse attention: per variant the loss, passkey retrieval by depth, the
    computed-pair share and the times, averaged over seeds (the document adds the targets)."""
    config = {k: v for k, v in p.get("config", {}).items() if not isinstance(v, (dict, list))}
    stages = p.get("config", {}).get("pretrain") or []
    curriculum = ", then ".join(f"{s['steps']} steps at {s['seq_len']} (batch {s['batch_size']})"
                                for s in stages)
    out = [f"Configuration: {mapping(config)}; model {mapping(p.get('config', {}).get('model', {}))}.", ""]
    out += [f"Dense pretraining: {curriculum}.", ""] if curriculum else []
    out += ["Per variant (mean over seeds; retrieval: exact match of the greedy passkey, and the share of "
            "right digits, per depth of the needle):", ""]
    rows = [{**{k: v for k, v in r.items() if not isinstance(v, dict)},
             **{f"exact@{d}": v for d, v in r.get("retrieval", {}).items()},
             **{f"digits@{d}": v for d, v in r.get("retrieval_digits", {}).items()}} for r in p["summary"]]
    return out + render_rows({"rows": rows})
