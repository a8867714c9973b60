"""The wheel installs kernels/ as treeattn_lab.kernels and nothing at the top level but treeattn_lab."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_maps_kernels_into_the_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("treeattn_lab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"treeattn_lab"}, f"unexpected top-level entries: {top}"
    assert "treeattn_lab/kernels/tree_attention.py" in names
    assert "treeattn_lab/kernels/__init__.py" in names
    for sub in ("reference", "ops", "patterns", "lab", "bench"):
        assert f"treeattn_lab/{sub}/__init__.py" in names


def test_every_library_folder_is_listed_as_a_package():
    listed = (ROOT / "pyproject.toml").read_text()
    for init in (ROOT / "treeattn_lab").rglob("__init__.py"):
        dotted = ".".join(init.parent.relative_to(ROOT).parts)
        assert f'"{dotted}"' in listed, f"{dotted} is missing from [tool.setuptools] packages"
