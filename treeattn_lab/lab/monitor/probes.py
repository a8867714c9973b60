"""What a :class:`~.live.LiveMonitor` asks the machine, and the checks of its arguments.

Nothing here initialises CUDA: a GPU's name is read only once CUDA is initialised, and NVML is reached
through ``torch.cuda.utilization``, which raises where pynvml or the driver is missing.
"""

from __future__ import annotations

import numbers
import sys
import warnings
from collections.abc import Sequence

import torch


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, nbclient), False in a script or a terminal IPython."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def host_rss_bytes() -> int | None:
    """Resident memory of this process (psutil; ``/proc/self/statm`` where psutil is missing)."""
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/self/statm") as f:
                import os

                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError, AttributeError):
            return None
    return psutil.Process().memory_info().rss


def nvml_utilization(device: int) -> float:
    """GPU utilisation in percent through NVML (``torch.cuda.utilization``, which maps the device index
    through ``CUDA_VISIBLE_DEVICES``); raises when pynvml or the driver is missing."""
    with warnings.catch_warnings():  # the deprecated "pynvml" package warns on import
        warnings.simplefilter("ignore")
        return float(torch.cuda.utilization(device))


def gpu_name(device: int) -> str:
    """`` <name>`` of a GPU, or nothing while CUDA is uninitialised (asking would initialise it)."""
    return f" {torch.cuda.get_device_name(device)}" if torch.cuda.is_initialized() else ""


def check_devices(devices) -> list[int]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices == "auto":
        return list(range(count))
    if devices is None:
        return []
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be 'auto', None or a list of GPU indices, got {devices!r}")
    out = []
    for d in devices:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"devices must hold GPU indices (ints), got {d!r}")
        if not 0 <= d < count:
            raise ValueError(f"GPU {d} does not exist here ({count} CUDA device(s) visible)")
        out.append(int(d))
    if len(set(out)) != len(out):
        raise ValueError(f"devices lists a GPU twice: {out}")
    return out
