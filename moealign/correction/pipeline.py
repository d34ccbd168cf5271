"""The rollout-correction pipeline: validation, one pass over the tokens, metrics.

:func:`compute_rollout_correction_and_rejection_mask` is the verl-compatible entry point. Internally the
batch is processed in blocks of whole rows: each block is read once and yields its weights, its keep mask
and a handful of per-row sums; every metric is then derived from the per-row sums (O(B) work). Blocks keep
the temporaries small (cache-resident, no page faults from large transient allocations). With
``fused=True`` (or ``MOEALIGN_FUSED=1``) the whole pass is compiled by ``torch.compile`` (dynamic shapes,
no recompilation per batch shape) into a few fused loops.

Inputs are checked with one host sync per call: shapes, devices (the meta device refused), a 0/1 mask, at
least one valid token, finite log-probs at valid positions (NaN/Inf at padding is ignored) and log-probs
<= ``LOG_PROB_TOLERANCE`` there (probabilities or negative log-likelihoods are refused). A failed check
raises ``InputError`` naming the tensor; no weight is ever silently NaN or inf.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass

import torch

from .._validate import check_devices, check_log_prob_max, compute_dtype
from ..errors import ConfigError, EngineError, InputError, InputTypeError, MoealignWarning
from ._masked import RowAgg, safe_div
from .is_weights import batch_norm_terms, is_metrics, is_weights_pass
from .metrics import (
    PREFIX,
    CorrectionMetrics,
    agreement_metrics,
    agreement_pass,
    masked_quantile,
    offpolicy_metrics,
    offpolicy_pass,
)
from .rejection import rs_metrics, rs_pass, veto_metrics, veto_pass
from .thresholds import (
    LEGACY_RS_LEVELS,
    ISSpec,
    RSOption,
    as_positive_float,
    parse_is_spec,
    parse_rs_spec,
)
from .tokens import TokenView

__all__ = [
    "CorrectionPlan",
    "build_plan",
    "run_plan",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_offpolicy_metrics",
    "compute_agreement_metrics",
]

# Elements per block in the eager path: 2^18 fp32 = 1 MiB per temporary.
_BLOCK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class CorrectionPlan:
    """Everything static about one correction call (hashable: the key of a compiled pass)."""

    is_spec: ISSpec | None = None
    rs_options: tuple[RSOption, ...] = ()
    veto_threshold: float | None = None
    batch_normalize: bool = False
    agreement: bool = False


# ----------------------------------------------------------------------------------------------- inputs


_NAMES = ("old_log_prob", "rollout_log_prob")
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _check_shapes(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, names=_NAMES) -> None:
    for name, t in ((names[0], old), (names[1], rollout), ("response_mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if old.dim() != 2:
        raise InputError(f"{names[0]} must be 2-D (batch, tokens), got shape {tuple(old.shape)}")
    if rollout.shape != old.shape:
        raise InputError(
            f"{names[1]} shape {tuple(rollout.shape)} does not match {names[0]} shape {tuple(old.shape)}"
        )
    if mask.shape != old.shape:
        raise InputError(f"response_mask shape {tuple(mask.shape)} does not match log-prob shape {tuple(old.shape)}")
    for name, t in ((names[0], old), (names[1], rollout)):
        if not t.is_floating_point():
            raise InputTypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if mask.dtype != torch.bool and not mask.is_floating_point() and mask.dtype not in _INT_DTYPES:
        raise InputTypeError(f"response_mask must be bool, integer or floating point, got {mask.dtype}")
    check_devices({names[0]: old, names[1]: rollout, "response_mask": mask}, InputError)


def _raise_on_checks(checks: list[float], old, rollout, mask, names=_NAMES) -> int | None:
    """Raise on bad input; return the number of valid tokens, or None when non-finite values sit only in
    padding (the caller then zeroes the padding and runs the pass again)."""
    n_valid, bad_input, bad_mask = checks[:3]
    if bad_mask != 0:  # also NaN
        raise InputError("response_mask must hold only 0 and 1 (found other values, NaN included)")
    if n_valid == 0:
        raise InputError(f"response_mask has no valid token (all padding) in a batch of shape {tuple(old.shape)}")
    if bad_input == 0:
        return int(n_valid)
    valid = mask if mask.dtype == torch.bool else mask != 0
    for name, t in ((names[0], old), (names[1], rollout)):
        bad = int((valid & ~torch.isfinite(t)).any(dim=-1).sum())
        if bad:
            raise InputError(
                f"{name} has non-finite values (NaN or Inf) at valid positions (response_mask == 1) in {bad} row(s); "
                "a -inf log-prob usually means the token lies outside the other engine's sampling support: "
                "apply the rollout's sampling mask to the trainer's logits, or mask such tokens out"
            )
    return None


def _raise_on_positive(checks: list[float], names=_NAMES) -> None:
    """Refuse log-probs above the tolerance at valid positions (``checks[3:5]``: each input's max there)."""
    for name, value in zip(names, checks[3:5]):
        check_log_prob_max(value, name, InputError, where=" at valid positions (response_mask == 1)")


def _check_weight_bounds(spec: ISSpec, dtype: torch.dtype, name: str) -> None:
    """Refuse IS bounds the weights' dtype cannot hold: an upper bound above its largest value would let
    weights turn into inf (raw weights reach exp(20) = 4.85e8, float16 stops at 65504), a lower bound (clip,
    mask) below its smallest positive value would turn clipped weights into 0."""
    if not dtype.is_floating_point:
        return
    info = torch.finfo(dtype)
    smallest = info.smallest_normal * info.eps  # smallest subnormal
    bounds = [("upper", spec.upper)] + ([("lower", spec.lower)] if spec.lower is not None else [])
    for which, value in bounds:
        if value > info.max or value < smallest:
            limit = f"above its largest value {info.max:.6g}" if value > info.max else \
                f"below its smallest positive value {smallest:.6g}"
            raise ConfigError(
                f"IS {which} bound {value!r} does not fit the weights' dtype {dtype} ({name}'s dtype): it is {limit}, "
                f"so weights would become {'inf' if value > info.max else '0'}; use a bound within the dtype's "
                "range or pass float32 log-probs"
            )


def _to_weights_dtype(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast the weights (float32/64) to the log-probs' dtype, saturating at its largest value (batch
    normalisation can scale a bounded weight past float16's 65504): never inf."""
    if weights.dtype == dtype:
        return weights
    big = torch.finfo(dtype).max
    if big < torch.finfo(weights.dtype).max:
        weights = weights.clamp(max=big)
    return weights.to(dtype)


# ------------------------------------------------------------------------------------------------ pass


def _block_pass(old, rollout, mask, plan: CorrectionPlan, dtype, weights_out=None):
    """One block of rows: weights (into ``weights_out`` when given), keep masks and per-row statistics.

    Returns ``(weights, token_keep, row_keep, stats)``; ``token_keep`` is (b, T) 0/1 in the compute
    dtype or None, ``row_keep`` (b,) bool or None.
    """
    view = TokenView.build(old, rollout, mask, dtype)
    stats = {"n": view.n, "row_log_ratio": view.row_log_ratio}
    stats.update(offpolicy_pass(view))
    # NaN/Inf in an input makes its row's log-ratio sum non-finite: one flag per row for both inputs,
    # with no extra pass. The (rare) flagged path re-checks each input exactly, so a sum that overflowed
    # from finite values raises nothing.
    stats["bad_input"] = (~torch.isfinite(view.row_log_ratio)).to(dtype)
    # each input's max at valid positions (padding is 0 in the view): positive log-probs are refused
    stats["old_max"] = view.old.amax(dim=-1)
    stats["rollout_max"] = view.rollout.amax(dim=-1)
    if view.mask_error is not None:
        stats["bad_mask"] = view.mask_error
    weights = token_keep = row_keep = None
    if plan.is_spec is not None:
        weights, s = is_weights_pass(view, plan.is_spec, weights_out)
        stats.update(s)
    if plan.rs_options:
        token_keep, row_keep, s = rs_pass(view, plan.rs_options)
        stats.update(s)
    if plan.veto_threshold is not None:
        veto_keep, s = veto_pass(view, plan.veto_threshold)
        row_keep = veto_keep if row_keep is None else row_keep & veto_keep
        stats.update(s)
    if plan.agreement:
        stats.update(agreement_pass(view))
    return weights, token_keep, row_keep, stats


def _finalize(stats: dict[str, torch.Tensor], plan: CorrectionPlan):
    """All metrics (no prefix) and the validation counts, from the per-row statistics."""
    n = stats["n"]
    n_tokens = n.sum()
    rows = RowAgg(n)
    metrics = offpolicy_metrics(stats, n_tokens, rows)
    bn_terms = None
    if plan.is_spec is not None:
        metrics.update(is_metrics(stats, plan.is_spec, n_tokens, rows))
        if plan.batch_normalize:
            bn_terms = batch_norm_terms(stats, plan.is_spec, rows)
    if plan.rs_options:
        metrics.update(rs_metrics(stats, plan.rs_options, n_tokens, rows))
    if plan.veto_threshold is not None:
        metrics.update(veto_metrics(stats, n_tokens, rows))
    if plan.agreement:
        metrics.update(agreement_metrics(stats, n_tokens))
    zero = torch.zeros((), dtype=n.dtype, device=n.device)
    checks = torch.stack([
        n_tokens,
        stats["bad_input"].sum(),
        stats["bad_mask"].sum() if "bad_mask" in stats else zero,
        stats["old_max"].amax(),
        stats["rollout_max"].amax(),
    ])
    return metrics, bn_terms, checks


def _whole_pass(old, rollout, mask, plan: CorrectionPlan, dtype):
    weights, token_keep, row_keep, stats = _block_pass(old, rollout, mask, plan, dtype)
    metrics, bn_terms, checks = _finalize(stats, plan)
    return weights, token_keep, row_keep, metrics, bn_terms, checks


def _has_token_modes(plan: CorrectionPlan) -> bool:
    return any(opt.agg == "token" for opt in plan.rs_options)


def _blocked_pass(old, rollout, mask, *, plan: CorrectionPlan, dtype):
    rows, width = old.shape
    block = max(1, _BLOCK_ELEMENTS // max(width, 1))
    if block >= rows:
        return _whole_pass(old, rollout, mask, plan, dtype)
    weights = torch.empty((rows, width), dtype=dtype, device=old.device) if plan.is_spec is not None else None
    token_keep = torch.empty((rows, width), dtype=dtype, device=old.device) if _has_token_modes(plan) else None
    parts: dict[str, list[torch.Tensor]] = {}
    row_parts: list[torch.Tensor] = []
    for start in range(0, rows, block):
        sl = slice(start, min(start + block, rows))
        _, tk, rk, stats = _block_pass(
            old[sl], rollout[sl], mask[sl], plan, dtype, None if weights is None else weights[sl]
        )
        if token_keep is not None:
            token_keep[sl] = tk
        if rk is not None:
            row_parts.append(rk)
        for key, value in stats.items():
            parts.setdefault(key, []).append(value)
    stats = {key: torch.cat(values) for key, values in parts.items()}
    row_keep = torch.cat(row_parts) if row_parts else None
    metrics, bn_terms, checks = _finalize(stats, plan)
    return weights, token_keep, row_keep, metrics, bn_terms, checks


@functools.lru_cache(maxsize=64)
def _compiled(plan: CorrectionPlan, dtype: torch.dtype):
    return torch.compile(functools.partial(_packed_pass, plan=plan, dtype=dtype), dynamic=True)


def _packed_pass(old, rollout, mask, *, plan: CorrectionPlan, dtype):
    """The whole pass for ``torch.compile``: the modified mask is built inside the graph, and the metrics
    leave it as one vector (dozens of 0-d outputs would each cost an allocation per call)."""
    weights, token_keep, row_keep, metrics, bn_terms, checks = _whole_pass(old, rollout, mask, plan, dtype)
    names = tuple(metrics)
    vector = torch.stack([metrics[k].to(torch.float64) for k in names])
    return weights, _apply_keep(mask, token_keep, row_keep), names, vector, bn_terms, checks


def _unpacked(run):
    """Adapt the compiled pass to the eager pass's return convention (keeps marked as already applied)."""

    def call(*args):
        weights, modified, names, vector, bn_terms, checks = run(*args)
        return weights, modified, _APPLIED, dict(zip(names, vector.unbind())), bn_terms, checks

    return call


_APPLIED = object()  # marker: the pass already returned the modified mask


def _fused_default() -> bool:
    return os.environ.get("MOEALIGN_FUSED", "0") not in ("", "0", "false", "False")


def run_plan(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    plan: CorrectionPlan,
    *,
    process_group=None,
    fused: bool | None = None,
    names: tuple[str, str] = _NAMES,
    log_probs: bool = True,
):
    """Execute a plan. Returns ``(weights or None, modified_mask, metrics)``; metrics carry no prefix.

    ``log_probs``: the two inputs are log-probabilities (refused when positive at valid positions); False
    for a log-ratio (any sign). IS bounds are checked against ``old_log_prob``'s dtype, the one the entry
    points return the weights in.
    """
    _check_shapes(old_log_prob, rollout_log_prob, response_mask, names)
    if plan.is_spec is not None:
        _check_weight_bounds(plan.is_spec, old_log_prob.dtype, names[0])
    dtype = compute_dtype(old_log_prob, rollout_log_prob)
    if fused is None:
        fused = _fused_default()
    with torch.no_grad():
        if old_log_prob.numel() == 0:
            raise InputError(f"response_mask has no valid token (empty batch of shape {tuple(old_log_prob.shape)})")
        args = (old_log_prob.detach(), rollout_log_prob.detach(), response_mask.detach())
        run = _unpacked(_compiled(plan, dtype)) if fused else functools.partial(_blocked_pass, plan=plan, dtype=dtype)
        try:
            weights, token_keep, row_keep, metrics, bn_terms, checks = run(*args)
        except Exception as exc:
            if not fused:
                raise
            raise EngineError(
                f"fused=True compiles the correction pass with torch.compile, which failed here "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "on CPU it needs a C++ compiler, on GPU triton. Use fused=False (same results, unfused)."
            ) from exc
        checks = checks.tolist()  # the one host sync
        n_valid = _raise_on_checks(checks, *args, names)
        if n_valid is None:  # NaN/Inf in padding only: zero the padding exactly and run again
            valid = args[2] if args[2].dtype == torch.bool else args[2] != 0
            args = (torch.where(valid, args[0], 0.0), torch.where(valid, args[1], 0.0), args[2])
            weights, token_keep, row_keep, metrics, bn_terms, checks = run(*args)
            checks = checks.tolist()
            # still flagged with clean inputs: a row sum overflowed from finite values
            n_valid = _raise_on_checks(checks, *args, names)
            n_valid = int(checks[0]) if n_valid is None else n_valid
        if log_probs:
            _raise_on_positive(checks, names)
        if plan.agreement:
            # finite garbage in padding may overflow in the difference; padding is masked out anyway
            abs_lr = torch.nan_to_num((args[0].to(dtype) - args[1].to(dtype)).abs_(), nan=0.0, posinf=0.0)
            metrics["logprob_abs_diff_p99"] = masked_quantile(abs_lr, args[2], 0.99, n_valid)
        if plan.batch_normalize and plan.is_spec is not None:
            if process_group is not None:
                import torch.distributed as dist

                dist.all_reduce(bn_terms, op=dist.ReduceOp.SUM, group=process_group)
            mean = safe_div(bn_terms[0], bn_terms[1])
            ok = mean > 1e-8
            weights.mul_(torch.where(ok, 1.0 / torch.where(ok, mean, 1.0), 1.0))
            metrics["rollout_is_batch_norm_factor"] = torch.where(ok, mean, 1.0)
        modified = token_keep if row_keep is _APPLIED else _apply_keep(args[2], token_keep, row_keep)
    if weights is not None and weights.dtype != old_log_prob.dtype and old_log_prob.dtype == torch.float64:
        weights = weights.to(torch.float64)
    is_mode = plan.is_spec.mode if plan.is_spec is not None else None
    return weights, modified, CorrectionMetrics(metrics, is_mode=is_mode)


def _apply_keep(mask: torch.Tensor, token_keep, row_keep) -> torch.Tensor:
    """The original mask times the token keep (0/1, b x T) and the row keep (bool, b), in one pass."""
    if token_keep is None and row_keep is None:
        return mask.clone()
    if mask.dtype == torch.bool:
        out = mask if token_keep is None else mask & token_keep.bool()
        return out & row_keep[:, None] if row_keep is not None else out
    keep = token_keep
    if row_keep is not None:
        row = row_keep.to(mask.dtype if mask.is_floating_point() else torch.float32)[:, None]
        keep = row if keep is None else keep.mul_(row)  # token_keep is our own buffer
    out = mask * keep
    return out if out.dtype == mask.dtype else out.to(mask.dtype)


# ----------------------------------------------------------------------------------------- entry points

def legacy_rs_spelling(rollout_rs, rollout_rs_threshold, rollout_rs_threshold_lower):
    """Map the earlier ``token`` / ``sequence`` / ``geometric`` spelling onto the current modes."""
    if isinstance(rollout_rs, str) and rollout_rs.strip() in LEGACY_RS_LEVELS:
        level = rollout_rs.strip()
        mode = LEGACY_RS_LEVELS[level]
        if rollout_rs_threshold is None:
            raise InputError(f"rollout_rs_threshold is required when rollout_rs={level!r}")
        if isinstance(rollout_rs_threshold, str) and "_" in rollout_rs_threshold:
            band = rollout_rs_threshold.strip()
            if rollout_rs_threshold_lower is not None:
                raise InputError("give the lower bound either in 'lower_upper' or as rollout_rs_threshold_lower, not both")
        else:
            upper = as_positive_float(rollout_rs_threshold, "rollout_rs_threshold")
            lower = (
                1.0 / upper
                if rollout_rs_threshold_lower is None
                else as_positive_float(rollout_rs_threshold_lower, "rollout_rs_threshold_lower")
            )
            if lower > upper:
                raise InputError(f"rollout_rs_threshold_lower {lower} > rollout_rs_threshold {upper}")
            band = f"{lower!r}_{upper!r}"
        warnings.warn(
            f"rollout_rs={level!r} is the earlier spelling: use rollout_rs={mode!r} with "
            f"rollout_rs_threshold={band!r}",
            DeprecationWarning,
            stacklevel=4,
        )
        return mode, band
    if rollout_rs_threshold_lower is not None:
        raise InputError(
            "rollout_rs_threshold_lower belongs to the earlier token/sequence/geometric spelling; "
            "with the current modes write the k1 band as rollout_rs_threshold='lower_upper'"
        )
    return rollout_rs, rollout_rs_threshold


def _veto(threshold):
    if threshold is None:
        return None
    c = as_positive_float(threshold, "rollout_token_veto_threshold")
    warnings.warn(
        "rollout_token_veto_threshold is the earlier veto; the nearest current spelling is "
        f"rollout_rs='seq_max_k2' with rollout_rs_threshold={0.5 * math.log(c) ** 2!r} "
        "(two-sided: it also rejects sequences with a token ratio above 1/C)",
        DeprecationWarning,
        stacklevel=4,
    )
    return c


def build_plan(
    rollout_is=None,
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize=False,
    rollout_rs=None,
    rollout_rs_threshold=None,
    *,
    rollout_is_mode=None,
    rollout_is_threshold_lower=None,
    rollout_rs_threshold_lower=None,
    rollout_token_veto_threshold=None,
    agreement_metrics=False,
) -> CorrectionPlan:
    """Validate a configuration (no tensors touched) and turn it into a :class:`CorrectionPlan`."""
    if not isinstance(rollout_is_batch_normalize, bool):
        raise InputTypeError(f"rollout_is_batch_normalize must be a bool, got {rollout_is_batch_normalize!r}")
    is_spec = None
    if rollout_is is not None and rollout_is_threshold is not None:
        is_spec = parse_is_spec(rollout_is, rollout_is_threshold, rollout_is_mode, rollout_is_threshold_lower)
    elif rollout_is_mode is not None or rollout_is_threshold_lower is not None:
        raise InputError("rollout_is_mode / rollout_is_threshold_lower given but IS is off "
                         "(rollout_is or rollout_is_threshold is None)")
    elif rollout_is is not None:  # verl: IS iff both are set; kept, but a user who asked for IS should know
        warnings.warn(f"rollout_is={rollout_is!r} with rollout_is_threshold=None computes no IS weights "
                      "(weights=None, as verl does); give a threshold, or rollout_is=None for metrics only",
                      MoealignWarning, stacklevel=3)
    if rollout_is_batch_normalize and is_spec is None:
        warnings.warn("rollout_is_batch_normalize=True has no effect without IS weights (rollout_is and "
                      "rollout_is_threshold both set); verl ignores it too", MoealignWarning, stacklevel=3)
    options: tuple[RSOption, ...] = ()
    rs, rs_threshold = legacy_rs_spelling(rollout_rs, rollout_rs_threshold, rollout_rs_threshold_lower)
    if rs is not None:
        if rs_threshold is None:
            raise InputError(f"rollout_rs_threshold is required when rollout_rs={rs!r}")
        options = parse_rs_spec(rs, rs_threshold)
    return CorrectionPlan(
        is_spec=is_spec,
        rs_options=options,
        veto_threshold=_veto(rollout_token_veto_threshold),
        batch_normalize=bool(rollout_is_batch_normalize) and is_spec is not None,
        agreement=bool(agreement_metrics),
    )


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is=None,
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs=None,
    rollout_rs_threshold=None,
    *,
    rollout_is_mode=None,
    rollout_is_threshold_lower=None,
    rollout_rs_threshold_lower=None,
    rollout_token_veto_threshold=None,
    process_group=None,
    agreement_metrics: bool = False,
    fused: bool | None = None,
):
    """IS weights, rejection mask and metrics for one batch (verl's entry point and semantics).

    Args:
        old_log_prob: (B, T) log-probs of the sampled tokens under the training engine (pi_old; pi_theta
            in bypass mode).
        rollout_log_prob: (B, T) log-probs under the rollout engine's sampling distribution.
        response_mask: (B, T) 0/1 mask of valid response tokens (bool, integer or float).
        rollout_is: ``"token"``, ``"sequence"``, ``"geometric"`` or None (no weights).
        rollout_is_threshold: a number (truncate, TIS) or ``"lower_upper"`` (IcePop band mask).
        rollout_is_batch_normalize: normalise weights to mean 1 after truncation (token level over valid
            tokens, sequence levels over per-sequence means of non-empty rows).
        rollout_rs: a rejection mode or a comma-separated chain (see ``rejection.py``).
        rollout_rs_threshold: one threshold for all modes, or one per mode.

    Keyword-only extensions (verl's positional arguments come first, with verl's names):
    ``rollout_is_mode`` ("truncate" | "clip" | "mask"), ``rollout_is_threshold_lower``,
    ``process_group`` (batch-normalisation mean over that group; never an implicit world all-reduce),
    ``agreement_metrics`` (add the probability-agreement metrics and the p99 |delta log-prob|),
    ``fused`` (compile the pass with torch.compile), and the earlier API ``rollout_rs`` =
    token/sequence/geometric with ``rollout_rs_threshold_lower``, ``rollout_token_veto_threshold``
    (accepted with a DeprecationWarning naming the current spelling).

    Returns:
        ``(weights or None, modified_mask, metrics)``: detached weights of the log-prob dtype (0 on
        padding), the mask with rejected tokens zeroed (dtype of ``response_mask``), and a
        :class:`CorrectionMetrics` of 0-d tensors keyed ``rollout_corr/<name>``.
    """
    plan = build_plan(
        rollout_is,
        rollout_is_threshold,
        rollout_is_batch_normalize,
        rollout_rs,
        rollout_rs_threshold,
        rollout_is_mode=rollout_is_mode,
        rollout_is_threshold_lower=rollout_is_threshold_lower,
        rollout_rs_threshold_lower=rollout_rs_threshold_lower,
        rollout_token_veto_threshold=rollout_token_veto_threshold,
        agreement_metrics=agreement_metrics,
    )
    weights, modified, metrics = run_plan(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        plan,
        process_group=process_group,
        fused=fused,
    )
    if weights is not None:
        weights = _to_weights_dtype(weights, old_log_prob.dtype)
    return weights, modified, metrics.with_prefix(PREFIX)


_LOG_RATIO_NAMES = ("log_ratio", "log_ratio")


def _zeros_like_log_ratio(log_ratio) -> torch.Tensor:
    """The rollout-side zeros the log-ratio wrappers pass to the pipeline (after the type check)."""
    if not isinstance(log_ratio, torch.Tensor):
        raise InputTypeError(f"log_ratio must be a torch.Tensor, got {type(log_ratio).__name__}")
    return torch.zeros_like(log_ratio)


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold=2.0,
    rollout_is_batch_normalize: bool = False,
    *,
    rollout_is_mode=None,
    rollout_is_threshold_lower=None,
    process_group=None,
):
    """IS weights and their metrics (no prefix) from a log-ratio ``log(pi_train / pi_rollout)``."""
    plan = build_plan(
        rollout_is, rollout_is_threshold, rollout_is_batch_normalize,
        rollout_is_mode=rollout_is_mode, rollout_is_threshold_lower=rollout_is_threshold_lower,
    )
    zeros = _zeros_like_log_ratio(log_ratio)
    weights, _, metrics = run_plan(log_ratio, zeros, response_mask, plan, process_group=process_group,
                                   names=_LOG_RATIO_NAMES, log_probs=False)
    return _to_weights_dtype(weights, log_ratio.dtype), _only(metrics, "rollout_is_")


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold=None,
):
    """Rejection mask (dtype of ``response_mask``) and RS metrics (no prefix) from a log-ratio."""
    plan = build_plan(rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold)
    zeros = _zeros_like_log_ratio(log_ratio)
    _, modified, metrics = run_plan(log_ratio, zeros, response_mask, plan, names=_LOG_RATIO_NAMES, log_probs=False)
    return modified, _only(metrics, "rollout_rs_")


def compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask) -> CorrectionMetrics:
    """The 13 off-policy metrics (no prefix)."""
    _, _, metrics = run_plan(old_log_prob, rollout_log_prob, response_mask, CorrectionPlan())
    return metrics


def compute_agreement_metrics(old_log_prob, rollout_log_prob, response_mask) -> CorrectionMetrics:
    """Probability-agreement metrics and |delta log-prob| mean / p99 / max (no prefix)."""
    _, _, metrics = run_plan(old_log_prob, rollout_log_prob, response_mask, CorrectionPlan(agreement=True))
    keys = ("rollout_probs_", "rollout_actor_", "logprob_abs_diff_")
    return CorrectionMetrics({k: v for k, v in metrics.items() if k.startswith(keys)})


def _only(metrics: CorrectionMetrics, prefix: str) -> CorrectionMetrics:
    return CorrectionMetrics({k: v for k, v in metrics.items() if k.startswith(prefix)}, is_mode=metrics.is_mode)
