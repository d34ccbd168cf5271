"""Replay math: forced-id gate weights equal the native top-k's bit for bit, keep the router's gradient,
and agree with the transformers routers and aux loss they stand in for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moealign.routing_replay import (
    RouteError,
    RouterScoring,
    compact_routes,
    load_balancing_loss,
    replay_gate_weights,
    replay_recorded_gate_weights,
    select_topk,
)

MODES = {
    "softmax": (RouterScoring(), None),
    "softmax_renorm": (RouterScoring(renormalize=True), None),
    "softmax_topk": (RouterScoring(score="softmax_topk"), None),
    "softmax_topk_renorm_scaled": (RouterScoring(score="softmax_topk", renormalize=True, scaling_factor=1.5), None),
    "softmax_no_fp32": (RouterScoring(weights_in_fp32=False, renormalize=True), None),
    "softmax_grouped": (RouterScoring(renormalize=True, n_group=4, topk_group=2), None),
    "sigmoid": (RouterScoring(score="sigmoid"), None),
    "sigmoid_bias_renorm_scaled": (RouterScoring(score="sigmoid", renormalize=True, scaling_factor=2.5), "bias"),
    "sigmoid_grouped_bias": (
        RouterScoring(score="sigmoid", renormalize=True, scaling_factor=2.5, n_group=4, topk_group=2), "bias"),
    "softmax_bias": (RouterScoring(), "bias"),
}


def make_logits(tokens=64, experts=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=g) * 2).to(dtype)


def make_bias(experts=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(experts, generator=g) * 0.3


# ----------------------------------------------------------------------------------------- hand values


def test_hand_values_softmax_families():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    logits = probs.log()  # softmax(logits) == probs
    ids = torch.tensor([[3, 1]])
    f64 = dict(out_dtype=torch.float64)
    w = replay_gate_weights(logits, ids, RouterScoring(weights_in_fp32=False), **f64)
    assert torch.allclose(w, torch.tensor([[0.4, 0.2]], dtype=torch.float64))
    w = replay_gate_weights(logits, ids, RouterScoring(renormalize=True, weights_in_fp32=False), **f64)
    assert torch.allclose(w, torch.tensor([[2 / 3, 1 / 3]], dtype=torch.float64))
    # softmax over the two gathered logits log 0.4, log 0.2
    w = replay_gate_weights(logits, ids, RouterScoring(score="softmax_topk", weights_in_fp32=False), **f64)
    assert torch.allclose(w, torch.tensor([[2 / 3, 1 / 3]], dtype=torch.float64))
    w = replay_gate_weights(logits, ids, RouterScoring(scaling_factor=3.0, weights_in_fp32=False), **f64)
    assert torch.allclose(w, torch.tensor([[1.2, 0.6]], dtype=torch.float64))
    # slot order follows ids
    w = replay_gate_weights(logits, torch.tensor([[1, 3]]), RouterScoring(weights_in_fp32=False), **f64)
    assert torch.allclose(w, torch.tensor([[0.2, 0.4]], dtype=torch.float64))


def test_hand_values_sigmoid_with_bias():
    # sigmoid scores 0.5, 0.75, 0.2, ~0; the bias moves the choice, never the weights
    s = torch.tensor([[0.5, 0.75, 0.2, 1e-4]], dtype=torch.float64)
    logits = torch.log(s / (1 - s))
    scoring = RouterScoring(score="sigmoid", renormalize=True, scaling_factor=2.0)
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    w, ids = select_topk(logits, 2, scoring, expert_bias=bias)
    assert ids.tolist() == [[2, 1]]  # 0.2 + 1.0 beats 0.75
    assert torch.allclose(w, torch.tensor([[0.2, 0.75]], dtype=torch.float64) / 0.95 * 2.0)
    w, ids = select_topk(logits, 2, scoring)
    assert ids.tolist() == [[1, 0]]
    assert torch.allclose(w, torch.tensor([[0.75, 0.5]], dtype=torch.float64) / 1.25 * 2.0)


def test_hand_values_group_limited():
    # 8 experts, 4 groups of 2, keep the best 2 groups. Sigmoid groups are ranked by their top-2 sum.
    s = torch.tensor([[0.9, 0.1, 0.6, 0.6, 0.8, 0.7, 0.2, 0.2]])
    logits = torch.log(s / (1 - s))  # sigmoid(logits) == s
    scoring = RouterScoring(score="sigmoid", n_group=4, topk_group=2)
    _, ids = select_topk(logits, 3, scoring)
    # group sums: 1.0, 1.2, 1.5, 0.4 -> groups 2 and 1 -> experts {4, 5, 2 or 3}; expert 0 (0.9) excluded
    chosen = set(ids[0].tolist())
    assert {4, 5} <= chosen and 0 not in chosen and chosen & {2, 3}
    # without the group limit expert 0 wins
    _, ids = select_topk(logits, 3, RouterScoring(score="sigmoid"))
    assert ids[0, 0].item() == 0
    # softmax groups are ranked by their best member: maxima 0.9, 0.6, 0.8, 0.2 -> groups 0 and 2
    _, ids = select_topk(s.log(), 3, RouterScoring(n_group=4, topk_group=2))
    assert sorted(ids[0].tolist()) == [0, 4, 5]


# ----------------------------------------------------------------------------------------- bitwise replay


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", list(MODES))
def test_replay_at_native_ids_is_bitwise_equal(mode, dtype):
    scoring, bias = MODES[mode]
    bias = make_bias() if bias else None
    logits = make_logits(dtype=dtype)
    w_native, ids = select_topk(logits, 4, scoring, expert_bias=bias)
    assert ids.dtype == torch.int64 and w_native.dtype == dtype
    for stored in (ids, compact_routes(ids, 16), ids.to(torch.int16), ids.to(torch.int32)):
        w_replay = replay_gate_weights(logits, stored, scoring)
        assert torch.equal(w_replay, w_native), (mode, stored.dtype)

    # negative control: other ids (shifted by one expert) give other weights
    other = (ids + 1) % 16
    assert not torch.equal(replay_gate_weights(logits, other, scoring), w_native)


@pytest.mark.parametrize("mode", list(MODES))
def test_replay_keeps_the_router_gradient(mode):
    scoring, _ = MODES[mode]
    logits = make_logits().requires_grad_(True)
    ids = torch.rand(64, 16).argsort(dim=-1)[:, :4].to(torch.uint8)  # forced, not the router's choice
    w = replay_gate_weights(logits, ids, scoring)
    (w * torch.linspace(-1, 1, 4)).sum().backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0


def test_replay_gradient_matches_autograd_of_the_formula():
    logits = make_logits(tokens=5, experts=6, dtype=torch.float64).requires_grad_(True)
    ids = torch.tensor([[0, 5], [1, 2], [3, 4], [5, 0], [2, 3]])
    scoring = RouterScoring(renormalize=True, weights_in_fp32=False)
    up = torch.randn(5, 2, dtype=torch.float64)
    (replay_gate_weights(logits, ids, scoring) * up).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(ref_logits, dim=-1).gather(1, ids)
    ((p / p.sum(-1, keepdim=True)) * up).sum().backward()
    assert torch.allclose(logits.grad, ref_logits.grad)


def test_out_dtype():
    logits = make_logits(dtype=torch.bfloat16)
    w, ids = select_topk(logits, 2, RouterScoring(), out_dtype=torch.float32)
    assert w.dtype == torch.float32
    assert torch.equal(replay_gate_weights(logits, ids, RouterScoring(), out_dtype=torch.float32), w)


# ----------------------------------------------------------------------------------------- vs transformers


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_topk_is_qwen3_moe_router(norm, dtype):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = SimpleNamespace(num_experts_per_tok=4, num_experts=16, norm_topk_prob=norm, hidden_size=32)
    router = Qwen3MoeTopKRouter(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g) * 0.5)
    router = router.to(dtype)
    hidden = torch.randn(50, 32, generator=g).to(dtype)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = select_topk(logits, 4, RouterScoring(renormalize=norm))
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights)
    assert torch.equal(replay_gate_weights(logits, hf_ids, RouterScoring(renormalize=norm)), hf_weights)


def test_select_topk_is_deepseek_v3_router():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3TopkRouter,
    )

    config = SimpleNamespace(num_experts_per_tok=4, num_local_experts=32, hidden_size=24, routed_scaling_factor=2.5,
                             n_group=8, topk_group=3, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 24, generator=g) * 0.5)
        router.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.2)
    hidden = torch.randn(40, 24, generator=g)
    logits, hf_weights, hf_ids = router(hidden)
    scoring = RouterScoring(score="sigmoid", renormalize=True, scaling_factor=2.5, n_group=8, topk_group=3)
    weights, ids = select_topk(logits, 4, scoring, expert_bias=router.e_score_correction_bias)
    # HF uses topk(sorted=False): compare per token after ordering the slots by expert id
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    assert torch.allclose(hf_weights.gather(1, hf_order), weights.gather(1, order), rtol=1e-6, atol=0)
    replayed = replay_gate_weights(logits, hf_ids, scoring)
    assert torch.allclose(replayed, hf_weights, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------- recorded weights


def test_replay_recorded_gate_weights():
    like = torch.zeros(3, 8, dtype=torch.bfloat16, requires_grad=True)
    recorded = torch.tensor([[0.5, 0.25], [0.7, 0.3], [1.0, 0.0]], requires_grad=True)
    out = replay_recorded_gate_weights(recorded, like)
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    assert torch.equal(out, recorded.detach().to(torch.bfloat16))


@pytest.mark.parametrize("recorded, like, fragment", [
    (torch.tensor([[0.5, float("nan")], [0.5, 0.5]]), torch.zeros(2, 4), r"recorded_weights\[0, 1\] = nan is not finite"),
    (torch.tensor([[0.5, 0.5], [float("inf"), 0.5]]), torch.zeros(2, 4), r"recorded_weights\[1, 0\] = inf"),
    (torch.tensor([[0.5, 0.5]]), torch.zeros(2, 4), r"recorded_weights \(1, 2\) and like \(2, 4\) disagree on tokens"),
    (torch.tensor([0.5, 0.5]), torch.zeros(2, 4), r"shape \[tokens, k\], got \(2,\)"),
    (torch.tensor([[1, 0]]), torch.zeros(1, 4), "floating tensor, got dtype torch.int64"),
    (torch.tensor([[0.5, 0.5]]), torch.zeros(1, 4, dtype=torch.int64), "like must be a floating tensor"),
])
def test_replay_recorded_gate_weights_errors(recorded, like, fragment):
    with pytest.raises(RouteError, match=fragment):
        replay_recorded_gate_weights(recorded, like)


# ----------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kw, fragment", [
    (dict(score="softmaxx"), r"unknown router score 'softmaxx'; expected one of \('softmax', 'softmax_topk', 'sigmoid'\)"),
    (dict(n_group=4), "n_group and topk_group must be given together"),
    (dict(topk_group=2), "n_group and topk_group must be given together"),
    (dict(n_group=2, topk_group=3), "topk_group=3 > n_group=2"),
    (dict(n_group=0, topk_group=0), "n_group must be >= 1"),
    (dict(scaling_factor=0.0), "scaling_factor must be a finite number > 0"),
    (dict(scaling_factor=float("nan")), "scaling_factor must be a finite number > 0"),
    (dict(renormalize=1), "renormalize must be a bool"),
])
def test_router_scoring_errors(kw, fragment):
    with pytest.raises(RouteError, match=fragment):
        RouterScoring(**kw)


def test_group_errors_at_use_time():
    logits = make_logits(tokens=4, experts=12)
    with pytest.raises(RouteError, match="n_group=5 does not divide num_experts=12"):
        select_topk(logits, 2, RouterScoring(n_group=5, topk_group=2))
    with pytest.raises(RouteError, match="n_group=5 does not divide num_experts=12"):
        replay_gate_weights(logits, torch.tensor([[0, 1]] * 4), RouterScoring(n_group=5, topk_group=2))
    with pytest.raises(RouteError, match="k=7 experts cannot be chosen from topk_group=2 groups of 3"):
        select_topk(logits, 7, RouterScoring(n_group=4, topk_group=2))
    with pytest.raises(RouteError, match="1 expert per group"):
        select_topk(logits, 2, RouterScoring(score="sigmoid", n_group=12, topk_group=4))


@pytest.mark.parametrize("k, bias, fragment", [
    (0, None, "k must be >= 1"),
    (17, None, r"k=17 > num_experts=16"),
    (2.0, None, "k must be an int"),
    (2, torch.zeros(15), r"expert_bias must have shape \(16,\) to match logits \(8, 16\), got \(15,\)"),
    (2, torch.zeros(16, dtype=torch.int64), "expert_bias must be a floating tensor"),
])
def test_select_topk_errors(k, bias, fragment):
    with pytest.raises(RouteError, match=fragment):
        select_topk(make_logits(tokens=8), k, RouterScoring(), expert_bias=bias)


@pytest.mark.parametrize("logits, ids, fragment", [
    (make_logits(tokens=8), torch.zeros(7, 2, dtype=torch.int64),
     r"ids \(7, 2\) vs logits \(8, 16\)"),
    (make_logits(tokens=8), torch.zeros(8, dtype=torch.int64), r"ids \(8,\) vs logits \(8, 16\)"),
    (make_logits(tokens=2), torch.tensor([[0.0, 1.0], [1.0, 2.0]]), "ids must be an integer tensor"),
    (make_logits(tokens=2), torch.tensor([[0, 1], [1, 16]]), r"ids\[1, 1\] = 16 is not an expert id in \[0, 16\)"),
    (make_logits(tokens=2), torch.tensor([[0, 1], [5, 5]]), r"ids row \[1\] repeats expert 5"),
    (make_logits(tokens=2).to(torch.int64), torch.tensor([[0, 1], [1, 2]]), "logits must be a floating tensor"),
    (torch.zeros(2, 3, 4), torch.tensor([[0, 1], [1, 2]]), r"logits must have shape \[tokens, num_experts\]"),
])
def test_replay_gate_weights_errors(logits, ids, fragment):
    with pytest.raises(RouteError, match=fragment):
        replay_gate_weights(logits, ids, RouterScoring())


def test_replay_rejects_non_scoring():
    with pytest.raises(RouteError, match="scoring must be a RouterScoring"):
        replay_gate_weights(make_logits(tokens=1), torch.tensor([[0]]), "softmax")


# ----------------------------------------------------------------------------------------- aux loss


def _layers(num_layers=3, tokens=24, experts=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, experts, generator=g) * 1.5 for _ in range(num_layers))


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        load_balancing_loss_func,
    )

    layers = _layers()
    mask = None
    if masked:
        mask = torch.ones(4, 6, dtype=torch.int64)
        mask[0, 4:] = 0
        mask[2, :3] = 0
    ids = [torch.topk(torch.softmax(x, dim=-1), 2, dim=-1).indices for x in layers]
    ours = load_balancing_loss(layers, ids, 8, 2, attention_mask=mask)
    theirs = load_balancing_loss_func(layers, 8, 2, mask)
    assert ours.dtype == torch.float32 and ours.shape == ()
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    # the same ids as one [tokens, layers, k] uint8 route table
    table = torch.stack(ids, dim=1).to(torch.uint8)
    assert torch.allclose(load_balancing_loss(list(layers), table, 8, 2, attention_mask=mask), theirs, rtol=1e-6)

    # negative control: other (replayed) choices give another loss
    other = [(i + 3) % 8 for i in ids]
    assert not torch.allclose(load_balancing_loss(layers, other, 8, 2, attention_mask=mask), theirs)


def test_load_balancing_loss_hand_values():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 2)
    logits = [probs.log()]
    # P = (0.1, 0.2, 0.3, 0.4); all tokens on expert 3: 4 * 0.4, on expert 0: 4 * 0.1
    assert load_balancing_loss(logits, [torch.tensor([[3], [3]])], 4, 1).item() == pytest.approx(1.6, rel=1e-6)
    assert load_balancing_loss(logits, [torch.tensor([[0], [0]])], 4, 1).item() == pytest.approx(0.4, rel=1e-6)
    # a padded second token is ignored entirely
    mask = torch.tensor([[1, 0]])
    loss = load_balancing_loss(logits, [torch.tensor([[0], [3]])], 4, 1, attention_mask=mask)
    assert loss.item() == pytest.approx(0.4, rel=1e-6)


def test_load_balancing_loss_is_differentiable():
    layers = tuple(x.requires_grad_(True) for x in _layers())
    ids = [torch.rand(24, 8).argsort(dim=-1)[:, :2] for _ in layers]
    load_balancing_loss(layers, ids, 8, 2).backward()
    for x in layers:
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("logits, ids, top_k, mask, fragment", [
    ((), [], 2, None, "router_logits is empty"),
    (_layers(2), [torch.zeros(24, 2, dtype=torch.int64)], 2, None, "router_logits has 2 layers but ids has 1"),
    (_layers(1), [torch.zeros(24, 3, dtype=torch.int64)], 2, None,
     r"ids\[0\] must have shape \[tokens, top_k\] = \(24, 2\)"),
    (_layers(1, experts=6), [torch.tensor([[0, 1]] * 24)], 2, None, r"router_logits\[0\] has 6 experts, num_experts=8"),
    (_layers(1), [torch.tensor([[0, 8]] * 24)], 2, None, r"ids\[0\]\[0, 1\] = 8 is not an expert id"),
    (_layers(1), [torch.tensor([[1, 1]] * 24)], 2, None, r"ids\[0\] row \[0\] repeats expert 1"),
    (_layers(1), [torch.tensor([[0, 1]] * 24)], 2, torch.ones(5, 4), r"attention_mask \(5, 4\) covers 20 tokens"),
    (_layers(1), [torch.tensor([[0, 1]] * 24)], 2, torch.ones(24), r"attention_mask must have shape \[batch, seq\]"),
    (torch.zeros(24, 8), [torch.tensor([[0, 1]] * 24)], 2, None, "sequence of per-layer tensors"),
    (_layers(1), torch.zeros(24, 2, dtype=torch.int64), 2, None, r"route table \[tokens, layers, k\]"),
])
def test_load_balancing_loss_errors(logits, ids, top_k, mask, fragment):
    with pytest.raises(RouteError, match=fragment):
        load_balancing_loss(logits, ids, 8, top_k, attention_mask=mask)
