"""Simulated balancing: every partitioner over K = 2..64 ranks, on the bundled sets and on larger tries.

No model runs here: each partition is costed (tokens by default, see :mod:`treeattn_lab.distributed.costs`)
and reported as rows for tables and plots: makespan, imbalance (max / mean rank cost), replicated tokens,
the lower bound max(total / K, costliest rollout), and the ratios to the anchor (``contiguous_dfs``) at the
same K.

The larger tries:

- ``<set>_x<S>`` (e.g. ``grpo_math_x8``): the union of the bundled generator's rollouts for seeds 0..S-1,
  S times the rollouts with the same statistics;
- ``random_forest``: 64 prompts, each a random tree of forks (1-4 ways, 1-4 levels deep) with log-normal
  segments, 1000-2000 rollouts of fresh token ids (shaped like tree-search and agentic RL, larger).

Command line: ``python -m treeattn_lab bench balance`` (or ``python -m treeattn_lab.bench.balance``)
prints a table per set and writes ``bench/results/balance__*.json``; ``--quick`` runs the bundled sets at
K = 2, 4, 8, 16 only. ``--cost-model FILE`` (a saved :class:`~treeattn_lab.engine.CostModel`, or a
results file holding one under ``"cost_model"``, such as ``bench train``'s) costs every rank in the
engine's predicted seconds instead of tokens (:class:`~treeattn_lab.distributed.costs.EngineCost`, with
``--mode`` and ``--block-tokens`` as the engine will run): each micro-batch the larger of its host and
device terms, the micro-batches cut by that model's planner, and the rows count each rank's
micro-batches and those predicted host-bound.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

from ..datasets import DATASETS, generate, load_trie
from ..distributed.balance import ANCHOR, BEST, PARTITIONERS, EngineCost, TokenCost, balance
from ..engine import MODES, CostModel
from ..trie import RolloutTrie
from .harness import (
    add_out_argument,
    choice_list,
    environment,
    int_list,
    positive_int,
    print_table,
    write_results,
)

KS = (2, 4, 8, 16, 32, 64)
LARGE_SETS = ("grpo_math_x8", "tree_search_x8", "agentic_x4", "random_forest")
TARGET_K = 8
TARGET_IMBALANCE = 1.05
TARGET_SETS_VS_ANCHOR = ("agentic", "tree_search")  # best's excess imbalance <= half the anchor's here


def random_forest_trie(
    seed: int = 0, prompts: int = 64, max_width: int = 4, max_levels: int = 4
) -> RolloutTrie:
    """``prompts`` random fork trees: a prompt, then at each level every branch forks 1..``max_width`` ways
    for 1..``max_levels`` levels; segments log-normal (median 200 tokens). Token ids are fresh integers, so
    rollouts share exactly the prefixes the tree gives them."""
    rng = random.Random(seed)
    next_id = 0

    def segment(median: float) -> list[int]:
        nonlocal next_id
        n = max(8, round(median * math.exp(0.6 * rng.gauss(0.0, 1.0))))
        next_id += n
        return list(range(next_id - n, next_id))

    seqs: list[list[int]] = []
    for _ in range(prompts):
        levels = rng.randint(1, max_levels)
        frontier = [segment(400)]
        for _ in range(levels):
            frontier = [path + segment(200) for path in frontier for _ in range(rng.randint(1, max_width))]
        seqs.extend(frontier)
    return RolloutTrie.from_sequences(seqs)


def is_set_name(name: str) -> bool:
    """Whether :func:`load_set` knows ``name``."""
    match = re.fullmatch(r"(.+)_x(\d+)", name)
    return name in DATASETS or name == "random_forest" or bool(
        match and match.group(1) in DATASETS and int(match.group(2)) >= 1)


def load_set(name: str) -> RolloutTrie:
    """A bundled set, ``<bundled set>_x<S>`` (seeds 0..S-1 together) or ``random_forest``."""
    if not is_set_name(name):
        raise ValueError(
            f"unknown set {name!r}: use one of {DATASETS}, '<set>_x<copies>' (e.g. 'grpo_math_x8') "
            "or 'random_forest'"
        )
    if name in DATASETS:
        return load_trie(name)
    if name == "random_forest":
        return random_forest_trie()
    base, copies = name.rsplit("_x", 1)
    return RolloutTrie.from_sequences([s for seed in range(int(copies)) for s in generate(base, seed)])


def simulate(
    sets=DATASETS,
    ks=KS,
    partitioners=tuple(PARTITIONERS),
    *,
    cost=None,
    token_budget: int | None = None,
    exact: bool | None = None,
    progress: bool = False,
) -> list[dict]:
    """One row per (set, K, partitioner): :meth:`BalanceReport.row` plus the set's size and the ratios to
    the anchor at the same K. ``sets`` holds names (see :func:`load_set`) or ``(name, trie)`` pairs.
    ``exact=None`` costs the ranks' own micro-batches only where it differs from the surrogate (a token
    budget, or a cost other than tokens)."""
    cost = TokenCost() if cost is None else cost
    if exact is None:
        exact = token_budget is not None or not isinstance(cost, TokenCost)
    rows = []
    for item in sets:
        name, trie = item if isinstance(item, tuple) else (item, load_set(item))
        stats = trie.stats()
        for k in ks:
            started = time.perf_counter()
            group = []
            for p in partitioners:
                report = balance(trie, k, p, cost=cost, token_budget=token_budget, exact=exact)
                row = report.row()
                group.append(
                    {
                        "set": name,
                        "num_sequences": stats["num_sequences"],
                        "tree_tokens": stats["tree_tokens"],
                        **row,
                        "max_micro_batches": max(row["micro_batches"]),
                        "host_bound": sum(row["host_bound_micro_batches"]),
                    }
                )
            anchor = next((r for r in group if r["partitioner"] == ANCHOR), None)
            for r in group:
                r["makespan_vs_anchor"] = r["makespan"] / anchor["makespan"] if anchor else None
                excess = anchor["imbalance"] - 1 if anchor else None
                r["excess_vs_anchor"] = (r["imbalance"] - 1) / excess if excess else None
            rows += group
            if progress:
                print(f"{name} K={k}: {time.perf_counter() - started:.1f} s", flush=True)
    return rows


def targets(rows: list[dict], best: str = BEST) -> list[dict]:
    """The targets at K = 8 for ``best``: imbalance <= 1.05 on every bundled set, and at most half
    the anchor's excess imbalance (imbalance - 1) on the agentic and tree-search sets."""
    out = []
    at = {(r["set"], r["partitioner"]): r for r in rows if r["num_ranks"] == TARGET_K}
    for name in DATASETS:
        r, anchor = at.get((name, best)), at.get((name, ANCHOR))
        if r is None:
            continue
        out.append(
            {
                "target": f"{name}: imbalance <= {TARGET_IMBALANCE} at K={TARGET_K}",
                "value": r["imbalance"],
                "goal": TARGET_IMBALANCE,
                "met": r["imbalance"] <= TARGET_IMBALANCE,
            }
        )
        if name in TARGET_SETS_VS_ANCHOR and anchor is not None:
            goal = 1 + (anchor["imbalance"] - 1) / 2
            out.append(
                {
                    "target": f"{name}: imbalance - 1 <= half the anchor's ({anchor['imbalance']:.4f})",
                    "value": r["imbalance"],
                    "goal": goal,
                    "met": r["imbalance"] <= goal,
                }
            )
        out.append(
            {
                "target": f"{name}: makespan <= the anchor's",
                "value": r["makespan"],
                "goal": anchor["makespan"] if anchor else None,
                "met": anchor is not None and r["makespan"] <= anchor["makespan"],
            }
        )
    return out


def load_cost_model(path: str | Path) -> CostModel:
    """A saved :class:`CostModel` (:meth:`CostModel.to_dict`), or the one a results file keeps under
    ``"cost_model"``; ValueError naming the file where it holds neither."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(data, dict) and "time" not in data and isinstance(data.get("cost_model"), dict):
        data = data["cost_model"]
    try:
        return CostModel.from_dict(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} holds no saved cost model ({e})") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m treeattn_lab bench balance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sets", default=",".join(DATASETS + LARGE_SETS), help="comma list (see load_set)")
    parser.add_argument("--ks", type=int_list, default=list(KS), help="comma list of rank counts")
    parser.add_argument("--partitioners", type=choice_list(PARTITIONERS), default=list(PARTITIONERS))
    parser.add_argument("--token-budget", type=positive_int, default=None, help="tree tokens per micro-batch")
    parser.add_argument("--quick", action="store_true", help="bundled sets, K = 2, 4, 8, 16")
    parser.add_argument(
        "--cost-model", default=None, help="a saved cost model (or a results file with one): cost in seconds"
    )
    parser.add_argument("--mode", default="auto", choices=("auto",) + MODES, help="with --cost-model")
    parser.add_argument("--block-tokens", type=positive_int, default=4096, help="with --cost-model")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    cost = TokenCost()
    if args.cost_model:
        try:
            model = load_cost_model(args.cost_model)
        except (OSError, ValueError) as e:
            parser.error(f"--cost-model: {e}")
        cost = EngineCost(model, mode=args.mode, block_tokens=args.block_tokens)
    sets = list(DATASETS) if args.quick else args.sets.split(",")
    ks = (2, 4, 8, 16) if args.quick else tuple(args.ks)
    partitioners = args.partitioners
    unknown = [s for s in sets if not is_set_name(s)]
    if unknown:
        parser.error(f"unknown sets {unknown}: use one of {DATASETS}, '<set>_x<copies>' or 'random_forest'")
    rows = simulate(sets, ks, partitioners, cost=cost, token_budget=args.token_budget, progress=True)
    columns = [
        ("num_ranks", "K"),
        ("partitioner", "partitioner"),
        ("makespan", "makespan"),
        ("imbalance", "imbalance"),
        ("makespan_over_bound", "x bound"),
        ("makespan_vs_anchor", "x anchor"),
        ("replicated_fraction", "replicated"),
        ("max_micro_batches", "micro-batches (max)"),
        ("host_bound", "host-bound"),
        ("partition_s", "s"),
    ]
    for name in sets:
        print_table(
            f"{name}: makespan in {cost.unit}, imbalance = max / mean",
            columns,
            [r for r in rows if r["set"] == name],
        )
    checks = targets(rows)
    if checks:
        print_table(
            "targets", [("target", "target"), ("value", "value"), ("goal", "goal"), ("met", "met")], checks
        )
    env = environment()
    path = write_results(
        "balance",
        rows,
        env,
        directory=Path(args.out) if args.out else None,
        extra={
            "token_budget": args.token_budget,
            "cost": cost.unit,
            "cost_model": cost.cost_model.to_dict() if isinstance(cost, EngineCost) else None,
            "mode": args.mode if isinstance(cost, EngineCost) else None,
            "block_tokens": args.block_tokens if isinstance(cost, EngineCost) else None,
            "targets": checks,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
