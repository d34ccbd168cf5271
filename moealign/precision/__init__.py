"""Precision alignment: precision policies and audits, FP8 simulation, TP-invariant tree reductions.

Submodules are imported explicitly (nothing is imported eagerly here):

* :mod:`moealign.precision.tree` - TP-invariant tree reductions (leaf tree, tree all-reduce,
  row-parallel linear, vocab-parallel selected-token log-prob).
"""
