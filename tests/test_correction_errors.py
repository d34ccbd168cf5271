"""Every bad input to the rollout-correction entry point fails loudly, with a message naming the problem.

Configuration errors are raised before any tensor is touched (``thresholds.py``); tensor errors after one
validation pass (``pipeline.py``): shapes, a 0/1 mask, at least one valid token, finite log-probs at
valid positions (NaN / Inf at padding is ignored and never reaches a weight or a metric).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from moealign.correction.pipeline import (
    compute_rollout_correction_and_rejection_mask as correct,
)
from moealign.correction.pipeline import (
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)


def batch(dtype=torch.float32):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -4.0]], dtype=dtype)
    rollout = old - torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.05, -0.1]], dtype=dtype)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    return old, rollout, mask


def call(**kw):
    return correct(*batch(), **kw)


# ----------------------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize("kw", [
    dict(rollout_is="token", rollout_is_threshold=True),
    dict(rollout_is="sequence", rollout_is_threshold=False),
    dict(rollout_rs="token_k1", rollout_rs_threshold=True),
    dict(rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold=[2.0, True]),
    dict(rollout_rs="token", rollout_rs_threshold=True),  # legacy spelling
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_mode="clip", rollout_is_threshold_lower=True),
])
def test_bool_threshold_is_a_type_error(kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match="bool"):
            call(**kw)


def test_bool_veto_threshold_is_a_type_error():
    with pytest.raises(TypeError, match="bool"):
        call(rollout_token_veto_threshold=True)


@pytest.mark.parametrize("kw, fragment", [
    (dict(rollout_is="token", rollout_is_threshold=0), "must be a finite number > 0"),
    (dict(rollout_is="token", rollout_is_threshold=-2.0), "must be a finite number > 0"),
    (dict(rollout_is="token", rollout_is_threshold="0"), "must be a finite number > 0"),
    (dict(rollout_is="token", rollout_is_threshold=math.inf), "must be a finite number > 0"),
    (dict(rollout_is="token", rollout_is_threshold=math.nan), "must be a finite number > 0"),
    (dict(rollout_is="token", rollout_is_threshold="0_2.0"), "lower bound must be a finite number > 0"),
    (dict(rollout_is="token", rollout_is_threshold="-1_2.0"), "lower bound must be a finite number > 0"),
    (dict(rollout_is="token", rollout_is_threshold="0.5_0"), "upper bound must be a finite number > 0"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold=0.0), "must be a finite number > 0"),
    (dict(rollout_rs="seq_max_k3", rollout_rs_threshold=-0.1), "must be a finite number > 0"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="0_2.0"), "lower bound must be a finite number > 0"),
    (dict(rollout_rs="seq_mean_k1", rollout_rs_threshold=0), "must be a finite number > 0"),
    (dict(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="2.0,-1"), "seq_mean_k3 must be a finite number > 0"),
])
def test_non_positive_threshold(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        call(**kw)


def test_non_positive_veto_and_lower_thresholds():
    with pytest.raises(ValueError, match="rollout_token_veto_threshold must be a finite number > 0"):
        call(rollout_token_veto_threshold=0.0)
    with pytest.raises(ValueError, match="rollout_is_threshold_lower must be a finite number > 0"):
        call(rollout_is="token", rollout_is_threshold=2.0, rollout_is_mode="clip", rollout_is_threshold_lower=-0.5)


@pytest.mark.parametrize("kw, fragment", [
    (dict(rollout_is="token", rollout_is_threshold="5.0_0.5"), r"lower bound 5\.0 > upper bound 0\.5"),
    (dict(rollout_is="sequence", rollout_is_threshold=" 2_1 "), r"lower bound 2\.0 > upper bound 1\.0"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="2.0_0.5"), r"lower bound 2\.0 > upper bound 0\.5"),
    (dict(rollout_rs="seq_sum_k1,seq_mean_k1", rollout_rs_threshold="0.5_2.0,1.1_1.0"),
     r"seq_mean_k1 '1\.1_1\.0': lower bound 1\.1 > upper bound 1\.0"),
    (dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_mode="clip", rollout_is_threshold_lower=3.0),
     r"IS lower bound 3\.0 > upper bound 2\.0"),
])
def test_lower_greater_than_upper(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        call(**kw)


def test_legacy_lower_greater_than_upper():
    with pytest.raises(ValueError, match=r"rollout_rs_threshold_lower 3\.0 > rollout_rs_threshold 2\.0"):
        call(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0)
    # a single legacy value u < 1 means the band [1/u, u], which is empty
    with pytest.raises(ValueError, match=r"rollout_rs_threshold_lower 2\.0 > rollout_rs_threshold 0\.5"):
        call(rollout_rs="sequence", rollout_rs_threshold=0.5)


@pytest.mark.parametrize("level", ["seq", "Token", "", "tokens", "geo"])
def test_unknown_is_level(level):
    with pytest.raises(ValueError, match="unknown rollout_is level"):
        call(rollout_is=level, rollout_is_threshold=2.0)


def test_unknown_is_mode():
    with pytest.raises(ValueError, match="unknown rollout_is mode 'band'"):
        call(rollout_is="token", rollout_is_threshold=2.0, rollout_is_mode="band")


@pytest.mark.parametrize("mode", ["seq_max_k1", "token_k4", "seq_k1", "tokens", "token_k1,foo", "TOKEN_K1"])
def test_unknown_rs_mode(mode):
    with pytest.raises(ValueError, match="unknown rollout_rs mode"):
        call(rollout_rs=mode, rollout_rs_threshold=2.0)


@pytest.mark.parametrize("mode", ["", " , ", ","])
def test_rs_mode_naming_nothing(mode):
    with pytest.raises(ValueError, match="names no mode"):
        call(rollout_rs=mode, rollout_rs_threshold=2.0)


def test_rs_mode_not_a_string():
    with pytest.raises(TypeError, match="rollout_rs must be a string"):
        call(rollout_rs=["token_k1"], rollout_rs_threshold=2.0)


def test_legacy_name_inside_a_chain():
    with pytest.raises(ValueError, match="earlier spelling"):
        call(rollout_rs="token,seq_max_k2", rollout_rs_threshold="2.0,0.1")


@pytest.mark.parametrize("mode", ["token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3",
                                  "seq_max_k2", "seq_max_k3"])
def test_band_for_k2_k3_mode(mode):
    with pytest.raises(ValueError, match=f"{mode} takes an upper bound only"):
        call(rollout_rs=mode, rollout_rs_threshold="0.1_0.5")


def test_band_for_k2_mode_inside_a_chain():
    with pytest.raises(ValueError, match="seq_mean_k3 takes an upper bound only, got the band '0.1_0.2'"):
        call(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.5_2.0,0.1_0.2")


@pytest.mark.parametrize("modes, threshold, fragment", [
    ("token_k1,seq_max_k2", "2.0,0.1,0.3", "has 3 entries for 2 modes"),
    ("token_k1,seq_max_k2", [2.0, 0.1, 0.3], "has 3 entries for 2 modes"),
    ("token_k1,seq_max_k2,seq_mean_k3", "2.0,0.1", "has 2 entries for 3 modes"),
    ("token_k1,token_k1", "2.0,3.0", "has 2 entries for 1 modes"),  # duplicates are dropped first
])
def test_wrong_number_of_thresholds_for_a_chain(modes, threshold, fragment):
    with pytest.raises(ValueError, match=fragment):
        call(rollout_rs=modes, rollout_rs_threshold=threshold)


@pytest.mark.parametrize("threshold", ["", " , ", []])
def test_empty_rs_threshold(threshold):
    with pytest.raises(ValueError, match="holds no threshold"):
        call(rollout_rs="token_k1", rollout_rs_threshold=threshold)


@pytest.mark.parametrize("mode", ["token_k1", "seq_sum_k1", "seq_mean_k1"])
@pytest.mark.parametrize("u", [0.5, "0.999"])
def test_single_k1_value_below_one(mode, u):
    with pytest.raises(ValueError, match="needs u >= 1"):
        call(rollout_rs=mode, rollout_rs_threshold=u)


@pytest.mark.parametrize("kw, exc, fragment", [
    (dict(rollout_is="token", rollout_is_threshold=""), ValueError, "empty string"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), ValueError, "is not a number"),
    (dict(rollout_is="token", rollout_is_threshold="0.5_x"), ValueError, "is not a number"),
    (dict(rollout_is="token", rollout_is_threshold=[2.0]), TypeError, "must be a number or a 'lower_upper' string"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="abc"), ValueError, "is not a number"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold={"a": 1}), TypeError, "rollout_rs_threshold must be"),
])
def test_unparseable_threshold(kw, exc, fragment):
    with pytest.raises(exc, match=fragment):
        call(**kw)


@pytest.mark.parametrize("kw, text", [
    (dict(rollout_is="token", rollout_is_threshold="0.5_5_0"), "5_0"),
    (dict(rollout_is="token", rollout_is_threshold="0.5_5.0_7"), "5.0_7"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_1_0"), "1_0"),
])
def test_threshold_with_two_underscores(kw, text):
    """'l_u' has one underscore. Splitting at the first one leaves '5_0' / '1_0', which Python's float()
    reads as 50 / 10 (PEP 515 digit separators): a typo must not silently become the band [0.5, 50].
    The message names the offending text (the whole value or its part after the first '_')."""
    with pytest.raises(ValueError, match=text.replace(".", r"\.")):
        call(**kw)


def test_is_band_with_truncate_mode():
    with pytest.raises(ValueError, match="mode 'truncate' has no lower bound"):
        call(rollout_is="token", rollout_is_threshold="0.5_5.0", rollout_is_mode="truncate")


def test_is_band_contradicted_by_explicit_lower():
    with pytest.raises(ValueError, match="contradicts"):
        call(rollout_is="token", rollout_is_threshold="0.5_5.0", rollout_is_threshold_lower=0.3)


def test_is_options_without_is():
    with pytest.raises(ValueError, match="IS is off"):
        call(rollout_is_mode="clip")
    with pytest.raises(ValueError, match="IS is off"):
        call(rollout_is_threshold_lower=0.5)


def test_batch_normalize_must_be_bool():
    with pytest.raises(TypeError, match="rollout_is_batch_normalize must be a bool"):
        call(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize="yes")


def test_unknown_extended_keyword():
    # real keyword-only parameters: Python itself rejects a misspelt one, naming it
    with pytest.raises(TypeError, match="unexpected keyword argument 'rollout_is_thresh'"):
        call(rollout_is="token", rollout_is_thresh=2.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rollout_rs_mode'"):
        call(rollout_rs_mode="token_k1")


def test_extensions_are_keyword_only_with_verl_names():
    import inspect

    params = inspect.signature(correct).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword_only = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert positional == ["old_log_prob", "rollout_log_prob", "response_mask", "rollout_is", "rollout_is_threshold",
                          "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold"]
    assert keyword_only == {"rollout_is_mode": None, "rollout_is_threshold_lower": None,
                            "rollout_rs_threshold_lower": None, "rollout_token_veto_threshold": None,
                            "process_group": None, "agreement_metrics": False, "fused": None}
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    with pytest.raises(TypeError, match="positional argument"):   # the extensions are not positional
        correct(*([None] * 8), "clip")


@pytest.mark.parametrize("mode", ["token_k1", "seq_max_k2", "token", "geometric"])
def test_rs_without_threshold(mode):
    with pytest.raises(ValueError, match="rollout_rs_threshold is required"):
        call(rollout_rs=mode)


@pytest.mark.parametrize("mode", ["token_k1", "seq_mean_k1", "seq_max_k2", None])
def test_rs_threshold_lower_with_new_style_mode(mode):
    with pytest.raises(ValueError, match="rollout_rs_threshold_lower belongs to the earlier"):
        call(rollout_rs=mode, rollout_rs_threshold="0.5_2.0", rollout_rs_threshold_lower=0.5)


def test_legacy_band_and_lower_together():
    with pytest.raises(ValueError, match="not both"):
        call(rollout_rs="token", rollout_rs_threshold="0.5_2.0", rollout_rs_threshold_lower=0.5)


def test_configuration_errors_come_before_tensor_checks():
    """A bad threshold is reported even when the tensors are unusable too."""
    old = torch.full((2, 3), float("nan"))
    with pytest.raises(ValueError, match="needs u >= 1"):
        correct(old, old, torch.zeros(2, 3), rollout_rs="token_k1", rollout_rs_threshold=0.5)


# -------------------------------------------------------------------------------------------- tensors


def test_shape_mismatch_old_vs_rollout():
    old, rollout, mask = batch()
    with pytest.raises(ValueError, match=r"rollout_log_prob shape \(2, 4\) does not match old_log_prob shape \(2, 3\)"):
        correct(old, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="rollout_log_prob shape"):
        correct(old, rollout.T.contiguous(), mask)


def test_shape_mismatch_mask_vs_log_probs():
    old, rollout, mask = batch()
    with pytest.raises(ValueError, match=r"response_mask shape \(2, 4\) does not match log-prob shape \(2, 3\)"):
        correct(old, rollout, torch.ones(2, 4))
    with pytest.raises(ValueError, match="response_mask shape"):
        correct(old, rollout, mask[0])


@pytest.mark.parametrize("shape", [(3,), (1, 2, 3), ()])
def test_non_2d_input(shape):
    t = torch.zeros(shape)
    with pytest.raises(ValueError, match="must be 2-D"):
        correct(t, t.clone(), torch.ones(shape), rollout_is="token", rollout_is_threshold=2.0)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool, torch.int64])
def test_all_padding_batch(mask_dtype):
    old, rollout, _ = batch()
    with pytest.raises(ValueError, match=r"no valid token \(all padding\)"):
        correct(old, rollout, torch.zeros(2, 3).to(mask_dtype), rollout_is="token", rollout_is_threshold=2.0)


@pytest.mark.parametrize("shape", [(0, 4), (0, 0), (3, 0)])
def test_empty_batch(shape):
    t = torch.zeros(shape)
    with pytest.raises(ValueError, match=r"no valid token \(empty batch"):
        correct(t, t.clone(), torch.ones(shape), rollout_rs="token_k1", rollout_rs_threshold=2.0)


@pytest.mark.parametrize("name", ["old_log_prob", "rollout_log_prob"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_non_finite_at_valid_positions(name, bad, dtype):
    old, rollout, mask = batch(dtype)
    target = old if name == "old_log_prob" else rollout
    target[1, 2] = bad  # valid position
    target[0, 2] = bad  # padding: not counted
    with pytest.raises(ValueError, match=rf"{name} has .*non-finite"):
        correct(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    with pytest.raises(ValueError, match=name):  # also when only metrics are computed
        correct(old, rollout, mask)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_non_finite_at_padding_is_ignored(bad, level):
    old, rollout, mask = batch()
    kw = dict(rollout_is=level, rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
              rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.5_2.0,0.1", agreement_metrics=True)
    w_clean, m_clean, f_clean = correct(old, rollout, mask, **kw)
    old_bad, rollout_bad = old.clone(), rollout.clone()
    old_bad[0, 2] = bad
    rollout_bad[0, 2] = -bad if bad == bad else bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w, m, f = correct(old_bad, rollout_bad, mask, **kw)
    assert torch.isfinite(w).all()
    assert w[0, 2] == 0
    assert torch.equal(w, w_clean)
    assert torch.equal(m, m_clean)
    floats = f.to_floats()
    assert all(math.isfinite(v) for v in floats.values())
    assert floats == f_clean.to_floats()


@pytest.mark.parametrize("mask", [
    torch.tensor([[1, 2, 0], [1, 1, 1]]),
    torch.tensor([[1, -1, 0], [1, 1, 1]]),
    torch.tensor([[1, 3, -1], [1, 1, 1]], dtype=torch.int32),
    torch.tensor([[1.0, 0.5, 0.0], [1.0, 1.0, 1.0]]),
    torch.tensor([[0.5, 1.5, 0.0], [1.0, 1.0, 1.0]]),
    torch.tensor([[1.0, float("nan"), 0.0], [1.0, 1.0, 1.0]]),
    torch.tensor([[1.0, float("inf"), 0.0], [1.0, 1.0, 1.0]]),
    torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 2.0]], dtype=torch.float64),
    # entries 1 +- 1e-4: not a 0/1 mask either
    torch.tensor([[1.0001, 0.9999, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float32),
], ids=["int2", "int-1", "int32", "half", "0.5+1.5", "nan", "inf", "f64-2", "1+-1e-4"])
def test_mask_values_other_than_zero_and_one(mask):
    old, rollout, _ = batch()
    with pytest.raises(ValueError, match="response_mask must hold only 0 and 1"):
        correct(old, rollout, mask, rollout_rs="token_k1", rollout_rs_threshold=2.0)


def test_finite_extreme_log_probs_are_not_reported_as_non_finite():
    """-2e38 is a finite float32 log-prob (e.g. a logit filled with a large negative value); two of them
    in a row must not be reported as NaN / Inf."""
    old = torch.tensor([[-2e38, -2e38, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float32)
    rollout = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float32)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.isfinite(old).all()
    w, _, _ = correct(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    assert torch.isfinite(w).all()


def test_non_tensor_and_non_float_inputs():
    old, rollout, mask = batch()
    with pytest.raises(TypeError, match="old_log_prob must be a torch.Tensor"):
        correct(old.tolist(), rollout, mask)
    with pytest.raises(TypeError, match="response_mask must be a torch.Tensor"):
        correct(old, rollout, None)
    with pytest.raises(TypeError, match="rollout_log_prob must be a floating-point tensor"):
        correct(old, rollout.long(), mask)
    with pytest.raises(TypeError, match="response_mask must be bool, integer or floating point"):
        correct(old, rollout, mask.to(torch.complex64))


def test_wrappers_name_their_own_tensor():
    """The docstring promises a ValueError naming the tensor; for the log-ratio wrappers the caller's
    tensor is ``log_ratio``."""
    log_ratio = torch.tensor([[0.1, float("nan")], [0.0, 0.2]])
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="log_ratio"):
        compute_rollout_correction_weights(log_ratio, mask, rollout_is="token", rollout_is_threshold=2.0)
    with pytest.raises(ValueError, match="log_ratio"):
        compute_rollout_rejection_mask(log_ratio, mask, rollout_rs="token_k1", rollout_rs_threshold=2.0)


def test_error_leaves_inputs_untouched():
    old, rollout, mask = batch()
    old[1, 0] = float("nan")
    copies = (old.clone(), rollout.clone(), mask.clone())
    with pytest.raises(ValueError):
        correct(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    assert torch.equal(rollout, copies[1]) and torch.equal(mask, copies[2])
    assert torch.isnan(old[1, 0]) and torch.equal(old.nan_to_num(), copies[0].nan_to_num())


def test_truncate_mode_rejects_explicit_lower_bound():
    old, rollout, mask = batch()
    with pytest.raises(ValueError, match="mode 'truncate' has no lower bound"):
        correct(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0,
                rollout_is_mode="truncate", rollout_is_threshold_lower=0.5)
