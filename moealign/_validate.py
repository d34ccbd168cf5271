"""Small argument and tensor checks, dtype sets and the compute dtype shared by the pure packages
(``precision``, ``routing_replay``, ``correction``); no engine imports. The error class is the caller's."""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "POLICY_DTYPES", "check_float_matrix", "check_positive_int", "compute_dtype"]

#: Floating dtypes the batch-invariant kernels and attention compute in.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Dtypes a precision policy may name (no float64: no engine computes a model in it), in the order error
#: messages list them.
POLICY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_positive_int(value: object, name: str, error_cls: type[Exception], *, noun: str = "int") -> int:
    """``value`` if it is an int >= 1 (bools are refused), else ``error_cls("<name> must be a positive <noun>,
    got <value!r>")``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error_cls(f"{name} must be a positive {noun}, got {value!r}")
    return value


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
