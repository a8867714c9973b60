"""Drop-ins for training libraries; each module needs its library, installed through an extra:

- :mod:`treeattn_lab.integrations.trl` (``pip install "treeattn_lab[trl]"``): ``TreeGRPOTrainer``, TRL's
  ``GRPOTrainer`` with its log-probs and loss computed over the rollout trie.

Nothing is imported here, so ``treeattn_lab`` never needs these libraries.
"""
