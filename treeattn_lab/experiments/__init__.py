"""Experiments: small, seeded studies that run end to end on a CPU (quick modes) or a GPU.

- :mod:`.rat_dilation`: train dense, infer sparse: RAT+ against plain attention under dilated inference.
- :mod:`.sparse_recall`: how much attention mass vertical-slash patterns keep on a trained TinyLM's heads.
"""
