"""Issue 40 item 5: routing replay's cost per router, pinned by counting aten ops (each one a kernel launch and some
host time on a GPU). A replayed forward of the embedded model (4 MoE routers) against the plain one, the ops counted
with a ``TorchDispatchMode`` (``tools/bench_replay.py``'s ``replay_ops``, which ``--count-ops`` prints) and split by
where they run: inside the router modules (per router) and elsewhere (the token check and the verifier's batched pass:
per forward). The routes are the model's own, so the experts run the same work on both sides. A change that adds ops
per router fails here; the control adds one op per router by construction and must be seen. The replayed logits and
router gradients are also compared bitwise (``torch.equal``) with a reference built from the public, checked API
(``select_topk`` / ``replay_gate_weights``, the path the adapter took before its ops were cut), with a shifted-rows
negative control."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from moealign.embedded import embedded_model_path
from moealign.routing_replay.gates import replay_gate_weights, select_topk
from moealign.routing_replay.protocol import ReplayBatch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from bench_replay import replay_ops  # noqa: E402

# the pins (ops over the plain forward): per router with rows the record does not route (padding: the own top-k
# there, one where to merge, one gather for the gates; the plain router's top-k values come free) and with every
# row routed (the gather replaces the top-k); per forward: the token check and the verifier's one batched pass
PER_ROUTER_MASKED = 2
PER_ROUTER_ALL_ROUTED = 0
PER_FORWARD_MAX = {"masked": 21, "all": 17}
SET_ROUTES_MAX = 3            # one [routers, rows, k] table and the verifier's expected sets, for all routers


@pytest.fixture(scope="module")
def setup():
    from moealign.patches import hf
    from moealign.patches.hf.loading import load_model

    model, _ = load_model(embedded_model_path(), "fp32")
    info = hf.describe_model(model)
    meta = hf.record_meta(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, meta.vocab_size, (2, 12), generator=g)
    am = torch.ones_like(ids)
    am[1, 9:] = 0                                              # right padding in row 1: rows without a route
    batches = {}
    for kind, mask in (("masked", am), ("all", torch.ones_like(am))):
        with torch.no_grad(), hf.capture_routes(model) as cap:
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            own = cap.last_forward().reshape(2, 12, len(meta.moe_layers), meta.top_k)
        batches[kind] = ReplayBatch.padded(own, input_ids=ids, attention_mask=mask, moe_layers=meta.moe_layers)
    # forced routes that differ from the model's own: distinct random experts per row
    forced = torch.stack([torch.randperm(meta.num_experts, generator=g)[:meta.top_k]
                          for _ in range(2 * 12 * len(meta.moe_layers))]).reshape(own.shape)
    batches["forced"] = ReplayBatch.padded(forced, input_ids=ids, attention_mask=am, moe_layers=meta.moe_layers)
    return model, info, batches


def _delta(model, info, batch, **kw):
    ops = replay_ops(model, info, batch, aux_loss="replayed", **kw)
    assert ops["routers"] == 4 and ops["per_router_rest"] == 0, ops
    return ops["per_router"], ops["per_forward"], ops["set_routes"]


@pytest.mark.parametrize("kind", ["masked", "all"])
def test_replay_ops_per_router_are_pinned(setup, kind):
    model, info, batches = setup
    per_router, per_forward, set_routes = _delta(model, info, batches[kind])
    assert per_router == (PER_ROUTER_MASKED if kind == "masked" else PER_ROUTER_ALL_ROUTED), per_router
    assert 0 < per_forward <= PER_FORWARD_MAX[kind], per_forward
    assert set_routes <= SET_ROUTES_MAX, set_routes


def test_op_count_sees_one_more_op_per_router(setup):
    """Negative control by construction: one op added to every replayed router call moves the per-router count."""
    model, info, batches = setup
    base = _delta(model, info, batches["masked"])
    def one_more_op(forward):
        def wrapped(hidden):
            logits, weights, ids = forward(hidden)
            return logits, weights.clone(), ids
        return wrapped

    more = _delta(model, info, batches["masked"], wrap_router=one_more_op)
    assert more[0] == base[0] + 1 and more[1] == base[1], (base, more)


def _reference(model, info, batch, shift: int = 0):
    """The replayed forward built by hand from the checked public API (routes set on each router as instance
    ``forward``s): logits and the routers' weight gradients. ``shift`` rolls the route rows (negative control)."""
    routes = batch.routes.roll(shift, 0) if shift else batch.routes
    mask = batch.route_mask
    saved = []
    for index, (_, router) in enumerate(info.routers):
        def forward(hidden, router=router, target=routes[:, index]):
            h = hidden.reshape(-1, router.hidden_dim)
            logits = F.linear(h, router.weight)
            native = select_topk(logits, router.top_k, info.scoring)[1]
            ids = torch.where(mask[:, None], target, native)
            return logits, replay_gate_weights(logits, ids, info.scoring, out_dtype=logits.dtype), ids
        router.forward = forward
        saved.append(router)
    try:
        return _train_step(model, info, batch)
    finally:
        for router in saved:
            del router.forward


def _train_step(model, info, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    out.logits.float().logsumexp(-1).mean().backward()
    grads = [router.weight.grad.clone() for _, router in info.routers]
    model.zero_grad(set_to_none=True)
    model.eval()
    return out.logits.detach(), grads


def test_replayed_forward_bitwise_equals_the_reference(setup):
    from moealign.patches import hf

    model, info, batches = setup
    batch = batches["forced"]
    want_logits, want_grads = _reference(model, info, batch)
    with hf.replay_routing(model, batch, aux_loss="own") as replay:
        logits, grads = _train_step(model, info, batch)
        replay.check(calls=1)
        assert replay.verify_report().clean
    assert torch.equal(logits, want_logits)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    # negative control: the same reference with the route rows shifted by one is a different forward
    shifted_logits, shifted_grads = _reference(model, info, batch, shift=1)
    assert not torch.equal(logits, shifted_logits)
    assert not all(torch.equal(a, b) for a, b in zip(grads, shifted_grads))
