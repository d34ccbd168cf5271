"""Hostile inputs to the correction API (issue 11, "Correction API"): each test failed before its fix.

Positive "log-probs", thresholds the weights' dtype cannot hold, IS options that silently do nothing, slime
flags that exited the process or were silently ignored, meta-device tensors; and their siblings across the
entry point, the log-ratio wrappers, the metric functions and the losses.
"""

from __future__ import annotations

import argparse
import math
import warnings

import pytest
import torch

from moealign._validate import LOG_PROB_TOLERANCE
from moealign.correction import (
    RolloutCorrectionConfig,
    agg_loss,
    bypass_policy_loss,
    compute_agreement_metrics,
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    deepseek_offpolicy_sequence_mask,
    ppo_clip_loss,
    reinforce_loss,
)
from moealign.errors import ConfigError, InputError, InputTypeError, MoealignError, MoealignWarning

C = RolloutCorrectionConfig
F = compute_rollout_correction_and_rejection_mask


def _batch(B=3, T=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 2.0 - 0.1
    rollout = -torch.rand(B, T, generator=g, dtype=dtype) * 2.0 - 0.1
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    return old, rollout, mask


# ---------------------------------------------------------------------------------- positive log-probs

@pytest.mark.parametrize("which", ["old_log_prob", "rollout_log_prob"])
@pytest.mark.parametrize("kind", ["probabilities", "nll"])
def test_entry_point_refuses_positive_log_probs_naming_the_tensor(which, kind):
    old, rollout, mask = _batch()
    bad = {"probabilities": lambda t: t.exp(), "nll": lambda t: -t}[kind]
    args = {"old_log_prob": old, "rollout_log_prob": rollout}
    args[which] = bad(args[which])
    expected_max = float(args[which][mask.bool()].max())
    with pytest.raises(InputError, match=rf"{which} has positive entries .*\(max ") as info:
        F(args["old_log_prob"], args["rollout_log_prob"], mask, rollout_is="token", rollout_is_threshold=2.0)
    assert float(str(info.value).split("(max ")[1].split(")")[0]) == pytest.approx(expected_max, rel=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_positive_check_holds_in_the_blocked_and_fused_paths(fused, monkeypatch):
    import moealign.correction.pipeline as pipeline

    monkeypatch.setattr(pipeline, "_BLOCK_ELEMENTS", 8)  # several blocks of rows
    old, rollout, mask = _batch(B=9, T=4)
    rollout[7, 2] = 0.5  # one positive entry in a late block
    try:
        with pytest.raises(InputError, match="rollout_log_prob has positive entries"):
            F(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0, fused=fused)
    except Exception as exc:  # fused=True needs a working torch.compile (a C++ compiler on CPU)
        if fused and "torch.compile" in str(exc):
            pytest.skip("torch.compile unavailable here")
        raise


def test_positive_values_in_padding_and_tiny_rounding_are_accepted():
    old, rollout, mask = _batch()
    old[1, 4] = 0.9  # padding: ignored, like NaN there
    rollout[0, 0] = LOG_PROB_TOLERANCE / 2  # float32 rounding of a near-certain token's log-prob
    w, _, _ = F(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    assert torch.isfinite(w).all()


def test_positive_check_also_after_nan_padding_rerun():
    old, rollout, mask = _batch()
    old[1, 4] = float("nan")  # padding garbage sends the pass through its second run
    rollout[0, 1] = 0.3
    with pytest.raises(InputError, match="rollout_log_prob has positive entries"):
        F(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)


@pytest.mark.parametrize("fn", [compute_offpolicy_metrics, compute_agreement_metrics])
def test_metric_functions_refuse_positive_log_probs(fn):
    old, rollout, mask = _batch()
    with pytest.raises(InputError, match="old_log_prob has positive entries"):
        fn(old.exp(), rollout, mask)


def test_config_compute_refuses_positive_log_probs():
    old, rollout, mask = _batch()
    with pytest.raises(InputError, match="rollout_log_prob has positive entries"):
        C.decoupled_token_is().compute(old, -rollout, mask)


def test_log_ratio_wrappers_refuse_non_tensors_by_name():
    from moealign.correction import compute_rollout_rejection_mask

    with pytest.raises(InputTypeError, match="log_ratio must be a torch.Tensor"):
        compute_rollout_correction_weights([[0.1]], torch.ones(1, 1))
    with pytest.raises(InputTypeError, match="log_ratio must be a torch.Tensor"):
        compute_rollout_rejection_mask([[0.1]], torch.ones(1, 1), "token_k1", 2.0)


def test_log_ratio_wrapper_accepts_any_sign():
    old, rollout, mask = _batch()
    w, _ = compute_rollout_correction_weights(old - rollout + 0.5, mask)  # a log-ratio, not a log-prob
    assert torch.isfinite(w).all()


def test_losses_refuse_positive_log_probs():
    old, rollout, mask = _batch(dtype=torch.float64)
    adv = torch.randn(old.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with pytest.raises(InputError, match="old_log_prob has positive entries"):
        ppo_clip_loss(old, old.exp(), adv, mask)
    with pytest.raises(InputError, match="log_prob has positive entries"):
        ppo_clip_loss(-old, rollout, adv, mask)
    with pytest.raises(InputError, match="rollout_log_prob has positive entries"):
        reinforce_loss(old, adv, mask, rollout_log_prob=rollout.exp())
    with pytest.raises(InputError, match="rollout_log_prob has positive entries"):
        deepseek_offpolicy_sequence_mask(old, -rollout, adv, mask, 0.1)
    with pytest.raises(InputError, match="rollout_log_prob has positive entries"):
        bypass_policy_loss(old, rollout.exp(), adv, mask, C.bypass_ppo_clip())


# ------------------------------------------------------------------------- weights never inf (dtypes)

@pytest.mark.parametrize("threshold, kw", [
    (1e5, {}),                                   # TIS
    ("0.5_1e5", {}),                             # IcePop band
    ("0.5_1e5", {"rollout_is_mode": "clip"}),
    (1e5, {"rollout_is": "sequence"}),
    (1e5, {"rollout_is": "geometric"}),
])
def test_fp16_threshold_above_65504_is_refused_not_inf(threshold, kw):
    old = torch.zeros(2, 4, dtype=torch.float16)
    rollout = torch.full((2, 4), -15.0, dtype=torch.float16)  # ratio e^15 = 3.3e6 > 65504
    kw = {"rollout_is": "token", **kw}
    with pytest.raises(ConfigError, match=r"upper bound .*torch.float16.*65504"):
        F(old, rollout, torch.ones(2, 4), rollout_is_threshold=threshold, **kw)
    # at float16's largest value the weights are finite
    w, _, _ = F(old, rollout, torch.ones(2, 4), rollout_is_threshold=65504.0, rollout_is=kw["rollout_is"])
    assert w.dtype == torch.float16 and torch.isfinite(w).all()
    assert float(w.max()) == 65504.0


@pytest.mark.parametrize("mode", ["clip", "mask"])
def test_fp16_lower_bound_below_its_smallest_value_is_refused(mode):
    old = torch.full((1, 3), -20.0, dtype=torch.float16)
    rollout = torch.zeros(1, 3, dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"lower bound .*torch.float16"):
        F(old, rollout, torch.ones(1, 3), rollout_is="token", rollout_is_threshold="1e-9_2.0", rollout_is_mode=mode)
    # fine in float32: a clipped weight is the bound itself
    w, _, _ = F(old.float(), rollout.float(), torch.ones(1, 3), rollout_is="token", rollout_is_threshold="1e-9_2.0",
                rollout_is_mode=mode)
    assert (w > 0).all() if mode == "clip" else torch.equal(w, torch.full_like(w, math.exp(-20.0)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_threshold_beyond_the_float_range_is_a_named_error_not_a_torch_one(dtype):
    old, rollout, mask = _batch(dtype=dtype)
    with pytest.raises(ConfigError, match="IS upper bound 1e\\+39"):
        F(old, rollout, mask, rollout_is="token", rollout_is_threshold=1e39)
    w, _, _ = F(old, rollout, mask, rollout_is="token", rollout_is_threshold=1e30)  # no truncation at all
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("mode", ["token_k2", "seq_sum_k3", "seq_max_k3"])
def test_rs_bound_beyond_float32_rejects_nothing(mode):
    old, rollout, mask = _batch()
    _, keep, _ = F(old, rollout, mask, rollout_rs=mode, rollout_rs_threshold=1e39)
    assert torch.equal(keep, mask)


def test_fp16_batch_normalized_weights_saturate_instead_of_inf():
    # one weight e^11 = 59874 among 70000 weights e^-20: the batch mean is ~0.86, the normalised weight
    # ~70000, beyond float16's range
    T = 70000
    old = torch.full((1, T), -20.0, dtype=torch.float16)
    old[0, 0] = 0.0
    rollout = torch.zeros(1, T, dtype=torch.float16)
    rollout[0, 0] = -11.0
    w, _, _ = F(old, rollout, torch.ones(1, T), rollout_is="token", rollout_is_threshold=60000.0,
                rollout_is_batch_normalize=True)
    assert w.dtype == torch.float16 and torch.isfinite(w).all()
    assert float(w[0, 0]) == 65504.0


# -------------------------------------------------------------------------- IS options with no effect

def test_is_without_threshold_warns_and_keeps_verl_behaviour():
    old, rollout, mask = _batch()
    with pytest.warns(MoealignWarning, match="rollout_is_threshold=None"):
        w, keep, _ = F(old, rollout, mask, rollout_is="token", rollout_is_threshold=None)
    assert w is None and torch.equal(keep, mask)
    with pytest.warns(MoealignWarning, match="rollout_is_threshold=None"):
        C(rollout_is="sequence", rollout_is_threshold=None)


def test_batch_normalize_without_is_warns():
    with pytest.warns(MoealignWarning, match="rollout_is_batch_normalize"):
        C(rollout_is_batch_normalize=True)
    old, rollout, mask = _batch()
    with pytest.warns(MoealignWarning, match="rollout_is_batch_normalize"):
        F(old, rollout, mask, rollout_is=None, rollout_is_batch_normalize=True)


def test_config_compute_does_not_repeat_construction_warnings():
    with pytest.warns(MoealignWarning):
        cfg = C(rollout_is="token", rollout_is_threshold=None)
    old, rollout, mask = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.compute(old, rollout, mask)


@pytest.mark.parametrize("mode", ["clip", "mask", "truncate"])
def test_config_refuses_is_mode_without_is_like_the_entry_point(mode):
    with pytest.raises(InputError, match="rollout_is_mode"):
        C(rollout_is_mode=mode)
    with pytest.raises(InputError, match="rollout_is_mode"):
        C(rollout_is="token", rollout_is_threshold=None, rollout_is_mode=mode)
    with pytest.raises(InputError, match="rollout_is_mode"):
        C.from_dict({"preset": "decoupled_k3_rs", "rollout_is_mode": mode})
    old, rollout, mask = _batch()
    with pytest.raises(InputError, match="rollout_is_mode"):
        F(old, rollout, mask, rollout_is=None, rollout_is_mode=mode)


# ----------------------------------------------------------------------------------- from_slime_args

@pytest.mark.parametrize("argv, flag", [
    (["--use-tis", "--tis-upper-bound", "abc"], "--tis-upper-bound"),
    (["--use-tis", "--tis-mode", "squash"], "--tis-mode"),
    (["--use-rs", "--rs-level", "tokens"], "--rs-level"),
    (["--use-tis", "--tis-upper-bound"], "--tis-upper-bound"),
    (["--use-tis", "--tis-mode", "clip", "--tis-upper-bound", "0"], "--tis-upper-bound"),
    (["--use-rs", "--rs-upper-bound", "-1"], "--rs-upper-bound"),
    (["--use-tis", "--rs-veto-threshold", "nan"], "--rs-veto-threshold"),
])
def test_slime_bad_value_raises_config_error_not_system_exit(argv, flag):
    try:
        C.from_slime_args(argv)
    except SystemExit:  # pragma: no cover - the bug
        pytest.fail("from_slime_args exited the process")
    except ConfigError as exc:
        assert flag in str(exc)
    else:
        pytest.fail("no error")


@pytest.mark.parametrize("values, flag, exc", [
    ({"use_tis": True, "tis_upper_bound": "abc"}, "--tis-upper-bound", ConfigError),
    ({"use_tis": True, "tis_level": "tok"}, "--tis-level", ConfigError),
    ({"use_tis": True, "tis_mode": "squash"}, "--tis-mode", ConfigError),
    ({"use_tis": "false"}, "--use-tis", InputTypeError),
    ({"use_rs": True, "rs_lower_bound": 0}, "--rs-lower-bound", ConfigError),
])
def test_slime_mapping_bad_value_names_the_flag(values, flag, exc):
    with pytest.raises(exc, match=flag):
        C.from_slime_args(values)
    with pytest.raises(exc, match=flag):
        C.from_slime_args(argparse.Namespace(**values))


def test_slime_unknown_prefixed_flags_warn_with_a_suggestion():
    argv = ["--use-tis", "--tis-uper-bound", "3", "--mis-mode", "mask", "--rs-levl=token", "--lr", "1e-6",
            "--tis-upper", "5"]
    with pytest.warns(MoealignWarning) as record:
        cfg = C.from_slime_args(argv)
    messages = [str(w.message) for w in record if issubclass(w.category, MoealignWarning)]
    assert any("--tis-uper-bound" in m and "did you mean --tis-upper-bound" in m for m in messages)
    assert any("--mis-mode" in m for m in messages)
    assert any("--rs-levl" in m and "--rs-level" in m for m in messages)
    assert any("--tis-upper " in m or m.split(" is ")[0].endswith("--tis-upper") for m in messages)  # no abbrev
    assert not any("--lr" in m for m in messages)  # other trainer flags are not ours
    assert float(cfg.rollout_is_threshold) == 2.0  # nothing was silently taken from the misspellings


@pytest.mark.parametrize("make", [dict, lambda d: argparse.Namespace(**d)])
def test_slime_unknown_prefixed_keys_warn(make):
    with pytest.warns(MoealignWarning, match="--tis-uper-bound"):
        C.from_slime_args(make({"use_tis": True, "tis_uper_bound": 3.0}))


def test_slime_known_flags_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.from_slime_args(["--use-tis", "--tis-mode", "clip", "--tis-upper-bound", "2", "--use-rs",
                           "--rs-level", "geometric", "--lr", "1e-6", "--use-rollout-logprobs"])


# ---------------------------------------------------------------------------- devices, dtypes, values

def _meta(*tensors):
    return [t.to("meta") for t in tensors]


def test_meta_device_inputs_are_refused_by_name():
    old, rollout, mask = _batch()
    with pytest.raises(InputError, match="old_log_prob is on the meta device"):
        F(*_meta(old, rollout, mask), rollout_is="token", rollout_is_threshold=2.0)
    with pytest.raises(InputError, match="log_ratio is on the meta device"):
        compute_rollout_correction_weights(*_meta(old, mask))
    with pytest.raises(InputError, match="on the meta device"):
        compute_offpolicy_metrics(*_meta(old, rollout, mask))
    with pytest.raises(InputError, match="rollout_log_prob on meta"):
        F(old, *_meta(rollout), mask)


def test_losses_refuse_meta_and_mixed_devices():
    old, rollout, mask = _batch()
    adv = torch.ones_like(old)
    with pytest.raises(InputError, match="meta device"):
        ppo_clip_loss(*_meta(old, rollout, adv, mask))
    with pytest.raises(InputError, match="meta device"):
        agg_loss(*_meta(old, mask))
    with pytest.raises(InputError, match="meta device"):
        deepseek_offpolicy_sequence_mask(*_meta(old, rollout, adv, mask), 0.1)
    with pytest.raises(InputError, match="old_log_prob on meta"):
        ppo_clip_loss(old, *_meta(rollout), adv, mask)


def test_losses_refuse_wrong_types_and_dtypes():
    old, rollout, mask = _batch()
    adv = torch.ones_like(old)
    with pytest.raises(InputTypeError, match="log_prob must be a torch.Tensor"):
        ppo_clip_loss(old.tolist(), rollout, adv, mask)
    with pytest.raises(InputTypeError, match="loss_mask must be a torch.Tensor"):
        agg_loss(old, mask.tolist())
    with pytest.raises(InputTypeError, match="log_prob must be a floating-point tensor"):
        ppo_clip_loss(old.long(), rollout, adv, mask)
    with pytest.raises(InputTypeError, match="advantages must be a floating-point tensor"):
        reinforce_loss(old, adv.long(), mask)
    with pytest.raises(InputTypeError, match="loss_scale_factor"):
        agg_loss(old, mask, "seq-mean-token-sum-norm", loss_scale_factor="2")
    with pytest.raises(InputError, match="loss_scale_factor"):
        agg_loss(old, mask, "seq-mean-token-sum-norm", loss_scale_factor=float("nan"))


@pytest.mark.parametrize("bad_mask", [2, -1, 0.5])
def test_losses_refuse_non_binary_masks(bad_mask):
    old, rollout, mask = _batch()
    mask = mask.clone()
    mask[0, 0] = bad_mask
    adv = torch.ones_like(old)
    with pytest.raises(InputError, match="response_mask must hold only 0 and 1"):
        ppo_clip_loss(old, rollout, adv, mask)
    with pytest.raises(InputError, match="loss_mask must hold only 0 and 1"):
        agg_loss(old, mask.long() if bad_mask != 0.5 else mask)
    with pytest.raises(InputError, match="response_mask must hold only 0 and 1"):
        bypass_policy_loss(old, rollout, adv, mask, C.bypass_ppo_clip())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_losses_refuse_non_finite_values_at_valid_positions_only(bad):
    old, rollout, mask = _batch(dtype=torch.float64)
    adv = torch.ones_like(old)
    bad_adv = adv.clone()
    bad_adv[0, 1] = bad
    with pytest.raises(InputError, match="advantages has non-finite"):
        ppo_clip_loss(old, rollout, bad_adv, mask)
    with pytest.raises(InputError, match="advantages has non-finite"):
        reinforce_loss(old, bad_adv, mask)
    with pytest.raises(InputError, match="advantages has non-finite"):
        deepseek_offpolicy_sequence_mask(old, rollout, bad_adv, mask, 0.1)
    with pytest.raises(InputError, match="advantages has non-finite"):
        deepseek_offpolicy_sequence_mask(old, rollout, bad_adv[:, 1], mask, 0.1)
    with pytest.raises(InputError, match="rollout_is_weights has non-finite"):
        ppo_clip_loss(old, rollout, adv, mask, rollout_is_weights=bad_adv)
    with pytest.raises(InputError, match="loss_mat has non-finite"):
        agg_loss(bad_adv, mask)
    # the same value in padding (row 1, tokens 3..) is ignored
    pad_adv = adv.clone()
    pad_adv[1, 4] = bad
    loss, _ = ppo_clip_loss(old, rollout, pad_adv, mask)
    assert torch.isfinite(loss)


def test_losses_accept_an_empty_mask_and_batch():
    old, rollout, mask = _batch()
    loss, _ = ppo_clip_loss(old, rollout, torch.ones_like(old), torch.zeros_like(mask))
    assert float(loss) == 0.0
    empty = torch.zeros(0, 5)
    assert float(agg_loss(empty, empty)) == 0.0


def test_every_error_here_is_a_moealign_error():
    old, rollout, mask = _batch()
    for call in (lambda: F(*_meta(old, rollout, mask)), lambda: C.from_slime_args(["--tis-mode", "x"]),
                 lambda: F(old.half(), rollout.half(), mask, rollout_is="token", rollout_is_threshold=1e6)):
        with pytest.raises(MoealignError):
            call()
