"""Experiments: small, seeded studies that run end to end on a CPU (quick modes) or a GPU.

- :mod:`.rat_dilation`: train dense, infer sparse: RAT+ against plain attention under dilated inference.
"""
