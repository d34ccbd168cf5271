"""Policy losses: agg_loss, PPO clip (dual clip), REINFORCE, bypass dispatch, DeepSeek-V3.2 off-policy
sequence masking.

Reference: verl-rollout-correction-and-router-replay.md §3 (agg_loss, vanilla PPO, REINFORCE, bypass);
tp-batch-invariance-icepop-r3.md §5.4 (off-policy sequence masking).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moealign.correction import (
    AGG_MODES,
    RolloutCorrectionConfig,
    agg_loss,
    bypass_policy_loss,
    compute_rollout_correction_and_rejection_mask,
    deepseek_offpolicy_sequence_mask,
    ppo_clip_loss,
    reinforce_loss,
)

C = RolloutCorrectionConfig
F64 = torch.float64
SHIFT = -64.0  # added to hand-made log-probs so that they are <= 0 (only differences matter); exact in float64


def _t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# agg_loss on a hand-computed (B=3, T=4) example with an empty row
#
#   loss = [[ 1,  2,  3,  4],      mask = [[1, 1, 0, 0],     row sums  s = [3, -, 42]
#           [ 5,  6,  7,  8],              [0, 0, 0, 0],     row sizes n = [2, 0, 4]
#           [ 9, 10, 11, 12]]              [1, 1, 1, 1]]
#
# token-sum = 3 + 42 = 45                       token-mean = 45 / 6 = 7.5
# seq-mean-token-sum = (3 + 42) / 2 = 22.5      seq-mean-token-mean = (3/2 + 42/4) / 2 = (1.5 + 10.5) / 2 = 6
# seq-mean-token-sum-norm = 22.5 / T = 22.5 / 4 = 5.625

LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]]
MASK = [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
EXPECTED = {
    "token-sum": 45.0,
    "token-mean": 7.5,
    "seq-mean-token-sum": 22.5,
    "seq-mean-token-mean": 6.0,
    "seq-mean-token-sum-norm": 5.625,
}


def test_agg_modes_listed():
    assert set(AGG_MODES) == set(EXPECTED)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool, torch.int64, F64])
def test_agg_loss_hand_example(mode, mask_dtype):
    out = agg_loss(_t(LOSS), _t(MASK, mask_dtype), mode)
    assert out.dim() == 0
    assert out.item() == EXPECTED[mode]


def test_agg_loss_default_mode_is_token_mean():
    assert agg_loss(_t(LOSS), _t(MASK)).item() == 7.5


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {"num_tokens": 10}, 45.0 / 10),
        ("token-mean", {"num_tokens": torch.tensor(9.0)}, 45.0 / 9),
        ("token-mean", {"num_seqs": 7}, 7.5),  # num_seqs does not touch token-mean
        ("token-sum", {"num_tokens": 10, "num_seqs": 7}, 45.0),
        ("seq-mean-token-sum", {"num_seqs": 3}, 45.0 / 3),
        ("seq-mean-token-sum", {"num_seqs": torch.tensor(5)}, 45.0 / 5),
        ("seq-mean-token-sum", {"num_tokens": 100}, 22.5),  # num_tokens does not touch seq modes
        ("seq-mean-token-mean", {"num_seqs": 3}, 12.0 / 3),
        ("seq-mean-token-sum-norm", {"num_seqs": 3}, 45.0 / 3 / 4),
        ("seq-mean-token-sum-norm", {"loss_scale_factor": 10.0}, 22.5 / 10),
        ("seq-mean-token-sum-norm", {"num_seqs": 3, "loss_scale_factor": 2.5}, 45.0 / 3 / 2.5),
    ],
)
def test_agg_loss_overrides(mode, kwargs, expected):
    out = agg_loss(_t(LOSS), _t(MASK), mode, **kwargs)
    assert out.item() == pytest.approx(expected, rel=1e-15, abs=0)


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="token-average"):
        agg_loss(_t(LOSS), _t(MASK), "token-average")


def test_agg_loss_bad_shapes_and_scale():
    with pytest.raises(ValueError):
        agg_loss(_t(LOSS), _t(MASK)[:, :3])
    with pytest.raises(ValueError):
        agg_loss(_t(LOSS)[0], _t(MASK)[0])
    with pytest.raises(ValueError):
        agg_loss(_t(LOSS), _t(MASK), "seq-mean-token-sum-norm", loss_scale_factor=0.0)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_agg_loss_empty_mask_is_zero(mode):
    loss = _t(LOSS).requires_grad_(True)
    out = agg_loss(loss, torch.zeros(3, 4), mode)
    assert out.item() == 0.0
    assert not torch.isnan(out)
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(3, 4, dtype=F64))


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_agg_loss_nan_at_padding_does_not_leak(mode):
    poisoned = _t(LOSS)
    mask = _t(MASK)
    poisoned[mask == 0] = float("nan")
    poisoned[0, 3] = float("inf")
    poisoned[1, 0] = -float("inf")
    poisoned.requires_grad_(True)
    out = agg_loss(poisoned, mask, mode)
    assert out.item() == EXPECTED[mode]
    out.backward()
    assert torch.isfinite(poisoned.grad).all()
    assert torch.equal(poisoned.grad[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=F64))


def test_agg_loss_gradient_hand_example():
    loss = _t(LOSS).requires_grad_(True)
    agg_loss(loss, _t(MASK), "seq-mean-token-mean").backward()
    # d/dL = m / (n_i * G), G = 2 non-empty rows
    expected = _t([[0.25, 0.25, 0, 0], [0, 0, 0, 0], [0.125, 0.125, 0.125, 0.125]])
    assert torch.equal(loss.grad, expected)


# ----------------------------------------------------------------------------------------------------
# PPO clip: per-token values


def _ppo_one(r, a, **kw):
    """The per-token PPO loss of one token with ratio r and advantage a (a (1, 1) batch, token-mean)."""
    log_prob = torch.tensor([[math.log(r) + SHIFT]], dtype=F64)
    old = torch.full((1, 1), SHIFT, dtype=F64)
    loss, _ = ppo_clip_loss(log_prob, old, torch.tensor([[a]], dtype=F64), torch.ones(1, 1), **kw)
    return loss.item()


@pytest.mark.parametrize(
    "r, a, expected",
    [
        # eps = 0.2, clip_ratio_c = 3
        (1.1, 2.0, -2.2),  # A > 0, inside the range: -A r
        (1.5, 2.0, -2.4),  # A > 0, above 1 + eps: -A (1 + eps)
        (0.5, 2.0, -1.0),  # A > 0, below 1 - eps: not clipped, -A r
        (0.9, -2.0, 1.8),  # A < 0, inside: -A r
        (0.5, -2.0, 1.6),  # A < 0, below 1 - eps: -A (1 - eps)
        (1.5, -2.0, 3.0),  # A < 0, above 1 + eps: not clipped, -A r
        (2.5, -2.0, 5.0),  # A < 0, -A r = 5 < -A c = 6: dual clip inactive
        (5.0, -2.0, 6.0),  # A < 0, -A r = 10 > 6: dual clip -A c
        (100.0, -0.5, 1.5),  # dual clip: 0.5 * 3
        (5.0, 0.0, 0.0),
        (0.01, 1.0, -0.01),
    ],
)
def test_ppo_clip_per_token_values(r, a, expected):
    assert _ppo_one(r, a) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    "r, a, expected",
    [
        # clip_ratio_low = 0.1, clip_ratio_high = 0.3: range [0.9, 1.3]
        (1.25, 1.0, -1.25),
        (1.4, 1.0, -1.3),
        (0.95, -1.0, 0.95),
        (0.85, -1.0, 0.9),
        (0.85, 1.0, -0.85),
        (1.25, -1.0, 1.25),
    ],
)
def test_ppo_clip_asymmetric(r, a, expected):
    got = _ppo_one(r, a, clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.3)
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("r, a, c, expected", [(5.0, -2.0, 2.0, 4.0), (5.0, -2.0, 10.0, 10.0), (1.5, -1.0, 1.2, 1.2)])
def test_ppo_clip_dual_clip_constant(r, a, c, expected):
    assert _ppo_one(r, a, clip_ratio_c=c) == pytest.approx(expected, rel=1e-12)


def _ppo_reference(r, a, eps_low, eps_high, c):
    """Textbook PPO with dual clip, written per case (not the implementation's min/max form)."""
    if a > 0:
        return -a * min(r, 1.0 + eps_high)
    if a < 0:
        return min(-a * max(r, 1.0 - eps_low), -a * c)
    return 0.0


def test_ppo_clip_matches_reference_formula_on_random_tokens():
    g = torch.Generator().manual_seed(0)
    B, T = 7, 9
    log_prob = 1.5 * torch.randn(B, T, generator=g, dtype=F64) - 20.0  # log-probs: <= 0
    old = 0.3 * torch.randn(B, T, generator=g, dtype=F64) - 20.0
    adv = 2.0 * torch.randn(B, T, generator=g, dtype=F64)
    adv[0, :3] = 0.0
    for eps_low, eps_high, c in [(0.2, 0.2, 3.0), (0.1, 0.28, 2.0), (0.0, 0.0, 10.0)]:
        per_token = torch.empty(B, T, dtype=F64)
        for i in range(B):
            for j in range(T):
                r = math.exp(log_prob[i, j].item() - old[i, j].item())
                per_token[i, j] = _ppo_reference(r, adv[i, j].item(), eps_low, eps_high, c)
        mask = torch.ones(B, T)
        loss, _ = ppo_clip_loss(log_prob, old, adv, mask, clip_ratio_low=eps_low, clip_ratio_high=eps_high,
                                clip_ratio_c=c, loss_agg_mode="token-sum")
        torch.testing.assert_close(loss, per_token.sum(), rtol=1e-12, atol=1e-12)
        # and per token, by a one-hot mask
        for i, j in [(0, 0), (1, 4), (6, 8), (3, 2)]:
            one = torch.zeros(B, T)
            one[i, j] = 1
            tok, _ = ppo_clip_loss(log_prob, old, adv, one, clip_ratio_low=eps_low, clip_ratio_high=eps_high,
                                   clip_ratio_c=c, loss_agg_mode="token-mean")
            torch.testing.assert_close(tok, per_token[i, j], rtol=1e-12, atol=1e-12)


def test_ppo_clip_ratio_is_safety_clamped():
    # log-ratio 50 is clamped at 20 before exp
    assert _ppo_one(math.exp(50.0), 1.0, clip_ratio_high=1e12) == pytest.approx(-math.exp(20.0), rel=1e-12)


@pytest.mark.parametrize("c", [1.0, 0.5, 0.0, -3.0, True])
def test_ppo_clip_ratio_c_must_exceed_one(c):
    x = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError):
        ppo_clip_loss(x, x, x, torch.ones(1, 2), clip_ratio_c=c)


def test_ppo_clip_bad_clip_ratios():
    x = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ValueError):
        ppo_clip_loss(x, x, x, torch.ones(1, 2), clip_ratio_low=1.0)
    with pytest.raises(ValueError):
        ppo_clip_loss(x, x, x, torch.ones(1, 2), clip_ratio_high=-0.1)
    with pytest.raises(ValueError):
        ppo_clip_loss(x, x, x, torch.ones(1, 3))


# (ratio, advantage) per token, one row; the last token is padding that would count as clipped and
# dual-clipped if it leaked into the metrics.
METRIC_TOKENS = [
    (1.1, 2.0),  # L1 = L2 = -2.2: not clipped
    (1.5, 2.0),  # L1 = -3.0 < L2 = -2.4: clipped
    (0.5, -2.0),  # L1 = 1.0 < L2 = 1.6: clipped
    (5.0, -2.0),  # L1 = 10 > L2 = 2.4: not clipped; Lc = 10 > L3 = 6 and A < 0: lower clip
    (0.5, 2.0),  # L1 = -1.0 > L2 = -1.6: not clipped
    (10.0, -5.0),  # padding
]


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_ppo_clip_metrics_exact(mask_dtype):
    ratios = [r for r, _ in METRIC_TOKENS]
    log_prob = torch.tensor([[math.log(r) + SHIFT for r in ratios]], dtype=F64)
    old = torch.full_like(log_prob, SHIFT)
    adv = torch.tensor([[a for _, a in METRIC_TOKENS]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=mask_dtype)
    loss, metrics = ppo_clip_loss(log_prob, old, adv, mask)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(2 / 5, rel=1e-15)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 5, rel=1e-15)
    expected_kl = -sum(math.log(r) for r in ratios[:5]) / 5
    assert metrics["actor/ppo_kl"].item() == pytest.approx(expected_kl, rel=1e-12)
    per_token = [-2.2, -2.4, 1.6, 6.0, -1.0]
    assert loss.item() == pytest.approx(sum(per_token) / 5, rel=1e-12)
    for v in metrics.values():
        assert not v.requires_grad


def test_ppo_clip_is_weights_multiply_and_are_detached():
    ratios = [r for r, _ in METRIC_TOKENS]
    log_prob = torch.tensor([[math.log(r) + SHIFT for r in ratios]], dtype=F64, requires_grad=True)
    old = torch.full((1, 6), SHIFT, dtype=F64)
    adv = torch.tensor([[a for _, a in METRIC_TOKENS]], dtype=F64)
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    weights = torch.tensor([[0.5, 2.0, 1.0, 0.25, 3.0, 7.0]], dtype=F64, requires_grad=True)
    loss, _ = ppo_clip_loss(log_prob, old, adv, mask, rollout_is_weights=weights)
    per_token = [-2.2, -2.4, 1.6, 6.0, -1.0]
    w = [0.5, 2.0, 1.0, 0.25, 3.0]
    assert loss.item() == pytest.approx(sum(p * q for p, q in zip(per_token, w)) / 5, rel=1e-12)
    loss.backward()
    assert weights.grad is None
    # unclipped tokens 0 and 4: -A r w / N; clipped tokens 1, 2, dual-clipped 3, padding 5: 0
    expected = torch.tensor([[-2.0 * 1.1 * 0.5 / 5, 0, 0, 0, -2.0 * 0.5 * 3.0 / 5, 0]], dtype=F64)
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------------------------------
# PPO clip: gradient in the unclipped and clipped regions

PPO_GRAD_TOKENS = [
    # (ratio, advantage, weight, mask, clipped?)
    (1.1, 1.0, 0.7, 1, False),
    (0.9, -1.0, 1.3, 1, False),
    (1.5, 1.0, 0.9, 1, True),  # A > 0 above 1 + eps
    (0.5, -1.0, 1.1, 1, True),  # A < 0 below 1 - eps
    (0.5, 1.0, 2.0, 1, False),  # A > 0 below 1 - eps: unclipped branch
    (1.5, -1.0, 0.4, 1, False),  # A < 0 above 1 + eps, below c: unclipped branch
    (4.0, -1.0, 1.0, 1, True),  # dual clip
    (1.0, 1.0, 1.0, 0, True),  # padding
    (1.05, 3.0, 0.2, 1, False),
]


@pytest.mark.parametrize("with_weights", [False, True])
def test_ppo_clip_gradient_regions(with_weights):
    ratios = torch.tensor([[t[0] for t in PPO_GRAD_TOKENS]], dtype=F64)
    adv = torch.tensor([[t[1] for t in PPO_GRAD_TOKENS]], dtype=F64)
    w = torch.tensor([[t[2] for t in PPO_GRAD_TOKENS]], dtype=F64)
    mask = torch.tensor([[t[3] for t in PPO_GRAD_TOKENS]], dtype=torch.float32)
    clipped = torch.tensor([[t[4] for t in PPO_GRAD_TOKENS]])
    old = torch.full_like(ratios, -11.3)
    log_prob = (old + ratios.log()).requires_grad_(True)
    kw = {"rollout_is_weights": w} if with_weights else {}
    loss, _ = ppo_clip_loss(log_prob, old, adv, mask, **kw)
    loss.backward()
    n = mask.sum().item()
    weight = w if with_weights else torch.ones_like(w)
    expected = torch.where(clipped, 0.0, -adv * ratios * weight / n)
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-12, atol=1e-15)
    assert (log_prob.grad[clipped] == 0).all()


# ----------------------------------------------------------------------------------------------------
# REINFORCE


def test_reinforce_per_token_and_metric():
    log_prob = _t([[-0.5, -1.0, -2.0], [-0.1, -0.2, -9.0]])
    rollout = _t([[-0.4, -1.5, -2.0], [-0.1, -0.1, 0.0]])
    adv = _t([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = _t([[1, 1, 1], [1, 1, 0]], torch.float32)
    w = _t([[1.0, 2.0, 0.5], [1.0, 0.5, 9.0]])
    loss, metrics = reinforce_loss(log_prob, adv, mask, rollout_is_weights=w, rollout_log_prob=rollout)
    # default mode seq-mean-token-sum: row 0 = 0.5 + 2.0 + 1.0 = 3.5; row 1 = -0.2 - 0.2 = -0.4
    assert loss.item() == pytest.approx((3.5 - 0.4) / 2, rel=1e-14)
    kl = (0.1 - 0.5 + 0.0 + 0.0 + 0.1) / 5
    assert metrics["actor/ppo_kl"].item() == pytest.approx(kl, rel=1e-12)
    loss_tm, metrics_tm = reinforce_loss(log_prob, adv, mask, rollout_is_weights=w, loss_agg_mode="token-mean")
    assert loss_tm.item() == pytest.approx((3.5 - 0.4) / 5, rel=1e-14)
    assert "actor/ppo_kl" not in metrics_tm


def _reinforce_expected_grad(adv, w, valid, mode):
    m = valid.to(F64)
    n_row = m.sum(dim=-1, keepdim=True)
    nonempty = (n_row > 0).sum().item()
    if mode == "token-mean":
        den = m.sum().item()
        return torch.zeros_like(adv) if den == 0 else -adv * w * m / den
    if mode == "seq-mean-token-sum":
        return torch.zeros_like(adv) if nonempty == 0 else -adv * w * m / nonempty
    # seq-mean-token-mean
    if nonempty == 0:
        return torch.zeros_like(adv)
    return -adv * w * m / torch.where(n_row > 0, n_row, 1.0) / nonempty


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 6),
    T=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
    use_weights=st.booleans(),
    p_valid=st.floats(0.0, 1.0),
)
def test_reinforce_gradient_property(B, T, seed, mode, use_weights, p_valid):
    g = torch.Generator().manual_seed(seed)
    log_prob = (-3.0 * torch.rand(B, T, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=F64)
    valid = torch.rand(B, T, generator=g) < p_valid
    w = 2.0 * torch.rand(B, T, generator=g, dtype=F64)
    weights = w.clone().requires_grad_(True) if use_weights else None
    loss, _ = reinforce_loss(log_prob, adv, valid.to(torch.float32), rollout_is_weights=weights, loss_agg_mode=mode)
    assert torch.isfinite(loss)
    loss.backward()
    expected = _reinforce_expected_grad(adv, w if use_weights else torch.ones_like(w), valid, mode)
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-12, atol=1e-14)
    if use_weights:
        assert weights.grad is None


# ----------------------------------------------------------------------------------------------------
# rejected tokens leave numerator and denominator
#
# d = log(pi / pi_behaviour) per token; RS token_k1 band [0.8, 1.25] keeps |d| <= log 1.25 = 0.223.
D = [[0.0, 0.1, 0.5, -0.05],  # token 2 rejected
     [0.6, -0.4, 0.0, 0.0],  # both valid tokens rejected: the row becomes empty
     [0.05, -0.1, 0.2, 9.9]]  # all valid kept; the padding has a wild ratio
VALID = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
ADV = [[1.5, -0.5, 2.0, 1.0], [-2.0, 3.0, 1.0, 1.0], [0.7, -1.2, 0.4, 5.0]]
LOGP = [[-0.3, -1.1, -2.5, -0.7], [-0.2, -1.9, -0.4, -0.6], [-1.4, -0.8, -0.9, -3.0]]
BAND = (0.8, 1.25)


def _kept_rows(d):
    """The kept tokens as lists of (i, j) per row (rows with none dropped): physically removed."""
    lo, hi = math.log(BAND[0]), math.log(BAND[1])
    rows = []
    for i in range(len(d)):
        row = [(i, j) for j in range(len(d[0])) if VALID[i][j] and lo <= d[i][j] <= hi]
        if row:
            rows.append(row)
    return rows


def _aggregate(rows, value, mode):
    if mode == "token-mean":
        tokens = [value(i, j) for row in rows for (i, j) in row]
        return sum(tokens) / len(tokens)
    sums = [sum(value(i, j) for (i, j) in row) for row in rows]
    return sum(sums) / len(sums)


def test_rejection_reference_batch_is_what_we_think():
    rows = _kept_rows(D)
    assert rows == [[(0, 0), (0, 1), (0, 3)], [(2, 0), (2, 1), (2, 2)]]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("with_is", [False, True])
def test_bypass_reinforce_rejected_tokens_removed(mode, with_is):
    cfg = C(rollout_is="token" if with_is else None, rollout_is_threshold=1.2,
            rollout_rs="token_k1", rollout_rs_threshold=f"{BAND[0]}_{BAND[1]}",
            bypass_mode=True, loss_type="reinforce")
    log_prob = _t(LOGP).requires_grad_(True)
    rollout = _t(LOGP) - _t(D)
    loss, metrics = bypass_policy_loss(log_prob, rollout, _t(ADV), _t(VALID, torch.float32), cfg,
                                       loss_agg_mode=mode)

    def value(i, j):
        w = min(math.exp(D[i][j]), 1.2) if with_is else 1.0
        return -ADV[i][j] * LOGP[i][j] * w

    assert loss.item() == pytest.approx(_aggregate(_kept_rows(D), value, mode), rel=1e-12)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(3 / 9, rel=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_bypass_ppo_clip_rejected_tokens_removed(mode):
    cfg = C(rollout_rs="token_k1", rollout_rs_threshold=f"{BAND[0]}_{BAND[1]}", bypass_mode=True,
            loss_type="ppo_clip")
    log_prob = _t(LOGP)
    rollout = _t(LOGP) - _t(D)
    loss, _ = bypass_policy_loss(log_prob, rollout, _t(ADV), _t(VALID, torch.float32), cfg, loss_agg_mode=mode)

    def value(i, j):
        return _ppo_reference(math.exp(D[i][j]), ADV[i][j], 0.2, 0.2, 3.0)

    assert loss.item() == pytest.approx(_aggregate(_kept_rows(D), value, mode), rel=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_decoupled_rejected_tokens_removed(mode):
    # decoupled: D is log(pi_old / pi_rollout); pi_theta differs from pi_old by E
    E = [[0.1, -0.3, 0.0, 0.05], [0.0, 0.2, 0.0, 0.0], [0.3, -0.02, 0.15, 0.0]]
    old = _t(LOGP)
    rollout = old - _t(D)
    log_prob = old + _t(E)
    mask = _t(VALID, torch.float32)
    weights, modified, _ = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=1.2,
        rollout_rs="token_k1", rollout_rs_threshold=f"{BAND[0]}_{BAND[1]}")
    assert modified.dtype == mask.dtype
    assert torch.equal(modified, _t([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]], torch.float32))
    loss, _ = ppo_clip_loss(log_prob, old, _t(ADV), modified, rollout_is_weights=weights, loss_agg_mode=mode)

    def value(i, j):
        w = min(math.exp(D[i][j]), 1.2)
        return w * _ppo_reference(math.exp(E[i][j]), ADV[i][j], 0.2, 0.2, 3.0)

    assert loss.item() == pytest.approx(_aggregate(_kept_rows(D), value, mode), rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# bypass_policy_loss dispatch


def _bypass_batch(seed=0, B=5, T=6):
    g = torch.Generator().manual_seed(seed)
    log_prob = (-2.0 * torch.rand(B, T, generator=g, dtype=F64)).requires_grad_(True)
    rollout = (log_prob.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=0.0)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).contiguous()
    lengths = torch.tensor([T, 4, 1, T, 2])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    return log_prob, rollout, adv, mask


@pytest.mark.parametrize(
    "cfg",
    [
        C.bypass_pg_is(),
        C.bypass_pg_token_icepop(threshold=1.3, threshold_lower=0.8),
        C.bypass_pg_geo_rs_token_tis(rs_threshold="0.9_1.1"),
        C(rollout_is="geometric", rollout_is_threshold="0.7_1.4", rollout_is_mode="clip",
          rollout_rs="token_k1", rollout_rs_threshold=1.4, bypass_mode=True, loss_type="reinforce"),
    ],
    ids=["pg_is", "pg_token_icepop", "pg_geo_rs_token_tis", "geometric-clip-token-rs"],
)
@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "token-mean"])
def test_bypass_reinforce_branch(cfg, mode):
    log_prob, rollout, adv, mask = _bypass_batch()
    loss, metrics = bypass_policy_loss(log_prob, rollout, adv, mask, cfg, loss_agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, log_prob)

    weights, modified, corr = compute_rollout_correction_and_rejection_mask(
        log_prob.detach(), rollout, mask, **cfg.to_kwargs())
    assert weights is not None
    ref_loss, ref_metrics = reinforce_loss(log_prob, adv, modified, rollout_is_weights=weights,
                                           rollout_log_prob=rollout, loss_agg_mode=mode)
    (ref_grad,) = torch.autograd.grad(ref_loss, log_prob)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad, ref_grad)
    assert "rollout_corr/kl" in metrics
    for key, value in corr.items():
        assert torch.equal(metrics[key], value), key
    assert torch.equal(metrics["actor/ppo_kl"], ref_metrics["actor/ppo_kl"])


@pytest.mark.parametrize(
    "cfg",
    [
        C.bypass_ppo_clip(),
        C.bypass_ppo_clip_geo_rs(rs_threshold="0.9_1.1"),
        C.bypass_ppo_clip_k3_rs(rs_threshold=0.02),
        # IS configured too: the PPO branch must still apply no IS weight
        C(rollout_is="token", rollout_is_threshold=1.05, rollout_rs="token_k1", rollout_rs_threshold=1.5,
          bypass_mode=True, loss_type="ppo_clip"),
    ],
    ids=["ppo_clip", "ppo_clip_geo_rs", "ppo_clip_k3_rs", "with-is"],
)
def test_bypass_ppo_clip_branch_has_no_is_weights(cfg):
    log_prob, rollout, adv, mask = _bypass_batch(seed=1)
    loss, metrics = bypass_policy_loss(log_prob, rollout, adv, mask, cfg, clip_ratio=0.1)
    (grad,) = torch.autograd.grad(loss, log_prob)
    _, modified, _ = compute_rollout_correction_and_rejection_mask(log_prob.detach(), rollout, mask,
                                                                   **cfg.to_kwargs())
    ref_loss, ref_metrics = ppo_clip_loss(log_prob, rollout, adv, modified, clip_ratio=0.1)
    (ref_grad,) = torch.autograd.grad(ref_loss, log_prob)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad, ref_grad)
    assert "rollout_corr/kl" in metrics
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert torch.equal(metrics[key], ref_metrics[key])


def test_bypass_ppo_clip_with_is_differs_from_weighted():
    # sanity: with IS configured, applying the weights would have changed the loss
    cfg = C(rollout_is="token", rollout_is_threshold=1.05, bypass_mode=True, loss_type="ppo_clip")
    log_prob, rollout, adv, mask = _bypass_batch(seed=1)
    loss, metrics = bypass_policy_loss(log_prob, rollout, adv, mask, cfg)
    weights, modified, _ = compute_rollout_correction_and_rejection_mask(log_prob.detach(), rollout, mask,
                                                                         **cfg.to_kwargs())
    weighted, _ = ppo_clip_loss(log_prob, rollout, adv, modified, rollout_is_weights=weights)
    assert not torch.allclose(loss, weighted)
    assert "rollout_corr/rollout_is_mean" in metrics  # weights still computed, for metrics


@pytest.mark.parametrize("cfg", [C.decoupled_token_is(), C.disabled(), C.decoupled_geo_rs()])
def test_bypass_requires_bypass_mode(cfg):
    log_prob, rollout, adv, mask = _bypass_batch()
    with pytest.raises(ValueError):
        bypass_policy_loss(log_prob, rollout, adv, mask, cfg)


def test_bypass_weights_follow_pi_theta():
    # the correction is recomputed against the current pi_theta: moving pi_theta changes the weights
    cfg = C.bypass_pg_is(threshold=100.0)
    log_prob, rollout, adv, mask = _bypass_batch(seed=2)
    _, m1 = bypass_policy_loss(log_prob, rollout, adv, mask, cfg)
    shifted = (log_prob.detach() + 0.01).requires_grad_(True)
    _, m2 = bypass_policy_loss(shifted, rollout, adv, mask, cfg)
    assert m2["rollout_corr/rollout_is_mean"] > m1["rollout_corr/rollout_is_mean"]
    # sequence weight of row 2 (one valid token): exp(log_prob - rollout) of that token
    w, _, _ = compute_rollout_correction_and_rejection_mask(log_prob.detach(), rollout, mask,
                                                            **cfg.to_kwargs())
    expected = math.exp(log_prob[2, 0].item() - rollout[2, 0].item())
    assert w[2, 0].item() == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# DeepSeek-V3.2 off-policy sequence masking
#
# per row: k = mean over valid tokens of (rollout - log_prob); drop iff A < 0 and k > delta (delta = 0.1)
DS_DIFF = [  # rollout - log_prob
    [0.3, 0.3, 0.3, 0.0],  # k = 0.3  (A < 0): drop
    [0.05, 0.05, 100.0, 0.0],  # k = 0.05 over the 2 valid tokens (the padding would push it to 33): keep
    [0.5, 0.5, 0.5, 0.5],  # k = 0.5, A > 0: keep
    [-0.4, -0.4, -0.4, -0.4],  # k = -0.4, A < 0: keep
    [0.5, 0.5, 0.5, 0.5],  # k = 0.5, A = 0: keep
    [0.2, 0.0, 0.0, 0.0],  # k = 0.2 (one valid token), A < 0: drop
    [0.9, 0.9, 0.9, 0.9],  # empty row
]
DS_VALID = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]]
DS_ADV_ROW = [-1.0, -1.0, 2.0, -0.5, 0.0, -3.0, -1.0]
DS_KEEP_ROW = [0, 1, 1, 1, 1, 0, 1]


def _ds_inputs(mask_dtype=torch.float32):
    log_prob = _t([[-1.0, -2.0, -0.5, -0.1]] * 7) - 1.0  # rollout (log_prob + diff) stays <= 0
    # first row of the diff (0.3) on log-probs: tokens 0..2 of row 0 give mean 0.3 up to rounding
    rollout = log_prob + _t(DS_DIFF)
    mask = _t(DS_VALID, mask_dtype)
    return log_prob, rollout, mask


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, F64])
def test_deepseek_mask_row_advantages(mask_dtype):
    log_prob, rollout, mask = _ds_inputs(mask_dtype)
    out = deepseek_offpolicy_sequence_mask(log_prob, rollout, _t(DS_ADV_ROW), mask, delta=0.1)
    assert out.dtype == mask_dtype
    keep = torch.tensor(DS_KEEP_ROW, dtype=torch.bool)[:, None]
    expected = mask & keep if mask_dtype == torch.bool else mask * keep.to(mask_dtype)
    assert torch.equal(out, expected)
    assert torch.equal(mask, _t(DS_VALID, mask_dtype))  # input untouched


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_deepseek_mask_token_advantages(mask_dtype):
    log_prob, rollout, mask = _ds_inputs(mask_dtype)
    adv = _t(DS_ADV_ROW)[:, None].expand(7, 4).clone()
    # row 1: token advantages whose valid mean is -1 while the padding is large and positive
    adv[1] = _t([-1.5, -0.5, 50.0, 50.0])
    # row 2: valid mean +2 while the padding is very negative
    adv[2] = _t([1.0, 3.0, 2.0, 2.0])
    adv[0, 3] = 1e6  # padding of a dropped row
    out = deepseek_offpolicy_sequence_mask(log_prob, rollout, adv, mask, delta=0.1)
    row = deepseek_offpolicy_sequence_mask(log_prob, rollout, _t(DS_ADV_ROW), mask, delta=0.1)
    assert out.dtype == mask_dtype
    assert torch.equal(out, row)


def test_deepseek_mask_positive_advantage_kept_regardless():
    log_prob = torch.full((3, 5), SHIFT, dtype=F64)
    rollout = torch.full((3, 5), 50.0 + SHIFT, dtype=F64)  # enormous divergence
    mask = torch.ones(3, 5)
    out = deepseek_offpolicy_sequence_mask(log_prob, rollout, _t([1.0, 1e-9, 0.0]), mask, delta=0.0)
    assert torch.equal(out, mask)
    out = deepseek_offpolicy_sequence_mask(log_prob, rollout, _t([-1.0, -1e-9, 0.0]), mask, delta=0.0)
    assert torch.equal(out, _t([[0] * 5, [0] * 5, [1] * 5], torch.float32))


def test_deepseek_mask_threshold_is_strict():
    log_prob = torch.full((2, 2), SHIFT, dtype=F64)
    rollout = _t([[0.25, 0.25], [0.5, 0.0]]) + SHIFT  # k = 0.25 exactly for both rows
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = deepseek_offpolicy_sequence_mask(log_prob, rollout, _t([-1.0, -1.0]), mask, delta=0.25)
    assert torch.equal(out, mask)
    out = deepseek_offpolicy_sequence_mask(log_prob, rollout, _t([-1.0, -1.0]), mask, delta=0.2)
    assert not out.any()


@pytest.mark.parametrize("delta", [-0.1, -1, True, False, float("inf"), float("nan"), "0.1", None])
def test_deepseek_mask_bad_delta(delta):
    log_prob, rollout, mask = _ds_inputs()
    with pytest.raises(ValueError):
        deepseek_offpolicy_sequence_mask(log_prob, rollout, _t(DS_ADV_ROW), mask, delta=delta)


def test_deepseek_mask_int_delta_and_bad_advantage_shape():
    log_prob, rollout, mask = _ds_inputs()
    out = deepseek_offpolicy_sequence_mask(log_prob, rollout, _t(DS_ADV_ROW), mask, delta=0)
    assert out.dtype == mask.dtype
    with pytest.raises(ValueError):
        deepseek_offpolicy_sequence_mask(log_prob, rollout, _t(DS_ADV_ROW[:3]), mask, delta=0.1)
    with pytest.raises(ValueError):
        deepseek_offpolicy_sequence_mask(log_prob, rollout, torch.zeros(7, 3, dtype=F64), mask, delta=0.1)


def test_deepseek_mask_then_loss_drops_sequences():
    # the masked sequences leave the seq-mean denominator as well
    log_prob, rollout, mask = _ds_inputs()
    out = deepseek_offpolicy_sequence_mask(log_prob, rollout, _t(DS_ADV_ROW), mask, delta=0.1)
    loss_mat = torch.ones(7, 4, dtype=F64)
    # rows kept with >= 1 valid token: 1, 2, 3, 4 -> row sums 2, 4, 4, 4
    assert agg_loss(loss_mat, out, "seq-mean-token-sum").item() == pytest.approx(14 / 4, rel=1e-15)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert agg_loss(loss_mat, out, "token-mean").item() == 1.0


def test_bypass_reinforce_ignores_ppo_settings():
    import torch as _t

    from moealign.correction import RolloutCorrectionConfig as _C
    from moealign.correction.losses import bypass_policy_loss as _bp
    from moealign.correction.losses import reinforce_loss as _rl

    g = _t.Generator().manual_seed(0)
    lp = (-_t.rand(3, 5, generator=g)).requires_grad_()
    rl = (lp.detach() + 0.05 * _t.randn(3, 5, generator=g)).clamp(max=0.0)
    adv = _t.randn(3, 5, generator=g)
    mask = _t.ones(3, 5)
    cfg = _C.bypass_pg_is()
    loss, _ = _bp(lp, rl, adv, mask, cfg, clip_ratio=0.3, clip_ratio_c=2.0)
    w, m, _ = cfg.compute(lp.detach(), rl, mask)
    ref, _ = _rl(lp, adv, m, rollout_is_weights=w, rollout_log_prob=rl, loss_agg_mode="token-mean")
    assert _t.equal(loss.detach(), ref.detach())
