"""Markdown for the results document: cell formatting, tables of records and pivots."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence

HEADERS = {"T": "packed T", "fwd_ms": "fwd ms", "fwd_bwd_ms": "fwd+bwd ms", "fwd_speedup": "fwd x base",
           "fwd_bwd_speedup": "fwd+bwd x base", "fwd_tflops": "fwd TFLOP/s",
           "fwd_bwd_tflops": "fwd+bwd TFLOP/s",
           "rel_err_out": "err out", "rel_err_dq": "err dq", "rel_err_dk": "err dk", "rel_err_dv": "err dv",
           "fwd_GBps": "fwd GB/s", "bwd_GBps": "bwd GB/s", "copy_GBps": "copy GB/s",
           "fwd_frac_copy": "fwd / copy", "bwd_frac_copy": "bwd / copy", "ms": "ms"}


def fmt(x) -> str:
    """A cell: floats to 3 significant digits (whole numbers from 1000 up), ints as they are."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"
    if isinstance(x, int):
        return f"{x:,}" if abs(x) >= 10000 else str(x)
    if x is None:
        return ""
    if isinstance(x, (list, tuple)):
        return ", ".join(fmt(v) for v in x)
    return str(x).replace("|", "\\|").replace("\n", " ")


def table(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table (already formatted cells)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return lines + [""]


def records(rows: Sequence[dict], keys: Sequence[str], headers: dict | None = None) -> list[str]:
    """One table row per record, the columns ``keys`` that at least one record has."""
    keys = [k for k in keys if any(k in r for r in rows)]
    names = {**HEADERS, **(headers or {})}
    return table([names.get(k, k) for k in keys], [[fmt(r.get(k)) for k in keys] for r in rows])


def pivot(rows: Sequence[dict], index: Sequence[str], column: str, cell: Callable[[list[dict]], str],
          headers: dict | None = None) -> list[str]:
    """A table with one row per distinct ``index`` values and one column per distinct ``column`` value;
    ``cell`` formats the records that fall in a cell (several records: e.g. repeats of one timing)."""
    keys = list(dict.fromkeys(tuple(r.get(k) for k in index) for r in rows))
    cols = list(dict.fromkeys(r.get(column) for r in rows))
    names = {**HEADERS, **(headers or {})}
    cells = []
    for key in keys:
        mine = [r for r in rows if tuple(r.get(k) for k in index) == key]
        cells.append([fmt(v) for v in key]
                     + [cell(g) if (g := [r for r in mine if r.get(column) == c]) else "" for c in cols])
    return table([names.get(k, k) for k in index] + [fmt(c) for c in cols], cells)


def median_of(key: str) -> Callable[[list[dict]], str]:
    """A :func:`pivot` cell: the value of ``key`` (the median, and how many, when a cell holds repeats)."""

    def cell(group: list[dict]) -> str:
        values = [r[key] for r in group if isinstance(r.get(key), (int, float))]
        if not values:
            return "error" if any(r.get("error") for r in group) else ""
        text = fmt(statistics.median(values))
        return text if len(values) == 1 else f"{text} (median of {len(values)})"

    return cell


def mapping(d: dict) -> str:
    """A dict as ``key: value`` pairs on one line (nested values shown as they are)."""
    return ", ".join(f"{k}: {fmt(v) if not isinstance(v, dict) else json.dumps(v)}" for k, v in d.items())


def render_rows(p: dict) -> list[str]:
    """Any other result file: its rows, scalar fields only."""
    rows = p.get("rows") or []
    keys = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, (dict, list))))
    return records(rows, keys) if rows else ["(no rows)", ""]
