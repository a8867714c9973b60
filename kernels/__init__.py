"""Triton kernels, one op per file (installed as ``treeattn_lab.kernels``).

``tree_attention.py``, ``block_sparse.py`` and ``dilated_attention.py`` each hold an op's tile schedule
and visibility rule, built on the FlashAttention-2 steps of ``attention_core.py``; ``scan.py`` is the
gated recurrence. Every file opens with a docstring teaching its algorithm and exposes a
``torch.autograd.Function``. Launch configs (:class:`~.tuning.LaunchConfig`) and the tuned tables live in
``tuning.py``. Import through :mod:`treeattn_lab` so the Triton interpreter is configured first on CPU
machines.
"""
