"""Benchmark runners and their plumbing: nothing in the library imports from here.

- one runner per ``python -m treeattn_lab bench NAME`` (``tree``, ``tree-tune``, ``train``, ``sparse``,
  ``dilated``, ``balance``, ``rl``, ``compile``), plus the torchrun runners ``multi_gpu_train`` and ``ring``;
- :mod:`.harness`: timing, the environment record, argparse types and atomic JSON writes to
  ``./bench/results`` (or ``--out``);
- :mod:`.report`: ``docs/results.md`` generated from the result files (``python -m treeattn_lab results``);
- :mod:`.trace`: compact GPU timelines from profiler traces.
"""
