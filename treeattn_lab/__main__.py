"""Command line of treeattn_lab.

- ``python -m treeattn_lab info``: versions, devices and available attention backends;
- ``python -m treeattn_lab bench NAME [options]``: run a benchmark (``bench NAME --help`` lists its options);
- ``python -m treeattn_lab results [--check]``: write docs/results.md from bench/results/*.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

BENCHES = {
    "tree": "treeattn_lab.bench.tree",
    "tree-tune": "treeattn_lab.bench.tree_tune",
    "train": "treeattn_lab.bench.train",
    "dfs-kernels": "treeattn_lab.bench.dfs_kernels",
    "rl": "treeattn_lab.bench.rl",
    "sparse": "treeattn_lab.bench.sparse",
    "dilated": "treeattn_lab.bench.dilated",
    "balance": "treeattn_lab.bench.balance",
    "compile": "treeattn_lab.bench.compile",
    "notebooks": "treeattn_lab.bench.notebooks",
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


def _bench(args) -> int:
    module = importlib.import_module(BENCHES[args.name])
    options = args.options[1:] if args.options[:1] == ["--"] else args.options
    return module.main(options)


def _results(args) -> int:
    from .bench.report import check_document, write_document

    if args.check:
        return check_document(args.results_dir, args.out)
    print(f"wrote {write_document(args.results_dir, args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, devices and available attention backends")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    bench = sub.add_parser("bench", help="run a benchmark: prints a table, writes JSON to ./bench/results",
                           description="Run a benchmark. `bench NAME --help` lists NAME's own options.")
    bench.add_argument("name", choices=sorted(BENCHES))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's options")
    results = sub.add_parser("results", help="write docs/results.md from the JSON under bench/results",
                             description="Generate the results document from the result files.")
    results.add_argument("--results-dir", type=Path, default=Path("bench/results"),
                         help="folder of the JSON result files (default ./bench/results)")
    results.add_argument("--out", default="docs/results.md", help="the document (default ./docs/results.md)")
    results.add_argument("--check", action="store_true",
                         help="write nothing; exit 1 when the document differs from what the JSON gives")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return _info(args)
    if args.command == "bench":
        return _bench(args)
    return _results(args)


if __name__ == "__main__":
    sys.exit(main())
