"""Packaging: the wheel installs kernels/ as treeattn_lab.kernels and nothing else at the top level (and
the repository root on sys.path does not hide the PyPI package ``kernels``); the
core install needs no notebook stack; results land in the working directory; ``make lab`` serves."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

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
    # no __init__.py: the folder must not shadow the PyPI package `kernels` from a repository root
    assert "treeattn_lab/kernels/__init__.py" not in names
    for sub in ("reference", "ops", "patterns", "lab", "bench"):
        assert f"treeattn_lab/{sub}/__init__.py" in names


def test_the_repository_root_does_not_shadow_the_pypi_package_kernels():
    code = ("import importlib.util, sys; spec = importlib.util.find_spec('kernels'); "
            "print(spec is None or not spec.origin or not spec.origin.startswith(sys.argv[1]))")
    run = subprocess.run([sys.executable, "-c", code, str(ROOT / "kernels")], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    assert run.stdout.strip() == "True"
    code = ("import treeattn_lab.kernels.tuning, treeattn_lab; "
            "print(treeattn_lab.kernels.tuning.__name__, treeattn_lab.kernels.__path__[0])")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    assert run.stdout.split() == ["treeattn_lab.kernels.tuning", str(ROOT / "kernels")]


def test_every_library_folder_is_listed_as_a_package():
    listed = (ROOT / "pyproject.toml").read_text()
    for init in (ROOT / "treeattn_lab").rglob("__init__.py"):
        dotted = ".".join(init.parent.relative_to(ROOT).parts)
        assert f'"{dotted}"' in listed, f"{dotted} is missing from [tool.setuptools] packages"


# --------------------------------------------------------------------------------------- dependencies
NOTEBOOK_STACK = ("plotly", "ipywidgets", "anywidget", "jupyterlab", "jupyter_server", "psutil", "IPython")

BLOCKED_IMPORT = f"""
import importlib.abc, pkgutil, sys

BLOCKED = {NOTEBOOK_STACK!r}


class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not a core dependency)")
        return None


sys.meta_path.insert(0, Block())
import torch
import treeattn_lab
from treeattn_lab import RolloutTrie, tree_attention
from treeattn_lab.engine import tree_backward  # noqa: F401

failed = []
for info in pkgutil.walk_packages(treeattn_lab.__path__, "treeattn_lab."):
    if info.name.startswith(("treeattn_lab.lab", "treeattn_lab.integrations")):
        continue  # the notebook helpers, and drop-ins that need their own library
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        failed.append(f"{{info.name}}: {{type(exc).__name__}}: {{exc}}")
pack = RolloutTrie.from_sequences([[1, 2, 3], [1, 2, 4]]).pack()
q = torch.randn(pack.num_tokens, 2, 8)
out = tree_attention(q, q, q, pack)
assert out.shape == q.shape
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print("FAILED", failed)
print("LOADED", loaded)
"""


def test_the_core_imports_without_the_notebook_stack():
    """``import treeattn_lab``, the ops, the engine and every module outside treeattn_lab.lab (and the
    integrations, which need their own libraries) work with JupyterLab, plotly, the widgets and psutil
    unimportable (the core install has none of them)."""
    proc = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "FAILED []" in proc.stdout, proc.stdout
    assert "LOADED []" in proc.stdout, proc.stdout


def test_the_notebook_stack_is_an_extra():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}

    core = names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert {"torch", "triton", "einops", "networkx", "tqdm", "rich"} <= core
    assert not core & {"jupyterlab", "ipywidgets", "anywidget", "plotly", "psutil"}
    assert {"jupyterlab", "ipywidgets", "anywidget", "plotly", "psutil"} <= names(extras["lab"])
    assert "trl" in names(extras["trl"])
    assert "treeattn-lab[lab,trl]" in extras["dev"]
    assert '".[lab]"' in (ROOT / "binder" / "postBuild").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert 'install -q -e ".[lab]"' in makefile and 'install -q -e ".[dev]"' in makefile


# -------------------------------------------------------------------------------------------- results
def test_results_default_to_the_working_directory(tmp_path, monkeypatch):
    from treeattn_lab.bench import harness

    monkeypatch.chdir(tmp_path)
    env = {"device": "cpu", "torch": "1", "triton": "2"}
    path = harness.write_results("probe", [{"x": 1}], env)
    assert path == tmp_path / "bench" / "results" / "probe__cpu__torch-1__triton-2.json"
    assert json.loads(path.read_text())["rows"] == [{"x": 1}]
    assert not path.is_relative_to(Path(harness.__file__).resolve().parents[1])


def test_a_benchmark_run_writes_under_its_working_directory(tmp_path):
    before = sorted((ROOT / "bench" / "results").iterdir())
    proc = subprocess.run([sys.executable, "-m", "treeattn_lab", "bench", "tree", "--backends", "flat"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (written,) = (tmp_path / "bench" / "results").glob("tree__*.json")
    assert json.loads(written.read_text())["command"].startswith("python -m treeattn_lab bench tree")
    assert sorted((ROOT / "bench" / "results").iterdir()) == before


def test_a_failed_write_leaves_the_old_file(tmp_path):
    from treeattn_lab.bench import harness

    env = {"device": "cpu", "torch": "1", "triton": "2"}
    path = harness.write_results("probe", [{"x": 1}], env, directory=tmp_path)
    with pytest.raises(TypeError):
        harness.write_results("probe", [{"x": object()}], env, directory=tmp_path)
    assert json.loads(path.read_text())["rows"] == [{"x": 1}]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


# ----------------------------------------------------------------------------------------- make lab
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.lab_server
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "jupyter").exists(), reason="no .venv with JupyterLab")
@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_lab_serves_jupyterlab_as_any_user(tmp_path):
    """``make lab`` as a newcomer runs it (as root too, where JupyterLab needs --allow-root): the server
    answers on /api/status, then is stopped."""
    port, token = free_port(), "treeattn-test"
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token}"
    log_path = tmp_path / "lab.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(["make", "lab", f"LAB_ARGS={args}"], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path)})
    status = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and status is None:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/api/status",
                                             headers={"Authorization": f"token {token}"})
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    status = json.loads(response.read())
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        output = log_path.read_text()
    assert status is not None, f"JupyterLab did not answer on port {port}:\n{output[-4000:]}"
    assert "started" in status
    if os.getuid() == 0:
        assert "--allow-root" in output
