"""What this machine can run: CUDA or not, Triton compiled or interpreted.

Triton kernels run compiled on a CUDA GPU. Without one, they run under Triton's interpreter, which
is switched on through ``TRITON_INTERPRET=1``. ``triton.jit`` reads the variable when a function is
*defined*: a kernel defined before it was set is a compiled kernel, which the interpreter cannot call.
That holds for Triton's own library too: ``triton.language`` defines ``tl.cdiv``, ``tl.max``, ``tl.sum``,
... with ``triton.jit`` when ``triton`` is first imported. Importing :mod:`treeattn_lab` calls
:func:`configure_triton`, which sets the variable before any kernel module of the lab is imported and,
when ``triton`` was imported earlier without it (``transformers`` and ``torch.compile`` import it),
defines ``triton.language``'s functions again under the interpreter, so the import order does not matter.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import platform
import sys
from pathlib import Path


def module_found(name: str) -> bool:
    """Whether module ``name`` can be imported here (``importlib.util.find_spec``, which torch.compile does
    not trace); False too when a package above it is missing or broken."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package, or a module whose __spec__ is unset
        return False


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def configure_triton() -> None:
    """Switch Triton to its interpreter when no CUDA device exists (unless the user chose already), and
    make the interpreter work even if ``triton`` was imported before (:func:`reinterpret_triton_language`)."""
    if "TRITON_INTERPRET" not in os.environ and not cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"
    if triton_interpreted() and "triton.language" in sys.modules:
        reinterpret_triton_language()


def _compiled_jit_functions(module) -> bool:
    """Whether ``module`` holds ``triton.jit`` functions defined for compilation (not the interpreter)."""
    from triton.runtime.jit import JITFunction

    return any(isinstance(value, JITFunction) for value in vars(module).values())


def reinterpret_triton_language() -> list[str]:
    """Define ``triton.language``'s own jit functions again, now for the interpreter, if ``triton`` was
    imported before ``TRITON_INTERPRET`` was set; returns the modules re-run (none when nothing was stale).

    Triton's library modules (``triton.language.standard``, ``.random``, ...) are re-executed in place,
    then ``triton.language`` itself, which re-exports their functions; every other module keeps its
    objects, so ``tl.tensor``, dtypes and descriptors stay the ones already in use.
    """
    import importlib

    stale = sorted(name for name, module in list(sys.modules.items()) if module is not None
                   and name.startswith("triton.language") and _compiled_jit_functions(module))
    package = "triton.language"
    for name in [n for n in stale if n != package] + ([package] if package in stale else []):
        importlib.reload(sys.modules[name])
    return stale


def link_source_kernels() -> None:
    """Make ``treeattn_lab.kernels`` importable from a source checkout or an editable install.

    Installs map the top-level ``kernels/`` folder to ``treeattn_lab.kernels``. The folder has no
    ``__init__.py``: with one, a repository root on ``sys.path`` (``python -m`` or pytest run there) would
    make it the top-level package ``kernels`` and hide the PyPI distribution of that name, which
    transformers imports. A wheel installs it as a namespace subpackage; where the package is imported
    straight from the repository (``PYTHONPATH=.``, or an editable install, whose finder looks for an
    ``__init__.py``), register the folder under that name here.
    """
    name = "treeattn_lab.kernels"
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return
    folder = Path(__file__).resolve().parents[1] / "kernels"
    if not (folder / "tree_attention.py").is_file():
        return
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent = sys.modules.get("treeattn_lab")
    if parent is not None:  # as an import would: the subpackage is also an attribute of its parent
        parent.kernels = module


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def package_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (a pip name), or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def environment_report() -> dict:
    """A dictionary describing the versions, devices and attention backends available here."""
    import torch

    report = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": cuda_available(),
        "triton": None,
        "triton_mode": None,
        "flash_attn_4": package_version("flash-attn-4"),
        "gpus": [],
    }
    if triton_installed():
        import triton

        report["triton"] = triton.__version__
        report["triton_mode"] = "interpreter (CPU)" if triton_interpreted() else "compiled"
    if report["cuda"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            report["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
    from .ops.backends import KERNELS, available_backends

    for op in KERNELS:
        report[f"{op}_backends"] = available_backends("cuda" if report["cuda"] else "cpu", op)
    return report


def device_name() -> str:
    """A short name of the device benchmarks run on (the GPU's name, or 'cpu')."""
    import torch

    return torch.cuda.get_device_name(0) if cuda_available() else "cpu"
