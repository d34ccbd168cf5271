"""Small masked-reduction helpers shared by the correction modules (pure torch, no host sync)."""

from __future__ import annotations

import torch

SAFETY_BOUND = 20.0  # log-ratio clamp before exp: exp(20) ~ 4.85e8, exp(-20) ~ 2.06e-9


def row_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-row max over valid entries; -inf for a row with none."""
    return torch.where(valid, x, float("-inf")).amax(dim=-1)


def row_min(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-row min over valid entries; +inf for a row with none."""
    return torch.where(valid, x, float("inf")).amin(dim=-1)


def row_sum(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-row sum over valid entries (non-finite values outside the mask are neutralised)."""
    return torch.where(valid, x, 0.0).sum(dim=-1)


def safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den with 0 where den == 0 (no NaN for empty sets)."""
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def mean_over(values: torch.Tensor, keep: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the rows where ``keep``; ``count`` = keep.sum() (0 -> result 0)."""
    return safe_div(torch.where(keep, values, 0.0).sum(), count)


def max_over(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Max over kept rows; 0 when none are kept."""
    out = torch.where(keep, values, float("-inf")).amax()
    return torch.where(keep.any(), out, 0.0)


def min_over(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Min over kept rows; 0 when none are kept."""
    out = torch.where(keep, values, float("inf")).amin()
    return torch.where(keep.any(), out, 0.0)


def std_over(values: torch.Tensor, keep: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Unbiased std over kept rows (0 with fewer than two)."""
    mean = mean_over(values, keep, count)
    sq = torch.where(keep, (values - mean) ** 2, 0.0).sum()
    return torch.where(count > 1, torch.sqrt(sq / torch.clamp(count - 1, min=1)), 0.0)


def population_std(sum_x: torch.Tensor, sum_x2: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Population std from running sums (0 with fewer than two samples)."""
    mean = safe_div(sum_x, count)
    var = torch.clamp(safe_div(sum_x2, count) - mean * mean, min=0.0)
    return torch.where(count > 1, torch.sqrt(var), 0.0)
