"""Rejection sampling (RS): modes that remove tokens or whole sequences from the mask.

RS only ever changes the mask, never the IS weights, and every mode is computed from the original mask.
Per-token statistics on the safety-clamped log-ratio ``s = clamp(log r, -20, 20)``, ``r = pi_train / pi_rollout``:

* ``k1 = -log r``          (aggregated: per token, sum = -log of the product, mean = -log of the geometric mean)
* ``k2 = (log r)^2 / 2``
* ``k3 = r - 1 - log r``   (>= 0)

Aggregations: ``token_*`` (per token), ``seq_sum_*`` (sum over the row), ``seq_mean_*`` (mean over the
row's valid tokens), ``seq_max_*`` (max over the row's valid tokens). A token survives a chain when it
passes every mode.

Bounds. k2/k3 modes keep ``stat <= upper``. k1 modes take a band ``[l, u]`` **on the ratio r** itself
(per token, product, or geometric mean), as verl's docs state (``lower <= rho <= upper``). verl's code
compares ``-log r`` with ``[log l, log u]``, i.e. bounds ``1/r``: the two agree for symmetric bands
(``l = 1/u``, the default for a single value) and differ for asymmetric ones, where this module follows
the docs.

Legacy veto (``rollout_token_veto_threshold = C``): a whole sequence is rejected when any valid token's
*unclamped* ratio is below ``C``.

Metric conventions (prefix ``rollout_rs_{mode}_``) follow verl: ``mean``/``std`` are token-weighted,
``seq_*`` run over rows with at least one valid token, ``fraction_high``/``fraction_low`` compare the
statistic with its bounds (for k1 the bounds in statistic space are ``[-log u, -log l]``).
"""

from __future__ import annotations

import math

import torch

from ._masked import max_over, mean_over, min_over, population_std, row_max, row_min, safe_div, std_over
from .thresholds import RSOption
from .tokens import TokenView

__all__ = ["rs_pass", "rs_metrics", "veto_pass", "veto_metrics", "token_statistic"]


def token_statistic(view: TokenView, k: int) -> torch.Tensor:
    """k1 / k2 / k3 per token (0 on padding)."""
    s = view.clamped
    if k == 1:
        return -s
    if k == 2:
        return 0.5 * s * s
    return torch.exp(s) - 1.0 - s


def _row_value(view: TokenView, stat: torch.Tensor, agg: str) -> torch.Tensor:
    if agg == "seq_sum":
        return stat.sum(dim=-1)
    if agg == "seq_mean":
        return safe_div(stat.sum(dim=-1), view.n)
    # seq_max: 0 for a row with no valid token
    return torch.where(view.n > 0, row_max(stat, view.valid), 0.0)


def rs_pass(
    view: TokenView, options: tuple[RSOption, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Combined keep mask (bool, b x T; True outside the original mask too) and per-row statistics."""
    stats: dict[str, torch.Tensor] = {}
    cache: dict[int, torch.Tensor] = {}
    keep_all = None
    for opt in options:
        if opt.k not in cache:
            cache[opt.k] = token_statistic(view, opt.k)
        stat = cache[opt.k]
        lo, hi = opt.stat_bounds
        lo_clamp = lo if opt.k == 1 else 0.0
        key = f"rs_{opt.name}"
        if opt.agg == "token":
            keep = (stat >= lo) & (stat <= hi)
            rejected = view.valid & ~keep
            stats[f"{key}_sum"] = stat.sum(dim=-1)
            stats[f"{key}_max"] = row_max(stat, view.valid)
            stats[f"{key}_min"] = row_min(stat, view.valid)
            stats[f"{key}_n_high"] = (view.valid & (stat > hi)).sum(dim=-1).to(stat.dtype)
            stats[f"{key}_n_low"] = (view.valid & (stat < lo)).sum(dim=-1).to(stat.dtype)
            clamped = torch.clamp(stat, min=lo_clamp, max=hi) * view.maskf
            stats[f"{key}_csum"] = clamped.sum(dim=-1)
            stats[f"{key}_csq"] = (clamped * clamped).sum(dim=-1)
            stats[f"{key}_rejected"] = rejected.sum(dim=-1).to(stat.dtype)
        else:
            value = _row_value(view, stat, opt.agg)
            keep_row = (value >= lo) & (value <= hi)
            keep = keep_row[:, None]
            clamped = torch.clamp(value, min=lo_clamp, max=hi)
            stats[f"{key}_value"] = value
            stats[f"{key}_csum"] = clamped * view.n
            stats[f"{key}_csq"] = clamped * clamped * view.n
            stats[f"{key}_rejected"] = (~keep_row).to(stat.dtype) * view.n
        keep_all = keep if keep_all is None else keep_all & keep
    keep_all = keep_all.expand_as(view.valid)
    stats["rs_rejected"] = (view.valid & ~keep_all).sum(dim=-1).to(view.maskf.dtype)
    return keep_all, stats


def rs_metrics(
    stats: dict[str, torch.Tensor],
    options: tuple[RSOption, ...],
    n_tokens: torch.Tensor,
    nonempty: torch.Tensor,
    n_rows: torch.Tensor,
) -> dict[str, torch.Tensor]:
    n = stats["n"]
    out: dict[str, torch.Tensor] = {}
    for opt in options:
        key = f"rs_{opt.name}"
        name = f"rollout_rs_{opt.name}"
        lo, hi = opt.stat_bounds
        if opt.agg == "token":
            seq_values = safe_div(stats[f"{key}_sum"], n)
            out[f"{name}_mean"] = safe_div(stats[f"{key}_sum"].sum(), n_tokens)
            out[f"{name}_max"] = stats[f"{key}_max"].amax()
            out[f"{name}_min"] = stats[f"{key}_min"].amin()
            out[f"{name}_fraction_high"] = safe_div(stats[f"{key}_n_high"].sum(), n_tokens)
            out[f"{name}_fraction_low"] = safe_div(stats[f"{key}_n_low"].sum(), n_tokens)
        else:
            seq_values = stats[f"{key}_value"]
            out[f"{name}_mean"] = safe_div((seq_values * n).sum(), n_tokens)
            out[f"{name}_max"] = max_over(seq_values, nonempty)
            out[f"{name}_min"] = min_over(seq_values, nonempty)
            out[f"{name}_fraction_high"] = mean_over((seq_values > hi).to(n.dtype), nonempty, n_rows)
            out[f"{name}_fraction_low"] = mean_over((seq_values < lo).to(n.dtype), nonempty, n_rows)
        out[f"{name}_std"] = population_std(stats[f"{key}_csum"].sum(), stats[f"{key}_csq"].sum(), n_tokens)
        out[f"{name}_seq_mean"] = mean_over(seq_values, nonempty, n_rows)
        out[f"{name}_seq_std"] = std_over(seq_values, nonempty, n_rows)
        out[f"{name}_seq_max"] = max_over(seq_values, nonempty)
        out[f"{name}_seq_min"] = min_over(seq_values, nonempty)
        out[f"{name}_seq_max_deviation"] = max_over(seq_values.abs(), nonempty)
        out[f"{name}_seq_fraction_high"] = mean_over((seq_values > hi).to(n.dtype), nonempty, n_rows)
        if opt.k == 1:
            out[f"{name}_seq_fraction_low"] = mean_over((seq_values < lo).to(n.dtype), nonempty, n_rows)
        rejected = stats[f"{key}_rejected"]
        out[f"{name}_masked_fraction"] = safe_div(rejected.sum(), n_tokens)
        out[f"{name}_seq_masked_fraction"] = mean_over((rejected > 0).to(n.dtype), nonempty, n_rows)
    rejected = stats["rs_rejected"]
    out["rollout_rs_masked_fraction"] = safe_div(rejected.sum(), n_tokens)
    out["rollout_rs_seq_masked_fraction"] = mean_over((rejected > 0).to(n.dtype), nonempty, n_rows)
    return out


def veto_pass(view: TokenView, threshold: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Keep mask (b, 1) of rows with no catastrophic token (unclamped ratio < threshold)."""
    catastrophic = view.valid & (view.log_ratio < math.log(threshold))
    count = catastrophic.sum(dim=-1).to(view.maskf.dtype)
    return (count == 0)[:, None], {"veto_catastrophic": count}


def veto_metrics(
    stats: dict[str, torch.Tensor], n_tokens: torch.Tensor, nonempty: torch.Tensor, n_rows: torch.Tensor
) -> dict[str, torch.Tensor]:
    count = stats["veto_catastrophic"]
    return {
        "rollout_is_veto_fraction": mean_over((count > 0).to(count.dtype), nonempty, n_rows),
        "rollout_is_catastrophic_token_fraction": safe_div(count.sum(), n_tokens),
    }
