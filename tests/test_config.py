"""RolloutCorrectionConfig: verl's 19 presets, the earlier preset names, validation, and construction
from a dict, YAML and slime's flags.

Reference: verl-rollout-correction-and-router-replay.md §2 (presets table), §1.9 (earlier names),
slime-rollout-correction.md (slime's flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import warnings

import pytest
import torch

from moealign.correction import (
    PRESETS,
    RolloutCorrectionConfig,
    compute_rollout_correction_and_rejection_mask,
)
from moealign.correction.config import LEGACY_PRESETS
from moealign.errors import ConfigError

C = RolloutCorrectionConfig

# ----------------------------------------------------------------------------------------------------
# verl's presets table, written out literally (§2). Columns:
# rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold, bypass_mode, loss_type
PRESET_TABLE = {
    "decoupled_token_is": ("token", 2.0, None, None, False, "ppo_clip"),
    "decoupled_seq_is": ("sequence", 2.0, None, None, False, "ppo_clip"),
    "decoupled_token_icepop": ("token", "0.5_5.0", None, None, False, "ppo_clip"),
    "decoupled_seq_is_rs": ("sequence", 2.0, "seq_sum_k1", "0.5_2.0", False, "ppo_clip"),
    "decoupled_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_seq_tis": ("sequence", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_token_tis": ("token", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "bypass_ppo_clip": (None, 2.0, None, None, True, "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "ppo_clip"),
    "bypass_ppo_clip_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, True, "ppo_clip"),
    "bypass_pg_is": ("sequence", 2.0, None, None, True, "reinforce"),
    "bypass_pg_token_icepop": ("token", "0.5_5.0", None, None, True, "reinforce"),
    "bypass_pg_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "disabled": (None, 2.0, None, None, False, "ppo_clip"),
}
FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold", "bypass_mode", "loss_type")


def _fields(cfg):
    return tuple(getattr(cfg, f) for f in FIELDS)


def _batch(seed=0, B=6, T=7, scale=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3.0
    rollout = (old + scale * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=0.0)  # log-probs <= 0
    lengths = torch.tensor([T, T - 1, 3, 1, T, 5][:B])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    return old, rollout, mask


def _quiet_entry(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return compute_rollout_correction_and_rejection_mask(*args, **kwargs)


def _assert_same_result(a, b):
    wa, ma, meta = a
    wb, mb, metb = b
    if wa is None or wb is None:
        assert wa is None and wb is None
    else:
        assert torch.equal(wa, wb)
    assert torch.equal(ma, mb)
    assert sorted(meta) == sorted(metb)
    for key in meta:
        assert torch.equal(meta[key], metb[key]), key


# ----------------------------------------------------------------------------------------------------
# presets


def test_nineteen_presets():
    assert len(PRESETS) == 19
    assert set(PRESETS) == set(PRESET_TABLE)


@pytest.mark.parametrize("name", sorted(PRESET_TABLE))
def test_preset_fields_match_verl_table(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # current presets never warn
        cfg = PRESETS[name]()
        by_name = C.preset(name)
        method = getattr(C, name)()
    assert _fields(cfg) == PRESET_TABLE[name]
    assert cfg == by_name == method
    # the fields verl does not have keep their neutral defaults
    assert cfg.rollout_is_batch_normalize is False
    assert cfg.rollout_is_mode is None
    assert cfg.rollout_token_veto_threshold is None


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("decoupled_token_is", {"threshold": 3.0}, ("token", 3.0, None, None, False, "ppo_clip")),
        ("decoupled_seq_is_rs", {"is_threshold": 4.0, "rs_threshold": "0.25_4.0"},
         ("sequence", 4.0, "seq_sum_k1", "0.25_4.0", False, "ppo_clip")),
        ("decoupled_token_icepop", {"threshold": 8.0, "threshold_lower": 0.25},
         ("token", "0.25_8.0", None, None, False, "ppo_clip")),
        ("bypass_ppo_clip_k3_rs", {"rs_threshold": 0.05}, (None, 2.0, "seq_mean_k3", 0.05, True, "ppo_clip")),
        ("bypass_pg_token_icepop", {"threshold": 4.0, "threshold_lower": 0.5},
         ("token", "0.5_4.0", None, None, True, "reinforce")),
    ],
)
def test_preset_arguments(name, kwargs, expected):
    assert _fields(C.preset(name, **kwargs)) == expected


def test_unknown_preset():
    with pytest.raises(ValueError, match="no_such_preset"):
        C.preset("no_such_preset")


# ----------------------------------------------------------------------------------------------------
# earlier preset names (§1.9)


@pytest.mark.parametrize(
    "old, kwargs, current",
    [
        ("ppo_is_bypass", {}, lambda: C.bypass_ppo_clip()),
        ("pg_is", {}, lambda: C.bypass_pg_is()),
        ("pg_is", {"threshold": 3.0}, lambda: C.bypass_pg_is(threshold=3.0)),
        ("geo_rs_seq_tis", {}, lambda: C.decoupled_geo_rs_seq_tis(is_threshold=2.0, rs_threshold="1.001")),
        ("pg_geo_rs_seq_tis", {}, lambda: C.bypass_pg_geo_rs_seq_tis(is_threshold=2.0, rs_threshold="1.001")),
    ],
)
def test_earlier_preset_names_warn_and_map(old, kwargs, current):
    assert old in LEGACY_PRESETS
    with pytest.warns(DeprecationWarning):
        cfg = C.preset(old, **kwargs)
    with pytest.warns(DeprecationWarning):
        direct = getattr(C, old)(**kwargs)
    expected = current()
    assert cfg == direct == expected
    assert cfg.to_dict() == expected.to_dict()


def test_earlier_pg_rs_keeps_the_veto():
    with pytest.warns(DeprecationWarning):
        cfg = C.preset("pg_rs")
    ref = C.bypass_pg_geo_rs()
    # same mode / loss as bypass_pg_geo_rs, and the earlier veto threshold kept
    assert (cfg.rollout_is, cfg.rollout_rs, cfg.bypass_mode, cfg.loss_type) == (
        ref.rollout_is, ref.rollout_rs, ref.bypass_mode, ref.loss_type)
    assert cfg.rollout_token_veto_threshold == 1e-4
    # the earlier threshold 1.001 is the band [1/1.001, 1.001] on the geometric mean
    with pytest.warns(DeprecationWarning, match="veto"):
        plan = cfg.plan()
    (opt,) = plan.rs_options
    assert opt.name == "seq_mean_k1"
    assert opt.upper == 1.001
    assert opt.lower == pytest.approx(1 / 1.001, rel=1e-15)
    assert plan.veto_threshold == 1e-4


def test_earlier_decoupled_geo_rs_with_veto():
    with pytest.warns(DeprecationWarning):
        cfg = C.decoupled_geo_rs(veto_threshold=1e-4)
    ref = C.decoupled_geo_rs()
    assert cfg == dataclasses.replace(ref, rollout_token_veto_threshold=1e-4)
    assert _fields(cfg) == _fields(ref)


def test_earlier_veto_config_rejects_catastrophic_sequence():
    old, rollout, mask = _batch(seed=1, scale=0.0)
    old = old.clone()
    old[2, 1] = rollout[2, 1] + math.log(1e-6)  # ratio 1e-6 < 1e-4 on a valid token of row 2
    with pytest.warns(DeprecationWarning):
        cfg = C.pg_rs()
    _, keep, _ = cfg.compute(old, rollout, mask)
    assert torch.equal(keep[2], torch.zeros_like(mask[2]))
    others = [0, 1, 3, 4, 5]
    assert torch.equal(keep[others], mask[others])


# ----------------------------------------------------------------------------------------------------
# frozen, .get, validation


def test_frozen_and_get():
    cfg = C.decoupled_geo_rs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout_is = "token"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bypass_mode = True
    assert cfg.get("rollout_rs") == "seq_mean_k1"
    assert cfg.get("rollout_rs_threshold") == "0.999_1.001"
    assert cfg.get("rollout_is") is None
    assert cfg.get("no_such_field") is None
    assert cfg.get("no_such_field", 7) == 7
    assert cfg.get("loss_type", "x") == "ppo_clip"
    assert hash(cfg) == hash(C.decoupled_geo_rs())


def test_defaults_are_verl_yaml_defaults():
    cfg = C()
    assert _fields(cfg) == (None, 2.0, None, None, False, "ppo_clip")
    assert cfg.rollout_is_batch_normalize is False
    assert cfg == C.disabled()


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"loss_type": "vanilla"}, ValueError),
        ({"loss_type": "bypass_mode"}, ValueError),
        ({"bypass_mode": 1}, TypeError),
        ({"bypass_mode": "true"}, TypeError),
        ({"bypass_mode": None}, TypeError),
        ({"rollout_is": "token", "rollout_is_threshold": "abc"}, ValueError),
        ({"rollout_is": "token", "rollout_is_threshold": ""}, ValueError),
        ({"rollout_is": "token", "rollout_is_threshold": -1.0}, ValueError),
        ({"rollout_is": "token", "rollout_is_threshold": 0}, ValueError),
        ({"rollout_is": "token", "rollout_is_threshold": float("nan")}, ValueError),
        ({"rollout_is": "token", "rollout_is_threshold": float("inf")}, ValueError),
        ({"rollout_is": "token", "rollout_is_threshold": True}, TypeError),
        ({"rollout_is": "token", "rollout_is_threshold": "5.0_0.5"}, ValueError),
        ({"rollout_is": "token", "rollout_is_threshold": "0.5_x"}, ValueError),
        ({"rollout_is": "token", "rollout_is_threshold": [2.0]}, TypeError),
        ({"rollout_is": "geo"}, ValueError),
        ({"rollout_is": "tokens"}, ValueError),
        ({"rollout_is": "Token"}, ValueError),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, ValueError),
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 2.0}, ValueError),
        ({"rollout_rs": "bogus", "rollout_rs_threshold": 2.0}, ValueError),
        ({"rollout_rs": "seq_mean_k1"}, ValueError),  # no threshold
        ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": "0.5_2.0"}, ValueError),  # band on k3
        ({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "1.001_0.999"}, ValueError),
        ({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": 0.5}, ValueError),  # single u < 1
        ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": -0.01}, ValueError),
        ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": True}, TypeError),
        ({"rollout_rs": "seq_mean_k1,seq_mean_k3", "rollout_rs_threshold": "1.1,0.01,0.02"}, ValueError),
        ({"rollout_is_batch_normalize": "yes"}, TypeError),
        ({"rollout_is": "token", "rollout_is_mode": "squash"}, ValueError),
    ],
)
def test_validation_at_construction(kwargs, exc):
    with pytest.raises(exc):
        C(**kwargs)


def test_chain_and_per_mode_thresholds_are_valid():
    cfg = C(rollout_rs="seq_mean_k1,seq_max_k2", rollout_rs_threshold="0.99_1.01,0.5")
    names = [o.name for o in cfg.plan().rs_options]
    assert names == ["seq_mean_k1", "seq_max_k2"]


# ----------------------------------------------------------------------------------------------------
# from_dict


def test_from_dict_plain():
    d = {"rollout_is": "token", "rollout_is_threshold": 3.0, "rollout_rs": "seq_mean_k3",
         "rollout_rs_threshold": 0.02, "bypass_mode": True, "loss_type": "reinforce"}
    cfg = C.from_dict(d)
    assert _fields(cfg) == ("token", 3.0, "seq_mean_k3", 0.02, True, "reinforce")
    assert C.from_dict(cfg.to_dict()) == cfg
    assert C.from_dict({}) == C()


def test_from_dict_nested():
    inner = {"rollout_is": "sequence", "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}
    expected = C.decoupled_geo_rs_seq_tis()
    assert C.from_dict({"algorithm": {"rollout_correction": inner}}) == expected
    assert C.from_dict({"rollout_correction": inner}) == expected
    # a verl config with an algorithm block but no rollout_correction: defaults
    assert C.from_dict({"algorithm": {"gamma": 1.0}}) == C()


def test_from_dict_preset_with_override():
    cfg = C.from_dict({"preset": "decoupled_geo_rs", "rollout_rs_threshold": "0.99_1.01"})
    assert _fields(cfg) == (None, 2.0, "seq_mean_k1", "0.99_1.01", False, "ppo_clip")
    cfg = C.from_dict({"algorithm": {"rollout_correction": {"preset": "bypass_pg_is", "rollout_is_threshold": 5.0}}})
    assert _fields(cfg) == ("sequence", 5.0, None, None, True, "reinforce")
    # a preset alone equals the preset
    assert C.from_dict({"preset": "bypass_ppo_clip_k3_rs"}) == C.bypass_ppo_clip_k3_rs()


def test_from_dict_unknown_key_names_it():
    with pytest.raises(ValueError, match="rollout_is_treshold"):
        C.from_dict({"rollout_is": "token", "rollout_is_treshold": 2.0})
    with pytest.raises(ValueError, match="frobnicate"):
        C.from_dict({"algorithm": {"rollout_correction": {"frobnicate": 1}}})


def test_from_dict_not_a_mapping():
    with pytest.raises(TypeError):
        C.from_dict(["rollout_is", "token"])


@pytest.mark.parametrize("upg, loss_type", [(True, "reinforce"), (False, "ppo_clip")])
def test_from_dict_use_policy_gradient(upg, loss_type):
    with pytest.warns(DeprecationWarning, match="use_policy_gradient"):
        cfg = C.from_dict({"rollout_is": "sequence", "bypass_mode": True, "use_policy_gradient": upg})
    assert cfg.loss_type == loss_type
    assert "use_policy_gradient" not in cfg.to_dict()


def test_from_dict_use_policy_gradient_must_be_bool():
    with pytest.raises(TypeError):
        C.from_dict({"use_policy_gradient": "yes"})


@pytest.mark.parametrize("level, mode", [("token", "token_k1"), ("sequence", "seq_sum_k1"),
                                         ("geometric", "seq_mean_k1")])
def test_from_dict_rollout_rs_threshold_lower(level, mode):
    with pytest.warns(DeprecationWarning):
        cfg = C.from_dict({"rollout_rs": level, "rollout_rs_threshold": 1.002, "rollout_rs_threshold_lower": 0.998})
    assert cfg.rollout_rs == mode
    assert cfg.rollout_rs_threshold == "0.998_1.002"
    (opt,) = cfg.plan().rs_options
    assert (opt.lower, opt.upper) == (0.998, 1.002)


def test_from_dict_rollout_rs_threshold_lower_needs_earlier_level():
    with pytest.raises(ValueError):
        C.from_dict({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": 1.002, "rollout_rs_threshold_lower": 0.998})


# ----------------------------------------------------------------------------------------------------
# from_yaml

YAML_TEXT = """\
algorithm:
  gamma: 1.0
  rollout_correction:
    rollout_is: token
    rollout_is_threshold: 2.0
    rollout_is_batch_normalize: false
    rollout_rs: seq_mean_k1
    rollout_rs_threshold: "0.999_1.001"
    bypass_mode: false
    loss_type: ppo_clip
"""


def test_from_yaml_text():
    pytest.importorskip("yaml")
    cfg = C.from_yaml(YAML_TEXT)
    assert cfg == C.decoupled_geo_rs_token_tis()


def test_from_yaml_file(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "rollout_correction.yaml"
    path.write_text(YAML_TEXT)
    assert C.from_yaml(str(path)) == C.decoupled_geo_rs_token_tis()
    other = tmp_path / "preset.yaml"
    other.write_text("preset: bypass_pg_token_icepop\nrollout_is_threshold: '0.25_4.0'\n")
    cfg = C.from_yaml(str(other))
    assert _fields(cfg) == ("token", "0.25_4.0", None, None, True, "reinforce")


def test_from_yaml_empty_and_unknown():
    pytest.importorskip("yaml")
    assert C.from_yaml("") == C()
    with pytest.raises(ValueError, match="mystery"):
        C.from_yaml("rollout_is: token\nmystery: 3\n")


# ----------------------------------------------------------------------------------------------------
# from_slime_args


def _slime_ns(**overrides):
    base = dict(use_tis=False, tis_mode="truncate", tis_level="token", tis_lower_bound=None, tis_upper_bound=2.0,
                tis_batch_normalize=False, use_rs=False, rs_level="token", rs_lower_bound=None,
                rs_upper_bound=None, rs_veto_threshold=None, use_rollout_logprobs=False)
    base.update(overrides)
    return argparse.Namespace(**base)


def _check_same_as_entry(cfg, seed=0, **explicit):
    old, rollout, mask = _batch(seed=seed)
    _assert_same_result(cfg.compute(old, rollout, mask), _quiet_entry(old, rollout, mask, **explicit))


def test_slime_nothing():
    cfg = C.from_slime_args([])
    assert cfg == C()
    assert C.from_slime_args({}) == C()
    assert C.from_slime_args(_slime_ns()) == C()


def test_slime_truncate():
    argv = ["--use-tis", "--tis-mode", "truncate", "--tis-level", "token", "--tis-upper-bound", "3.0"]
    cfg = C.from_slime_args(argv)
    assert C.from_slime_args(_slime_ns(use_tis=True, tis_upper_bound=3.0)) == cfg
    assert C.from_slime_args({"use_tis": True, "tis_upper_bound": 3.0}) == cfg
    assert C.from_slime_args({"use-tis": True, "tis-upper-bound": 3.0}) == cfg
    assert cfg.rollout_is == "token"
    assert float(cfg.rollout_is_threshold) == 3.0
    assert cfg.rollout_is_mode in (None, "truncate")
    assert cfg.plan().is_spec.mode == "truncate"
    assert cfg.bypass_mode is False
    _check_same_as_entry(cfg, rollout_is="token", rollout_is_threshold=3.0)


def test_slime_truncate_default_upper_and_lower_ignored():
    cfg = C.from_slime_args(["--use-tis", "--tis-lower-bound", "0.1"])
    spec = cfg.plan().is_spec
    assert (spec.level, spec.mode, spec.upper, spec.lower) == ("token", "truncate", 2.0, None)
    _check_same_as_entry(cfg, seed=3, rollout_is="token", rollout_is_threshold=2.0)


def test_slime_clip():
    cfg = C.from_slime_args(["--use-tis", "--tis-mode", "clip", "--tis-upper-bound", "2.0"])
    assert C.from_slime_args(_slime_ns(use_tis=True, tis_mode="clip")) == cfg
    assert C.from_slime_args({"use_tis": True, "tis_mode": "clip", "tis_upper_bound": 2.0}) == cfg
    spec = cfg.plan().is_spec
    assert (spec.level, spec.mode, spec.upper, spec.lower) == ("token", "clip", 2.0, 0.5)
    # the lower bound defaults to 1/upper
    _check_same_as_entry(cfg, rollout_is="token", rollout_is_threshold=2.0, rollout_is_mode="clip")
    # with an explicit lower bound
    cfg2 = C.from_slime_args(["--use-tis", "--tis-mode", "clip", "--tis-lower-bound", "0.8",
                              "--tis-upper-bound", "1.25"])
    spec2 = cfg2.plan().is_spec
    assert (spec2.mode, spec2.lower, spec2.upper) == ("clip", 0.8, 1.25)
    _check_same_as_entry(cfg2, seed=1, rollout_is="token", rollout_is_threshold=1.25, rollout_is_mode="clip",
                         rollout_is_threshold_lower=0.8)


def test_slime_clip_weights_by_hand():
    old = torch.tensor([[-5.0, -5.0, -5.0, -5.0]], dtype=torch.float64)  # log-probs: <= 0
    rollout = old + torch.tensor([[math.log(4.0), 0.0, -math.log(1.5), -math.log(4.0)]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    w, _, _ = C.from_slime_args(["--use-tis", "--tis-mode", "clip"]).compute(old, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 1.5, 2.0]], dtype=torch.float64), rtol=1e-12, atol=0)
    w, _, _ = C.from_slime_args(["--use-tis", "--tis-mode", "mask"]).compute(old, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 1.5, 0.0]], dtype=torch.float64), rtol=1e-12, atol=0)
    w, _, _ = C.from_slime_args(["--use-tis"]).compute(old, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[0.25, 1.0, 1.5, 2.0]], dtype=torch.float64), rtol=1e-12, atol=0)


def test_slime_mask():
    cfg = C.from_slime_args(["--use-tis", "--tis-mode", "mask", "--tis-lower-bound", "0.5",
                             "--tis-upper-bound", "1.5"])
    assert C.from_slime_args(_slime_ns(use_tis=True, tis_mode="mask", tis_lower_bound=0.5,
                                       tis_upper_bound=1.5)) == cfg
    assert C.from_slime_args({"use_tis": True, "tis_mode": "mask", "tis_lower_bound": 0.5,
                              "tis_upper_bound": 1.5}) == cfg
    spec = cfg.plan().is_spec
    assert (spec.mode, spec.lower, spec.upper) == ("mask", 0.5, 1.5)
    # IcePop's band spelling in the entry point
    _check_same_as_entry(cfg, rollout_is="token", rollout_is_threshold="0.5_1.5")


@pytest.mark.parametrize("mode", ["truncate", "clip", "mask"])
def test_slime_geometric_level(mode):
    cfg = C.from_slime_args(["--use-tis", "--tis-level", "geometric", "--tis-mode", mode,
                             "--tis-upper-bound", "1.1"])
    assert C.from_slime_args({"use_tis": True, "tis_level": "geometric", "tis_mode": mode,
                              "tis_upper_bound": 1.1}) == cfg
    assert cfg.rollout_is == "geometric"
    explicit = {"rollout_is": "geometric", "rollout_is_threshold": 1.1}
    if mode != "truncate":
        explicit["rollout_is_mode"] = mode
    _check_same_as_entry(cfg, seed=2, **explicit)


def test_slime_sequence_level_and_batch_normalize():
    cfg = C.from_slime_args(["--use-tis", "--tis-level", "sequence", "--tis-batch-normalize"])
    assert cfg.rollout_is == "sequence"
    assert cfg.rollout_is_batch_normalize is True
    _check_same_as_entry(cfg, seed=4, rollout_is="sequence", rollout_is_threshold=2.0,
                         rollout_is_batch_normalize=True)


@pytest.mark.parametrize("level, mode", [("token", "token_k1"), ("sequence", "seq_sum_k1"),
                                         ("geometric", "seq_mean_k1")])
def test_slime_rs_levels(level, mode):
    cfg = C.from_slime_args(["--use-rs", "--rs-level", level, "--tis-upper-bound", "1.3"])
    assert C.from_slime_args(_slime_ns(use_rs=True, rs_level=level, tis_upper_bound=1.3)) == cfg
    assert C.from_slime_args({"use_rs": True, "rs_level": level, "tis_upper_bound": 1.3}) == cfg
    assert cfg.rollout_rs == mode
    assert cfg.rollout_is is None  # RS alone: no IS weights
    (opt,) = cfg.plan().rs_options
    assert opt.name == mode
    # the RS bounds default to the IS bounds: [1/1.3, 1.3]
    assert opt.upper == 1.3
    assert opt.lower == pytest.approx(1 / 1.3, rel=1e-15)
    _check_same_as_entry(cfg, seed=5, rollout_rs=mode, rollout_rs_threshold=1.3)
    # the earlier entry-point spelling (token / sequence / geometric) gives the same result
    _check_same_as_entry(cfg, seed=5, rollout_rs=level, rollout_rs_threshold=1.3)


def test_slime_rs_bounds_default_to_tis_bounds():
    cfg = C.from_slime_args(["--use-tis", "--tis-mode", "clip", "--tis-lower-bound", "0.7",
                             "--tis-upper-bound", "1.6", "--use-rs", "--rs-level", "geometric"])
    (opt,) = cfg.plan().rs_options
    assert (opt.name, opt.lower, opt.upper) == ("seq_mean_k1", 0.7, 1.6)
    _check_same_as_entry(cfg, seed=6, rollout_is="token", rollout_is_threshold="0.7_1.6", rollout_is_mode="clip",
                         rollout_rs="seq_mean_k1", rollout_rs_threshold="0.7_1.6")


def test_slime_rs_explicit_bounds():
    cfg = C.from_slime_args(["--use-rs", "--rs-level", "token", "--rs-lower-bound", "0.8",
                             "--rs-upper-bound", "1.2"])
    (opt,) = cfg.plan().rs_options
    assert (opt.name, opt.lower, opt.upper) == ("token_k1", 0.8, 1.2)
    _check_same_as_entry(cfg, seed=7, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.2")
    # only the upper bound: lower = 1/upper
    cfg = C.from_slime_args({"use_rs": True, "rs_level": "sequence", "rs_upper_bound": 1.5})
    (opt,) = cfg.plan().rs_options
    assert opt.name == "seq_sum_k1" and opt.upper == 1.5
    assert opt.lower == pytest.approx(1 / 1.5, rel=1e-15)
    _check_same_as_entry(cfg, seed=7, rollout_rs="seq_sum_k1", rollout_rs_threshold=1.5)


def test_slime_rs_mask_by_hand():
    # asymmetric band on the ratio r = pi_train / pi_rollout: keep 0.8 <= r <= 1.5
    old = torch.full((1, 4), -5.0, dtype=torch.float64)  # log-probs: <= 0
    ratio = torch.tensor([[0.7, 0.9, 1.4, 1.6]], dtype=torch.float64)
    rollout = old - ratio.log()
    mask = torch.ones(1, 4)
    cfg = C.from_slime_args(["--use-rs", "--rs-lower-bound", "0.8", "--rs-upper-bound", "1.5"])
    w, keep, _ = cfg.compute(old, rollout, mask)
    assert w is None
    assert torch.equal(keep, torch.tensor([[0.0, 1.0, 1.0, 0.0]]))


def test_slime_rs_veto_threshold():
    cfg = C.from_slime_args(["--use-tis", "--rs-veto-threshold", "1e-4"])
    assert cfg.rollout_token_veto_threshold == 1e-4
    assert C.from_slime_args({"use_tis": True, "rs_veto_threshold": 1e-4}) == cfg
    old, rollout, mask = _batch(seed=8, scale=0.1)
    old = old.clone()
    old[1, 0] = rollout[1, 0] - 12.0  # ratio exp(-12) ~ 6e-6 < 1e-4
    _assert_same_result(
        cfg.compute(old, rollout, mask),
        _quiet_entry(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0,
                     rollout_token_veto_threshold=1e-4),
    )
    _, keep, _ = cfg.compute(old, rollout, mask)
    assert keep[1].sum() == 0
    assert torch.equal(keep[[0, 2, 3, 4, 5]], mask[[0, 2, 3, 4, 5]])


def test_slime_use_rollout_logprobs_is_bypass():
    cfg = C.from_slime_args(["--use-rollout-logprobs"])
    assert cfg.bypass_mode is True
    assert cfg.loss_type == "ppo_clip"
    assert C.from_slime_args({"use_rollout_logprobs": True}) == cfg
    assert C.from_slime_args(_slime_ns(use_rollout_logprobs=True)) == cfg
    assert cfg == C.bypass_ppo_clip()
    assert C.from_slime_args(["--use-tis"]).bypass_mode is False


def test_slime_errors():
    with pytest.raises(ValueError):
        C.from_slime_args({"use_rs": True, "rs_level": "tokens"})
    with pytest.raises(TypeError):
        C.from_slime_args("--use-tis")
    with pytest.raises(ConfigError, match="--tis-mode"):  # never SystemExit: a trainer must not exit
        C.from_slime_args(["--tis-mode", "squash"])


# ----------------------------------------------------------------------------------------------------
# config.compute == entry point with config.to_kwargs()


@pytest.mark.parametrize("name", sorted(PRESET_TABLE))
def test_compute_equals_entry_point_presets(name):
    cfg = PRESETS[name]()
    old, rollout, mask = _batch(seed=11, scale=0.05)
    _assert_same_result(cfg.compute(old, rollout, mask), _quiet_entry(old, rollout, mask, **cfg.to_kwargs()))


@pytest.mark.parametrize(
    "cfg",
    [
        C(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_mode="clip"),
        C(rollout_is="geometric", rollout_is_threshold=1.2, rollout_is_batch_normalize=True),
        C(rollout_rs="seq_mean_k1,seq_max_k2", rollout_rs_threshold="0.9_1.1,0.2"),
        C(rollout_is="sequence", rollout_token_veto_threshold=1e-3),
    ],
    ids=["clip", "geometric-bn", "chain", "veto"],
)
def test_compute_equals_entry_point_extended(cfg):
    old, rollout, mask = _batch(seed=12, scale=0.4)
    bool_mask = mask.bool()
    for m in (mask, bool_mask):
        _assert_same_result(cfg.compute(old, rollout, m), _quiet_entry(old, rollout, m, **cfg.to_kwargs()))
    # to_kwargs holds only entry-point arguments
    kw = cfg.to_kwargs()
    assert "bypass_mode" not in kw and "loss_type" not in kw


# ----------------------------------------------------------------------------------------------------
# the earlier rollout_rs spelling (token / sequence / geometric, §1.9) through the config
#
# RolloutCorrectionConfig.compute() silences DeprecationWarning on the grounds that the config was
# "warned once, at construction"; so constructing a config with the earlier spelling must warn.


@pytest.mark.parametrize(
    "build",
    [
        lambda: C.from_dict({"rollout_rs": "geometric", "rollout_rs_threshold": 1.001}),
        lambda: C(rollout_rs="sequence", rollout_rs_threshold=2.0),
    ],
    ids=["from_dict", "constructor"],
)
def test_earlier_rs_spelling_warns_at_construction(build):
    with pytest.warns(DeprecationWarning, match="earlier spelling"):
        build()


def test_earlier_rs_spelling_computes_like_current_mode():
    old, rollout, mask = _batch(seed=13, scale=0.002)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        earlier = C.from_dict({"rollout_rs": "geometric", "rollout_rs_threshold": 1.001})
    current = C(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.001)
    _assert_same_result(earlier.compute(old, rollout, mask), current.compute(old, rollout, mask))


def test_yaml_unquoted_band_stays_a_band():
    # YAML 1.1 would read 0.5_5 as 0.55; the loader keeps it the IcePop band [0.5, 5]
    cfg = RolloutCorrectionConfig.from_yaml(
        "rollout_is: token\nrollout_is_threshold: 0.5_5  # icepop\n"
        "rollout_rs: token_k1,seq_max_k2\nrollout_rs_threshold: 0.5_2.0,3\n")
    assert cfg.rollout_is_threshold == "0.5_5"
    assert cfg.rollout_rs_threshold == "0.5_2.0,3"
    assert cfg.plan().is_spec.mode == "mask" and cfg.plan().is_spec.lower == 0.5


def test_slime_argv_with_unrelated_flags():
    cfg = RolloutCorrectionConfig.from_slime_args(
        ["--micro-batch-size", "4", "--use-tis", "--tis-upper-bound", "3", "--lr", "1e-6"])
    assert cfg.rollout_is == "token" and cfg.rollout_is_threshold == 3.0
