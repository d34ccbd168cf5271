"""Property tests (hypothesis) for the rollout-correction entry point.

Semantics under test are the modules' docstrings (``moealign/correction/*.py``) and the reference notes
(``verl-rollout-correction-and-router-replay.md`` sections 1.1-1.7, 1.9; ``rollout-correction-math.md``).
Batches: B in 1..6, T in 1..12, random padding (some rows fully empty, at least one valid token per
batch), log-probs in [-8, 0] with a perturbation between the two engines, and sometimes NaN / Inf /
huge values written into padding (which must never matter).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moealign.correction import pipeline as _pipeline
from moealign.correction.pipeline import (
    compute_rollout_correction_and_rejection_mask as correct,
)
from moealign.correction.thresholds import RS_MODES

SETTINGS = settings(max_examples=60, deadline=None)
PREFIX = "rollout_corr/"

K1_MODES = ("token_k1", "seq_sum_k1", "seq_mean_k1")
LEGACY = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


# ------------------------------------------------------------------------------------------ strategies


class Batch:
    def __init__(self, old, rollout, mask):
        self.old = old
        self.rollout = rollout
        self.mask = mask
        self.valid = mask != 0 if mask.dtype != torch.bool else mask.clone()

    def __repr__(self):  # shown by hypothesis on failure
        return f"Batch(old={self.old.tolist()!r}, rollout={self.rollout.tolist()!r}, mask={self.mask.tolist()!r}, dtype={self.old.dtype}, mask_dtype={self.mask.dtype})"


@st.composite
def batches(draw, garbage=True):
    B = draw(st.integers(1, 6))
    T = draw(st.integers(1, 12))
    rows = []
    for _ in range(B):
        kind = draw(st.sampled_from(["full", "prefix", "random", "empty"]))
        if kind == "full":
            row = [True] * T
        elif kind == "empty":
            row = [False] * T
        elif kind == "prefix":
            k = draw(st.integers(0, T))
            row = [True] * k + [False] * (T - k)
        else:
            row = draw(st.lists(st.booleans(), min_size=T, max_size=T))
        rows.append(row)
    if not any(any(r) for r in rows):
        i = draw(st.integers(0, B - 1))
        j = draw(st.integers(0, T - 1))
        rows[i][j] = True
    n = B * T
    old = draw(st.lists(st.floats(-8.0, 0.0, allow_nan=False), min_size=n, max_size=n))
    scale = draw(st.sampled_from([0.0, 0.01, 0.3, 3.0]))
    pert = draw(st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=n, max_size=n))
    rollout = [min(0.0, max(-8.0, o + scale * p)) for o, p in zip(old, pert)]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    mask_dtype = draw(st.sampled_from([torch.bool, torch.float32, torch.int64]))
    old_t = torch.tensor(old, dtype=dtype).reshape(B, T)
    rollout_t = torch.tensor(rollout, dtype=dtype).reshape(B, T)
    valid = torch.tensor(rows, dtype=torch.bool)
    if garbage:
        junk = draw(st.sampled_from([None, float("nan"), float("inf"), float("-inf"), 1e30]))
        if junk is not None:
            which = draw(st.sampled_from(["old", "rollout", "both"]))
            if which in ("old", "both"):
                old_t = torch.where(valid, old_t, torch.tensor(junk, dtype=dtype))
            if which in ("rollout", "both"):
                rollout_t = torch.where(valid, rollout_t, torch.tensor(-junk if junk == junk else junk, dtype=dtype))
    return Batch(old_t, rollout_t, valid.to(mask_dtype))


positive_upper = st.floats(0.2, 10.0, allow_nan=False)


@st.composite
def k1_thresholds(draw):
    """A k1 threshold: a single u >= 1 (band [1/u, u]) or a band 'l_u' with l <= u."""
    if draw(st.booleans()):
        u = draw(st.floats(1.0, 5.0))
        return draw(st.sampled_from([u, repr(u)]))
    lower = draw(st.floats(0.05, 1.0))
    upper = draw(st.floats(1.0, 10.0))
    return f"{lower!r}_{upper!r}"


def threshold_for(draw, mode):
    if mode.endswith("_k1"):
        return draw(k1_thresholds())
    return draw(st.sampled_from([repr, float]))(draw(st.floats(1e-4, 5.0)))


@st.composite
def chains(draw):
    modes = draw(st.lists(st.sampled_from(RS_MODES), min_size=1, max_size=4, unique=True))
    thresholds = [threshold_for(draw, m) for m in modes]
    return modes, thresholds


def run(batch, **kw):
    return correct(batch.old, batch.rollout, batch.mask, **kw)


def kept(mask):
    return mask != 0 if mask.dtype != torch.bool else mask


def raw_token_ratio(batch):
    """exp(clamp(old - rollout, -20, 20)) in the inputs' dtype, 1 on padding (plain torch, same ops)."""
    lr = torch.where(batch.valid, batch.old - batch.rollout, torch.zeros((), dtype=batch.old.dtype))
    return torch.exp(lr.clamp(-20.0, 20.0))


def masked_row_log(batch):
    """Per-row sum of old - rollout over valid tokens and the per-row counts (float64)."""
    lr = torch.where(batch.valid, (batch.old - batch.rollout).double(), torch.zeros((), dtype=torch.float64))
    return lr.sum(-1), batch.valid.sum(-1).double()


# -------------------------------------------------------------------------------------------- IS weights


@SETTINGS
@given(batch=batches(), level=st.sampled_from(["token", "sequence", "geometric"]), upper=positive_upper,
       threshold_as_str=st.booleans())
def test_tis_weights_bounded_zero_on_padding_and_detached(batch, level, upper, threshold_as_str):
    old = batch.old.clone().requires_grad_(True)
    rollout = batch.rollout.clone().requires_grad_(True)
    thr = repr(upper) if threshold_as_str else upper
    w, mask, _ = correct(old, rollout, batch.mask, rollout_is=level, rollout_is_threshold=thr)
    assert w.shape == batch.old.shape
    assert w.dtype == batch.old.dtype
    assert not w.requires_grad
    assert w.grad_fn is None
    assert torch.isfinite(w).all()
    assert (w <= upper).all()
    assert (w >= 0).all()
    assert (w[~batch.valid] == 0).all()
    assert (w[batch.valid] > 0).all()  # truncation has no lower bound: a valid weight is never 0
    # IS never changes the mask
    assert torch.equal(mask, batch.mask)
    assert mask.dtype == batch.mask.dtype


@SETTINGS
@given(batch=batches(), lower=st.floats(0.05, 1.0), upper=st.floats(1.0, 20.0))
def test_icepop_token_weights_zero_outside_band_raw_inside(batch, lower, upper):
    w, mask, metrics = run(batch, rollout_is="token", rollout_is_threshold=f"{lower!r}_{upper!r}")
    raw = raw_token_ratio(batch)
    inside = (raw >= lower) & (raw <= upper) & batch.valid
    outside = ~((raw >= lower) & (raw <= upper)) & batch.valid
    # tokens within float noise of a band edge are classified either way: skip them
    edge = ((raw - lower).abs() <= 1e-5 * lower) | ((raw - upper).abs() <= 1e-5 * upper)
    assert (w[outside & ~edge] == 0).all()
    assert torch.allclose(w[inside & ~edge], raw[inside & ~edge], rtol=1e-5, atol=0.0)
    assert (w[~batch.valid] == 0).all()
    assert not w.requires_grad
    assert torch.equal(mask, batch.mask)  # IcePop zeroes weights, never the mask
    f = metrics.to_floats()
    n_tokens = int(batch.valid.sum())
    n_oob = int((outside & ~edge).sum())
    n_edge = int((edge & batch.valid).sum())
    assert n_oob / n_tokens - 1e-6 <= f[PREFIX + "rollout_is_oob_ratio"] <= (n_oob + n_edge) / n_tokens + 1e-6


@SETTINGS
@given(batch=batches(), level=st.sampled_from(["sequence", "geometric"]),
       spec=st.sampled_from(["truncate", "mask", "clip"]), upper=st.floats(1.0, 10.0), lower=st.floats(0.05, 1.0))
def test_sequence_and_geometric_weights_constant_over_valid_tokens(batch, level, spec, upper, lower):
    if spec == "truncate":
        kw = dict(rollout_is_threshold=upper)
    elif spec == "mask":
        kw = dict(rollout_is_threshold=f"{lower!r}_{upper!r}")
    else:
        kw = dict(rollout_is_threshold=upper, rollout_is_mode="clip", rollout_is_threshold_lower=lower)
    w, _, _ = run(batch, rollout_is=level, **kw)
    assert (w[~batch.valid] == 0).all()
    row_sum, n = masked_row_log(batch)
    for i in range(w.shape[0]):
        row = w[i][batch.valid[i]]
        if row.numel() == 0:
            continue
        assert torch.equal(row, row[:1].expand_as(row)), f"row {i} not constant: {row.tolist()}"
        if spec == "truncate":
            row_log = float(row_sum[i]) if level == "sequence" else float(row_sum[i]) / float(n[i])
            expected = min(math.exp(max(-20.0, min(20.0, row_log))), upper)
            assert float(row[0]) == pytest.approx(expected, rel=1e-4)


# --------------------------------------------------------------------------------------------- rejection


def chain_threshold(thresholds, as_list):
    """A chain's thresholds as a list or as one comma-separated string."""
    return thresholds if as_list else ",".join(str(t) for t in thresholds)


@SETTINGS
@given(batch=batches(), chain=chains(), as_list=st.booleans())
def test_rejection_only_removes_tokens(batch, chain, as_list):
    modes, thresholds = chain
    thr = chain_threshold(thresholds, as_list)
    w, mask, _ = run(batch, rollout_rs=",".join(modes), rollout_rs_threshold=thr)
    assert w is None
    assert mask.dtype == batch.mask.dtype
    assert mask.shape == batch.mask.shape
    assert (mask.to(torch.int64) <= batch.mask.to(torch.int64)).all()
    assert not kept(mask)[~batch.valid].any()
    assert set(torch.unique(mask.to(torch.float64)).tolist()) <= {0.0, 1.0}


@SETTINGS
@given(batch=batches(), mode=st.sampled_from(RS_MODES), data=st.data())
def test_every_single_mode_only_removes_tokens(batch, mode, data):
    thr = threshold_for(data.draw, mode)
    _, mask, metrics = run(batch, rollout_rs=mode, rollout_rs_threshold=thr)
    assert (mask.to(torch.int64) <= batch.mask.to(torch.int64)).all()
    f = metrics.to_floats()
    removed = int((kept(batch.mask) & ~kept(mask)).sum())
    assert f[PREFIX + "rollout_rs_masked_fraction"] == pytest.approx(removed / int(batch.valid.sum()), abs=1e-6)
    if mode.startswith("seq_"):
        # a sequence mode keeps or removes whole rows
        for i in range(mask.shape[0]):
            row = kept(mask)[i][batch.valid[i]]
            assert row.all() or not row.any()


@SETTINGS
@given(batch=batches(), chain=chains(), as_list=st.booleans())
def test_chain_equals_and_of_its_modes(batch, chain, as_list):
    modes, thresholds = chain
    thr = chain_threshold(thresholds, as_list)
    _, chained, metrics = run(batch, rollout_rs=",".join(modes), rollout_rs_threshold=thr)
    expected = kept(batch.mask).clone()
    singles = {}
    for mode, t in zip(modes, thresholds):
        _, single, m = run(batch, rollout_rs=mode, rollout_rs_threshold=t)
        expected &= kept(single)
        singles[mode] = m.to_floats()
    assert torch.equal(kept(chained), expected)
    # per-mode metrics in a chain are those of the mode alone
    f = metrics.to_floats()
    for mode, single in singles.items():
        for key, value in single.items():
            if key.startswith(PREFIX + f"rollout_rs_{mode}_"):
                assert f[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@SETTINGS
@given(batch=batches(), mode=st.sampled_from(K1_MODES), u=st.floats(1.0, 5.0),
       form=st.sampled_from(["float", "str", "band"]))
def test_symmetric_k1_band_is_invariant_under_swapping_old_and_rollout(batch, mode, u, form):
    thr = {"float": u, "str": repr(u), "band": f"{1.0 / u!r}_{u!r}"}[form]
    _, m1, _ = correct(batch.old, batch.rollout, batch.mask, rollout_rs=mode, rollout_rs_threshold=thr)
    _, m2, _ = correct(batch.rollout, batch.old, batch.mask, rollout_rs=mode, rollout_rs_threshold=thr)
    assert torch.equal(m1, m2)


@SETTINGS
@given(batch=batches(), level=st.sampled_from(sorted(LEGACY)), u=st.floats(1.0, 5.0),
       lower=st.one_of(st.none(), st.floats(0.05, 1.0)), band_string=st.booleans())
def test_legacy_rs_names_equal_their_new_spelling(batch, level, u, lower, band_string):
    band_lower = 1.0 / u if lower is None else lower
    if band_string and lower is not None:
        legacy_kw = dict(rollout_rs_threshold=f"{lower!r}_{u!r}")
    else:
        legacy_kw = dict(rollout_rs_threshold=u)
        if lower is not None:
            legacy_kw["rollout_rs_threshold_lower"] = lower
    with pytest.warns(DeprecationWarning, match=LEGACY[level]):
        _, legacy_mask, legacy_metrics = run(batch, rollout_rs=level, **legacy_kw)
    _, new_mask, new_metrics = run(batch, rollout_rs=LEGACY[level], rollout_rs_threshold=f"{band_lower!r}_{u!r}")
    assert torch.equal(legacy_mask, new_mask)
    assert legacy_metrics.to_floats() == new_metrics.to_floats()


@SETTINGS
@given(batch=batches(), c=st.floats(0.01, 1.5))
def test_veto_removes_a_sequence_iff_some_valid_token_ratio_is_below_c(batch, c):
    with pytest.warns(DeprecationWarning):
        w, mask, metrics = run(batch, rollout_is="token", rollout_is_threshold=2.0, rollout_token_veto_threshold=c)
    lr = torch.where(batch.valid, (batch.old - batch.rollout).double(), torch.zeros((), dtype=torch.float64))
    ratio = torch.exp(lr)
    catastrophic = batch.valid & (ratio < c)
    # a ratio within float noise of C (e.g. exp(-1e-100) == 1.0 == C) may be classified either way
    ambiguous = batch.valid & ((lr - math.log(c)).abs() <= 1e-6) & (lr != math.log(c))
    assume(not ambiguous.any())
    vetoed = catastrophic.any(-1)
    expected = kept(batch.mask) & ~vetoed[:, None]
    assert torch.equal(kept(mask), expected)
    f = metrics.to_floats()
    nonempty = batch.valid.any(-1)
    assert f[PREFIX + "rollout_is_veto_fraction"] == pytest.approx(
        float((vetoed & nonempty).sum()) / float(nonempty.sum()), abs=1e-6)
    assert f[PREFIX + "rollout_is_catastrophic_token_fraction"] == pytest.approx(
        float(catastrophic.sum()) / float(batch.valid.sum()), abs=1e-7)
    # the veto changes the mask, never the IS weights
    w_plain, _, _ = run(batch, rollout_is="token", rollout_is_threshold=2.0)
    assert torch.equal(w, w_plain)


# ----------------------------------------------------------------------------------- batch normalisation


@SETTINGS
@given(batch=batches(), mode=st.sampled_from(["truncate", "clip", "mask"]), upper=st.floats(1.0, 10.0),
       lower=st.floats(0.05, 1.0))
def test_token_batch_normalisation_gives_masked_mean_one(batch, mode, upper, lower):
    kw = dict(rollout_is="token", rollout_is_threshold=upper, rollout_is_mode=mode)
    if mode != "truncate":
        kw["rollout_is_threshold_lower"] = lower
    w0, _, m0 = run(batch, **kw)
    w1, _, m1 = run(batch, rollout_is_batch_normalize=True, **kw)
    v = batch.valid
    mean0 = float(w0.double()[v].mean())
    factor = m1.to_floats()[PREFIX + "rollout_is_batch_norm_factor"]
    assert (w1[~v] == 0).all()
    if mean0 > 1e-7:
        assert float(w1.double()[v].mean()) == pytest.approx(1.0, rel=1e-5)
        assert factor == pytest.approx(mean0, rel=1e-5)
        assert torch.allclose(w1.double(), w0.double() / mean0, rtol=1e-5, atol=0.0)
    elif mean0 < 1e-9:  # e.g. IcePop with every token outside the band: nothing to normalise
        assert torch.equal(w1, w0)
        assert factor == 1.0
    # metrics other than the factor describe the weights before normalisation
    f0, f1 = m0.to_floats(), m1.to_floats()
    for key, value in f0.items():
        assert f1[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


@SETTINGS
@given(batch=batches(), level=st.sampled_from(["sequence", "geometric"]),
       mode=st.sampled_from(["truncate", "clip", "mask"]), upper=st.floats(1.0, 10.0), lower=st.floats(0.05, 1.0))
def test_sequence_batch_normalisation_gives_mean_one_over_nonempty_rows(batch, level, mode, upper, lower):
    kw = dict(rollout_is=level, rollout_is_threshold=upper, rollout_is_mode=mode)
    if mode != "truncate":
        kw["rollout_is_threshold_lower"] = lower
    w0, _, _ = run(batch, **kw)
    w1, _, m1 = run(batch, rollout_is_batch_normalize=True, **kw)
    v = batch.valid
    nonempty = v.any(-1)
    n = v.sum(-1).double()

    def row_means(w):
        return (torch.where(v, w.double(), 0.0).sum(-1) / n.clamp(min=1))[nonempty]

    mean0 = float(row_means(w0).mean())
    factor = m1.to_floats()[PREFIX + "rollout_is_batch_norm_factor"]
    if mean0 > 1e-7:
        assert float(row_means(w1).mean()) == pytest.approx(1.0, rel=1e-5)
        assert factor == pytest.approx(mean0, rel=1e-5)
    elif mean0 < 1e-9:
        assert torch.equal(w1, w0)
        assert factor == 1.0


# ------------------------------------------------------------------------------------------------ extras


@SETTINGS
@given(batch=batches(), chain=chains(), level=st.sampled_from(["token", "sequence", "geometric"]),
       upper=st.floats(1.0, 10.0))
def test_rejection_never_changes_weights_and_is_never_changes_mask(batch, chain, level, upper):
    modes, thresholds = chain
    w_is, m_is, _ = run(batch, rollout_is=level, rollout_is_threshold=upper)
    _, m_rs, _ = run(batch, rollout_rs=",".join(modes), rollout_rs_threshold=thresholds)
    w_both, m_both, _ = run(batch, rollout_is=level, rollout_is_threshold=upper,
                            rollout_rs=",".join(modes), rollout_rs_threshold=thresholds)
    assert torch.equal(w_both, w_is)
    assert torch.equal(m_both, m_rs)
    assert torch.equal(m_is, batch.mask)


@SETTINGS
@given(batch=batches(), chain=chains(), level=st.sampled_from(["token", "sequence", "geometric"]),
       threshold=st.sampled_from([2.0, "0.5_2.0"]), normalize=st.booleans())
def test_all_metrics_finite_and_all_floats(batch, chain, level, threshold, normalize):
    modes, thresholds = chain
    w, _, metrics = run(batch, rollout_is=level, rollout_is_threshold=threshold,
                        rollout_is_batch_normalize=normalize,
                        rollout_rs=",".join(modes), rollout_rs_threshold=thresholds, agreement_metrics=True)
    f = metrics.to_floats()
    assert set(f) == set(metrics)
    assert all(k.startswith(PREFIX) for k in f)
    bad = {k: v for k, v in f.items() if not (isinstance(v, float) and math.isfinite(v))}
    assert not bad
    assert torch.isfinite(w).all()


@SETTINGS
@given(batch=batches())
def test_p99_matches_torch_quantile(batch):
    _, _, metrics = run(batch, agreement_metrics=True)
    f = metrics.to_floats()
    values = (batch.old - batch.rollout).abs()[batch.valid]
    rel = 1e-12 if batch.old.dtype == torch.float64 else 1e-6
    assert f[PREFIX + "logprob_abs_diff_p99"] == pytest.approx(float(torch.quantile(values, 0.99)), rel=rel, abs=1e-9)
    assert f[PREFIX + "logprob_abs_diff_max"] == pytest.approx(float(values.max()), rel=1e-6, abs=1e-9)
    assert f[PREFIX + "logprob_abs_diff_mean"] == pytest.approx(float(values.mean()), rel=1e-5, abs=1e-7)


@SETTINGS
@given(batch=batches(), chain=chains(), level=st.sampled_from(["token", "sequence", "geometric"]),
       threshold=st.sampled_from([2.0, "0.5_2.0"]), block=st.integers(1, 40))
def test_blocked_pass_equals_whole_batch_pass(batch, chain, level, threshold, block):
    """The eager path processes blocks of whole rows; the result must not depend on the block size."""
    modes, thresholds = chain
    kw = dict(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=True,
              rollout_rs=",".join(modes), rollout_rs_threshold=thresholds, agreement_metrics=True)
    w_whole, m_whole, f_whole = run(batch, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pipeline, "_BLOCK_ELEMENTS", block)
        w_blk, m_blk, f_blk = run(batch, **kw)
    assert torch.equal(m_blk, m_whole)
    assert torch.allclose(w_blk, w_whole, rtol=1e-6, atol=0.0)
    a, b = f_whole.to_floats(), f_blk.to_floats()
    assert set(a) == set(b)
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), key


def test_no_warning_without_legacy_options():
    batch = Batch(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.1, -1.9]]), torch.ones(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(batch, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold=2.0)
