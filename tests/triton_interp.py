"""The Triton interpreter's ``tl.dot`` replaced by an MMA-like one, for the children that check the canonical
Triton kernels' invariances on the CPU (tests/canonical_triton_child.py, tests/aligned_cuda_path_child.py).

The interpreter's ``tl.dot`` is numpy's BLAS, whose bits for a row depend on the row's place in the tile (OpenBLAS
sgemm); a GPU's MMA gives every row of a tile the same instruction sequence. The stand-in: each element the fp32
products of its row and column summed in K order, plus the accumulator, nothing else."""

from __future__ import annotations

import numpy as np


def mma_like_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    from triton.runtime import interpreter

    x, y = a.data.astype(np.float32), b.data.astype(np.float32)
    acc = np.zeros((x.shape[0], y.shape[1]), dtype=np.float32)
    for kk in range(x.shape[1]):
        acc += x[:, kk, None] * y[None, kk, :]
    return interpreter.TensorHandle(acc + d.data, d.dtype.scalar)


def install_mma_like_dot():
    """Swap the interpreter's ``create_dot`` for :func:`mma_like_dot`; returns the stock one (to put back)."""
    from triton.runtime import interpreter

    stock = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = mma_like_dot
    return stock
