"""``RolloutCorrectionConfig``: verl's fields, its 19 presets, the earlier preset names, and construction
from a dict, YAML, or slime's flags. Every construction is validated at once (verl validates only when
the config is first used)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

from ..errors import ConfigError, InputTypeError, MoealignWarning
from .pipeline import (
    build_plan,
    compute_rollout_correction_and_rejection_mask,
    legacy_rs_spelling,
)

__all__ = ["RolloutCorrectionConfig", "PRESETS", "LEGACY_PRESETS", "LOSS_TYPES", "slime_argument_parser"]

LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction`` block.

    ``rollout_is`` defaults to None (metrics only), as in verl's YAML; verl's dataclass default is
    ``"sequence"``. ``rollout_is_mode`` and ``rollout_token_veto_threshold`` are moealign extensions
    (slime's clip mode; the earlier veto, kept for the earlier presets).
    """

    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    rollout_is_mode: str | None = None
    rollout_token_veto_threshold: float | None = None

    def __post_init__(self):
        if not isinstance(self.bypass_mode, bool):
            raise InputTypeError(f"bypass_mode must be a bool, got {self.bypass_mode!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"unknown loss_type {self.loss_type!r}; expected one of {LOSS_TYPES}")
        self.plan()  # raises on any malformed field; warns once for earlier spellings

    # ------------------------------------------------------------------ use
    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style access, as verl's ``BaseConfig``."""
        return getattr(self, key, default)

    def to_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`compute_rollout_correction_and_rejection_mask`."""
        kw = {
            "rollout_is": self.rollout_is,
            "rollout_is_threshold": self.rollout_is_threshold,
            "rollout_is_batch_normalize": self.rollout_is_batch_normalize,
            "rollout_rs": self.rollout_rs,
            "rollout_rs_threshold": self.rollout_rs_threshold,
        }
        if self.rollout_is_mode is not None:
            kw["rollout_is_mode"] = self.rollout_is_mode
        if self.rollout_token_veto_threshold is not None:
            kw["rollout_token_veto_threshold"] = self.rollout_token_veto_threshold
        return kw

    def plan(self):
        return build_plan(
            self.rollout_is,
            self.rollout_is_threshold,
            self.rollout_is_batch_normalize,
            self.rollout_rs,
            self.rollout_rs_threshold,
            rollout_is_mode=self.rollout_is_mode,  # without IS: refused, as by the entry point
            rollout_token_veto_threshold=self.rollout_token_veto_threshold,
        )

    def compute(self, old_log_prob, rollout_log_prob, response_mask, *, process_group=None,
                agreement_metrics: bool = False, fused: bool | None = None):
        """Run the correction with this config: ``(weights or None, modified_mask, metrics)``.

        The keywords are the entry point's run options (the config holds every other argument).
        """
        with warnings.catch_warnings():
            # the plan's warnings (earlier spellings, options without effect) were given at construction
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", MoealignWarning)
            return compute_rollout_correction_and_rejection_mask(
                old_log_prob, rollout_log_prob, response_mask, **self.to_kwargs(),
                process_group=process_group, agreement_metrics=agreement_metrics, fused=fused,
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RolloutCorrectionConfig":
        """Build from a plain mapping. Accepts ``preset: NAME`` (other keys override it), verl's nesting
        ``algorithm.rollout_correction``, and the earlier keys ``use_policy_gradient``,
        ``rollout_rs_threshold_lower`` (with ``rollout_rs`` = token/sequence/geometric) with a warning."""
        if not isinstance(data, Mapping):
            raise InputTypeError(f"rollout-correction config must be a mapping, got {type(data).__name__}")
        data = dict(data)
        if "algorithm" in data and isinstance(data["algorithm"], Mapping):
            data = dict(data["algorithm"].get("rollout_correction") or {})
        elif "rollout_correction" in data and isinstance(data["rollout_correction"], Mapping):
            data = dict(data["rollout_correction"])
        base: dict[str, Any] = {}
        if "preset" in data:
            base = cls.preset(data.pop("preset")).to_dict()
        if "use_policy_gradient" in data:
            upg = data.pop("use_policy_gradient")
            if not isinstance(upg, bool):
                raise InputTypeError(f"use_policy_gradient must be a bool, got {upg!r}")
            warnings.warn("use_policy_gradient is the earlier spelling: use loss_type='reinforce' / 'ppo_clip'",
                          DeprecationWarning, stacklevel=2)
            data.setdefault("loss_type", "reinforce" if upg else "ppo_clip")
        lower = data.pop("rollout_rs_threshold_lower", None)
        if lower is not None:
            data["rollout_rs"], data["rollout_rs_threshold"] = legacy_rs_spelling(
                data.get("rollout_rs"), data.get("rollout_rs_threshold"), lower
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown rollout-correction field(s) {unknown}; known fields: {sorted(known)}")
        base.update(data)
        return cls(**base)

    @classmethod
    def from_yaml(cls, source: str) -> "RolloutCorrectionConfig":
        """Build from a YAML file path or YAML text (needs PyYAML)."""
        from moealign._files import read_input_bytes
        from moealign._optional import require

        yaml = require("yaml", "reading rollout-correction YAML needs PyYAML (pip install pyyaml)")
        import os

        text = source
        if os.path.lexists(source):     # a file: through the input-file guard (no FIFO / device, bounded size)
            try:
                text = read_input_bytes(source, "rollout-correction YAML", max_bytes=1 << 20).decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"rollout-correction YAML {source}: not UTF-8 text") from None
        data = yaml.safe_load(_quote_bands(text))
        if data is None:
            data = {}
        return cls.from_dict(data)

    @classmethod
    def from_slime_args(cls, args: argparse.Namespace | Mapping[str, Any] | Sequence[str]) -> "RolloutCorrectionConfig":
        """Translate slime's flags (a parsed Namespace, a mapping of attribute names, or an argv list).

        * ``--use-tis`` with ``--tis-level`` (token | sequence | geometric), ``--tis-mode``
          (truncate | clip | mask), ``--tis-upper-bound`` (default 2.0), ``--tis-lower-bound``
          (default 1/upper, unused by truncate), ``--tis-batch-normalize``;
        * ``--use-rs`` with ``--rs-level`` (token -> token_k1, sequence -> seq_sum_k1,
          geometric -> seq_mean_k1), ``--rs-lower-bound`` / ``--rs-upper-bound`` (default: the IS bounds);
        * ``--rs-veto-threshold`` (the per-token veto);
        * ``--use-rollout-logprobs``: bypass mode (PPO clipped against the rollout log-probs).

        A bad value raises :class:`~moealign.errors.ConfigError` naming the flag (never ``SystemExit``). Flags
        (or keys) starting with ``--tis-`` / ``--rs-`` / ``--mis-`` that are not translated (a misspelling, or a
        slime option such as ``--tis-clip`` or the MIS helper's ``--mis-*``) are named in a
        :class:`~moealign.errors.MoealignWarning`: they have no effect here.
        """
        parser = slime_argument_parser()
        if isinstance(args, argparse.Namespace):
            values = vars(args)
        elif isinstance(args, Mapping):
            values = dict(args)
        elif isinstance(args, Sequence) and not isinstance(args, str):
            # a full slime command line carries many other flags: parse only ours
            parsed, rest = parser.parse_known_args([str(a) for a in args])
            values = vars(parsed)
            _warn_unknown_slime_flags([a.split("=", 1)[0] for a in rest if a.startswith("--")], parser)
        else:
            raise InputTypeError(f"slime args must be a Namespace, a mapping or an argv list, got {type(args).__name__}")
        values = {str(k).replace("-", "_"): v for k, v in values.items()}
        if not (isinstance(args, Sequence) and not isinstance(args, str)):
            known = {a.dest for a in parser._actions}
            _warn_unknown_slime_flags(["--" + k.replace("_", "-") for k in values if k not in known], parser)
        for dest in ("use_tis", "use_rs", "tis_batch_normalize", "use_rollout_logprobs"):
            if values.get(dest) is not None and not isinstance(values[dest], bool):
                raise InputTypeError(f"--{dest.replace('_', '-')} must be a bool, got {values[dest]!r}")
        for dest, choices in (("tis_mode", ("truncate", "clip", "mask")), ("tis_level", _SLIME_LEVELS),
                              ("rs_level", _SLIME_LEVELS)):
            if values.get(dest) is not None and values[dest] not in choices:
                raise ConfigError(f"--{dest.replace('_', '-')} {values[dest]!r} is not one of {choices}")
        kw: dict[str, Any] = {"bypass_mode": bool(values.get("use_rollout_logprobs", False))}
        upper = _slime_bound(values, "tis_upper_bound")
        upper = 2.0 if upper is None else upper
        lower = _slime_bound(values, "tis_lower_bound")
        if values.get("use_tis"):
            level = values.get("tis_level") or "token"
            mode = values.get("tis_mode") or "truncate"
            kw["rollout_is"] = level
            kw["rollout_is_batch_normalize"] = bool(values.get("tis_batch_normalize", False))
            if mode == "truncate":
                kw["rollout_is_threshold"] = upper
            else:
                lo = 1.0 / upper if lower is None else lower
                kw["rollout_is_threshold"] = f"{lo!r}_{upper!r}"
                kw["rollout_is_mode"] = mode
        if values.get("use_rs"):
            level = values.get("rs_level") or "token"
            from .thresholds import LEGACY_RS_LEVELS

            if level not in LEGACY_RS_LEVELS:
                raise ConfigError(f"unknown --rs-level {level!r}; expected one of {tuple(LEGACY_RS_LEVELS)}")
            rs_upper = _slime_bound(values, "rs_upper_bound")
            rs_upper = upper if rs_upper is None else rs_upper
            rs_lower = _slime_bound(values, "rs_lower_bound")
            if rs_lower is None:
                rs_lower = lower if lower is not None else 1.0 / rs_upper
            kw["rollout_rs"] = LEGACY_RS_LEVELS[level]
            kw["rollout_rs_threshold"] = f"{float(rs_lower)!r}_{rs_upper!r}"
        veto = _slime_bound(values, "rs_veto_threshold")
        if veto is not None:
            kw["rollout_token_veto_threshold"] = veto
        return cls(**kw)

    @classmethod
    def preset(cls, name: str, **overrides) -> "RolloutCorrectionConfig":
        """A preset by name (current or earlier spelling), with keyword overrides of its arguments."""
        if name in PRESETS:
            return PRESETS[name](**overrides)
        if name in LEGACY_PRESETS:
            return LEGACY_PRESETS[name](**overrides)
        raise ConfigError(f"unknown preset {name!r}; available: {sorted(PRESETS)} (earlier names: {sorted(LEGACY_PRESETS)})")

    # ------------------------------------------------------------------ verl's 19 presets
    @classmethod
    def decoupled_token_is(cls, threshold=2.0):
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold=2.0):
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold=2.0, rs_threshold="0.5_2.0"):
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_sum_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold="0.999_1.001", veto_threshold=None):
        if veto_threshold is not None:
            warnings.warn("decoupled_geo_rs(veto_threshold=...) is the earlier preset; the veto is deprecated "
                          "(see rollout_token_veto_threshold)", DeprecationWarning, stacklevel=2)
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold,
                   rollout_token_veto_threshold=veto_threshold)

    @classmethod
    def decoupled_geo_rs_seq_tis(cls, is_threshold=2.0, rs_threshold="0.999_1.001"):
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_token_tis(cls, is_threshold=2.0, rs_threshold="0.999_1.001"):
        return cls(rollout_is="token", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold=0.01):
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(cls, is_threshold=2.0, rs_threshold=0.01):
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_token_tis(cls, is_threshold=2.0, rs_threshold=0.01):
        return cls(rollout_is="token", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_token_icepop(cls, threshold=5.0, threshold_lower=0.5):
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}")

    @classmethod
    def bypass_ppo_clip(cls):
        return cls(bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold="0.999_1.001"):
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold=0.01):
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_pg_is(cls, threshold=2.0):
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_token_icepop(cls, threshold=5.0, threshold_lower=0.5):
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}",
                   bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold="0.999_1.001"):
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_seq_tis(cls, is_threshold=2.0, rs_threshold="0.999_1.001"):
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_token_tis(cls, is_threshold=2.0, rs_threshold="0.999_1.001"):
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def disabled(cls):
        return cls()

    # ------------------------------------------------------------------ earlier preset names
    @classmethod
    def ppo_is_bypass(cls, threshold=2.0):
        _renamed("ppo_is_bypass", "bypass_ppo_clip()")
        return cls.bypass_ppo_clip()

    @classmethod
    def pg_is(cls, threshold=2.0):
        _renamed("pg_is", f"bypass_pg_is(threshold={threshold!r})")
        return cls.bypass_pg_is(threshold)

    @classmethod
    def pg_rs(cls, rs_threshold=1.001, veto_threshold=1e-4):
        _renamed("pg_rs", f"bypass_pg_geo_rs(rs_threshold={str(rs_threshold)!r})")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=str(rs_threshold), bypass_mode=True,
                       loss_type="reinforce", rollout_token_veto_threshold=veto_threshold)

    @classmethod
    def geo_rs_seq_tis(cls, is_threshold=2.0, rs_threshold=1.001):
        _renamed("geo_rs_seq_tis", "decoupled_geo_rs_seq_tis()")
        return cls.decoupled_geo_rs_seq_tis(is_threshold, str(rs_threshold))

    @classmethod
    def pg_geo_rs_seq_tis(cls, is_threshold=2.0, rs_threshold=1.001):
        _renamed("pg_geo_rs_seq_tis", "bypass_pg_geo_rs_seq_tis()")
        return cls.bypass_pg_geo_rs_seq_tis(is_threshold, str(rs_threshold))


# YAML 1.1 reads an unquoted 0.5_5 as the number 0.55 (underscores are digit separators), which would
# silently turn the IcePop band [0.5, 5] into a truncation at 0.55. Threshold values that look like a
# band are quoted before parsing.
_BAND_LINE = re.compile(
    r"^(?P<key>\s*(?:rollout_is_threshold|rollout_rs_threshold)\s*:\s*)"
    r"(?P<value>[0-9.eE+-]+_[0-9.eE+-]+(?:\s*,\s*[0-9.eE+_-]+)*)\s*(?P<comment>#.*)?$",
    re.MULTILINE,
)


def _quote_bands(text: str) -> str:
    return _BAND_LINE.sub(lambda m: f"{m['key']}\"{m['value']}\"" + (f" {m['comment']}" if m["comment"] else ""), text)


def _renamed(old: str, new: str) -> None:
    warnings.warn(f"preset {old!r} is the earlier name: use RolloutCorrectionConfig.{new}",
                  DeprecationWarning, stacklevel=3)


_PRESET_NAMES = (
    "decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs",
    "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis", "decoupled_k3_rs", "decoupled_k3_rs_seq_tis",
    "decoupled_k3_rs_token_tis", "decoupled_token_icepop", "bypass_ppo_clip", "bypass_ppo_clip_geo_rs",
    "bypass_ppo_clip_k3_rs", "bypass_pg_is", "bypass_pg_token_icepop", "bypass_pg_geo_rs",
    "bypass_pg_geo_rs_seq_tis", "bypass_pg_geo_rs_token_tis", "disabled",
)
PRESETS: dict[str, Callable[..., RolloutCorrectionConfig]] = {
    name: getattr(RolloutCorrectionConfig, name) for name in _PRESET_NAMES
}
LEGACY_PRESETS: dict[str, Callable[..., RolloutCorrectionConfig]] = {
    name: getattr(RolloutCorrectionConfig, name)
    for name in ("ppo_is_bypass", "pg_is", "pg_rs", "geo_rs_seq_tis", "pg_geo_rs_seq_tis")
}


_SLIME_LEVELS = ("token", "sequence", "geometric")
_SLIME_PREFIXES = ("--tis-", "--rs-", "--mis-")


def _slime_bound(values: Mapping[str, Any], dest: str) -> float | None:
    """``values[dest]`` as a finite float > 0 (None when absent), else ConfigError naming the flag."""
    value = values.get(dest)
    if value is None:
        return None
    flag = "--" + dest.replace("_", "-")
    if isinstance(value, bool):
        raise InputTypeError(f"{flag} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {value!r} is not a number") from None
    if not (math.isfinite(out) and out > 0.0):
        raise ConfigError(f"{flag} must be a finite number > 0, got {value!r}")
    return out


def _warn_unknown_slime_flags(flags: list[str], parser: argparse.ArgumentParser) -> None:
    """One MoealignWarning per flag that looks like a rollout-correction flag but is not one we translate."""
    known = [opt for a in parser._actions for opt in a.option_strings]
    for flag in dict.fromkeys(f for f in flags if f.startswith(_SLIME_PREFIXES)):
        close = difflib.get_close_matches(flag, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.warn(f"slime flag {flag} is not translated by from_slime_args (no effect here){hint}",
                      MoealignWarning, stacklevel=3)


class _SlimeParser(argparse.ArgumentParser):
    """argparse without the exit: a bad flag value raises ConfigError naming the flag (a trainer that builds
    its config from slime flags must not exit)."""

    def error(self, message):
        raise ConfigError(f"slime flags: {message}")

    def exit(self, status=0, message=None):
        raise ConfigError(f"slime flags: {message or f'argparse exited with status {status}'}".strip())


def slime_argument_parser() -> argparse.ArgumentParser:
    """An argparse parser for slime's rollout-correction flags (for argv lists); a bad value raises
    :class:`~moealign.errors.ConfigError` instead of exiting."""
    p = _SlimeParser(add_help=False, allow_abbrev=False)
    p.add_argument("--use-tis", action="store_true")
    p.add_argument("--tis-mode", choices=("truncate", "clip", "mask"), default="truncate")
    p.add_argument("--tis-level", choices=_SLIME_LEVELS, default="token")
    p.add_argument("--tis-lower-bound", type=float, default=None)
    p.add_argument("--tis-upper-bound", type=float, default=2.0)
    p.add_argument("--tis-batch-normalize", action="store_true")
    p.add_argument("--use-rs", action="store_true")
    p.add_argument("--rs-level", choices=_SLIME_LEVELS, default="token")
    p.add_argument("--rs-lower-bound", type=float, default=None)
    p.add_argument("--rs-upper-bound", type=float, default=None)
    p.add_argument("--rs-veto-threshold", type=float, default=None)
    p.add_argument("--use-rollout-logprobs", action="store_true")
    return p
