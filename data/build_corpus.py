"""Build the bundled text corpus (``data/corpus/``) from a CPython standard library folder.

The corpus is a fixed list of pure-Python standard-library modules, copied byte for byte, concatenated
into one UTF-8 file per split, each module under a one-line header ``# === Lib/<path> ===``. Split by
module (never inside one), so validation text is never seen in training.

The bundled files were built from CPython 3.11.7. Source files differ between Python versions, so the
corpus is *bundled* rather than rebuilt at import time; this script documents how it was made and can
rebuild it from any stdlib folder (a different version gives different bytes and hashes):

    python data/build_corpus.py           # from the running interpreter's stdlib; rewrites data/corpus/
    python data/build_corpus.py --check   # verify data/corpus/ against MANIFEST.json (exit 1 if not)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"

# (split, path under Lib/). About 2.2 MB; validation is ~6% of the bytes, whole modules only.
MODULES: tuple[tuple[str, str], ...] = tuple(
    ("train", p)
    for p in (
        "abc.py", "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py",
        "collections/__init__.py", "configparser.py", "contextlib.py", "copy.py", "dataclasses.py",
        "datetime.py", "difflib.py", "enum.py", "fnmatch.py", "functools.py", "gettext.py", "glob.py",
        "heapq.py", "inspect.py", "ipaddress.py", "json/__init__.py", "json/decoder.py",
        "json/encoder.py", "locale.py", "logging/__init__.py", "numbers.py", "operator.py",
        "optparse.py", "pathlib.py", "pprint.py", "queue.py", "random.py", "re/_compiler.py",
        "re/_parser.py", "shutil.py", "string.py", "subprocess.py", "tarfile.py", "tempfile.py",
        "threading.py", "tokenize.py", "typing.py", "uuid.py", "weakref.py", "zipfile.py",
    )  # fmt: skip
) + tuple(
    ("validation", p)
    for p in ("csv.py", "fractions.py", "graphlib.py", "shlex.py", "statistics.py", "textwrap.py")
)

SPLITS = ("train", "validation")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build(stdlib: Path, out: Path = CORPUS_DIR) -> dict:
    """Write ``<split>.txt``, ``LICENSE-PSF.txt`` and ``MANIFEST.json`` under ``out``; return the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "source": f"CPython {sys.version.split()[0]} standard library (Lib/)",
        "license": "PSF License Agreement for Python (LICENSE-PSF.txt)",
        "files": {},
        "modules": [],
    }
    for split in SPLITS:
        parts = []
        for s, rel in MODULES:
            if s != split:
                continue
            data = (stdlib / rel).read_bytes()
            data.decode("utf-8")  # every module must be UTF-8 text
            if not data.endswith(b"\n"):
                data += b"\n"
            parts.append(f"# === Lib/{rel} ===\n".encode() + data)
            manifest["modules"].append({"split": split, "path": f"Lib/{rel}", "bytes": len(data),
                                        "sha256": _sha256(data)})  # fmt: skip
        text = b"".join(parts)
        (out / f"{split}.txt").write_bytes(text)
        manifest["files"][f"{split}.txt"] = {"bytes": len(text), "sha256": _sha256(text)}
    license_text = (stdlib / "LICENSE.txt").read_bytes()
    (out / "LICENSE-PSF.txt").write_bytes(license_text)
    manifest["files"]["LICENSE-PSF.txt"] = {"bytes": len(license_text), "sha256": _sha256(license_text)}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def check(out: Path = CORPUS_DIR) -> list[str]:
    """Names of the files under ``out`` whose size or sha256 disagree with ``MANIFEST.json``."""
    manifest = json.loads((out / "MANIFEST.json").read_text(encoding="utf-8"))
    bad = []
    for name, entry in manifest["files"].items():
        path = out / name
        data = path.read_bytes() if path.exists() else b""
        if len(data) != entry["bytes"] or _sha256(data) != entry["sha256"]:
            bad.append(name)
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--check", action="store_true", help="verify the bundled files against the manifest")
    args = parser.parse_args(argv)
    if args.check:
        bad = check()
        print("corpus OK" if not bad else f"corpus files differ from MANIFEST.json: {bad}")
        return 1 if bad else 0
    manifest = build(args.stdlib)
    for name, entry in manifest["files"].items():
        print(f"{name}: {entry['bytes']:,} bytes  sha256 {entry['sha256'][:16]}...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
