"""Experiments: small, seeded studies that run end to end on a CPU (quick modes) or a GPU.

- :mod:`.grpo_tree`: GRPO flat against GRPO over tries on a seeded addition task: the same reward, and the
  time of the log-prob and training phases.
- :mod:`.rat_dilation`: train dense, infer sparse: RAT+ against plain attention under dilated inference.
- :mod:`.sparse_recall`: how much attention mass vertical-slash patterns keep on a trained TinyLM's heads.
- :mod:`.sparse_training`: dense, dynamic sparse and sliding-window training at long context (loss, passkeys).
"""
