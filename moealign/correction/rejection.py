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

from ._masked import RowAgg, ge, gt, le, lt, population_std, safe_div
from .thresholds import RSOption
from .tokens import TokenView

__all__ = ["rs_pass", "rs_metrics", "veto_pass", "veto_metrics", "token_statistic"]


def token_statistic(view: TokenView, k: int) -> torch.Tensor:
    """k1 / k2 / k3 per token (0 on padding, where the log-ratio is 0)."""
    s = view.clamped
    if k == 1:
        return -s
    if k == 2:
        return s.square().mul_(0.5)
    if view.k3 is not None:
        return view.k3
    return torch.expm1(s).sub_(s)  # r - 1 - log r, precise for r near 1


def rs_pass(
    view: TokenView, options: tuple[RSOption, ...]
) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Keep masks of one block and per-row statistics.

    Returns ``(token_keep, row_keep, stats)``: ``token_keep`` (b, T) 0/1 in the compute dtype from the
    token modes (None if there are none), ``row_keep`` (b,) bool from the sequence modes (None if there
    are none). Both may reject padding; the caller multiplies them into the original mask.
    """
    stats: dict[str, torch.Tensor] = {}
    cache: dict[int, torch.Tensor] = {}

    def stat_of(k: int) -> torch.Tensor:
        if k not in cache:
            cache[k] = token_statistic(view, k)
        return cache[k]

    dtype = view.maskf.dtype
    big = torch.finfo(dtype).max  # a k2/k3 bound past it (1e39 in float32) clamps nothing; torch.clamp refuses it
    pads = view.pads
    token_keep = row_keep = None
    neg_clamped_sum = None
    for opt in options:
        lo, hi = opt.stat_bounds
        lo_clamp = lo if opt.k == 1 else 0.0
        key = f"rs_{opt.name}"
        if opt.agg == "token":
            stat = stat_of(opt.k)
            keep = le(stat, hi)
            if opt.k == 1:
                keep.mul_(ge(stat, lo))
            kept_pads = pads if lo <= 0.0 <= hi else 0.0  # padding (statistic 0) passes the test
            stats[f"{key}_rejected"] = view.n - (keep.sum(dim=-1) - kept_pads)
            stats[f"{key}_sum"] = stat.sum(dim=-1)
            if opt.k == 1:
                stats[f"{key}_max"] = (stat - view.pad_fill).amax(dim=-1)
            else:  # k2, k3 >= 0 and 0 on padding
                stats[f"{key}_max"] = stat.amax(dim=-1)
            stats[f"{key}_min"] = (stat + view.pad_fill).amin(dim=-1)
            stats[f"{key}_n_high"] = gt(stat, hi).sum(dim=-1) - (pads if 0.0 > hi else 0.0)
            if opt.k == 1:
                stats[f"{key}_n_low"] = lt(stat, lo).sum(dim=-1) - (pads if 0.0 < lo else 0.0)
            else:
                stats[f"{key}_n_low"] = torch.zeros_like(view.n)
            clamped = torch.clamp(stat, min=lo_clamp, max=min(hi, big))
            if not lo_clamp <= 0.0 <= hi:
                clamped = clamped.mul_(view.maskf)
            stats[f"{key}_csum"] = clamped.sum(dim=-1)
            stats[f"{key}_csq"] = clamped.mul_(clamped).sum(dim=-1)
            token_keep = keep if token_keep is None else token_keep.mul_(keep)
        else:
            if opt.agg == "seq_max":  # k2/k3 >= 0 and 0 on padding: 0 for a row with no valid token
                value = stat_of(opt.k).amax(dim=-1)
            else:
                if opt.k == 1:  # sum of k1 = -sum of the clamped log-ratio, no per-token work
                    if neg_clamped_sum is None:
                        neg_clamped_sum = -view.clamped.sum(dim=-1)
                    total = neg_clamped_sum
                else:
                    total = stat_of(opt.k).sum(dim=-1)
                value = total if opt.agg == "seq_sum" else safe_div(total, view.n)
            keep = (value >= lo) & (value <= hi)
            clamped = torch.clamp(value, min=lo_clamp, max=min(hi, big))
            stats[f"{key}_value"] = value
            stats[f"{key}_csum"] = clamped * view.n
            stats[f"{key}_csq"] = clamped * clamped * view.n
            stats[f"{key}_rejected"] = (~keep).to(dtype) * view.n
            row_keep = keep if row_keep is None else row_keep & keep
    if token_keep is None:
        stats["rs_rejected"] = (~row_keep).to(dtype) * view.n
    else:
        kept = (token_keep * view.maskf).sum(dim=-1)
        if row_keep is not None:
            kept = kept * row_keep.to(dtype)
        stats["rs_rejected"] = view.n - kept
    return token_keep, row_keep, stats


def rs_metrics(
    stats: dict[str, torch.Tensor],
    options: tuple[RSOption, ...],
    n_tokens: torch.Tensor,
    rows: RowAgg,
) -> dict[str, torch.Tensor]:
    n = stats["n"]
    out: dict[str, torch.Tensor] = {}
    for opt in options:
        key = f"rs_{opt.name}"
        name = f"rollout_rs_{opt.name}"
        lo, hi = opt.stat_bounds
        if opt.agg == "token":
            seq_values = safe_div(stats[f"{key}_sum"], n)
            out[f"{name}_mean"] = stats[f"{key}_sum"].sum() / n_tokens
            out[f"{name}_max"] = stats[f"{key}_max"].amax()
            out[f"{name}_min"] = stats[f"{key}_min"].amin()
            out[f"{name}_fraction_high"] = stats[f"{key}_n_high"].sum() / n_tokens
            out[f"{name}_fraction_low"] = stats[f"{key}_n_low"].sum() / n_tokens
        else:
            seq_values = stats[f"{key}_value"]
            out[f"{name}_mean"] = (seq_values * n).sum() / n_tokens
            out[f"{name}_max"] = rows.max(seq_values)
            out[f"{name}_min"] = rows.min(seq_values)
            out[f"{name}_fraction_high"] = rows.mean((seq_values > hi).to(n.dtype))
            out[f"{name}_fraction_low"] = rows.mean((seq_values < lo).to(n.dtype))
        out[f"{name}_std"] = population_std(stats[f"{key}_csum"].sum(), stats[f"{key}_csq"].sum(), n_tokens)
        out[f"{name}_seq_mean"] = rows.mean(seq_values)
        out[f"{name}_seq_std"] = rows.std(seq_values)
        out[f"{name}_seq_max"] = rows.max(seq_values)
        out[f"{name}_seq_min"] = rows.min(seq_values)
        out[f"{name}_seq_max_deviation"] = rows.max(seq_values.abs())
        out[f"{name}_seq_fraction_high"] = rows.mean((seq_values > hi).to(n.dtype))
        if opt.k == 1:
            out[f"{name}_seq_fraction_low"] = rows.mean((seq_values < lo).to(n.dtype))
        rejected = stats[f"{key}_rejected"]
        out[f"{name}_masked_fraction"] = rejected.sum() / n_tokens
        out[f"{name}_seq_masked_fraction"] = rows.mean((rejected > 0).to(n.dtype))
    rejected = stats["rs_rejected"]
    out["rollout_rs_masked_fraction"] = rejected.sum() / n_tokens
    out["rollout_rs_seq_masked_fraction"] = rows.mean((rejected > 0).to(n.dtype))
    return out


def veto_pass(view: TokenView, threshold: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Row keep mask (b,) of rows with no catastrophic token (unclamped ratio < threshold)."""
    log_c = math.log(threshold)
    count = lt(view.log_ratio, log_c).sum(dim=-1)
    if 0.0 < log_c:  # padding (log-ratio 0) would count
        count = count - view.pads
    return count == 0, {"veto_catastrophic": count}


def veto_metrics(
    stats: dict[str, torch.Tensor], n_tokens: torch.Tensor, rows: RowAgg
) -> dict[str, torch.Tensor]:
    count = stats["veto_catastrophic"]
    return {
        "rollout_is_veto_fraction": rows.mean((count > 0).to(count.dtype)),
        "rollout_is_catastrophic_token_fraction": count.sum() / n_tokens,
    }
