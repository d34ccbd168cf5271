"""Parsing and validation of IS / RS thresholds and mode names.

Everything here is pure Python: a bad threshold or an unknown mode fails before any tensor is touched,
with an error that names the offending value.

Spellings (verl-compatible):

* IS threshold: a number ``u`` selects truncation (TIS, ``min(w, u)``); a string ``"l_u"`` such as
  ``"0.5_5.0"`` selects the IcePop band (``w`` kept when ``l <= w <= u``, else 0). An explicit
  ``mode`` (``"truncate"``, ``"clip"``, ``"mask"``) overrides the inference; ``clip`` is
  ``clamp(w, l, u)`` and takes ``l = 1/u`` when no lower bound is given (slime's rule).
* RS modes: ``token_k{1,2,3}``, ``seq_sum_k{1,2,3}``, ``seq_mean_k{1,2,3}``, ``seq_max_k{2,3}``,
  comma-separated for a chain. Thresholds: one for all modes or one per mode (comma-separated string or
  a sequence). For k1 modes a ratio band ``"l_u"`` or a single ``u`` meaning ``[1/u, u]``; for k2/k3
  modes a positive upper bound (an ``_`` is an error).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError, InputTypeError

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "RS_MODES",
    "LEGACY_RS_LEVELS",
    "ISSpec",
    "RSOption",
    "parse_is_threshold",
    "parse_is_spec",
    "parse_rs_modes",
    "parse_rs_spec",
]

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "clip", "mask")
RS_MODES = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
# Earlier spelling (verl before Jan 2026, slime's --rs-level) -> current mode.
LEGACY_RS_LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def as_positive_float(value, what: str) -> float:
    if isinstance(value, bool):
        raise InputTypeError(f"{what} must be a number, got bool {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise ConfigError(f"{what} is an empty string")
        if "_" in text:  # float("5_0") == 50.0 in Python: a second '_' in a band must not parse
            raise ConfigError(f"{what} {value!r} is not a number (a band takes exactly one '_')")
        try:
            out = float(text)
        except ValueError:
            raise ConfigError(f"{what} {value!r} is not a number") from None
    elif isinstance(value, numbers.Real):
        out = float(value)
    else:
        raise InputTypeError(f"{what} must be a number or a string, got {type(value).__name__} {value!r}")
    if not math.isfinite(out) or out <= 0.0:
        raise ConfigError(f"{what} must be a finite number > 0, got {value!r}")
    return out


def _split_band(text: str, what: str) -> tuple[float, float]:
    lower_s, upper_s = text.split("_", 1)
    lower = as_positive_float(lower_s, f"{what} lower bound")
    upper = as_positive_float(upper_s, f"{what} upper bound")
    if lower > upper:
        raise ConfigError(f"{what} {text!r}: lower bound {lower} > upper bound {upper}")
    return lower, upper


def parse_is_threshold(spec) -> tuple[float, float | None]:
    """``spec`` -> ``(upper, lower or None)``. A number or ``"u"`` gives no lower bound (TIS);
    ``"l_u"`` gives the band (IcePop)."""
    if isinstance(spec, bool):
        raise InputTypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got bool {spec!r}")
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ConfigError("rollout_is_threshold is an empty string")
        if "_" in text:
            lower, upper = _split_band(text, "rollout_is_threshold")
            return upper, lower
        return as_positive_float(text, "rollout_is_threshold"), None
    if isinstance(spec, numbers.Real):
        return as_positive_float(spec, "rollout_is_threshold"), None
    raise InputTypeError(
        f"rollout_is_threshold must be a number or a 'lower_upper' string, got {type(spec).__name__} {spec!r}"
    )


@dataclass(frozen=True)
class ISSpec:
    """A validated importance-sampling configuration."""

    level: str  # token | sequence | geometric
    mode: str  # truncate | clip | mask
    upper: float
    lower: float | None  # None only for truncate

    @property
    def diag_lower(self) -> float:
        """Lower bound used by diagnostics (fraction_low): the band's lower bound, else 1/upper."""
        return self.lower if self.lower is not None else 1.0 / self.upper


def parse_is_spec(level, threshold, mode=None, lower=None) -> ISSpec:
    """Validate an IS level, threshold and optional explicit mode / lower bound."""
    if not isinstance(level, str) or level not in IS_LEVELS:
        raise ConfigError(f"unknown rollout_is level {level!r}; expected one of {IS_LEVELS}")
    upper, band_lower = parse_is_threshold(threshold)
    if lower is not None:
        lower = as_positive_float(lower, "rollout_is_threshold_lower")
        if band_lower is not None and band_lower != lower:
            raise ConfigError(
                f"rollout_is_threshold {threshold!r} already names a lower bound; "
                f"rollout_is_threshold_lower={lower} contradicts it"
            )
        band_lower = lower
    if mode is None:
        mode = "mask" if band_lower is not None else "truncate"
    if not isinstance(mode, str) or mode not in IS_MODES:
        raise ConfigError(f"unknown rollout_is mode {mode!r}; expected one of {IS_MODES}")
    if mode == "truncate":
        if band_lower is not None:
            raise ConfigError(
                f"mode 'truncate' has no lower bound, but one was given ({band_lower}); "
                "use a single number, or mode 'mask' / 'clip'"
            )
    elif band_lower is None:
        band_lower = 1.0 / upper
    if band_lower is not None and band_lower > upper:
        raise ConfigError(f"IS lower bound {band_lower} > upper bound {upper}")
    return ISSpec(level=level, mode=mode, upper=upper, lower=band_lower)


@dataclass(frozen=True)
class RSOption:
    """One validated rejection mode: aggregation, divergence, and its bounds in ratio / statistic terms."""

    name: str
    agg: str  # token | seq_sum | seq_mean | seq_max
    k: int  # 1, 2, 3
    upper: float
    lower: float | None  # ratio lower bound for k1, None for k2/k3

    @property
    def stat_bounds(self) -> tuple[float, float]:
        """Bounds on the statistic itself. k1 = -log r, so the ratio band [l, u] becomes
        [-log u, -log l]; k2/k3 have only an upper bound."""
        if self.k == 1:
            return -math.log(self.upper), -math.log(self.lower)
        return -math.inf, self.upper


def parse_rs_modes(rollout_rs) -> list[str]:
    """Split a comma-separated chain, validate each name, drop duplicates (first occurrence wins)."""
    if not isinstance(rollout_rs, str):
        raise InputTypeError(f"rollout_rs must be a string such as 'seq_mean_k1', got {type(rollout_rs).__name__}")
    names = [part.strip() for part in rollout_rs.split(",") if part.strip()]
    if not names:
        raise ConfigError(f"rollout_rs {rollout_rs!r} names no mode")
    out: list[str] = []
    for name in names:
        if name in LEGACY_RS_LEVELS:
            raise ConfigError(
                f"rollout_rs {name!r} is the earlier spelling; pass it through the legacy API "
                f"(it maps to {LEGACY_RS_LEVELS[name]!r})"
            )
        if name not in RS_MODES:
            raise ConfigError(f"unknown rollout_rs mode {name!r}; expected one of {RS_MODES}")
        if name not in out:
            out.append(name)
    return out


def _threshold_entries(spec) -> list[str]:
    if isinstance(spec, bool):
        raise InputTypeError(f"rollout_rs_threshold must be a number or a string, got bool {spec!r}")
    if spec is None:
        raise ConfigError("rollout_rs_threshold is required when rollout_rs is set")
    if isinstance(spec, numbers.Real):
        return [repr(float(spec))]
    if isinstance(spec, str):
        entries = [part.strip() for part in spec.split(",") if part.strip()]
    elif isinstance(spec, Sequence):
        entries = []
        for item in spec:
            if isinstance(item, bool):
                raise InputTypeError(f"rollout_rs_threshold entry must be a number or a string, got bool {item!r}")
            entries.append(item.strip() if isinstance(item, str) else repr(float(item)))
    else:
        raise InputTypeError(f"rollout_rs_threshold must be a number, a string or a list, got {type(spec).__name__}")
    if not entries:
        raise ConfigError(f"rollout_rs_threshold {spec!r} holds no threshold")
    return entries


def parse_rs_spec(rollout_rs, rollout_rs_threshold) -> tuple[RSOption, ...]:
    """Validate a chain of RS modes and its thresholds."""
    names = parse_rs_modes(rollout_rs)
    entries = _threshold_entries(rollout_rs_threshold)
    if len(entries) == 1:
        entries = entries * len(names)
    elif len(entries) != len(names):
        raise ConfigError(
            f"rollout_rs_threshold has {len(entries)} entries for {len(names)} modes {names}; "
            "give one threshold for all modes or exactly one per mode"
        )
    options = []
    for name, text in zip(names, entries):
        agg, k = name.rsplit("_k", 1)
        k = int(k)
        what = f"rollout_rs_threshold for {name}"
        if k == 1:
            if "_" in text:
                lower, upper = _split_band(text, what)
            else:
                upper = as_positive_float(text, what)
                lower = 1.0 / upper
                if lower > upper:
                    raise ConfigError(
                        f"{what}: a single value u means the band [1/u, u] and needs u >= 1, got {text!r}"
                    )
        else:
            if "_" in text:
                raise ConfigError(f"{what}: {name} takes an upper bound only, got the band {text!r}")
            upper = as_positive_float(text, what)
            lower = None
        options.append(RSOption(name=name, agg=agg, k=k, upper=upper, lower=lower))
    return tuple(options)
