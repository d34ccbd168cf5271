"""Small helpers shared by the correction modules (pure torch, no host sync).

Hot-path conventions. On CPU, a comparison that writes a bool tensor, ``torch.where`` and bool->float
casts each cost about 8x an arithmetic op (measured on the project's 2-core machines: 170-450 us
against 20 us per 256K floats), so the per-token code works on float 0/1 masks: comparisons write
straight into a float buffer (``gt`` / ``lt`` / ...), padding is handled with arithmetic, and bool
tensors appear only on per-row (B,) vectors. Under ``torch.compile`` the plain forms are used; inductor
fuses them anyway.
"""

from __future__ import annotations

import torch

SAFETY_BOUND = 20.0  # log-ratio clamp before exp: exp(20) ~ 4.85e8, exp(-20) ~ 2.06e-9
PAD_FILL = 1e30  # added to padding entries so they never win a min (subtracted: a max)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _cmp(op, x: torch.Tensor, value: float) -> torch.Tensor:
    if _compiling():
        return op(x, value).to(x.dtype)
    return op(x, value, out=torch.empty_like(x))


def gt(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x > value`` as 0/1 in x's float dtype."""
    return _cmp(torch.gt, x, value)


def lt(x: torch.Tensor, value: float) -> torch.Tensor:
    return _cmp(torch.lt, x, value)


def ge(x: torch.Tensor, value: float) -> torch.Tensor:
    return _cmp(torch.ge, x, value)


def le(x: torch.Tensor, value: float) -> torch.Tensor:
    return _cmp(torch.le, x, value)


def ne(x: torch.Tensor, value, dtype: torch.dtype) -> torch.Tensor:
    """``x != value`` (a number or a tensor) as 0/1 of ``dtype`` (x may be any dtype)."""
    if _compiling():
        return (x != value).to(dtype)
    return torch.ne(x, value, out=torch.empty(x.shape, dtype=dtype, device=x.device))


def safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den with 0 where den == 0 (no NaN for empty sets)."""
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


class RowAgg:
    """Means, extremes and spreads over the rows that hold at least one valid token.

    Built once per batch from the per-row valid counts ``n``; each statistic is then two or three small
    ops. Per-row values of empty rows must be finite (the pass makes them 0). A batch with no valid row
    gives non-finite results, but the pipeline rejects such a batch before anyone sees them.
    """

    def __init__(self, n: torch.Tensor):
        self.keep = n > 0
        keepf = self.keep.to(n.dtype)
        self.count = keepf.sum()
        self.keepf = keepf
        self.weight = keepf / self.count
        self.neg_fill = torch.where(self.keep, 0.0, float("-inf")).to(n.dtype)
        self.pos_fill = -self.neg_fill

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        return (values * self.weight).sum()

    def max(self, values: torch.Tensor) -> torch.Tensor:
        return (values + self.neg_fill).amax()

    def min(self, values: torch.Tensor) -> torch.Tensor:
        return (values + self.pos_fill).amin()

    def std(self, values: torch.Tensor) -> torch.Tensor:
        """Unbiased std (0 with fewer than two rows)."""
        dev = (values - self.mean(values)) * self.keepf
        var = (dev * dev).sum() / torch.clamp(self.count - 1.0, min=1.0)
        return torch.where(self.count > 1, torch.sqrt(var), 0.0)


def population_std(sum_x: torch.Tensor, sum_x2: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Population std from running sums (0 with fewer than two samples)."""
    mean = safe_div(sum_x, count)
    var = torch.clamp(safe_div(sum_x2, count) - mean * mean, min=0.0)
    return torch.where(count > 1, torch.sqrt(var), 0.0)
