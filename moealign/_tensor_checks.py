"""Tensor checks and the compute dtype shared by the pure packages (``routing_replay``, ``correction``).

No engine imports; the error class is the caller's (each package raises its own ``moealign.errors`` class).
"""

from __future__ import annotations

import torch

__all__ = ["check_float_matrix", "compute_dtype"]


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any of ``tensors`` is float64, else float32: the dtype log-probs and ratios are computed in
    (half-precision inputs are upcast, float64 inputs keep their precision)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_float_matrix(x, name: str, error_cls: type[Exception], *, shape: str,
                       empty: str | None = None) -> torch.Tensor:
    """``x`` if it is a floating ``[rows, cols]`` tensor with ``cols >= 1``, else ``error_cls`` naming the problem.

    ``shape`` is how the message spells the expected shape (``"[N, V] with V >= 1"``). ``empty``: the message
    for zero columns (``"<name> <empty> (shape ...)"``, checked after the dtype); None folds that case into the
    shape message.
    """
    if not isinstance(x, torch.Tensor):
        raise error_cls(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or (empty is None and x.shape[1] == 0):
        raise error_cls(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise error_cls(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if x.shape[1] == 0:
        raise error_cls(f"{name} {empty} (shape {tuple(x.shape)})")
    return x
