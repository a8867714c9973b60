"""The venvs a learner gets run the lab: `make lab`'s and Binder's, each with nothing the dev extra adds.

``make test`` builds both (``make bare-venvs``) and names their interpreters in ``TREEATTN_LAB_PYTHON``
(``make lab``'s own recipe into ``.venv-lab``) and ``TREEATTN_BINDER_PYTHON`` (Binder's recipe into
``.venv-binder``). In each, as a subprocess of that interpreter:

- the venv is bare: none of the dev extra's tools (pytest, transformers) is importable, so nothing they
  pull in can hide a missing dependency;
- every module of the package imports, except those that need an extra this venv was not given;
- ``python -m treeattn_lab info`` reports the machine;
- a Triton kernel runs (compiled on a GPU, in Triton's interpreter on a CPU) and agrees with its
  float64 reference, forward and backward;
- notebook 00 runs top to bottom in a kernel of that venv (quick mode).

(JupyterLab in the browser test also runs from ``.venv-lab``, so every notebook runs in it there.)
Without the variables the tests skip, except under CI, where a missing venv is a broken setup.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import under_ci

REPO = Path(__file__).resolve().parents[1]
VENVS = {"make lab": "TREEATTN_LAB_PYTHON", "binder": "TREEATTN_BINDER_PYTHON"}
DEV_ONLY = ("pytest", "transformers")  # in the dev extra, in no extra a learner installs
# packages of the extras a bare venv does not get, and the modules that need them
EXTRA_ONLY = {"trl": "trl", "transformers": "trl", "flash_attn": "hopper", "cutlass": "hopper"}
RUN_S = 600  # the longest one subprocess may take (notebook 00 on a loaded 2-core CPU takes far less)

IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, treeattn_lab
missing = {}
for m in pkgutil.walk_packages(treeattn_lab.__path__, "treeattn_lab."):
    try:
        importlib.import_module(m.name)
    except ModuleNotFoundError as e:
        missing[m.name] = e.name
print(json.dumps(missing))
"""

TRITON_AGAINST_REFERENCE = """
import torch
from treeattn_lab import RolloutTrie, tree_attention
from treeattn_lab.runtime import environment_report

device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on a CPU
trie = RolloutTrie.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [11, 12]])
pack = trie.pack()
torch.manual_seed(0)
q, k, v = (torch.randn(pack.num_tokens, 2, 16).to(device).requires_grad_() for _ in range(3))
out = tree_attention(q, k, v, pack.to(device), backend="triton")
out.square().sum().backward()
grads = [x.grad for x in (q, k, v)]
ref_inputs = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
ref = tree_attention(*ref_inputs, pack, backend="reference")
ref.square().sum().backward()
expected = [ref, *(x.grad for x in ref_inputs)]
worst = max(float((a.cpu().double() - b).abs().max()) for a, b in zip([out, *grads], expected))
print(environment_report()["triton_mode"], worst)
"""


def _python(venv: str) -> str:
    path = os.environ.get(VENVS[venv])
    if not path:
        if under_ci():
            pytest.fail(f"{VENVS[venv]} is not set: `make test` builds the {venv} venv and sets it")
        pytest.skip(f"{VENVS[venv]} is not set (`make test` builds the {venv} venv)")
    if not Path(path).is_file():
        pytest.fail(f"{VENVS[venv]}={path}: no such interpreter")
    config = (Path(path).parents[1] / "pyvenv.cfg").read_text()
    if "include-system-site-packages = true" in config:  # `make lab` on a python that has torch
        why = f"the {venv} venv sees the system's site-packages, so it cannot show what it lacks"
        if under_ci():
            pytest.fail(why)
        pytest.skip(why)
    return path


def _run(python: str, *args: str, cwd: Path, env: dict | None = None) -> str:
    """stdout of ``python *args`` in ``cwd`` (outside the checkout, so the installed package is what runs),
    with Jupyter's folders in ``cwd`` too (no kernel spec of the user's own); a failure shows its stderr."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    jupyter = {"JUPYTER_PATH": str(cwd / "jupyter"), "JUPYTER_DATA_DIR": str(cwd / "jupyter"),
               "JUPYTER_CONFIG_DIR": str(cwd / "jupyter-config"), "JUPYTER_RUNTIME_DIR": str(cwd / "runtime")}
    done = subprocess.run([python, *args], cwd=cwd, capture_output=True, text=True, timeout=RUN_S,
                          env={**clean, **jupyter, **(env or {})})
    assert done.returncode == 0, f"{python} {' '.join(args)[:80]} failed:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.parametrize("venv", VENVS)
def test_the_venv_is_bare_and_every_module_imports(venv, tmp_path):
    python = _python(venv)
    probe = f"import importlib.util as u; print([m for m in {DEV_ONLY} if u.find_spec(m)])"
    found = _run(python, "-c", probe, cwd=tmp_path).strip()
    assert found == "[]", f"the {venv} venv has dev tools ({found}): not what a learner gets"
    missing = json.loads(_run(python, "-c", IMPORT_EVERY_MODULE, cwd=tmp_path).strip().splitlines()[-1])
    undeclared = {mod: name for mod, name in missing.items() if name.split(".")[0] not in EXTRA_ONLY}
    assert not undeclared, f"the {venv} venv lacks modules the package imports: {undeclared}"


@pytest.mark.parametrize("venv", VENVS)
def test_info_and_a_triton_kernel_run(venv, tmp_path):
    python = _python(venv)
    info = _run(python, "-m", "treeattn_lab", "info", cwd=tmp_path)
    assert "triton_mode" in info and "tree_attention_backends" in info, info
    last = _run(python, "-c", TRITON_AGAINST_REFERENCE, cwd=tmp_path).strip().splitlines()[-1]
    mode, worst = last.rsplit(" ", 1)
    assert float(worst) < 1e-4, f"the Triton kernel ({mode}) is {worst} from its reference in the {venv} venv"


@pytest.mark.notebook
@pytest.mark.parametrize("venv", VENVS)
def test_notebook_00_runs_in_the_venv(venv, tmp_path):
    python = _python(venv)
    out = tmp_path / "00_welcome.ipynb"  # executed into a copy: the committed notebook stays clean
    _run(python, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", f"--output-dir={tmp_path}",
         "--ExecutePreprocessor.kernel_name=python3", str(REPO / "notebooks" / "00_welcome.ipynb"),
         cwd=tmp_path, env={"TREEATTN_QUICK": "1"})
    cells = [c for c in json.loads(out.read_text())["cells"] if c["cell_type"] == "code"]
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors and all(c.get("execution_count") for c in cells), errors
