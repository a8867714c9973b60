"""How long each guided notebook takes to run top to bottom, as a learner runs it.

Each notebook under ``notebooks/`` is executed headless (nbclient, the ``python3`` kernel of this
environment, the notebook's folder as its working directory) on an in-memory copy, so no output is
written into the committed file. One row per notebook: its wall time, its slowest cell (from the
execution timestamps nbclient records), whether it ran without error and whether it stayed within
:data:`BUDGET_S`. The machine's load average before and after each notebook is recorded beside it: a
notebook's time is only meaningful on an otherwise idle machine.

Normal mode is what a learner gets; ``--quick`` sets ``TREEATTN_QUICK=1`` as the test suite does.

    python -m treeattn_lab bench notebooks                 # every notebook, normal mode
    python -m treeattn_lab bench notebooks --names 05,07   # some of them
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import datetime
from pathlib import Path

from .harness import add_out_argument, environment, print_table, write_results

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
BUDGET_S = 180  # a notebook in normal mode on a 2-core CPU
CELL_TIMEOUT_S = 1800


def notebook_paths(names: list[str] | None = None, directory: Path = NOTEBOOK_DIR) -> list[Path]:
    """The notebooks whose file name starts with one of ``names`` (all of them when None), in order."""
    paths = sorted(directory.glob("[0-9][0-9]_*.ipynb"))
    if names:
        unknown = [n for n in names if not any(p.name.startswith(n) for p in paths)]
        if unknown:
            raise ValueError(f"no notebook starts with {unknown}; there are {[p.name for p in paths]}")
        paths = [p for p in paths if any(p.name.startswith(n) for n in names)]
    return paths


def _cell_seconds(cell) -> float:
    timing = cell.get("metadata", {}).get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return 0.0
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


def time_notebook(path: Path, *, quick: bool) -> dict:
    """Run ``path`` once, top to bottom; a row of :func:`run` (an error is recorded, not raised)."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    previous = os.environ.get("TREEATTN_QUICK")
    os.environ.pop("TREEATTN_QUICK", None)
    if quick:
        os.environ["TREEATTN_QUICK"] = "1"  # the kernel inherits this process's environment
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    error = None
    try:
        nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    except Exception as e:  # noqa: BLE001 (a failed notebook is a row of the result)
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
    finally:
        if previous is None:
            os.environ.pop("TREEATTN_QUICK", None)
        else:
            os.environ["TREEATTN_QUICK"] = previous
    seconds = time.perf_counter() - start
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    slowest_index, slowest = max(code, key=lambda ic: _cell_seconds(ic[1]), default=(None, None))
    return {
        "notebook": path.stem,
        "mode": "quick" if quick else "normal",
        "seconds": round(seconds, 2),
        "slowest_cell": slowest_index,
        "slowest_cell_s": round(_cell_seconds(slowest), 2) if slowest is not None else 0.0,
        "ok": error is None,
        "error": error,
        "within_budget": error is None and seconds <= BUDGET_S,
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def run(names: list[str] | None = None, *, quick: bool = False, progress: bool = True) -> list[dict]:
    """One row per notebook (:func:`time_notebook`), run one after another."""
    from ..progress import progress_bar

    paths = notebook_paths(names)
    rows = []
    with progress_bar(total=len(paths), desc="notebooks", disable=not progress) as bar:
        for path in paths:
            bar.set_postfix_str(path.stem)
            rows.append(time_notebook(path, quick=quick))
            bar.update()
    return rows


COLUMNS = [("notebook", "notebook"), ("mode", "mode"), ("seconds", "s"), ("slowest_cell", "slowest cell"),
           ("slowest_cell_s", "its s"), ("ok", "ran"), ("within_budget", f"<= {BUDGET_S} s"),
           ("load_before", "load before"), ("load_after", "load after")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treeattn_lab bench notebooks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", type=lambda s: [n for n in s.split(",") if n], default=None,
                        help="comma list of notebook name prefixes, e.g. 05,07 (default: every notebook)")
    parser.add_argument("--quick", action="store_true", help="TREEATTN_QUICK=1, as the test suite runs them")
    parser.add_argument("--no-save", action="store_true")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    try:
        rows = run(args.names, quick=args.quick)
    except ValueError as e:
        parser.error(str(e))
    env = environment()
    print_table(f"notebooks ({'quick' if args.quick else 'normal'} mode, {env['device']}, "
                f"{os.cpu_count()} cores)", COLUMNS, rows)
    for r in rows:
        if r["error"]:
            print(f"{r['notebook']}: {r['error']}")
    if not args.no_save:
        bench = "notebooks-quick" if args.quick else "notebooks"
        path = write_results(bench, rows, env, directory=args.out,
                             extra={"budget_s": BUDGET_S, "cpu_count": os.cpu_count()})
        print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1
