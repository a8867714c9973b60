"""Regenerate the bundled rollout files, byte for byte.

    python data/generate.py           # rewrite data/rollouts/*.jsonl
    python data/generate.py --check   # regenerate into a temporary folder; exit 1 if any byte differs

The generator itself is :mod:`treeattn_lab.datasets` (seeded, pure Python); this script only places its
output beside this file.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROLLOUT_DIR = Path(__file__).resolve().parent / "rollouts"

try:
    from treeattn_lab.datasets import write_all
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(ROLLOUT_DIR.parents[1]))
    from treeattn_lab.datasets import write_all


def differing_files(expected_dir: Path, actual_dir: Path) -> list[str]:
    """Names of the .jsonl files that are missing, extra or different in ``actual_dir``."""
    expected = {p.name for p in expected_dir.glob("*.jsonl")}
    actual = {p.name for p in actual_dir.glob("*.jsonl")}
    differing = sorted(expected ^ actual)
    for name in sorted(expected & actual):
        if (expected_dir / name).read_bytes() != (actual_dir / name).read_bytes():
            differing.append(name)
    return differing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the files instead of rewriting them")
    args = parser.parse_args(argv)
    if not args.check:
        for path in write_all(ROLLOUT_DIR):
            print(f"wrote {path} ({path.stat().st_size:,} bytes)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        write_all(tmp)
        differing = differing_files(Path(tmp), ROLLOUT_DIR)
    if differing:
        print(f"{ROLLOUT_DIR} differs from the generator (missing, extra or changed): {', '.join(differing)}")
        print("regenerate with: python data/generate.py")
        return 1
    print(f"{ROLLOUT_DIR}: every file matches the generator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
