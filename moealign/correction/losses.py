"""Policy losses that consume the correction: PPO clip, REINFORCE, the bypass dispatcher, the DeepSeek-V3.2
off-policy sequence mask, and loss aggregation.

Rejected tokens (a 0 in the mask handed in) leave both the numerator and the denominator of every
aggregation, in bypass and decoupled mode alike: pass the RS-modified mask, and if you pass global
denominators (``num_tokens`` / ``num_seqs`` across data-parallel ranks) count them from that mask.

Inputs are checked like the correction pipeline's, with one host sync per call: tensors of one shape on one
(real) device, floating inputs, a 0/1 mask, finite values at valid positions, log-probs <= 0 there. An empty
mask is allowed (the loss is 0: a rank whose tokens were all rejected still takes part in the step).
``bypass_policy_loss`` relies on the correction pipeline's check (one sync) and does not check the
advantages' values.
"""

from __future__ import annotations

import math
import numbers

import torch

from .._validate import check_devices, check_log_prob_max
from ..errors import InputError, InputTypeError
from ._masked import SAFETY_BOUND, safe_div

__all__ = [
    "AGG_MODES",
    "agg_loss",
    "ppo_clip_loss",
    "reinforce_loss",
    "bypass_policy_loss",
    "deepseek_offpolicy_sequence_mask",
]

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    """Structural checks (no host sync): tensors (None skipped) of one shape on one real device; every input
    but the mask (named ``*mask``) floating."""
    items = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name.endswith("mask"):
            if t.is_complex():
                raise InputTypeError(f"{name} must be bool, integer or floating point, got {t.dtype}")
        elif not t.is_floating_point():
            raise InputTypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    check_devices(dict(items), InputError)
    name0, ref = items[0]
    if ref.dim() != 2:
        raise InputError(f"{name0} must be 2-D (batch, tokens), got shape {tuple(ref.shape)}")
    for name, t in items[1:]:
        if t is not None and t.shape != ref.shape:
            raise InputError(f"{name} shape {tuple(t.shape)} does not match {name0} shape {tuple(ref.shape)}")


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_values(mask_name: str, mask: torch.Tensor, log_probs: dict, others: dict) -> None:
    """One host sync: ``mask`` holds only 0/1; every tensor is finite at valid positions; ``log_probs`` are
    <= the log-prob tolerance there. None entries are skipped."""
    if mask.numel() == 0:
        return
    valid = _valid(mask)
    named = [(n, t, True) for n, t in log_probs.items() if t is not None]
    named += [(n, t, False) for n, t in others.items() if t is not None]
    with torch.no_grad():
        parts = [torch.zeros((), dtype=torch.float64, device=mask.device) if mask.dtype == torch.bool
                 else ((mask != 0) & (mask != 1)).sum().to(torch.float64)]
        for _, t, _ in named:
            parts.append((valid & ~torch.isfinite(t)).sum().to(torch.float64))
        for _, t, is_lp in named:
            if is_lp:
                parts.append(torch.where(valid, t.detach(), 0.0).amax().to(torch.float64))
        checks = torch.stack(parts).tolist()  # the one host sync
    if checks[0]:
        raise InputError(f"{mask_name} must hold only 0 and 1 (found other values, NaN included)")
    for (name, _, _), bad in zip(named, checks[1:]):
        if bad:
            raise InputError(f"{name} has non-finite values (NaN or Inf) at {int(bad)} valid position(s) "
                             f"({mask_name} == 1)")
    maxima = iter(checks[1 + len(named):])
    for name, _, is_lp in named:
        if is_lp:
            check_log_prob_max(next(maxima), name, InputError, where=f" at valid positions ({mask_name} == 1)")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss over the valid entries of ``loss_mask``.

    * ``token-mean``: sum / number of valid tokens (``num_tokens`` when given, e.g. a DP-global count)
    * ``token-sum``: sum
    * ``seq-mean-token-sum``: mean over sequences with >= 1 valid token of each row's sum
    * ``seq-mean-token-mean``: mean over those sequences of each row's mean
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` / ``loss_scale_factor`` (default T)

    ``num_seqs`` replaces the local count of non-empty sequences. An empty mask gives 0, never NaN.
    """
    _check_agg_args(loss_agg_mode, loss_scale_factor)
    _check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    _check_values("loss_mask", loss_mask, {}, {"loss_mat": loss_mat})
    return _agg_loss(loss_mat, loss_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                     loss_scale_factor=loss_scale_factor)


def _check_agg_args(loss_agg_mode, loss_scale_factor) -> None:
    if loss_agg_mode not in AGG_MODES:
        raise InputError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {AGG_MODES}")
    if loss_scale_factor is not None:
        if isinstance(loss_scale_factor, bool) or not isinstance(loss_scale_factor, numbers.Real):
            raise InputTypeError(f"loss_scale_factor must be a number, got {loss_scale_factor!r}")
        if not (math.isfinite(loss_scale_factor) and loss_scale_factor > 0):
            raise InputError(f"loss_scale_factor must be a finite number > 0, got {loss_scale_factor!r}")


def _agg_loss(loss_mat, loss_mask, loss_agg_mode="token-mean", *, num_tokens=None, num_seqs=None,
              loss_scale_factor=None) -> torch.Tensor:
    """agg_loss without the input checks (its callers checked them)."""
    valid = _valid(loss_mask)
    masked = torch.where(valid, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if loss_agg_mode == "token-sum":
        return masked.sum()
    if loss_agg_mode == "token-mean":
        den = valid.sum().to(loss_mat.dtype) if num_tokens is None else torch.as_tensor(num_tokens, dtype=loss_mat.dtype)
        return safe_div(masked.sum(), den)
    n = valid.sum(dim=-1).to(loss_mat.dtype)
    row = masked.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        row = safe_div(row, n)
    nonempty = n > 0
    den = nonempty.sum().to(loss_mat.dtype) if num_seqs is None else torch.as_tensor(num_seqs, dtype=loss_mat.dtype)
    out = safe_div(torch.where(nonempty, row, 0.0).sum(), den)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        factor = float(loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        if factor <= 0:  # T = 0
            raise InputError(f"loss_scale_factor must be > 0, got {factor!r} (the token dimension is empty)")
        out = out / factor
    return out


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return safe_div(torch.where(valid, x, 0.0).sum(), valid.sum().to(x.dtype))


def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs,
):
    """PPO clipped surrogate with asymmetric clip and dual clip.

    ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``; per token
    ``max(-A * ratio, -A * clamp(ratio, 1 - eps_low, 1 + eps_high))``, and for ``A < 0`` at most
    ``-A * clip_ratio_c`` (dual clip). In decoupled mode pass the IS weights pi_old / pi_rollout as
    ``rollout_is_weights`` (multiplied per token, detached). Returns ``(loss, metrics)``.
    """
    _check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages,
                      response_mask=response_mask, rollout_is_weights=rollout_is_weights)
    _check_agg_args(loss_agg_mode, agg_kwargs.get("loss_scale_factor"))
    _check_values("response_mask", response_mask, {"log_prob": log_prob, "old_log_prob": old_log_prob},
                  {"advantages": advantages, "rollout_is_weights": rollout_is_weights})
    return _ppo_clip_loss(log_prob, old_log_prob, advantages, response_mask, clip_ratio=clip_ratio,
                          clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                          rollout_is_weights=rollout_is_weights, loss_agg_mode=loss_agg_mode, **agg_kwargs)


def _ppo_clip_loss(log_prob, old_log_prob, advantages, response_mask, *, clip_ratio, clip_ratio_low,
                   clip_ratio_high, clip_ratio_c, rollout_is_weights, loss_agg_mode, **agg_kwargs):
    """ppo_clip_loss without the tensor checks (its callers checked them)."""
    if isinstance(clip_ratio_c, bool) or not clip_ratio_c > 1.0:
        raise InputError(f"clip_ratio_c (dual-clip constant) must be > 1, got {clip_ratio_c!r}")
    eps_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    eps_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    if eps_low < 0 or eps_high < 0 or eps_low >= 1:
        raise InputError(f"clip ratios must satisfy 0 <= low < 1 and high >= 0, got low={eps_low}, high={eps_high}")
    valid = _valid(response_mask)
    delta = torch.clamp(log_prob - old_log_prob, -SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(delta)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(loss3, clipped)
    per_token = torch.where(advantages < 0, dual, clipped)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.detach()
    loss = _agg_loss(per_token, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": _masked_mean((loss2 > loss1).to(delta.dtype), valid),
            "actor/ppo_kl": _masked_mean(-delta, valid),
            "actor/pg_clipfrac_lower": _masked_mean(((clipped > loss3) & (advantages < 0)).to(delta.dtype), valid),
        }
    return loss, metrics


def reinforce_loss(
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is_weights: torch.Tensor | None = None,
    rollout_log_prob: torch.Tensor | None = None,
    loss_agg_mode: str = "seq-mean-token-sum",
    **agg_kwargs,
):
    """REINFORCE: per token ``-A * log_prob * w`` with ``w`` the detached IS weight (or 1).

    Gradient ``-E[w * A * grad log pi]``: the weight is a change of measure, never differentiated.
    """
    _check_same_shape(log_prob=log_prob, advantages=advantages, response_mask=response_mask,
                      rollout_is_weights=rollout_is_weights, rollout_log_prob=rollout_log_prob)
    _check_agg_args(loss_agg_mode, agg_kwargs.get("loss_scale_factor"))
    _check_values("response_mask", response_mask, {"log_prob": log_prob, "rollout_log_prob": rollout_log_prob},
                  {"advantages": advantages, "rollout_is_weights": rollout_is_weights})
    return _reinforce_loss(log_prob, advantages, response_mask, rollout_is_weights=rollout_is_weights,
                           rollout_log_prob=rollout_log_prob, loss_agg_mode=loss_agg_mode, **agg_kwargs)


def _reinforce_loss(log_prob, advantages, response_mask, *, rollout_is_weights, rollout_log_prob, loss_agg_mode,
                    **agg_kwargs):
    """reinforce_loss without the tensor checks (its callers checked them)."""
    per_token = -advantages * log_prob
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.detach()
    loss = _agg_loss(per_token, response_mask, loss_agg_mode, **agg_kwargs)
    metrics = {}
    if rollout_log_prob is not None:
        with torch.no_grad():
            metrics["actor/ppo_kl"] = _masked_mean(rollout_log_prob - log_prob, _valid(response_mask))
    return loss, metrics


def bypass_policy_loss(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config,
    *,
    loss_agg_mode: str = "token-mean",
    process_group=None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    **agg_kwargs,
):
    """Bypass mode (pi_old = pi_rollout): the correction is recomputed on the fly against pi_theta.

    Under ``no_grad``, IS weights and the RS mask are computed from ``pi_theta / pi_rollout`` with
    ``config`` (a :class:`~moealign.correction.RolloutCorrectionConfig` with ``bypass_mode=True``). Then

    * ``loss_type="reinforce"``: REINFORCE with those (detached) weights and the RS mask;
    * ``loss_type="ppo_clip"``: PPO clipped against ``rollout_log_prob``, RS mask, **no** IS weight
      (the ratio already is pi_theta / pi_rollout; a weight would count it twice).

    The clip arguments apply to ``ppo_clip`` and are ignored by ``reinforce`` (a trainer may pass its
    PPO settings whatever the config). Rejected tokens leave numerator and denominator. Returns
    ``(loss, metrics)`` including the ``rollout_corr/*`` metrics (still tensors).
    """
    if not getattr(config, "bypass_mode", False):
        raise InputError("bypass_policy_loss needs a config with bypass_mode=True; in decoupled mode compute "
                         "the correction once per batch and pass its weights to ppo_clip_loss")
    _check_same_shape(log_prob=log_prob, rollout_log_prob=rollout_log_prob, advantages=advantages,
                      response_mask=response_mask)
    _check_agg_args(loss_agg_mode, agg_kwargs.get("loss_scale_factor"))
    with torch.no_grad():  # checks log-probs and mask (the one host sync)
        weights, mask, corr_metrics = config.compute(
            log_prob.detach(), rollout_log_prob.detach(), response_mask, process_group=process_group
        )
    if config.loss_type == "reinforce":
        loss, metrics = _reinforce_loss(log_prob, advantages, mask, rollout_is_weights=weights,
                                        rollout_log_prob=rollout_log_prob, loss_agg_mode=loss_agg_mode, **agg_kwargs)
    else:
        loss, metrics = _ppo_clip_loss(log_prob, rollout_log_prob, advantages, mask, clip_ratio=clip_ratio,
                                       clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                       clip_ratio_c=clip_ratio_c, rollout_is_weights=None,
                                       loss_agg_mode=loss_agg_mode, **agg_kwargs)
    metrics = dict(metrics)
    metrics.update(corr_metrics)
    return loss, metrics


def deepseek_offpolicy_sequence_mask(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556, Eq. 8-9).

    A sequence is dropped when its advantage is negative **and** its mean k1 divergence to the sampling
    policy, ``(1/|o|) sum_t log(pi_rollout / pi_theta)``, exceeds ``delta``. The divergence uses the
    rollout engine's log-probs, so it catches engine mismatch and minibatch staleness alike.
    ``advantages`` is (B, T) (the row's mean over valid tokens is used) or (B,). Returns the mask in
    the dtype of ``response_mask``.
    """
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not (delta >= 0) or delta == float("inf"):
        raise InputError(f"delta must be a finite number >= 0, got {delta!r}")
    _check_same_shape(log_prob=log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    if not isinstance(advantages, torch.Tensor):
        raise InputTypeError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if advantages.dim() == 1 and advantages.shape[0] == log_prob.shape[0]:
        per_token_adv = advantages[:, None].expand_as(log_prob)
    elif advantages.dim() == 2:
        per_token_adv = advantages
    else:
        raise InputError(f"advantages must be (B, T) or (B,), got shape {tuple(advantages.shape)}")
    _check_same_shape(log_prob=log_prob, advantages=per_token_adv)
    _check_values("response_mask", response_mask, {"log_prob": log_prob, "rollout_log_prob": rollout_log_prob},
                  {"advantages": per_token_adv})
    valid = _valid(response_mask)
    with torch.no_grad():
        n = valid.sum(dim=-1).to(log_prob.dtype)
        div = safe_div(torch.where(valid, rollout_log_prob - log_prob, 0.0).sum(dim=-1), n)
        if advantages.dim() == 2:
            adv = safe_div(torch.where(valid, advantages, 0.0).sum(dim=-1), n)
        else:
            adv = advantages
        drop = (adv < 0) & (div > delta)
    keep = ~drop[:, None]
    if response_mask.dtype == torch.bool:
        return response_mask & keep
    return response_mask * keep.to(response_mask.dtype)
