"""Command line: ``python -m treeattn_lab info`` and ``python -m treeattn_lab bench <name>``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

BENCHES = {
    "tree": "treeattn_lab.bench.tree",
    "tree-tune": "treeattn_lab.bench.tree_tune",
    "train": "treeattn_lab.bench.train",
    "sparse": "treeattn_lab.bench.sparse",
    "dilated": "treeattn_lab.bench.dilated",
    "balance": "treeattn_lab.distributed.balance_sim",
}


def _info(args) -> int:
    from .runtime import environment_report

    report = environment_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    width = max(len(k) for k in report)
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")
    return 0


def _bench(args, extra: list[str]) -> int:
    module = importlib.import_module(BENCHES[args.name])
    return module.main(extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, devices and available attention backends")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    bench = sub.add_parser("bench", help="run a benchmark: prints a table, writes JSON under bench/results/")
    bench.add_argument("name", choices=sorted(BENCHES))
    args, extra = parser.parse_known_args(argv)
    if args.command == "info":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return _info(args)
    return _bench(args, extra)


if __name__ == "__main__":
    sys.exit(main())
