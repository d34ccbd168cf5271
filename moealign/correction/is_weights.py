"""Importance-sampling weights: levels token / sequence / geometric, modes truncate / clip / mask.

Per token ``r_t = pi_train / pi_rollout = exp(old - rollout)``.

* ``token``: ``w_t = f(exp(clamp(log r_t, -20, 20)))``
* ``sequence``: one weight per row from the product, ``f(exp(clamp(sum_t log r_t, -20, 20)))``
* ``geometric``: one weight per row from the geometric mean, ``f(exp(clamp(mean_t log r_t, -20, 20)))``
  (slime's level)

with ``f`` = truncate ``min(w, u)`` (TIS, no lower bound), clip ``clamp(w, l, u)``, or mask (IcePop)
``w if l <= w <= u else 0``. Weights are 0 on padding and always detached. Rejection sampling is a
separate mechanism (``rejection.py``): IS never changes the mask.

Metrics follow verl's names; where verl's code and its docs disagree this module follows the docs:

* token-level ``rollout_is_max`` / ``rollout_is_min`` are taken from the safety-bounded weights *before*
  truncation or banding (docs: "before threshold clamping"); verl's code reports them after, so with
  TIS its max never exceeds the threshold.
* batch means over sequences (``rollout_is_seq_*``, ``ratio_fraction_*`` at sequence level) run over
  the rows that have at least one valid token; verl's code counts empty rows as weight 0 / ratio 1.
* ``rollout_is_eff_sample_size = mean(w)^2 / mean(w^2)``, without verl's ``+1e-8`` on the mean (which
  dominates for tiny weights and pushes the value above 1), and 0 when every weight is 0.
* ``rollout_is_std`` is computed from moments around 1, so float32 keeps weights near 1 apart.
"""

from __future__ import annotations

import math

import torch

from ._masked import (
    SAFETY_BOUND,
    RowAgg,
    ge,
    gt,
    le,
    lt,
    population_std,
    safe_div,
)
from .thresholds import ISSpec
from .tokens import TokenView

__all__ = ["is_weights_pass", "is_metrics", "apply_is_mode"]


def apply_is_mode(raw: torch.Tensor, spec: ISSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """Truncate / clip / band-mask raw (safety-bounded) weights."""
    if spec.mode == "truncate":
        return torch.clamp(raw, max=spec.upper, out=out)
    if spec.mode == "clip":
        return torch.clamp(raw, min=spec.lower, max=spec.upper, out=out)
    inside = ge(raw, spec.lower).mul_(le(raw, spec.upper))
    return torch.mul(raw, inside, out=out)


def is_weights_pass(
    view: TokenView, spec: ISSpec, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weights (b, T) for one block (written into ``out`` when given) and the per-row statistics its
    metrics need."""
    stats: dict[str, torch.Tensor] = {}
    if spec.level == "token":
        raw = torch.exp(view.clamped).mul_(view.maskf)  # 0 on padding
        w = apply_is_mode(raw, spec, out)
        if spec.mode == "clip":
            w.mul_(view.maskf)  # clamp lifted padding to the lower bound
        dev = w - view.maskf  # w - 1 on valid tokens, 0 on padding: moments around 1 keep float32 precise
        stats["is_d_sum"] = dev.sum(dim=-1)
        stats["is_d_sq"] = dev.mul_(dev).sum(dim=-1)
        stats["is_w_sum"] = stats["is_d_sum"] + view.n
        stats["is_raw_sum"] = raw.sum(dim=-1)
        stats["is_raw_max"] = raw.amax(dim=-1)  # raw > 0 on valid tokens, 0 on padding
        stats["is_raw_min"] = (raw + view.pad_fill).amin(dim=-1)
        stats["is_n_high"] = gt(raw, spec.upper).sum(dim=-1)  # padding (0) never counts
        stats["is_n_low"] = lt(raw, spec.diag_lower).sum(dim=-1) - view.pads  # padding always does
        if spec.mode == "mask":  # diag_lower is the band's lower bound here
            stats["is_n_oob"] = stats["is_n_high"] + stats["is_n_low"]
        return w, stats

    if spec.level == "sequence":
        row_log = view.row_log_ratio
    else:  # geometric
        row_log = safe_div(view.row_log_ratio, view.n)
    raw_row = torch.exp(row_log.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    w_row = apply_is_mode(raw_row, spec)
    w = torch.mul(w_row[:, None], view.maskf, out=out)
    stats["is_w_sum"] = w_row * view.n
    stats["is_d_sum"] = (w_row - 1.0) * view.n
    stats["is_d_sq"] = (w_row - 1.0) ** 2 * view.n
    stats["is_raw_sum"] = raw_row * view.n
    stats["is_row_log"] = row_log
    if spec.mode == "mask":
        outside = (raw_row < spec.lower) | (raw_row > spec.upper)
        stats["is_n_oob"] = outside.to(w.dtype) * view.n
    return w, stats


def is_metrics(
    stats: dict[str, torch.Tensor], spec: ISSpec, n_tokens: torch.Tensor, rows: RowAgg
) -> dict[str, torch.Tensor]:
    """verl's IS health metrics (no prefix) from the concatenated per-row statistics."""
    n = stats["n"]
    w_sum = stats["is_w_sum"]
    mean = w_sum.sum() / n_tokens
    std = population_std(stats["is_d_sum"].sum(), stats["is_d_sq"].sum(), n_tokens)
    second = std * std + mean * mean  # E[w^2]
    out = {
        "rollout_is_mean": mean,
        "rollout_is_std": std,
        # mean^2 / E[w^2], in (0, 1] (verl adds 1e-8 to the mean, which dominates for tiny weights)
        "rollout_is_eff_sample_size": torch.clamp(safe_div(mean * mean, second), max=1.0),
    }
    upper, lower = spec.upper, spec.diag_lower
    if spec.level == "token":
        out["rollout_is_max"] = stats["is_raw_max"].amax()
        out["rollout_is_min"] = stats["is_raw_min"].amin()
        out["rollout_is_ratio_fraction_high"] = stats["is_n_high"].sum() / n_tokens
        out["rollout_is_ratio_fraction_low"] = stats["is_n_low"].sum() / n_tokens
    else:
        row_log = stats["is_row_log"]
        out["rollout_is_max"] = torch.exp(torch.clamp(rows.max(row_log), max=SAFETY_BOUND))
        out["rollout_is_min"] = torch.exp(rows.min(row_log))
        out["rollout_is_ratio_fraction_high"] = rows.mean((row_log > math.log(upper)).to(n.dtype))
        out["rollout_is_ratio_fraction_low"] = rows.mean((row_log < math.log(lower)).to(n.dtype))
    seq_w = safe_div(w_sum, n)
    seq_raw = safe_div(stats["is_raw_sum"], n)
    out["rollout_is_seq_mean"] = rows.mean(seq_w)
    out["rollout_is_seq_std"] = rows.std(seq_w)
    out["rollout_is_seq_max"] = rows.max(seq_w)
    out["rollout_is_seq_min"] = rows.min(seq_w)
    out["rollout_is_seq_max_deviation"] = rows.max((seq_w - 1.0).abs())
    out["rollout_is_seq_fraction_high"] = rows.mean((seq_raw > upper).to(n.dtype))
    out["rollout_is_seq_fraction_low"] = rows.mean((seq_raw < lower).to(n.dtype))
    if spec.mode == "mask":
        out["rollout_is_oob_ratio"] = stats["is_n_oob"].sum() / n_tokens
    return out


def batch_norm_terms(stats: dict[str, torch.Tensor], spec: ISSpec, rows: RowAgg) -> torch.Tensor:
    """(numerator, denominator) of the batch-normalisation mean: over valid tokens at token level, over
    the per-sequence mean weights of non-empty rows at sequence / geometric level. Summable across ranks."""
    if spec.level == "token":
        return torch.stack([stats["is_w_sum"].sum(), stats["n"].sum()])
    seq_w = safe_div(stats["is_w_sum"], stats["n"])
    return torch.stack([(seq_w * rows.keepf).sum(), rows.count])
