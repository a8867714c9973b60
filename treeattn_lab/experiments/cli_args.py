"""Command-line argument types shared by the experiments' runners."""

from __future__ import annotations

import argparse


def seed_list(text: str) -> tuple[int, ...]:
    """``--seeds 0,1,2``: a comma list of distinct ints >= 0, as a tuple."""
    try:
        seeds = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints >= 0, got {text!r}") from None
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct ints >= 0, got {text!r}")
    return seeds
