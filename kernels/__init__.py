"""Triton kernels, one op per file (installed as ``treeattn_lab.kernels``).

Each file opens with a docstring teaching its algorithm and exposes a ``torch.autograd.Function``.
Import through :mod:`treeattn_lab` so the Triton interpreter is configured first on CPU machines.
"""
