"""Small hand-computed cases with exact expected values for every metric the entry point returns.

Expected numbers are computed here with plain Python (``math`` / ``statistics``) from hand-chosen
probabilities and ratios, following the docstrings of ``moealign/correction/*.py`` and the reference
notes (verl sections 1.1-1.7, 1.9; rollout-correction-math.md). Where the docstrings say the module
follows verl's docs rather than verl's code, the docs' semantics are tested:

* a k1 band ``l_u`` bounds the ratio r (not 1/r);
* ``log_ppl_diff`` = mean_i(log_ppl_rollout_i - log_ppl_training_i);
* ``ppl_ratio`` = exp(mean_i log(training_ppl_i / rollout_ppl_i));
* token-level ``rollout_is_max`` / ``_min`` are taken before truncation / banding;
* row means run over rows with at least one valid token (empty rows excluded).

No library internals are used to compute an expected value. Every batch is float64, with a padding
position holding log-probs whose ratio is e^30, so any leak of padding into a number shows.
"""

from __future__ import annotations

import math
import statistics
import warnings

import pytest
import torch

from moealign.correction.metrics import CorrectionMetrics
from moealign.errors import MoealignWarning
from moealign.correction.pipeline import (
    compute_agreement_metrics,
    compute_offpolicy_metrics,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from moealign.correction.pipeline import (
    compute_rollout_correction_and_rejection_mask as correct,
)

PREFIX = "rollout_corr/"
PAD_OLD, PAD_ROLL = 0.0, -30.0  # a padding ratio of e^30: visible in any number it leaks into
LN2, LN3 = math.log(2.0), math.log(3.0)

# ------------------------------------------------------------------------------------------ batches
# A row is the list of its valid tokens as (old_log_prob, rollout_log_prob); padding fills the rest.


def from_probs(rows):
    return [[(math.log(p), math.log(q)) for p, q in row] for row in rows]


def from_ratios(rows, q=0.2):
    """Tokens with rollout probability q and training probability q * r (so the ratio is r)."""
    return [[(math.log(q * r), math.log(q)) for r in row] for row in rows]


# BASE: ratios [2, 0.5, 2] and [3, 0.5], then an empty row.
BASE = from_probs([
    [(0.5, 0.25), (0.25, 0.5), (0.8, 0.4)],
    [(0.9, 0.3), (0.3, 0.6)],
    [],
])
BASE_RATIOS = [[2.0, 0.5, 2.0], [3.0, 0.5]]

# RSB: a batch for rejection sampling, given as ratios (row 2 is empty).
RSB_RATIOS = [[1.0, 2.0, 0.5], [1.1, 0.7, 1.2, 1.05], [], [4.0]]
RSB = from_ratios(RSB_RATIOS)


def tensors(rows, dtype=torch.float64, mask_dtype=torch.float32, width=None):
    width = width or max(len(r) for r in rows) + 1
    old = torch.tensor([[o for o, _ in r] + [PAD_OLD] * (width - len(r)) for r in rows], dtype=dtype)
    rollout = torch.tensor([[q for _, q in r] + [PAD_ROLL] * (width - len(r)) for r in rows], dtype=dtype)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]).to(mask_dtype)
    return old, rollout, mask


def run(rows, dtype=torch.float64, **kw):
    old, rollout, mask = tensors(rows, dtype)
    weights, modified, metrics = correct(old, rollout, mask, **kw)
    floats = metrics.to_floats()
    assert all(k.startswith(PREFIX) for k in floats)
    return weights, modified, metrics, {k[len(PREFIX):]: v for k, v in floats.items()}


def check(got, expected, rel=1e-9, abs_=1e-12):
    """Exactly the expected keys, every value equal."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    assert not missing and not extra, f"missing {missing}, unexpected {extra}"
    # the ESS is mean^2 / E[w^2]; verl's formula adds 1e-8 to the mean, a relative change of 2e-8 / mean
    loose = {"rollout_is_eff_sample_size": max(rel, 1e-6)}
    wrong = {k: (got[k], expected[k]) for k in expected
             if got[k] != pytest.approx(expected[k], rel=loose.get(k, rel), abs=abs_)}
    assert not wrong, f"(got, expected): {wrong}"


def padded(rows_of_values, width):
    return [list(r) + [0.0] * (width - len(r)) for r in rows_of_values]


# ------------------------------------------------------------------------------------ plain python


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


def pstd(xs):
    xs = list(xs)
    return statistics.pstdev(xs) if len(xs) > 1 else 0.0


def sstd(xs):
    xs = list(xs)
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def clamp(x, lo, hi):
    return max(lo, min(hi, x))


def clamp20(x):
    return clamp(x, -20.0, 20.0)


def offpolicy_expected(rows):
    """The 13 off-policy metrics of the docstring (rows with >= 1 valid token only)."""
    rows = [r for r in rows if r]
    a = [mean(o for o, _ in r) for r in rows]  # mean training log-prob per row
    b = [mean(q for _, q in r) for r in rows]  # mean rollout log-prob per row
    lr_rows = [[o - q for o, q in r] for r in rows]
    flat = [x for r in lr_rows for x in r]
    d = [(-bi) - (-ai) for ai, bi in zip(a, b)]  # log_ppl_rollout_i - log_ppl_training_i
    return {
        "training_ppl": mean(math.exp(-x) for x in a),
        "training_log_ppl": mean(-x for x in a),
        "rollout_ppl": mean(math.exp(-x) for x in b),
        "rollout_log_ppl": mean(-x for x in b),
        "kl": mean(-x for x in flat),
        "k3_kl": mean(math.exp(c) - 1.0 - c for c in (max(-20.0, min(20.0, x)) for x in flat)),
        "log_ppl_diff": mean(d),
        "log_ppl_abs_diff": mean(abs(x) for x in d),
        "log_ppl_diff_max": max(d),
        "log_ppl_diff_min": min(d),
        "ppl_ratio": math.exp(mean(math.log(math.exp(-ai) / math.exp(-bi)) for ai, bi in zip(a, b))),
        "chi2_token": mean(math.exp(clamp20(x)) ** 2 for x in flat) - 1.0,
        "chi2_seq": mean(math.exp(clamp20(sum(r))) ** 2 for r in lr_rows) - 1.0,
    }


def is_expected(level, w_rows, raw_rows, upper, lower, *, row_logs=None, mask_mode=False):
    """IS metrics. ``w_rows`` / ``raw_rows``: per non-empty row, the weight of each valid token after /
    before truncation or banding (sequence levels: the row value repeated). ``lower`` is the band's
    lower bound, or 1/upper for truncation (diagnostics only). ``row_logs``: per-row log of the
    sequence / geometric ratio (unclamped)."""
    w = [x for r in w_rows for x in r]
    raw = [x for r in raw_rows for x in r]
    n = len(w)
    m = mean(w)
    second = mean(x * x for x in w)
    out = {
        "rollout_is_mean": m,
        "rollout_is_std": pstd(w),
        "rollout_is_eff_sample_size": m * m / second if second > 0 else 0.0,
    }
    if level == "token":
        out["rollout_is_max"] = max(raw)
        out["rollout_is_min"] = min(raw)
        out["rollout_is_ratio_fraction_high"] = sum(x > upper for x in raw) / n
        out["rollout_is_ratio_fraction_low"] = sum(x < lower for x in raw) / n
    else:
        out["rollout_is_max"] = math.exp(min(max(row_logs), 20.0))
        out["rollout_is_min"] = math.exp(min(row_logs))
        out["rollout_is_ratio_fraction_high"] = mean(x > math.log(upper) for x in row_logs)
        out["rollout_is_ratio_fraction_low"] = mean(x < math.log(lower) for x in row_logs)
    seq_w = [mean(r) for r in w_rows]
    seq_raw = [mean(r) for r in raw_rows]
    out.update({
        "rollout_is_seq_mean": mean(seq_w),
        "rollout_is_seq_std": sstd(seq_w),
        "rollout_is_seq_max": max(seq_w),
        "rollout_is_seq_min": min(seq_w),
        "rollout_is_seq_max_deviation": max(abs(x - 1.0) for x in seq_w),
        "rollout_is_seq_fraction_high": mean(x > upper for x in seq_raw),
        "rollout_is_seq_fraction_low": mean(x < lower for x in seq_raw),
    })
    if mask_mode:
        out["rollout_is_oob_ratio"] = sum(x < lower or x > upper for x in raw) / n
    return out


def rs_bounds(mode, threshold):
    """Bounds in statistic space: k1 = -log r with the ratio band [l, u] -> [-log u, -log l]."""
    if mode.endswith("_k1"):
        text = str(threshold)
        if "_" in text:
            lo_r, up_r = (float(x) for x in text.split("_"))
        else:
            up_r = float(text)
            lo_r = 1.0 / up_r
        return -math.log(up_r), -math.log(lo_r), -math.log(up_r)
    return -math.inf, float(threshold), 0.0


def rs_stat(k, s):
    if k == 1:
        return -s
    if k == 2:
        return 0.5 * s * s
    return math.exp(s) - 1.0 - s


def rs_expected(mode, ratio_rows, threshold, keep_rows):
    """RS metrics for one mode. ``keep_rows``: per non-empty row, 1/0 per valid token (hand-computed)."""
    agg, k = mode.rsplit("_k", 1)
    k = int(k)
    lo, hi, lo_clamp = rs_bounds(mode, threshold)
    rows = [[rs_stat(k, clamp20(math.log(r))) for r in row] for row in ratio_rows if row]
    n = sum(len(r) for r in rows)
    name = f"rollout_rs_{mode}"
    out = {}
    if agg == "token":
        flat = [x for r in rows for x in r]
        seq = [mean(r) for r in rows]
        out[f"{name}_mean"] = mean(flat)
        out[f"{name}_max"] = max(flat)
        out[f"{name}_min"] = min(flat)
        out[f"{name}_fraction_high"] = sum(x > hi for x in flat) / n
        out[f"{name}_fraction_low"] = sum(x < lo for x in flat) / n
        clamped = [clamp(x, lo_clamp, hi) for x in flat]
    else:
        seq = [{"seq_sum": sum, "seq_mean": mean, "seq_max": max}[agg](r) for r in rows]
        out[f"{name}_mean"] = sum(v * len(r) for v, r in zip(seq, rows)) / n
        out[f"{name}_max"] = max(seq)
        out[f"{name}_min"] = min(seq)
        out[f"{name}_fraction_high"] = mean(v > hi for v in seq)
        out[f"{name}_fraction_low"] = mean(v < lo for v in seq)
        clamped = [clamp(v, lo_clamp, hi) for v, r in zip(seq, rows) for _ in r]
    out[f"{name}_std"] = pstd(clamped)
    out[f"{name}_seq_mean"] = mean(seq)
    out[f"{name}_seq_std"] = sstd(seq)
    out[f"{name}_seq_max"] = max(seq)
    out[f"{name}_seq_min"] = min(seq)
    out[f"{name}_seq_max_deviation"] = max(abs(v) for v in seq)
    out[f"{name}_seq_fraction_high"] = mean(v > hi for v in seq)
    if k == 1:
        out[f"{name}_seq_fraction_low"] = mean(v < lo for v in seq)
    rejected = [len(r) - sum(r) for r in keep_rows]
    out[f"{name}_masked_fraction"] = sum(rejected) / n
    out[f"{name}_seq_masked_fraction"] = mean(x > 0 for x in rejected)
    return out


def rs_overall(keep_rows):
    n = sum(len(r) for r in keep_rows)
    rejected = [len(r) - sum(r) for r in keep_rows]
    return {
        "rollout_rs_masked_fraction": sum(rejected) / n,
        "rollout_rs_seq_masked_fraction": mean(x > 0 for x in rejected),
    }


def mask_from_keep(rows, keep_nonempty, width):
    """Full (B, width) expected mask from per-non-empty-row keeps."""
    it = iter(keep_nonempty)
    out = []
    for r in rows:
        keep = next(it) if r else []
        out.append([float(x) for x in keep] + [0.0] * (width - len(keep)))
    return torch.tensor(out, dtype=torch.float32)


# ------------------------------------------------------------------------------------- off-policy


def test_offpolicy_metrics_hand_computed():
    """Row 0: p_train = 1/2, p_rollout = 1/4; row 1: both 1/4 twice; row 2 empty (excluded)."""
    rows = from_probs([[(0.5, 0.25)], [(0.25, 0.25), (0.25, 0.25)], []])
    w, mask, _, f = run(rows)
    assert w is None
    expected = {
        "training_ppl": (2.0 + 4.0) / 2,
        "training_log_ppl": (LN2 + 2 * LN2) / 2,
        "rollout_ppl": 4.0,
        "rollout_log_ppl": 2 * LN2,
        "kl": -LN2 / 3,  # mean over the 3 valid tokens of rollout - old
        "k3_kl": (2.0 - 1.0 - LN2) / 3,
        # docs' sign: log_ppl_rollout - log_ppl_training per row = [ln 2, 0] (verl's code: [-ln 2, 0])
        "log_ppl_diff": LN2 / 2,
        "log_ppl_abs_diff": LN2 / 2,
        "log_ppl_diff_max": LN2,
        "log_ppl_diff_min": 0.0,
        # docs: exp of the mean log ratio of perplexities, exp(-ln2 / 2); verl's code (arithmetic
        # mean of per-row ratios) would give 0.75
        "ppl_ratio": 1.0 / math.sqrt(2.0),
        "chi2_token": (4.0 + 1.0 + 1.0) / 3 - 1.0,
        "chi2_seq": (4.0 + 1.0) / 2 - 1.0,
    }
    check(f, expected)
    check(f, offpolicy_expected(rows))  # the oracle used below agrees with the hand numbers
    direct = compute_offpolicy_metrics(*tensors(rows)).to_floats()
    check(direct, expected)


def test_offpolicy_metrics_base_batch():
    _, _, _, f = run(BASE)
    check(f, offpolicy_expected(BASE))


def test_offpolicy_safety_bound_and_clamped_k3():
    """chi2 and k3_kl use log-ratios clamped to [-20, 20] (verl leaves k3_kl unclamped); kl does not clamp."""
    rows = [[(0.0, -25.0)], [(-30.0, 0.0)], [(math.log(0.5), math.log(0.25))]]
    _, _, _, f = run(rows)
    expected = offpolicy_expected(rows)
    assert expected["chi2_token"] == pytest.approx((math.exp(40) + math.exp(-40) + 4.0) / 3 - 1.0)
    assert expected["k3_kl"] == pytest.approx((math.exp(20) - 21.0 + math.exp(-20) + 19.0 + 1.0 - LN2) / 3)
    check(f, expected)


# --------------------------------------------------------------------------------------------- IS


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_tis_exact(dtype):
    upper = 1.6
    w, mask, _, f = run(BASE, dtype=dtype, rollout_is="token", rollout_is_threshold=upper)
    w_rows = [[1.6, 0.5, 1.6], [1.6, 0.5]]
    assert w.dtype == dtype
    assert torch.allclose(w.double(), torch.tensor(padded(w_rows + [[]], 4), dtype=torch.float64), rtol=1e-6)
    assert torch.equal(mask, tensors(BASE)[2])  # IS never touches the mask
    rel = 1e-9 if dtype == torch.float64 else 2e-6
    # hand values
    assert f["rollout_is_mean"] == pytest.approx(5.8 / 5, rel=rel)
    assert f["rollout_is_max"] == pytest.approx(3.0, rel=rel)  # before truncation (docs), not 1.6
    assert f["rollout_is_min"] == pytest.approx(0.5, rel=rel)
    assert f["rollout_is_ratio_fraction_high"] == pytest.approx(3 / 5, rel=rel)
    assert f["rollout_is_ratio_fraction_low"] == pytest.approx(2 / 5, rel=rel)  # raw < 1/1.6
    assert f["rollout_is_seq_mean"] == pytest.approx((3.7 / 3 + 2.1 / 2) / 2, rel=rel)
    assert f["rollout_is_seq_fraction_high"] == pytest.approx(0.5, rel=rel)  # raw row means 1.5, 1.75
    expected = offpolicy_expected(BASE)
    expected.update(is_expected("token", w_rows, BASE_RATIOS, upper, 1 / upper))
    check(f, expected, rel=rel, abs_=1e-12 if dtype == torch.float64 else 1e-6)


def test_sequence_tis_exact():
    upper = 1.8
    w, _, _, f = run(BASE, rollout_is="sequence", rollout_is_threshold=upper)
    # row products: 2 * 0.5 * 2 = 2 -> truncated to 1.8; 3 * 0.5 = 1.5
    w_rows = [[1.8] * 3, [1.5] * 2]
    assert torch.allclose(w, torch.tensor(padded(w_rows + [[]], 4), dtype=torch.float64), rtol=1e-12)
    assert f["rollout_is_mean"] == pytest.approx((3 * 1.8 + 2 * 1.5) / 5)
    assert f["rollout_is_std"] == pytest.approx(math.sqrt((3 * 1.8**2 + 2 * 1.5**2) / 5 - 1.68**2))
    assert f["rollout_is_max"] == pytest.approx(2.0)
    assert f["rollout_is_min"] == pytest.approx(1.5)
    assert f["rollout_is_seq_mean"] == pytest.approx(1.65)  # over the 2 non-empty rows
    assert f["rollout_is_seq_max_deviation"] == pytest.approx(0.8)
    expected = offpolicy_expected(BASE)
    expected.update(is_expected("sequence", w_rows, [[2.0] * 3, [1.5] * 2], upper, 1 / upper,
                                row_logs=[LN2, math.log(1.5)]))
    check(f, expected)


def test_sequence_tis_safety_bound():
    """Row log-ratios 25, -30, ln 2: weights min(e^20, 5), e^-20, 2; max reported e^20 (clamped), min
    e^-30 (unclamped)."""
    rows = [[(0.0, -25.0)], [(-30.0, 0.0)], [(math.log(0.5), math.log(0.25))]]
    upper = 5.0
    w, _, _, f = run(rows, rollout_is="sequence", rollout_is_threshold=upper)
    assert torch.allclose(w[:, 0], torch.tensor([5.0, math.exp(-20), 2.0], dtype=torch.float64), rtol=1e-12)
    assert f["rollout_is_max"] == pytest.approx(math.exp(20))
    assert f["rollout_is_min"] == pytest.approx(math.exp(-30))
    expected = offpolicy_expected(rows)
    expected.update(is_expected("sequence", [[5.0], [math.exp(-20)], [2.0]],
                                [[math.exp(20)], [math.exp(-20)], [2.0]], upper, 1 / upper,
                                row_logs=[25.0, -30.0, LN2]))
    assert expected["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert expected["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)
    check(f, expected)


def test_geometric_exact():
    upper = 1.25
    w, _, _, f = run(BASE, rollout_is="geometric", rollout_is_threshold=upper)
    g0, g1 = 2.0 ** (1 / 3), math.sqrt(1.5)  # geometric means 1.26 (truncated to 1.25) and 1.2247
    w_rows = [[1.25] * 3, [g1] * 2]
    assert torch.allclose(w, torch.tensor(padded(w_rows + [[]], 4), dtype=torch.float64), rtol=1e-12)
    assert f["rollout_is_max"] == pytest.approx(g0)
    assert f["rollout_is_min"] == pytest.approx(g1)
    assert f["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)
    expected = offpolicy_expected(BASE)
    expected.update(is_expected("geometric", w_rows, [[g0] * 3, [g1] * 2], upper, 1 / upper,
                                row_logs=[LN2 / 3, math.log(1.5) / 2]))
    check(f, expected)


def test_icepop_verl_documented_case():
    """verl's upstream test: raw token weights [0.4, 0.8, 6.0] with '0.5_5.0' -> w = [0, 0.8, 0],
    oob_ratio = 2/3, std = 0.3771236, ESS = 1/3."""
    rows = from_probs([[(0.2, 0.5), (0.4, 0.5), (0.6, 0.1)]])
    w, mask, metrics, f = run(rows, rollout_is="token", rollout_is_threshold="0.5_5.0")
    assert torch.allclose(w[0, :3], torch.tensor([0.0, 0.8, 0.0], dtype=torch.float64), rtol=1e-12, atol=0)
    assert w[0, 0] == 0 and w[0, 2] == 0 and w[0, 3] == 0
    assert torch.equal(mask, tensors(rows)[2])  # IcePop leaves the mask alone
    assert f["rollout_is_oob_ratio"] == pytest.approx(2 / 3)
    assert f["rollout_is_std"] == pytest.approx(0.3771236, abs=1e-7)
    assert f["rollout_is_eff_sample_size"] == pytest.approx(1 / 3, abs=1e-7)
    assert f["rollout_is_mean"] == pytest.approx(0.8 / 3)
    # docstring: token max / min are taken from the raw weights, before the band (verl's code: 0.8 / 0)
    assert f["rollout_is_max"] == pytest.approx(6.0)
    assert f["rollout_is_min"] == pytest.approx(0.4)
    assert f["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert f["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)
    assert f["rollout_is_seq_mean"] == pytest.approx(0.8 / 3)
    assert f["rollout_is_seq_std"] == 0.0  # a single row
    assert f["rollout_is_seq_max_deviation"] == pytest.approx(1 - 0.8 / 3)
    assert f["rollout_is_seq_fraction_high"] == 0.0  # raw row mean 2.4 inside [0.5, 5]
    expected = offpolicy_expected(rows)
    expected.update(is_expected("token", [[0.0, 0.8, 0.0]], [[0.4, 0.8, 6.0]], 5.0, 0.5, mask_mode=True))
    check(f, expected)
    assert metrics.is_mode == "mask"


def test_icepop_token_base_batch():
    w, _, _, f = run(BASE, rollout_is="token", rollout_is_threshold="0.6_2.5")
    w_rows = [[2.0, 0.0, 2.0], [0.0, 0.0]]
    assert torch.allclose(w, torch.tensor(padded(w_rows + [[]], 4), dtype=torch.float64), rtol=1e-12, atol=0)
    assert f["rollout_is_oob_ratio"] == pytest.approx(3 / 5)
    assert f["rollout_is_seq_min"] == 0.0
    assert f["rollout_is_seq_max_deviation"] == pytest.approx(1.0)
    expected = offpolicy_expected(BASE)
    expected.update(is_expected("token", w_rows, BASE_RATIOS, 2.5, 0.6, mask_mode=True))
    check(f, expected)


def test_icepop_sequence_level():
    w, _, _, f = run(BASE, rollout_is="sequence", rollout_is_threshold="0.5_1.8")
    w_rows = [[0.0] * 3, [1.5] * 2]  # product 2 is outside [0.5, 1.8], 1.5 inside
    assert torch.allclose(w, torch.tensor(padded(w_rows + [[]], 4), dtype=torch.float64), rtol=1e-12, atol=0)
    assert f["rollout_is_oob_ratio"] == pytest.approx(3 / 5)  # token-weighted
    expected = offpolicy_expected(BASE)
    expected.update(is_expected("sequence", w_rows, [[2.0] * 3, [1.5] * 2], 1.8, 0.5,
                                row_logs=[LN2, math.log(1.5)], mask_mode=True))
    check(f, expected)


@pytest.mark.parametrize(
    "kw, lower, w_rows",
    [
        # clip without a lower bound takes 1/u (slime's rule)
        (dict(rollout_is_threshold=1.6), 1 / 1.6, [[1.6, 1 / 1.6, 1.6], [1.6, 1 / 1.6]]),
        (dict(rollout_is_threshold=1.6, rollout_is_threshold_lower=0.4), 0.4, [[1.6, 0.5, 1.6], [1.6, 0.5]]),
        (dict(rollout_is_threshold="0.6_1.6"), 0.6, [[1.6, 0.6, 1.6], [1.6, 0.6]]),
    ],
)
def test_clip_mode_exact(kw, lower, w_rows):
    w, _, metrics, f = run(BASE, rollout_is="token", rollout_is_mode="clip", **kw)
    assert torch.allclose(w, torch.tensor(padded(w_rows + [[]], 4), dtype=torch.float64), rtol=1e-12)
    assert f["rollout_is_ratio_fraction_high"] == pytest.approx(3 / 5)
    expected = offpolicy_expected(BASE)
    expected.update(is_expected("token", w_rows, BASE_RATIOS, 1.6, lower))
    check(f, expected)
    assert metrics.is_mode == "clip"
    slime = metrics.slime().to_floats()
    assert slime["mis_clip_fraction_high"] == pytest.approx(3 / 5)
    assert slime["mis_clip_fraction_low"] == pytest.approx(expected["rollout_is_ratio_fraction_low"])


def test_clip_mode_sequence_level():
    w, _, _, f = run(BASE, rollout_is="sequence", rollout_is_mode="clip", rollout_is_threshold=1.8,
                     rollout_is_threshold_lower=1.6)
    w_rows = [[1.8] * 3, [1.6] * 2]  # products 2 -> 1.8, 1.5 -> 1.6
    assert torch.allclose(w, torch.tensor(padded(w_rows + [[]], 4), dtype=torch.float64), rtol=1e-12)
    expected = offpolicy_expected(BASE)
    expected.update(is_expected("sequence", w_rows, [[2.0] * 3, [1.5] * 2], 1.8, 1.6,
                                row_logs=[LN2, math.log(1.5)]))
    assert expected["rollout_is_ratio_fraction_low"] == 0.5
    check(f, expected)


@pytest.mark.parametrize(
    "level, upper, w_rows, raw_rows, row_logs, factor",
    [
        ("token", 1.6, [[1.6, 0.5, 1.6], [1.6, 0.5]], BASE_RATIOS, None, 5.8 / 5),
        ("sequence", 1.8, [[1.8] * 3, [1.5] * 2], [[2.0] * 3, [1.5] * 2], [LN2, math.log(1.5)], (1.8 + 1.5) / 2),
    ],
)
def test_batch_normalisation_exact(level, upper, w_rows, raw_rows, row_logs, factor):
    w, _, metrics, f = run(BASE, rollout_is=level, rollout_is_threshold=upper, rollout_is_batch_normalize=True)
    expected_w = torch.tensor(padded(w_rows + [[]], 4), dtype=torch.float64) / factor
    assert torch.allclose(w, expected_w, rtol=1e-12)
    assert f["rollout_is_batch_norm_factor"] == pytest.approx(factor)
    expected = offpolicy_expected(BASE)
    # the other IS metrics describe the weights before normalisation (verl section 1.4, step 5)
    expected.update(is_expected(level, w_rows, raw_rows, upper, 1 / upper, row_logs=row_logs))
    expected["rollout_is_batch_norm_factor"] = factor
    check(f, expected)
    assert metrics.slime().to_floats()["mis_batch_norm_factor"] == pytest.approx(factor)


def test_batch_normalisation_all_zero_weights_keeps_factor_one():
    """IcePop with every token outside the band: mean 0 <= 1e-8, so no normalisation, factor 1."""
    w, _, _, f = run(BASE, rollout_is="token", rollout_is_threshold="5.0_6.0", rollout_is_batch_normalize=True)
    assert torch.equal(w, torch.zeros_like(w))
    assert f["rollout_is_batch_norm_factor"] == 1.0
    assert f["rollout_is_eff_sample_size"] == 0.0  # every weight is 0 (docstring)
    assert f["rollout_is_oob_ratio"] == 1.0


# --------------------------------------------------------------------------------------------- RS

RS_CASES = [
    # mode, threshold, keep per non-empty row of RSB (ratios [1, 2, .5], [1.1, .7, 1.2, 1.05], [4])
    ("token_k1", "0.6_1.5", [[1, 0, 0], [1, 1, 1, 1], [0]]),
    ("token_k2", 0.1, [[1, 0, 0], [1, 1, 1, 1], [0]]),  # |log r| <= sqrt(0.2)
    ("token_k3", 0.05, [[1, 0, 0], [1, 0, 1, 1], [0]]),  # k3(0.7) = 0.0567 > 0.05
    ("seq_sum_k1", "0.5_2.0", [[1, 1, 1], [1, 1, 1, 1], [0]]),  # products 1, 0.970, 4
    ("seq_sum_k2", 0.3, [[0, 0, 0], [1, 1, 1, 1], [0]]),  # sums 0.480, 0.086, 0.961
    ("seq_sum_k3", 0.1, [[0, 0, 0], [1, 1, 1, 1], [0]]),  # sums 0.5, 0.080, 1.614
    ("seq_mean_k1", "0.995_1.005", [[1, 1, 1], [0, 0, 0, 0], [0]]),  # geometric means 1, 0.9925, 4
    ("seq_mean_k2", 0.05, [[0, 0, 0], [1, 1, 1, 1], [0]]),  # means 0.160, 0.0215, 0.961
    ("seq_mean_k3", 0.1, [[0, 0, 0], [1, 1, 1, 1], [0]]),  # means 0.167, 0.0201, 1.614
    ("seq_max_k2", 0.1, [[0, 0, 0], [1, 1, 1, 1], [0]]),  # maxima 0.240, 0.0636, 0.961
    ("seq_max_k3", 0.06, [[0, 0, 0], [1, 1, 1, 1], [0]]),  # maxima 0.307, 0.0567, 1.614
]

RS_MASKED_FRACTION = {  # hand counts: rejected tokens / 8 valid tokens, rows with a rejection / 3 rows
    "token_k1": (3 / 8, 2 / 3), "token_k2": (3 / 8, 2 / 3), "token_k3": (4 / 8, 3 / 3),
    "seq_sum_k1": (1 / 8, 1 / 3), "seq_sum_k2": (4 / 8, 2 / 3), "seq_sum_k3": (4 / 8, 2 / 3),
    "seq_mean_k1": (5 / 8, 2 / 3), "seq_mean_k2": (4 / 8, 2 / 3), "seq_mean_k3": (4 / 8, 2 / 3),
    "seq_max_k2": (4 / 8, 2 / 3), "seq_max_k3": (4 / 8, 2 / 3),
}


@pytest.mark.parametrize("mode, threshold, keep", RS_CASES, ids=[c[0] for c in RS_CASES])
def test_rs_mode_exact(mode, threshold, keep):
    w, mask, metrics, f = run(RSB, rollout_rs=mode, rollout_rs_threshold=threshold)
    assert w is None
    assert mask.dtype == torch.float32
    assert torch.equal(mask, mask_from_keep(RSB, keep, 5))
    frac, seq_frac = RS_MASKED_FRACTION[mode]
    assert f[f"rollout_rs_{mode}_masked_fraction"] == pytest.approx(frac)
    assert f[f"rollout_rs_{mode}_seq_masked_fraction"] == pytest.approx(seq_frac)
    assert f["rollout_rs_masked_fraction"] == pytest.approx(frac)
    assert f["rollout_rs_seq_masked_fraction"] == pytest.approx(seq_frac)  # over non-empty rows
    expected = offpolicy_expected(RSB)
    expected.update(rs_expected(mode, RSB_RATIOS, threshold, keep))
    expected.update(rs_overall(keep))
    check(f, expected)
    slime = metrics.slime().to_floats()
    assert slime["mis_rs_masked_fraction"] == pytest.approx(frac)
    assert slime["mis_rs_seq_masked_fraction"] == pytest.approx(seq_frac)


def test_rs_token_k1_statistics_by_hand():
    """k1 = -log r; the band [0.6, 1.5] on r is [-log 1.5, -log 0.6] on the statistic."""
    _, _, _, f = run(RSB, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.5")
    ln = math.log
    stats = [0.0, -LN2, LN2, -ln(1.1), -ln(0.7), -ln(1.2), -ln(1.05), -ln(4.0)]
    assert f["rollout_rs_token_k1_mean"] == pytest.approx(sum(stats) / 8)
    assert f["rollout_rs_token_k1_max"] == pytest.approx(LN2)
    assert f["rollout_rs_token_k1_min"] == pytest.approx(-ln(4.0))
    assert f["rollout_rs_token_k1_fraction_high"] == pytest.approx(1 / 8)  # r = 0.5: -log r > -log 0.6
    assert f["rollout_rs_token_k1_fraction_low"] == pytest.approx(2 / 8)  # r = 2, 4: -log r < -log 1.5
    assert f["rollout_rs_token_k1_seq_max_deviation"] == pytest.approx(ln(4.0))


@pytest.mark.parametrize(
    "mode, threshold, ratio_rows, keep",
    [
        # the band is on r: r = 1.5 > 1.4 rejected, r = 0.7 in [0.6, 1.4] kept (verl's code, bounding 1/r,
        # keeps 1.5 and rejects 0.7)
        ("token_k1", "0.6_1.4", [[1.5, 0.7, 1.0]], [[0, 1, 1]]),
        # product 2.5 in [0.8, 3.0] kept; product 0.7 rejected (verl's code: the opposite)
        ("seq_sum_k1", "0.8_3.0", [[2.0, 1.25], [0.7]], [[1, 1], [0]]),
        # geometric mean 2.5 kept, 0.7 rejected
        ("seq_mean_k1", "0.8_3.0", [[2.5, 2.5], [0.7, 0.7]], [[1, 1], [0, 0]]),
    ],
)
def test_asymmetric_k1_band_applies_to_the_ratio(mode, threshold, ratio_rows, keep):
    rows = from_ratios(ratio_rows)
    _, mask, _, f = run(rows, rollout_rs=mode, rollout_rs_threshold=threshold)
    assert torch.equal(mask, mask_from_keep(rows, keep, max(len(r) for r in rows) + 1))
    expected = offpolicy_expected(rows)
    expected.update(rs_expected(mode, ratio_rows, threshold, keep))
    expected.update(rs_overall(keep))
    check(f, expected)


@pytest.mark.parametrize("threshold", ["0.6_1.5,0.1", ["0.6_1.5", 0.1], ("0.6_1.5", "0.1")])
def test_chain_exact(threshold):
    w, mask, _, f = run(RSB, rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold=threshold)
    keep_k1 = [[1, 0, 0], [1, 1, 1, 1], [0]]
    keep_max = [[0, 0, 0], [1, 1, 1, 1], [0]]
    combined = [[a & b for a, b in zip(r1, r2)] for r1, r2 in zip(keep_k1, keep_max)]
    assert combined == [[0, 0, 0], [1, 1, 1, 1], [0]]
    assert torch.equal(mask, mask_from_keep(RSB, combined, 5))
    assert f["rollout_rs_masked_fraction"] == pytest.approx(4 / 8)
    assert f["rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    expected = offpolicy_expected(RSB)
    expected.update(rs_expected("token_k1", RSB_RATIOS, "0.6_1.5", keep_k1))
    expected.update(rs_expected("seq_max_k2", RSB_RATIOS, 0.1, keep_max))
    expected.update(rs_overall(combined))
    check(f, expected)


def test_chain_one_threshold_for_all_and_duplicates():
    _, mask, _, f = run(RSB, rollout_rs="seq_mean_k3, seq_max_k3,seq_mean_k3", rollout_rs_threshold=0.06)
    # seq_mean_k3 <= 0.06: means 0.167, 0.0201, 1.614; seq_max_k3 <= 0.06: maxima 0.307, 0.0567, 1.614
    keep = [[0, 0, 0], [1, 1, 1, 1], [0]]
    assert torch.equal(mask, mask_from_keep(RSB, keep, 5))
    expected = offpolicy_expected(RSB)
    expected.update(rs_expected("seq_mean_k3", RSB_RATIOS, 0.06, keep))
    expected.update(rs_expected("seq_max_k3", RSB_RATIOS, 0.06, keep))
    expected.update(rs_overall(keep))
    check(f, expected)


def test_is_and_rs_together_use_the_original_mask():
    """IS weights stay non-zero on RS-rejected tokens (verl section 1.6, step 4)."""
    w, mask, _, f = run(RSB, rollout_is="token", rollout_is_threshold=3.0,
                        rollout_rs="token_k1", rollout_rs_threshold="0.6_1.5")
    keep = [[1, 0, 0], [1, 1, 1, 1], [0]]
    w_rows = [[1.0, 2.0, 0.5], [1.1, 0.7, 1.2, 1.05], [3.0]]
    assert torch.equal(mask, mask_from_keep(RSB, keep, 5))
    expected_w = torch.tensor(padded([w_rows[0], w_rows[1], [], w_rows[2]], 5), dtype=torch.float64)
    assert torch.allclose(w, expected_w, rtol=1e-12)
    expected = offpolicy_expected(RSB)
    expected.update(is_expected("token", w_rows, [[1.0, 2.0, 0.5], [1.1, 0.7, 1.2, 1.05], [4.0]], 3.0, 1 / 3.0))
    expected.update(rs_expected("token_k1", RSB_RATIOS, "0.6_1.5", keep))
    expected.update(rs_overall(keep))
    check(f, expected)


# -------------------------------------------------------------------------------------------- veto


def test_veto_exact():
    with pytest.warns(DeprecationWarning, match="seq_max_k2"):
        w, mask, metrics, f = run(RSB, rollout_token_veto_threshold=0.6)
    assert w is None
    keep = [[0, 0, 0], [1, 1, 1, 1], [1]]  # row 0 holds r = 0.5 < 0.6; 0.7 and 4 are fine
    assert torch.equal(mask, mask_from_keep(RSB, keep, 5))
    expected = offpolicy_expected(RSB)
    expected["rollout_is_veto_fraction"] = 1 / 3  # of the 3 non-empty rows
    expected["rollout_is_catastrophic_token_fraction"] = 1 / 8
    check(f, expected)
    slime = metrics.slime().to_floats()
    assert slime["mis_catastrophic_seq_fraction"] == pytest.approx(1 / 3)
    assert slime["mis_catastrophic_token_fraction"] == pytest.approx(1 / 8)


def test_veto_uses_the_unclamped_ratio():
    """exp(-25) < 1e-10 < exp(-20): vetoed only because the ratio is not safety-clamped."""
    rows = [[(-25.0, 0.0), (-1.0, -1.0)], [(-20.5, 0.0)], [(-1.0, -1.0)]]
    with pytest.warns(DeprecationWarning):
        _, mask, _, f = run(rows, rollout_token_veto_threshold=1e-10)
    assert torch.equal(mask, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert f["rollout_is_veto_fraction"] == pytest.approx(1 / 3)
    assert f["rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 4)


def test_veto_with_rs_and_is():
    """The veto joins the RS mask; rollout_rs_* fractions count RS rejections only."""
    with pytest.warns(DeprecationWarning):
        w, mask, _, f = run(RSB, rollout_is="token", rollout_is_threshold=3.0, rollout_rs="seq_sum_k1",
                            rollout_rs_threshold="0.5_2.0", rollout_token_veto_threshold=0.6)
    rs_keep = [[1, 1, 1], [1, 1, 1, 1], [0]]
    final = [[0, 0, 0], [1, 1, 1, 1], [0]]
    assert torch.equal(mask, mask_from_keep(RSB, final, 5))
    w_rows = [[1.0, 2.0, 0.5], [1.1, 0.7, 1.2, 1.05], [3.0]]
    expected = offpolicy_expected(RSB)
    expected.update(is_expected("token", w_rows, [[1.0, 2.0, 0.5], [1.1, 0.7, 1.2, 1.05], [4.0]], 3.0, 1 / 3.0))
    expected.update(rs_expected("seq_sum_k1", RSB_RATIOS, "0.5_2.0", rs_keep))
    expected.update(rs_overall(rs_keep))
    expected["rollout_is_veto_fraction"] = 1 / 3
    expected["rollout_is_catastrophic_token_fraction"] = 1 / 8
    check(f, expected)


# -------------------------------------------------------------------------------------- agreement

AGREEMENT_KEYS = {
    "rollout_probs_diff_mean", "rollout_probs_diff_max", "rollout_probs_diff_std",
    "rollout_actor_probs_pearson_corr", "logprob_abs_diff_mean", "logprob_abs_diff_p99", "logprob_abs_diff_max",
}


def pearson(xs, ys):
    mx, my = mean(xs), mean(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return cov / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))


def test_agreement_metrics_exact():
    _, _, _, f = run(BASE, agreement_metrics=True)
    p_train = [0.5, 0.25, 0.8, 0.9, 0.3]
    p_roll = [0.25, 0.5, 0.4, 0.3, 0.6]
    diff = [abs(a - b) for a, b in zip(p_train, p_roll)]
    assert diff == pytest.approx([0.25, 0.25, 0.4, 0.6, 0.3])
    abs_lr = [LN2, LN2, LN2, LN3, LN2]
    p99 = LN2 + 0.96 * (LN3 - LN2)  # position 0.99 * (5 - 1) = 3.96 in the sorted values
    expected = offpolicy_expected(BASE)
    expected.update({
        "rollout_probs_diff_mean": 1.8 / 5,
        "rollout_probs_diff_max": 0.6,
        "rollout_probs_diff_std": math.sqrt(0.735 / 5 - 0.36**2),  # population std of |dp|
        "rollout_actor_probs_pearson_corr": pearson(p_train, p_roll),
        "logprob_abs_diff_mean": (4 * LN2 + LN3) / 5,
        "logprob_abs_diff_p99": p99,
        "logprob_abs_diff_max": LN3,
    })
    assert expected["rollout_probs_diff_std"] == pytest.approx(pstd(diff))
    check(f, expected)
    assert f["logprob_abs_diff_p99"] == pytest.approx(
        float(torch.quantile(torch.tensor(abs_lr, dtype=torch.float64), 0.99)), rel=1e-12)
    direct = compute_agreement_metrics(*tensors(BASE)).to_floats()
    check(direct, {k: expected[k] for k in AGREEMENT_KEYS})


def test_agreement_p99_many_values_matches_torch_quantile():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(7, 30, generator=gen, dtype=torch.float64) * 8
    rollout = (old + (torch.rand(7, 30, generator=gen, dtype=torch.float64) - 0.5)).clamp(max=0.0)
    mask = (torch.rand(7, 30, generator=gen) < 0.7).float()
    mask[3] = 0  # an empty row
    rollout[mask == 0] = float("nan")  # padding garbage must not matter
    f = compute_agreement_metrics(old, rollout, mask).to_floats()
    valid = (old - rollout).abs()[mask.bool()]
    assert f["logprob_abs_diff_p99"] == pytest.approx(float(torch.quantile(valid, 0.99)), rel=1e-12)
    assert f["logprob_abs_diff_max"] == pytest.approx(float(valid.max()), rel=1e-12)
    assert f["logprob_abs_diff_mean"] == pytest.approx(float(valid.mean()), rel=1e-12)
    pt, pr = old.exp()[mask.bool()], rollout.exp()[mask.bool()]
    assert f["rollout_actor_probs_pearson_corr"] == pytest.approx(pearson(pt.tolist(), pr.tolist()), rel=1e-9)


@pytest.mark.parametrize(
    "p_train, p_roll, expected",
    [
        ([0.3, 0.3, 0.3], [0.3, 0.3, 0.3], 1.0),  # identical and constant
        ([0.3, 0.3, 0.3], [0.2, 0.5, 0.3], 0.0),  # only one constant
        ([0.2, 0.5, 0.3], [0.4, 0.4, 0.4], 0.0),
        ([0.2, 0.5, 0.3], [0.2, 0.5, 0.3], 1.0),  # identical
        ([0.2, 0.5, 0.3], [0.4, 0.1, 0.3], -1.0),  # p_roll = 0.6 - p_train
    ],
)
def test_pearson_edge_cases(p_train, p_roll, expected):
    rows = from_probs([list(zip(p_train, p_roll))])
    _, _, _, f = run(rows, agreement_metrics=True)
    assert f["rollout_actor_probs_pearson_corr"] == pytest.approx(expected, abs=1e-9)


# ---------------------------------------------------------------------------------- slime / floats

OFFPOLICY_SLIME = {
    "training_log_ppl": "mismatch_training_log_ppl", "training_ppl": "mismatch_training_ppl",
    "rollout_log_ppl": "mismatch_rollout_log_ppl", "rollout_ppl": "mismatch_rollout_ppl",
    "kl": "mismatch_kl", "k3_kl": "mismatch_k3_kl", "log_ppl_diff": "mismatch_log_ppl_diff",
    "log_ppl_abs_diff": "mismatch_log_ppl_abs_diff", "ppl_ratio": "mismatch_ppl_ratio",
    "chi2_token": "mismatch_chi2_token", "chi2_seq": "mismatch_chi2_seq",
    "log_ppl_diff_max": "log_ppl_diff_max", "log_ppl_diff_min": "log_ppl_diff_min",
}


def test_slime_view_icepop_with_everything():
    with pytest.warns(DeprecationWarning):
        _, _, metrics, f = run(BASE, rollout_is="token", rollout_is_threshold="0.6_2.5",
                               rollout_is_batch_normalize=True, rollout_rs="token_k1", rollout_rs_threshold=2.5,
                               rollout_token_veto_threshold=1e-4, agreement_metrics=True)
    slime = metrics.slime()
    assert isinstance(slime, CorrectionMetrics)
    s = slime.to_floats()
    renamed = dict(OFFPOLICY_SLIME)
    renamed.update({
        "rollout_is_mean": "mis_ratio_mean_after_mis",
        "rollout_is_batch_norm_factor": "mis_batch_norm_factor",
        "rollout_is_eff_sample_size": "mis_eff_sample_size",
        "rollout_is_ratio_fraction_high": "mis_mask_fraction_high",
        "rollout_is_ratio_fraction_low": "mis_mask_fraction_low",
        "rollout_is_catastrophic_token_fraction": "mis_catastrophic_token_fraction",
        "rollout_is_veto_fraction": "mis_catastrophic_seq_fraction",
        "rollout_rs_masked_fraction": "mis_rs_masked_fraction",
        "rollout_rs_seq_masked_fraction": "mis_rs_seq_masked_fraction",
        "logprob_abs_diff_mean": "train_rollout_logprob_abs_diff",
    })
    expected = {renamed.get(k, k): v for k, v in f.items()}  # the others keep their bare verl name
    assert len(expected) == len(f)
    assert s == expected
    assert s["mismatch_kl"] == pytest.approx(offpolicy_expected(BASE)["kl"])
    assert s["mis_mask_fraction_high"] == pytest.approx(1 / 5)  # raw 3 > 2.5
    assert s["mis_mask_fraction_low"] == pytest.approx(2 / 5)  # raw 0.5 < 0.6
    assert not any(k.startswith(PREFIX) for k in s)


@pytest.mark.parametrize("mode, fraction_names", [
    ("truncate", {"rollout_is_ratio_fraction_high": "mis_truncate_fraction",
                  "rollout_is_ratio_fraction_low": "rollout_is_ratio_fraction_low"}),
    ("clip", {"rollout_is_ratio_fraction_high": "mis_clip_fraction_high",
              "rollout_is_ratio_fraction_low": "mis_clip_fraction_low"}),
    ("mask", {"rollout_is_ratio_fraction_high": "mis_mask_fraction_high",
              "rollout_is_ratio_fraction_low": "mis_mask_fraction_low"}),
])
def test_slime_fraction_names_follow_the_is_mode(mode, fraction_names):
    _, _, metrics, f = run(BASE, rollout_is="token", rollout_is_threshold=1.6, rollout_is_mode=mode)
    s = metrics.slime().to_floats()
    for verl_name, slime_name in fraction_names.items():
        assert s[slime_name] == f[verl_name]
    assert s["mismatch_training_ppl"] == f["training_ppl"]
    assert s["mis_ratio_mean_after_mis"] == f["rollout_is_mean"]


def test_to_floats():
    _, _, metrics, _ = run(BASE, rollout_is="token", rollout_is_threshold=1.6, rollout_rs="token_k1",
                           rollout_rs_threshold="0.6_1.5", agreement_metrics=True)
    assert isinstance(metrics, CorrectionMetrics)
    floats = metrics.to_floats()
    assert list(floats) == list(metrics)  # same keys, same order
    for key, value in floats.items():
        assert type(value) is float
        assert metrics[key].dim() == 0
        assert value == metrics[key].double().item()
    assert floats[PREFIX + "rollout_is_mean"] == pytest.approx(5.8 / 5)
    assert CorrectionMetrics().to_floats() == {}
    assert CorrectionMetrics({"a": torch.tensor(1.5, dtype=torch.float32), "b": 2}).to_floats() == {"a": 1.5, "b": 2.0}


def test_is_mode_is_a_declared_field():
    # a constructor keyword (None by default), kept by with_prefix and the slime view, set by the entry points
    assert CorrectionMetrics().is_mode is None
    m = CorrectionMetrics({"rollout_is_ratio_fraction_high": torch.tensor(0.25)}, is_mode="clip")
    assert m.is_mode == "clip" and "is_mode" not in m
    assert m.with_prefix(PREFIX).is_mode == "clip"
    assert m.slime().is_mode == "clip" and "mis_clip_fraction_high" in m.slime()
    assert "mis_truncate_fraction" in CorrectionMetrics(m, is_mode="truncate").slime()   # negative control
    _, _, metrics, _ = run(BASE, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.5")
    assert metrics.is_mode is None


def test_entry_point_metric_key_sets():
    """The key set for each configuration, spelled out."""
    offpolicy = set(OFFPOLICY_SLIME)
    is_keys = {"rollout_is_mean", "rollout_is_std", "rollout_is_eff_sample_size", "rollout_is_max",
               "rollout_is_min", "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low",
               "rollout_is_seq_mean", "rollout_is_seq_std", "rollout_is_seq_max", "rollout_is_seq_min",
               "rollout_is_seq_max_deviation", "rollout_is_seq_fraction_high", "rollout_is_seq_fraction_low"}
    assert len(offpolicy) == 13 and len(is_keys) == 14
    assert set(run(BASE)[3]) == offpolicy
    assert set(run(BASE, rollout_is="sequence", rollout_is_threshold=2.0)[3]) == offpolicy | is_keys
    assert set(run(BASE, rollout_is="token", rollout_is_threshold="0.5_2.0")[3]) == (
        offpolicy | is_keys | {"rollout_is_oob_ratio"})
    assert set(run(BASE, rollout_is=None, rollout_is_threshold=2.0, agreement_metrics=True)[3]) == (
        offpolicy | AGREEMENT_KEYS)
    # rollout_is_threshold=None switches IS off (verl section 1.6, step 3), with a warning
    with pytest.warns(MoealignWarning, match="rollout_is_threshold=None"):
        w, _, _, f = run(BASE, rollout_is="token", rollout_is_threshold=None)
    assert w is None and set(f) == offpolicy
    rs = {f"rollout_rs_seq_max_k2_{s}" for s in (
        "mean", "max", "min", "fraction_high", "fraction_low", "std", "seq_mean", "seq_std", "seq_max", "seq_min",
        "seq_max_deviation", "seq_fraction_high", "masked_fraction", "seq_masked_fraction")}
    overall = {"rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"}
    assert set(run(BASE, rollout_rs="seq_max_k2", rollout_rs_threshold=0.1)[3]) == offpolicy | rs | overall
    k1 = {k.replace("seq_max_k2", "seq_mean_k1") for k in rs} | {"rollout_rs_seq_mean_k1_seq_fraction_low"}
    assert set(run(BASE, rollout_rs="seq_mean_k1", rollout_rs_threshold=1.5)[3]) == offpolicy | k1 | overall


def test_float32_weights_and_bool_mask_dtypes():
    old, rollout, mask = tensors(BASE, dtype=torch.float32, mask_dtype=torch.bool)
    w, modified, _ = correct(old, rollout, mask, rollout_is="token", rollout_is_threshold=1.6,
                             rollout_rs="token_k1", rollout_rs_threshold="0.6_2.5")
    assert w.dtype == torch.float32
    assert modified.dtype == torch.bool
    assert modified.tolist() == [[True, False, True, False], [False, False, False, False], [False] * 4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current spelling warns about nothing
        correct(old, rollout, mask.long(), rollout_rs="seq_mean_k1", rollout_rs_threshold=1.5)


def test_log_ratio_wrappers_exact():
    """verl's helpers taking a log-ratio directly: same weights / mask, metrics without prefix."""
    log_ratio = torch.tensor([[LN2, -LN2, LN2, 0.0], [LN3, -LN2, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    w, metrics = compute_rollout_correction_weights(log_ratio, mask, rollout_is="token", rollout_is_threshold=1.6)
    assert torch.allclose(w, torch.tensor(padded([[1.6, 0.5, 1.6], [1.6, 0.5]], 4), dtype=torch.float64))
    check(metrics.to_floats(), is_expected("token", [[1.6, 0.5, 1.6], [1.6, 0.5]], BASE_RATIOS, 1.6, 1 / 1.6))
    modified, rs = compute_rollout_rejection_mask(log_ratio, mask, rollout_rs="token_k1", rollout_rs_threshold="0.6_2.5")
    keep = [[1, 0, 1], [0, 0]]
    assert modified.dtype == mask.dtype
    assert modified.tolist() == [[1, 0, 1, 0], [0, 0, 0, 0]]
    expected = rs_expected("token_k1", BASE_RATIOS, "0.6_2.5", keep)
    expected.update(rs_overall(keep))
    check(rs.to_floats(), expected)


@pytest.mark.parametrize("kw", [
    dict(rollout_rs="geometric", rollout_rs_threshold=1.01),
    dict(rollout_token_veto_threshold=1e-4),
])
def test_deprecation_warning_points_at_the_caller(kw):
    with pytest.warns(DeprecationWarning) as record:
        correct(*tensors(BASE), **kw)
    assert [w.filename for w in record] == [__file__]


@pytest.mark.parametrize("level, delta", [("sequence", 3.0), ("token", 9.0)])
def test_eff_sample_size_is_a_fraction_for_tiny_weights(level, delta):
    """ESS = mean(w)^2 / mean(w^2) lies in (0, 1] (Cauchy-Schwarz; verl's notes: "a fraction in (0,1]").
    Equal weights give exactly 1, however small they are: here every weight is e^-20 (sequence level,
    row log-ratio -24 clamped to -20) or e^-9 (token level)."""
    old = torch.full((2, 8), -15.0, dtype=torch.float64)
    rollout = old + delta  # still <= 0: log-probs
    w, _, metrics = correct(old, rollout, torch.ones(2, 8), rollout_is=level, rollout_is_threshold=2.0)
    assert torch.allclose(w, torch.full_like(w, math.exp(-20.0 if level == "sequence" else -9.0)))
    ess = metrics.to_floats()[PREFIX + "rollout_is_eff_sample_size"]
    assert 0.0 < ess <= 1.0 + 1e-9
    assert ess == pytest.approx(1.0, rel=1e-6)


# ------------------------------------------------------------------------- float32 (bf16 inputs) precision
# float32 is the compute dtype for bf16 / fp16 / fp32 inputs. Reference values are computed in float64
# from the very same float32 inputs, so the only difference left is the library's arithmetic.


def test_pearson_float32_high_confidence_tokens():
    """Tokens with probabilities near 1 (a confident model), p_rollout = p_train + 1e-4: correlation ~1."""
    p_train = [0.9990, 0.9992, 0.9994, 0.9996]
    p_roll = [0.9991, 0.9993, 0.9995, 0.9997]
    old = torch.log(torch.tensor([p_train], dtype=torch.float32))
    rollout = torch.log(torch.tensor([p_roll], dtype=torch.float32))
    f = compute_agreement_metrics(old, rollout, torch.ones(1, 4)).to_floats()
    truth = pearson(old.double().exp()[0].tolist(), rollout.double().exp()[0].tolist())
    assert truth == pytest.approx(1.0, abs=1e-6)
    assert f["rollout_actor_probs_pearson_corr"] == pytest.approx(truth, abs=1e-3)


def test_pearson_float32_only_one_constant_is_zero():
    """Docstring: 0 when only one of the two probability vectors is constant."""
    old = torch.full((1, 3), math.log(0.3), dtype=torch.float32)
    rollout = torch.log(torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float32))
    f = compute_agreement_metrics(old, rollout, torch.ones(1, 3)).to_floats()
    assert f["rollout_actor_probs_pearson_corr"] == pytest.approx(0.0, abs=1e-6)


def test_is_std_float32_weights_near_one():
    """Token log-ratios +-1e-4 (well-aligned engines): the weights' population std is ~1e-4."""
    lr = torch.tensor([[1e-4, -1e-4, 1e-4, -1e-4]], dtype=torch.float32)
    rollout = torch.full((1, 4), -0.5, dtype=torch.float32)
    old = rollout + lr
    w, _, metrics = correct(old, rollout, torch.ones(1, 4), rollout_is="token", rollout_is_threshold=2.0)
    truth = statistics.pstdev(w.double()[0].tolist())
    assert truth == pytest.approx(1e-4, rel=1e-2)
    assert metrics.to_floats()[PREFIX + "rollout_is_std"] == pytest.approx(truth, rel=0.05)
