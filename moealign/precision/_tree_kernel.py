"""A fused CPU kernel for the leaf tree of :func:`moealign.precision.tree.tree_linear` (float32 nodes).

It computes exactly the torch implementation's arithmetic, one IEEE float32 operation at a time in the same order
(each product, then the canonical tree within each leaf, then over the leaves), compiled with floating-point
contraction off and no fast-math, so the bits are the torch path's (``tests/test_canonical_ops.py`` compares them
with ``torch.equal``); outputs are independent, so the threads that share them out change nothing. Its C++ is part of
moealign's one native extension (:mod:`moealign._native`: built on first use with ``torch.utils.cpp_extension.
load_inline``, cached per machine); when it cannot be built (no compiler, no ninja) or ``MOEALIGN_TREE_KERNEL=0``, the
torch path runs instead (the same bits, slower).
"""

from __future__ import annotations

import torch

from .._native import extension

__all__ = ["tree_kernel", "leaf_tree_linear"]


def tree_kernel():
    """The compiled extension module, or None (not buildable here, or disabled by ``MOEALIGN_TREE_KERNEL=0``)."""
    return extension("tree")


def leaf_tree_linear(x: torch.Tensor, w: torch.Tensor, leaf_width: int, idx: torch.Tensor | None = None):
    """The fused kernel's ``[M, N]`` float32 roots, or None where it does not apply (not CPU float32, not built)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32:
        return None
    module = tree_kernel()
    if module is None:
        return None
    empty = torch.empty(0, dtype=torch.int64)
    wt = w.transpose(-1, -2).contiguous()            # [K, N] / [E, K, N]: the lanes read contiguous weights
    return module.leaf_tree_linear(x, wt, empty if idx is None else idx.to(torch.int64), int(leaf_width))
