"""The decision-tree diagnosis (moealign.mismatch.diagnose): classes, preset choice, fault precedence, ranking."""

from __future__ import annotations

import math
import random

import pytest

from moealign.correction import RolloutCorrectionConfig
from moealign.correction.config import PRESETS
from moealign.mismatch.attribution import shapley_values
from moealign.mismatch.diagnose import FIX_ORDER, ICEPOP_HIGH, choose_preset, classify, diagnose
from moealign.mismatch.levers import CAUSES

QUIET = {"pearson_prob": 0.999, "ppl_ratio": 1.0, "kl_k1": 0.001, "kl_k3": 0.001, "chi2_token": 0.01, "ess": 0.99,
         "max_abs_logp_diff": 0.1, "mean_abs_logp_diff": 0.01}
SEEN_PRESETS: set = set()


def m(**kw):
    out = dict(QUIET)
    out.update(kw)
    return out


def preset(metrics):
    name, why = choose_preset(metrics)
    assert isinstance(why, str) and why
    if name is not None:
        SEEN_PRESETS.add(name)
    return name


# --------------------------------------------------------------------------------------------- classify
@pytest.mark.parametrize("metrics,cls", [
    (m(), "none"),
    (m(max_abs_logp_diff=0.0), "aligned"),
    (m(pearson_prob=0.949), "A"),
    (m(pearson_prob=0.951), "mild"),
    (m(pearson_prob=0.989), "mild"),
    (m(pearson_prob=0.991), "none"),
    (m(kl_k3=0.051), "A"),
    (m(kl_k1=-0.051), "A"),            # |k1|
    (m(kl_k3=0.049), "mild"),
    (m(kl_k3=0.021), "mild"),
    (m(kl_k3=0.019), "none"),
    (m(ppl_ratio=1.051), "A"),
    (m(ppl_ratio=0.949), "A"),
    (m(ppl_ratio=1.049), "mild"),
    (m(ppl_ratio=1.011), "mild"),
    (m(ppl_ratio=1.009), "none"),
    (m(chi2_token=1.01), "D"),
    (m(chi2_token=0.99), "C"),
    (m(chi2_token=0.31), "C"),
    (m(chi2_token=0.29), "none"),
    (m(chi2_token=0.5, ess=0.49), "D"),
    (m(chi2_token=0.5, ess=0.51), "C"),
    (m(chi2_token=0.01, ess=0.49), "D"),
    (m(pearson_prob=0.9, chi2_token=5.0), "A"),      # Cause A is checked before D
])
def test_classify_thresholds(metrics, cls):
    got, why = classify(metrics)
    assert got == cls, why
    assert isinstance(why, str) and why


def test_classify_missing_pearson_is_not_cause_a():
    metrics = m()
    del metrics["pearson_prob"]
    assert classify(metrics)[0] == "none"


# --------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("metrics,name", [
    (m(max_abs_logp_diff=0.0), "disabled"),
    (m(), "disabled"),
    (m(pearson_prob=0.9), None),
    (m(kl_k3=0.06), None),
    (m(chi2_token=1.5), "decoupled_token_icepop"),
    (m(ess=0.3), "decoupled_token_icepop"),
    (m(chi2_token=0.5), "decoupled_geo_rs"),
    (m(chi2_token=0.5, geo_rs_masked_fraction=0.10), "decoupled_geo_rs_token_tis"),
    (m(chi2_token=0.5, geo_rs_masked_fraction=0.25), "decoupled_geo_rs_token_tis"),
    (m(chi2_token=0.5, geo_rs_masked_fraction=0.099), "decoupled_geo_rs"),
    (m(chi2_token=0.5, geo_rs_masked_fraction=0.251), "decoupled_geo_rs"),
    (m(geo_rs_masked_fraction=0.15), "decoupled_geo_rs_token_tis"),
    (m(max_abs_logp_diff=math.log(ICEPOP_HIGH) + 1e-3), "decoupled_token_icepop"),
    (m(max_abs_logp_diff=math.log(ICEPOP_HIGH) - 1e-3), "disabled"),
    (m(pearson_prob=0.97, max_abs_logp_diff=2.0), "decoupled_token_icepop"),     # mild + spike
    (m(pearson_prob=0.97), "disabled"),
])
def test_choose_preset(metrics, name):
    assert preset(metrics) == name


def test_icepop_limit_past_25_percent():
    _, why_past = choose_preset(m(chi2_token=2.0, icepop_masked_fraction=0.26))
    _, why_under = choose_preset(m(chi2_token=2.0, icepop_masked_fraction=0.24))
    assert "limit" in why_past and "limit" not in why_under


def test_cause_a_names_systems_fix():
    name, why = choose_preset(m(pearson_prob=0.5))
    assert name is None and "systems fix" in why


def test_every_returned_preset_exists():
    # run the preset table again so this test does not depend on test order
    for metrics in (m(max_abs_logp_diff=0.0), m(), m(chi2_token=1.5), m(chi2_token=0.5),
                    m(chi2_token=0.5, geo_rs_masked_fraction=0.2), m(max_abs_logp_diff=3.0),
                    m(chi2_token=3.0), m(ess=0.1, icepop_masked_fraction=0.5)):
        preset(metrics)
    assert {"disabled", "decoupled_token_icepop", "decoupled_geo_rs", "decoupled_geo_rs_token_tis"} <= SEEN_PRESETS
    for name in SEEN_PRESETS:
        assert name in PRESETS, name               # a current name, not a deprecated one
        cfg = RolloutCorrectionConfig.preset(name)
        assert cfg is not None
    with pytest.raises(Exception):                 # negative control: lookup does refuse unknown names
        RolloutCorrectionConfig.preset("decoupled_no_such_preset")


# --------------------------------------------------------------------------------------------- diagnose
def _attr(levers: dict, gap: float, residual: float | None = None) -> dict:
    residual = gap - sum(levers.values()) if residual is None else residual
    return {"mean_abs_logp_diff": {"gap": gap, "residual": residual, "levers": dict(levers)}}


BASE = m(pearson_prob=0.9, kl_k3=0.2, mean_abs_logp_diff=0.3, max_abs_logp_diff=4.0)
FINAL = m(mean_abs_logp_diff=0.01)


def test_weights_fault_first_even_with_larger_share():
    rows = [{"field": "weights.layers.2", "status": "gap", "message": "digests differ"},
            {"field": "precision.dtype", "status": "gap", "message": "bfloat16 vs float32"}]
    out = diagnose(runs={"baseline": BASE, "all levers": FINAL},
                   attribution=_attr({"precision": 0.25, "batch_invariant": 0.01}, 0.3), contract_rows=rows)
    assert out["first_cause"] == CAUSES["weights"] == "weights that differ"
    assert out["first_lever"] == "weights"
    assert out["ranked"][0]["lever"] == "precision"          # the share ranking is still there
    # negative control: without the weights row, the largest share wins
    out2 = diagnose(runs={"baseline": BASE, "all levers": FINAL},
                    attribution=_attr({"precision": 0.25, "batch_invariant": 0.01}, 0.3), contract_rows=rows[1:])
    assert out2["first_lever"] == "precision"


def test_weights_ok_row_is_not_a_fault():
    rows = [{"field": "weights", "status": "ok", "message": "same digest"}]
    out = diagnose(runs={"baseline": BASE, "all levers": FINAL}, attribution=_attr({"precision": 0.2}, 0.3),
                   contract_rows=rows)
    assert out["first_lever"] == "precision"


def test_replay_with_flips_named_first():
    runs = {"baseline": BASE, "all levers": FINAL, "routing_replay": m(router_flip_rate=0.02)}
    out = diagnose(runs=runs, attribution=_attr({"precision": 0.25, "routing_replay": 0.02}, 0.3))
    assert out["first_cause"] == "routing replay switched off"
    assert out["first_lever"] == "routing_replay"
    assert "routing replay switched off" in out["headline"]
    runs["routing_replay"] = m(router_flip_rate=0.0)                     # negative control
    assert diagnose(runs=runs, attribution=_attr({"precision": 0.25, "routing_replay": 0.02}, 0.3))[
        "first_lever"] == "precision"


def test_weights_before_replay():
    runs = {"baseline": BASE, "all levers": FINAL, "routing_replay": m(router_flip_rate=0.5)}
    rows = [{"field": "weights", "status": "gap", "message": "digests differ"}]
    assert diagnose(runs=runs, attribution=None, contract_rows=rows)["first_lever"] == "weights"


@pytest.mark.parametrize("field,lever,cause", [
    ("precision.lm_head", "precision:lm_head", "precision: LM head (one-sided fp32)"),
    ("precision.router", "precision:router", "precision: router (one-sided fp32)"),
    ("precision.attention", "precision", "precision (one-sided fp32)"),
])
def test_one_sided_region_named(field, lever, cause):
    rows = [{"field": field, "status": "gap", "message": "fp32 on one side only (one-sided)"}]
    out = diagnose(runs={"baseline": BASE, "all levers": FINAL},
                   attribution=_attr({"batch_invariant": 0.2, "precision": 0.05}, 0.3), contract_rows=rows)
    assert out["first_lever"] == lever
    assert out["first_cause"] == cause
    # negative control: the same row without "one-sided" is a finding, not a fault
    rows2 = [{"field": field, "status": "gap", "message": "fp32 vs bf16"}]
    out2 = diagnose(runs={"baseline": BASE, "all levers": FINAL},
                    attribution=_attr({"batch_invariant": 0.2, "precision": 0.05}, 0.3), contract_rows=rows2)
    assert out2["first_lever"] == "batch_invariant"
    assert any(f["field"] == field and f["lever"] is None for f in out2["findings"])


def test_tp_row_is_a_fault():
    rows = [{"field": "parallel.tp_size", "status": "gap", "message": "TP 1 vs 2 with stock reductions"}]
    out = diagnose(runs={"baseline": BASE, "all levers": FINAL}, attribution=_attr({"precision": 0.2}, 0.3),
                   contract_rows=rows)
    assert out["first_lever"] == "tree_reductions"


def test_largest_share_wins_without_fault():
    levers = {"sampling_mask": 0.01, "precision": 0.05, "routing_replay": 0.15, "batch_invariant": 0.04}
    out = diagnose(runs={"baseline": BASE, "all levers": FINAL}, attribution=_attr(levers, 0.3))
    assert out["first_lever"] == "routing_replay"
    assert out["first_cause"] == CAUSES["routing_replay"]
    assert [r["lever"] for r in out["ranked"]] == ["routing_replay", "precision", "batch_invariant", "sampling_mask"]


@pytest.mark.parametrize("seed", range(5))
def test_ties_broken_in_fix_order(seed):
    names = ["sampling_mask", "routing_replay", "batch_invariant", "precision"]
    random.Random(seed).shuffle(names)
    levers = {n: 0.05 for n in names}
    out = diagnose(runs={"baseline": BASE, "all levers": FINAL}, attribution=_attr(levers, 0.3))
    got = [r["lever"] for r in out["ranked"]]
    assert got == sorted(names, key=FIX_ORDER.index)
    assert out["first_lever"] == "precision"


def test_plain_dtype_gap_is_finding_not_first_cause():
    rows = [{"field": "precision.dtype", "status": "gap", "message": "bfloat16 vs float32"},
            {"field": "attention.backend", "status": "info", "message": "sdpa vs flash"},
            {"field": "vocab", "status": "ok", "message": "same"}]
    out = diagnose(runs={"baseline": BASE, "all levers": FINAL},
                   attribution=_attr({"routing_replay": 0.2, "precision": 0.05}, 0.3), contract_rows=rows)
    assert out["first_lever"] == "routing_replay"
    fields = {f["field"]: f for f in out["findings"]}
    assert set(fields) == {"precision.dtype", "attention.backend"}
    assert fields["precision.dtype"]["severity"] == "gap" and fields["precision.dtype"]["lever"] is None
    assert fields["attention.backend"]["severity"] == "info"


def test_all_zero_gap_is_aligned_and_disabled():
    zero = m(max_abs_logp_diff=0.0, mean_abs_logp_diff=0.0, kl_k1=0.0, kl_k3=0.0, chi2_token=0.0, ess=1.0,
             pearson_prob=1.0)
    out = diagnose(runs={"baseline": zero, "all levers": zero},
                   attribution=_attr({"precision": 0.0, "routing_replay": 0.0}, 0.0, 0.0))
    assert out["symptom"] == "aligned" and out["preset"] == "disabled"
    assert out["first_cause"] is None and out["first_lever"] is None
    assert "bitwise" in out["headline"]
    # negative control: a non-zero gap is not aligned
    assert diagnose(runs={"baseline": BASE, "all levers": FINAL}, attribution=None)["symptom"] != "aligned"


@pytest.mark.parametrize("seed", range(4))
def test_fractions_and_residual_sum_to_one(seed):
    rng = random.Random(seed)
    players = ["precision", "routing_replay", "batch_invariant", "sampling_mask"][: 2 + seed % 3]
    table = {}

    def value(s):
        if s not in table:
            table[s] = 0.0 if len(s) == len(players) and seed % 2 else rng.uniform(0.01, 0.5)
        return table[s]

    shares = shapley_values(players, value)
    gap, residual = value(frozenset()), value(frozenset(players))
    out = diagnose(runs={"baseline": BASE, "all levers": FINAL}, attribution=_attr(shares, gap, residual))
    total = sum(r["fraction"] for r in out["ranked"]) + residual / gap
    assert abs(total - 1.0) <= 1e-9
    assert len(out["ranked"]) == len(players)


def test_text_and_notes():
    out = diagnose(runs={"baseline": BASE, "all levers": FINAL}, attribution=_attr({"precision": 0.2}, 0.3),
                   notes=["rescoring off"])
    assert out["text"][0].startswith("Symptom")
    assert out["text"][-1] == "Note: rescoring off."
    assert out["residual_class"] == classify(FINAL)[0]
    assert out["preset"] == choose_preset(FINAL)[0]
