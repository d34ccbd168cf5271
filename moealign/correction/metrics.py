"""Off-policy and agreement metrics, the metric container, and the slime naming view.

All metrics are 0-d tensors on the inputs' device; :class:`CorrectionMetrics` converts them to Python
floats in one host transfer (``to_floats``), never one sync per metric.

Off-policy metrics (verl's names; the docs' formulas, rows = sequences with >= 1 valid token,
``a_i`` / ``b_i`` = mean training / rollout log-prob of row i):

* ``training_log_ppl = mean_i(-a_i)``, ``training_ppl = mean_i exp(-a_i)``; likewise ``rollout_*``.
* ``kl = mean_t(rollout - old)`` over valid tokens (direct estimator of KL(pi_rollout || pi_train)),
  ``k3_kl = mean_t(r - 1 - log r)`` with ``log r`` clamped to [-20, 20] like every other exp here (verl
  leaves it unclamped, so one catastrophic token turns it into inf).
* ``log_ppl_diff = mean_i(log_ppl_rollout_i - log_ppl_training_i)`` as the docs define it, with
  ``log_ppl_abs_diff``, ``log_ppl_diff_max`` / ``_min``. **verl's code uses the opposite sign**
  (``mean(rollout) - mean(old)`` per row); this module follows the docs.
* ``ppl_ratio = exp(mean_i log(training_ppl_i / rollout_ppl_i))`` (docs). verl's code averages the
  per-row ratios arithmetically; the two agree when every row has the same ratio.
* ``chi2_token = mean_t(r_t^2) - 1``, ``chi2_seq = mean_i((prod_t r_t)^2) - 1`` (log-ratios clamped to
  [-20, 20] before exp).
* verl counts empty rows in its row means (as log-prob 0); here they are left out.

Agreement metrics (the mismatch test's view; verl logs similar ones under ``training/``):
``rollout_probs_diff_mean`` / ``_max`` / ``_std`` of ``|p_train - p_rollout|`` in probability space,
``rollout_actor_probs_pearson_corr`` (Pearson correlation of the token probabilities; 1 when both
are identical and constant, 0 when only one is constant), and ``logprob_abs_diff_mean`` / ``_p99`` /
``_max`` of ``|log p_train - log p_rollout|`` (p99 with linear interpolation, as ``torch.quantile``).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from ..errors import InputError
from ._masked import SAFETY_BOUND, RowAgg, safe_div
from .tokens import TokenView

__all__ = [
    "PREFIX",
    "CorrectionMetrics",
    "offpolicy_pass",
    "offpolicy_metrics",
    "agreement_pass",
    "agreement_metrics",
    "masked_quantile",
    "SLIME_NAMES",
    "to_slime_names",
]

PREFIX = "rollout_corr/"


class CorrectionMetrics(dict):
    """``name -> 0-d tensor``. Values stay on the device until :meth:`to_floats`.

    ``is_mode``: the IS mode that produced the weights (``"truncate"``, ``"clip"``, ``"mask"``; None without
    IS), which the slime view needs to name its fraction metrics. Keyword-only in the constructor, kept
    by :meth:`with_prefix`.
    """

    is_mode: str | None

    def __init__(self, *args, is_mode: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_mode = is_mode

    def to_floats(self) -> dict[str, float]:
        """All metrics as Python floats, with a single device-to-host transfer."""
        if not self:
            return {}
        names = list(self.keys())
        tensors = [torch.as_tensor(self[k]).detach() for k in names]
        ref = tensors[0]
        if all(t.dim() == 0 and t.dtype == ref.dtype and t.device == ref.device for t in tensors):
            values = torch.stack(tensors)  # the common case: one op, one transfer
        else:
            values = torch.stack([t.reshape(()).to(device=ref.device, dtype=torch.float64) for t in tensors])
        return dict(zip(names, values.cpu().tolist()))

    def slime(self) -> "CorrectionMetrics":
        """The same metrics under slime's names (``mismatch_kl``, ``mismatch_training_ppl``, ...)."""
        return to_slime_names(self)

    def with_prefix(self, prefix: str) -> "CorrectionMetrics":
        return CorrectionMetrics({prefix + k: v for k, v in self.items()}, is_mode=self.is_mode)


def offpolicy_pass(view: TokenView) -> dict[str, torch.Tensor]:
    # One expm1 serves k3 = (r - 1) - log r and r^2 - 1 = (r - 1)(r + 1): expm1 keeps the tiny gaps of
    # well-aligned engines (log r ~ 1e-4) in float32, and both are 0 at padding (log r = 0 there).
    rm1 = torch.expm1(view.clamped)
    view.k3 = rm1 - view.clamped
    return {
        "old_sum": view.old.sum(dim=-1),
        "rollout_sum": view.rollout.sum(dim=-1),
        "k3_sum": view.k3.sum(dim=-1),
        # r^2 - 1 = (r - 1)^2 + 2 (r - 1), without a temporary
        "r2m1_sum": torch.linalg.vecdot(rm1, rm1) + 2.0 * rm1.sum(dim=-1),
    }


def offpolicy_metrics(
    stats: Mapping[str, torch.Tensor], n_tokens: torch.Tensor, rows: RowAgg
) -> dict[str, torch.Tensor]:
    n = stats["n"]
    train_mean = safe_div(stats["old_sum"], n)
    rollout_mean = safe_div(stats["rollout_sum"], n)
    diff = train_mean - rollout_mean  # = log_ppl_rollout - log_ppl_training per row (docs' sign)
    row_log = stats["row_log_ratio"].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": rows.mean(torch.exp(-train_mean)),
        "training_log_ppl": rows.mean(-train_mean),
        "rollout_ppl": rows.mean(torch.exp(-rollout_mean)),
        "rollout_log_ppl": rows.mean(-rollout_mean),
        "kl": -stats["row_log_ratio"].sum() / n_tokens,
        "k3_kl": stats["k3_sum"].sum() / n_tokens,
        "log_ppl_diff": rows.mean(diff),
        "log_ppl_abs_diff": rows.mean(diff.abs()),
        "log_ppl_diff_max": rows.max(diff),
        "log_ppl_diff_min": rows.min(diff),
        "ppl_ratio": torch.exp(rows.mean(-diff)),
        "chi2_token": stats["r2m1_sum"].sum() / n_tokens,
        "chi2_seq": rows.mean(torch.expm1(2.0 * row_log)),
    }


def agreement_pass(view: TokenView) -> dict[str, torch.Tensor]:
    # Moments of the probabilities are centred per row (and combined across rows in
    # agreement_metrics): confident tokens (p ~ 1) differ by ~1e-6, and raw moments E[p^2] - E[p]^2
    # would cancel to 0 in float32.
    maskf = view.maskf
    p_train = torch.exp(view.old).mul_(maskf)
    p_rollout = torch.exp(view.rollout).mul_(maskf)
    sx, sy = p_train.sum(dim=-1), p_rollout.sum(dim=-1)
    dx = (p_train - safe_div(sx, view.n)[:, None]).mul_(maskf)
    dy = (p_rollout - safe_div(sy, view.n)[:, None]).mul_(maskf)
    diff = p_train.sub_(p_rollout).abs_()  # |p_train - p_rollout|, 0 on padding
    abs_lr = view.log_ratio.abs()
    return {
        "p_train_sum": sx,
        "p_rollout_sum": sy,
        "p_cxx": (dx * dx).sum(dim=-1),
        "p_cyy": (dy * dy).sum(dim=-1),
        "p_cxy": dx.mul_(dy).sum(dim=-1),
        "p_absdiff_sum": diff.sum(dim=-1),
        "p_absdiff_max": diff.amax(dim=-1),
        "p_diff_sq": diff.mul_(diff).sum(dim=-1),
        "lr_abs_sum": abs_lr.sum(dim=-1),
        "lr_abs_max": abs_lr.amax(dim=-1),
    }


def agreement_metrics(stats: Mapping[str, torch.Tensor], n_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    n = stats["n"]
    row_mx = safe_div(stats["p_train_sum"], n)
    row_my = safe_div(stats["p_rollout_sum"], n)
    mx = stats["p_train_sum"].sum() / n_tokens
    my = stats["p_rollout_sum"].sum() / n_tokens
    ex, ey = row_mx - mx, row_my - my  # between-row parts (0 for empty rows: n = 0)
    cxx = stats["p_cxx"].sum() + (n * ex * ex).sum()
    cyy = stats["p_cyy"].sum() + (n * ey * ey).sum()
    cxy = stats["p_cxy"].sum() + (n * ex * ey).sum()
    denom = torch.sqrt(cxx * cyy)
    identical = stats["p_diff_sq"].sum() == 0
    pearson = torch.where(
        denom > 0,
        torch.clamp(cxy / torch.where(denom > 0, denom, 1.0), -1.0, 1.0),
        torch.where(identical, 1.0, 0.0),
    )
    diff_mean = stats["p_absdiff_sum"].sum() / n_tokens
    diff_var = torch.clamp(stats["p_diff_sq"].sum() / n_tokens - diff_mean * diff_mean, min=0.0)
    return {
        "rollout_probs_diff_mean": diff_mean,
        "rollout_probs_diff_max": stats["p_absdiff_max"].amax(),
        "rollout_probs_diff_std": torch.sqrt(diff_var),
        "rollout_actor_probs_pearson_corr": pearson,
        "logprob_abs_diff_mean": stats["lr_abs_sum"].sum() / n_tokens,
        "logprob_abs_diff_max": stats["lr_abs_max"].amax(),
    }


def masked_quantile(values: torch.Tensor, valid: torch.Tensor, q: float, n_valid: int) -> torch.Tensor:
    """Exact ``q``-quantile (linear interpolation; bitwise the value ``torch.quantile`` gives) of
    ``values[valid]`` for ``values >= 0`` (absolute differences).

    ``valid`` is a bool or 0/1 tensor and ``n_valid`` its count (known on the host). Invalid entries
    become -1 and sort first. For large inputs a strided sample gives a threshold below the answer, and
    only the entries above it (a few percent) are selected exactly; if the sample misleads, the whole
    tensor is used. No sort of the full input.
    """
    if n_valid <= 0:
        raise InputError("masked_quantile needs at least one valid entry")
    if not 0.0 <= q <= 1.0:
        raise InputError(f"quantile {q} outside [0, 1]")
    validf = valid.to(values.dtype)
    flat = (values * validf + (validf - 1.0)).reshape(-1)  # invalid -> -1
    total = flat.numel()
    n_invalid = total - n_valid
    # the rank in the values' dtype, as torch.quantile computes it (0.99 in float32 is 0.99000001)
    pos = torch.tensor(q, dtype=values.dtype) * (n_valid - 1)
    lo = int(pos.floor())
    frac = float(pos - lo)
    k = n_invalid + lo + 1  # 1-based ascending rank of the lower order statistic in ``flat``
    need = k + (1 if frac > 0.0 and lo + 1 < n_valid else 0)  # highest rank we must resolve
    cand, offset = flat, 0
    if total >= 1 << 16:
        stride = 16
        sample = flat[::stride]
        m = sample.numel()
        p = k / total
        r = int(p * m - 4.0 * math.sqrt(m * p * (1.0 - p) + 1.0)) - 2
        if r >= 1:
            t = torch.kthvalue(sample, r).values
            above = flat >= t
            n_above = int(above.sum())
            if total - n_above < k and n_above <= total // 8:  # t <= answer, and a small candidate set
                cand, offset = flat[above], total - n_above
    v_lo = torch.kthvalue(cand, k - offset).values
    if need == k:
        return v_lo
    v_hi = torch.kthvalue(cand, k + 1 - offset).values
    return torch.lerp(v_lo, v_hi, torch.tensor(frac, dtype=values.dtype, device=values.device))


# slime's names for the same quantities (examples/train_infer_mismatch_helper, slime's MIS metrics).
SLIME_NAMES = {
    "training_log_ppl": "mismatch_training_log_ppl",
    "training_ppl": "mismatch_training_ppl",
    "rollout_log_ppl": "mismatch_rollout_log_ppl",
    "rollout_ppl": "mismatch_rollout_ppl",
    "kl": "mismatch_kl",
    "k3_kl": "mismatch_k3_kl",
    "log_ppl_diff": "mismatch_log_ppl_diff",
    "log_ppl_abs_diff": "mismatch_log_ppl_abs_diff",
    "ppl_ratio": "mismatch_ppl_ratio",
    "chi2_token": "mismatch_chi2_token",
    "chi2_seq": "mismatch_chi2_seq",
    "logprob_abs_diff_mean": "train_rollout_logprob_abs_diff",
    "rollout_is_mean": "mis_ratio_mean_after_mis",
    "rollout_is_batch_norm_factor": "mis_batch_norm_factor",
    "rollout_is_catastrophic_token_fraction": "mis_catastrophic_token_fraction",
    "rollout_is_veto_fraction": "mis_catastrophic_seq_fraction",
    "rollout_is_eff_sample_size": "mis_eff_sample_size",
    "rollout_rs_masked_fraction": "mis_rs_masked_fraction",
    "rollout_rs_seq_masked_fraction": "mis_rs_seq_masked_fraction",
}
# IS fractions take the name of the mode that produced them.
_SLIME_MODE_FRACTIONS = {
    "truncate": {"rollout_is_ratio_fraction_high": "mis_truncate_fraction"},
    "clip": {"rollout_is_ratio_fraction_high": "mis_clip_fraction_high",
             "rollout_is_ratio_fraction_low": "mis_clip_fraction_low"},
    "mask": {"rollout_is_ratio_fraction_high": "mis_mask_fraction_high",
             "rollout_is_ratio_fraction_low": "mis_mask_fraction_low"},
}


def to_slime_names(metrics: Mapping[str, torch.Tensor], is_mode: str | None = None) -> CorrectionMetrics:
    """Rename metrics for slime users. Keys may carry verl's ``rollout_corr/`` prefix or not; names slime
    has no counterpart for are kept under their verl name without the prefix."""
    if is_mode is None:
        is_mode = getattr(metrics, "is_mode", None)
    table = dict(SLIME_NAMES)
    table.update(_SLIME_MODE_FRACTIONS.get(is_mode or "", {}))
    out = CorrectionMetrics(is_mode=is_mode)
    for key, value in metrics.items():
        bare = key[len(PREFIX):] if key.startswith(PREFIX) else key
        out[table.get(bare, bare)] = value
    return out
