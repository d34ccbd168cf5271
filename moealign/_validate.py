"""Small argument checks and dtype sets shared by the pure packages (no engine imports)."""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "POLICY_DTYPES", "check_positive_int"]

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
