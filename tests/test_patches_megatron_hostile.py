"""Megatron RouterReplayDriver against hostile but realistic use (issue 11): layout slips with equal shapes,
forward / backward without routes, colocated models, nested drivers, expert counts and route values, routers
swapped after binding, use after undo. Every case is a named moealign error, never a raw Megatron one, and
never a silent misroute; each has its negative control (the right call replays exactly the given routes)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_util import B, E, K, T, batch_routes, build, config, inputs, replay_batch, routing_maps  # noqa: E402

from moealign.errors import InputTypeError, ReplayConfigError, ReplayError, RouteError  # noqa: E402
from moealign.patches import megatron as mg  # noqa: E402
from moealign.routing_replay.protocol import ReplayBatch  # noqa: E402

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.fixture(scope="module")
def world():
    with mg.init_single_process(seed=123, device="cpu"):
        yield


@pytest.fixture
def make(world):
    """Build tiny GPT-MoE models (peaked routers: a replayed route is a real change); their RouterReplay
    instances leave Megatron's global list afterwards."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    built = []

    def _make(seed: int = 0, **overrides):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build(config(**overrides))
        with torch.no_grad():
            for _, router in mg.moe_routers(model):
                router.weight.mul_(20)
        built.append([r.router_replay for _, r in mg.moe_routers(model)])
        return model

    yield _make
    mine = {id(r) for replays in built for r in replays}
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]


def _want(routes: torch.Tensor, layer: int) -> torch.Tensor:
    """The routing map [T*B, E] Megatron must use for padded routes [B*T, layers, K] (sequence-first rows)."""
    want = torch.zeros(T, B, E, dtype=torch.bool)
    want.scatter_(-1, routes[:, layer].reshape(B, T, K).transpose(0, 1), True)
    return want.reshape(T * B, E)


def _run(model, ids=None, **kw):
    _, pos, mask = inputs(1)
    ids = inputs(1)[0] if ids is None else ids
    return model(ids, pos, attention_mask=mask, **kw)


# --------------------------------------------------------------------------------------------------
# 1. layout slips with equal shapes
# --------------------------------------------------------------------------------------------------


def _left_padded(ids, lengths):
    out = torch.zeros_like(ids)
    for b in range(ids.shape[0]):
        out[b, ids.shape[1] - int(lengths[b]):] = ids[b, :int(lengths[b])]
    return out


SLIPS = {
    # the slip: routes of the [B, T] batch handed over as if the batch were [T, B]
    "batch_shape (T, B): transposed": lambda ids: ids.t().contiguous(),
    "batch_shape (T, B): reshaped": lambda ids: ids.reshape(T, B),
    "another batch of the same shape": lambda ids: inputs(2)[0],
    "samples in another order": lambda ids: ids[[1, 0, 2]],
    "shifted by one token (labels for inputs)": lambda ids: torch.roll(ids, -1, dims=1),
}


@pytest.mark.parametrize("slip", list(SLIPS))
def test_layout_slip_with_equal_row_count_is_refused(make, slip):
    model = make()
    ids = inputs(1)[0]
    routes = batch_routes(4)
    wrong = SLIPS[slip](ids)
    assert wrong.numel() == ids.numel() and (wrong.shape != ids.shape or not torch.equal(wrong, ids))
    maps, handles = routing_maps(model, mg.moe_routers(model))
    try:
        with mg.replay_routing(model, aux_loss="own") as driver:
            driver.set_routes(replay_batch(routes, wrong))
            with torch.no_grad(), driver.forward():
                _run(model, ids)                                # checked on the device ...
            with pytest.raises(ReplayError, match="not running the batch"):
                driver.check(calls=1)                           # ... and raised here
            driver.reset_counters()
            maps.clear()                                        # (the refused forward's routing maps)
            driver.set_routes(replay_batch(routes, ids))        # negative control: the batch it was laid out for
            with torch.no_grad(), driver.forward():
                _run(model, ids)
            driver.check(calls=1)
    finally:
        for h in handles:
            h.remove()
    assert all(torch.equal(maps[layer], _want(routes, layer)) for layer in (0, 1))


def test_padding_side_slip_is_refused(make):
    """Routes laid out for right padding, the model fed the left-padded batch of the same [B, T]."""
    model = make()
    ids = inputs(1)[0]
    lengths = torch.tensor([T, T - 3, T - 5])
    right = torch.arange(T)[None] < lengths[:, None]
    right_ids = torch.where(right, ids, 0)
    batch = ReplayBatch.padded(batch_routes(6).reshape(B, T, 2, K), input_ids=right_ids, attention_mask=right.long(), moe_layers=(0, 1))
    with mg.replay_routing(model, aux_loss="own") as driver:
        driver.set_routes(batch)
        with torch.no_grad(), driver.forward():
            _run(model, _left_padded(ids, lengths))                 # checked on the device ...
        with pytest.raises(ReplayError, match="padding-side, layout or batch"):
            driver.check(calls=1)                                   # ... and raised here
        driver.reset_counters()
        with torch.no_grad(), driver.forward():
            _run(model, right_ids)
        driver.check(calls=1)


def test_routes_in_sequence_first_shape_are_refused(make):
    """4-D routes [T, B, layers, k] (Megatron's own order) with input_ids [B, T]: refused by shape."""
    ids = inputs(1)[0]
    routes = batch_routes(4).reshape(B, T, 2, K).transpose(0, 1)
    with pytest.raises(RouteError, match=r"routes \[batch, seq\] = \(10, 3\) do not match input_ids \(3, 10\)"):
        ReplayBatch.padded(routes, input_ids=ids, attention_mask=torch.ones_like(ids), moe_layers=(0, 1))


def test_tokens_are_checked_only_on_replayed_forwards(make):
    """A forward outside ``driver.forward()`` replays nothing, so it may run any batch; the replayed one is checked."""
    model = make()
    ids, other = inputs(1)[0], inputs(2)[0]
    with mg.replay_routing(model, aux_loss="own") as driver:
        driver.set_routes(replay_batch(batch_routes(4), ids))
        with torch.no_grad():
            _run(model, other)                                  # native routing on another batch: no replay
        with torch.no_grad(), driver.forward():
            _run(model, other)
        with pytest.raises(ReplayError, match="not running the batch"):
            driver.check(calls=1)                               # the replayed forward's tokens, read here
        driver.reset_counters()
        with torch.no_grad(), driver.forward():
            _run(model, ids)
        driver.check(calls=1)


# --------------------------------------------------------------------------------------------------
# 2. forward without routes, backward with nothing left for recompute
# --------------------------------------------------------------------------------------------------


def test_forward_without_routes_is_a_replay_error(make):
    model = make()
    with mg.replay_routing(model, aux_loss="own") as driver:
        with torch.no_grad(), driver.forward(), pytest.raises(ReplayError, match="no routes are set"):
            _run(model)
        driver.set_routes(replay_batch(batch_routes(1), inputs(1)[0]))
        driver.clear()                                          # clear() empties them again
        with torch.no_grad(), driver.forward(), pytest.raises(ReplayError, match="no routes are set"):
            _run(model)


def test_backward_with_nothing_left_for_recompute(make):
    """Two replayed forwards on one set_routes, then activation recompute of both: the second recompute has no
    routes left (Megatron: IndexError from its FIFO)."""
    model = make(**RECOMPUTE)
    model.train()
    with mg.replay_routing(model, aux_loss="own") as driver:
        driver.set_routes(replay_batch(batch_routes(1), inputs(1)[0]))
        with driver.forward():
            loss = _run(model).float().mean() + _run(model).float().mean()
        with driver.backward(), pytest.raises(ReplayError, match="nothing left for activation recompute"):
            loss.backward()
    model.zero_grad(set_to_none=True)


def test_backward_recompute_of_a_forward_that_did_not_replay(make):
    """Routes set, the forward run outside driver.forward() (native routing), its recompute inside
    driver.backward(): the recompute would replay routes the forward never used (silently wrong gradients)."""
    model = make(**RECOMPUTE)
    model.train()
    with mg.replay_routing(model, aux_loss="own") as driver:
        driver.set_routes(replay_batch(batch_routes(1), inputs(1)[0]))
        loss = _run(model).float().mean()                       # not replayed
        with driver.backward(), pytest.raises(ReplayError, match="did not replay"):
            loss.backward()
        with pytest.raises(ReplayError, match="did not replay"), driver.backward():
            _run(model)                                         # a forward run under backward(): same thing
    model.zero_grad(set_to_none=True)


def test_set_routes_before_the_recompute_of_the_last_forward(make):
    """With activation recompute, set_routes(next) before the backward of the last replayed forward would hand
    that backward's recompute the next batch's routes (same row count: silent); a backward outside
    driver.backward() recomputes natively. Both are refused at the next set_routes."""
    model = make(**RECOMPUTE)
    model.train()
    ids = inputs(1)[0]
    with mg.replay_routing(model, aux_loss="own") as driver:
        driver.set_routes(replay_batch(batch_routes(1), ids))
        with driver.forward():
            loss = _run(model).float().mean()
        with pytest.raises(ReplayError, match="set_routes before the backward of the last replayed forward"):
            driver.set_routes(replay_batch(batch_routes(2), ids))
        loss.backward()                                         # outside driver.backward(): recomputed natively
        with pytest.raises(ReplayError, match="set_routes before the backward"):
            driver.set_routes(replay_batch(batch_routes(2), ids))
        driver.clear()                                          # drops it explicitly
        for seed in (2, 3):                                     # negative control: set, forward, backward, repeat
            driver.set_routes(replay_batch(batch_routes(seed), ids))
            with driver.forward():
                loss = _run(model).float().mean()
            with driver.backward():
                loss.backward()
        with torch.no_grad(), driver.forward():                 # no grad: nothing to recompute
            _run(model)
        driver.set_routes(replay_batch(batch_routes(4), ids))
    model.zero_grad(set_to_none=True)


def test_recompute_replays_the_forwards_routes(make):
    """Negative control of the two above: set, forward, backward replays the same experts twice."""
    model = make(**RECOMPUTE)
    model.train()
    routes = batch_routes(11)
    maps, handles = routing_maps(model, mg.moe_routers(model))
    try:
        with mg.replay_routing(model, aux_loss="own") as driver:
            driver.set_routes(replay_batch(routes, inputs(1)[0]))
            with driver.forward():
                loss = _run(model).float().mean()
            with driver.backward():
                loss.backward()
            driver.check(calls=2)
    finally:
        for h in handles:
            h.remove()
    assert [torch.equal(m, _want(routes, layer)) for m, layer in zip(maps, (0, 1, 1, 0))] == [True] * 4
    model.zero_grad(set_to_none=True)


def test_more_forwards_than_set_routes_unbalance_the_counters(make):
    model = make()
    with mg.replay_routing(model, aux_loss="own") as driver:
        driver.set_routes(replay_batch(batch_routes(1), inputs(1)[0]))
        with torch.no_grad(), driver.forward():
            _run(model)
            _run(model)
        with pytest.raises(ReplayError, match="layer 0: 2 calls, 60 rows"):
            driver.check(calls=1)
        driver.check(calls=2)


# --------------------------------------------------------------------------------------------------
# 3. colocated models: each driver touches only its own routers
# --------------------------------------------------------------------------------------------------


def test_colocated_actor_and_reference_replay_their_own_routes(make):
    """Two GPTModels, two drivers, routes set for both before either runs, forwards interleaved: each model
    runs exactly its own routes (a process-global clear would leave the actor without targets)."""
    actor, ref = make(0), make(1)
    ids = inputs(1)[0]
    ra, rb = batch_routes(8), batch_routes(9)
    maps_a, ha = routing_maps(actor, mg.moe_routers(actor))
    maps_b, hb = routing_maps(ref, mg.moe_routers(ref))
    try:
        with mg.replay_routing(actor, aux_loss="own") as a, mg.replay_routing(ref, aux_loss="own") as b:
            a.set_routes(replay_batch(ra, ids))
            b.set_routes(replay_batch(rb, ids))
            with torch.no_grad():
                with a.forward():
                    _run(actor)
                with b.forward():
                    _run(ref)
                with a.forward():
                    _run(actor)
            a.check(calls=2)
            b.check(calls=1)
            b.set_routes(replay_batch(ra, ids))                 # new routes for ref: the actor's stay
            with torch.no_grad(), a.forward():
                _run(actor)
            a.check(calls=3)
    finally:
        for h in ha + hb:
            h.remove()
    assert len(maps_a) == 6 and len(maps_b) == 2
    assert all(torch.equal(m, _want(ra, i % 2)) for i, m in enumerate(maps_a))
    assert all(torch.equal(m, _want(rb, i % 2)) for i, m in enumerate(maps_b))


def _tracked_aux_loss(model):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    clear_aux_losses_tracker()
    model.train()
    _run(model).float().mean().backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    return get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()


def test_colocated_aux_loss_is_not_taken_from_the_other_models_replay(make):
    """The actor replays (aux_loss="replayed") in a no-grad pass (no aux loss: its replayed experts stay unread);
    the reference model then trains natively: its aux loss must be its own, not the actor's replayed experts."""
    actor, ref = make(0), make(1, hidden_dropout=0.0, attention_dropout=0.0)     # a training forward, deterministic
    native = _tracked_aux_loss(ref)
    assert torch.equal(_tracked_aux_loss(ref), native)
    with mg.replay_routing(actor, aux_loss="replayed") as a:
        a.set_routes(replay_batch(batch_routes(8), inputs(1)[0]))
        with torch.no_grad(), a.forward():
            _run(actor)
        got = _tracked_aux_loss(ref)
        assert a.aux_disagreement == []
    assert torch.equal(got, native)


# --------------------------------------------------------------------------------------------------
# 4. nested drivers
# --------------------------------------------------------------------------------------------------


def test_nested_driver_is_refused_also_through_a_wrapper(make):
    """A second driver on the same routers (the model itself, or a module wrapping it) is refused; the outer one
    keeps replaying; once it is undone a new driver binds."""
    model = make()
    routes = batch_routes(2)
    ids = inputs(1)[0]
    maps, handles = routing_maps(model, mg.moe_routers(model))
    try:
        with mg.replay_routing(model, aux_loss="own") as outer:
            for target in (model, torch.nn.ModuleList([model])):
                with pytest.raises(ReplayError, match="nested drivers on one model are refused"):
                    mg.replay_routing(target, aux_loss="own")
            outer.set_routes(replay_batch(routes, ids))
            with torch.no_grad(), outer.forward():
                _run(model)
            outer.check(calls=1)
        assert all(torch.equal(maps[layer], _want(routes, layer)) for layer in (0, 1))
        with mg.replay_routing(model, aux_loss="own") as again:
            again.set_routes(replay_batch(routes, ids))
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------------
# 5. expert count, route dtype, the audit's argument
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts, message", [
    (E + 1, r"num_experts=9 is outside 1\.\.8 \(the model's expert count\)"),
    (0, r"num_experts must be >= 1, got 0"),
    (7.9, r"num_experts must be an int, got float 7\.9"),
    ("8", r"num_experts must be an int, got str '8'"),
    (True, r"num_experts must be an int, got bool True"),
])
def test_num_experts_override_is_checked(make, num_experts, message):
    with mg.replay_routing(make(), aux_loss="own") as driver, pytest.raises(RouteError, match=message):
        driver.set_routes(replay_batch(batch_routes(2), inputs(1)[0]), num_experts=num_experts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool])
def test_non_integer_routes_are_refused(dtype):
    with pytest.raises(RouteError, match=f"routes must hold integer expert ids, got {dtype}"):
        replay_batch(batch_routes(2).to(dtype), inputs(1)[0])


@pytest.mark.parametrize("config_like", [dict(num_moe_experts=8, moe_enable_routing_replay=True), None, "cfg"])
def test_audit_takes_a_transformer_config(world, config_like):
    with pytest.raises(InputTypeError, match="audit_replay_config takes a megatron TransformerConfig"):
        mg.audit_replay_config(config_like)


# --------------------------------------------------------------------------------------------------
# 6. route values, devices, swapped routers, use after undo, parallel layout
# --------------------------------------------------------------------------------------------------


def _set(driver, routes, **kw):
    driver.set_routes(replay_batch(routes, inputs(1)[0]), **kw)


@pytest.mark.parametrize("bad, error, message", [
    (lambda r: torch.where(r == r.min(), torch.full_like(r, -1), r), RouteError, r"= -1 is not an expert id in \[0, 8\)"),
    (lambda r: torch.where(r == r.max(), torch.full_like(r, E), r), RouteError, r"= 8 is not an expert id in \[0, 8\)"),
    (lambda r: torch.where(r == r.max(), torch.full_like(r, 2 ** 40), r), RouteError, "not an expert id"),
    (lambda r: r[..., :1], RouteError, "replay routes have k=1, the model routes top-2"),
    (lambda r: torch.cat([r, (r[..., :1] + 1) % E], -1), RouteError, "replay routes have k=3, the model routes top-2"),
    (lambda r: torch.cat([r[..., :1], r[..., :1]], -1), RouteError, "repeats expert"),
])
def test_route_values_are_checked(make, bad, error, message):
    with mg.replay_routing(make(), aux_loss="own") as driver, pytest.raises(error, match=message):
        _set(driver, bad(batch_routes(2)))


def test_wrong_number_of_layers(make):
    ids = inputs(1)[0]
    with mg.replay_routing(make(), aux_loss="own") as driver:
        with pytest.raises(RouteError, match="moe_layers lists 2"):
            replay_batch(batch_routes(2)[:, :1], ids)
        with pytest.raises(RouteError, match=r"no routes for the model's MoE layers \[1\]"):
            driver.set_routes(replay_batch(batch_routes(2)[:, :1], ids, layers=(0,)))
        with pytest.raises(ReplayConfigError, match=r"layers \[2\], beyond the decoder's 2 layers"):
            driver.set_routes(replay_batch(batch_routes(2, layers=3), ids, layers=(0, 1, 2)))   # no layer 2


def test_routes_on_the_meta_device_are_refused(make):
    with mg.replay_routing(make(), aux_loss="own") as driver, pytest.raises(RouteError, match="meta"):
        _set(driver, batch_routes(2).to("meta"))


def test_routers_swapped_after_binding_are_refused(make):
    """A router replaced after the driver bound (a reload that rebuilds modules): the driver would set targets
    on routers the model no longer runs, and the new router would route natively."""
    model, donor = make(0), make(1)
    routes = batch_routes(3)
    with mg.replay_routing(model, aux_loss="own") as driver:
        layer = model.decoder.layers[0].mlp
        old = layer.router
        layer.router = donor.decoder.layers[0].mlp.router
        try:
            with pytest.raises(ReplayError, match=r"layers \[0\] were replaced after the driver was bound"):
                _set(driver, routes)
            with pytest.raises(ReplayError, match=r"layers \[0\] were replaced"), driver.forward():
                pass
        finally:
            layer.router = old
        _set(driver, routes)                                    # negative control: the bound routers again
        with torch.no_grad(), driver.forward():
            _run(model)
        driver.check(calls=1)


def test_use_after_undo_is_a_replay_error(make):
    model = make()
    driver = mg.replay_routing(model, aux_loss="own")
    _set(driver, batch_routes(1))
    driver.undo()
    driver.undo()                                               # idempotent
    with pytest.raises(ReplayError, match="this driver was undone"):
        _set(driver, batch_routes(1))
    with pytest.raises(ReplayError, match="this driver was undone"):
        _set(driver, batch_routes(1)[..., :1])                  # undone is said first, whatever the routes
    for phase in (driver.forward, driver.backward):
        with pytest.raises(ReplayError, match="this driver was undone"), phase():
            pass
    with torch.no_grad():
        _run(model)                                             # the model runs natively again
    assert all(r.router_replay.router_replay_action is None for _, r in mg.moe_routers(model))


@pytest.mark.parametrize("model", [{"decoder": None}, "model", None])
def test_driver_needs_a_module(world, model):
    with pytest.raises(InputTypeError, match="model must be a Megatron torch.nn.Module"):
        mg.replay_routing(model)


@pytest.mark.parametrize("parallel, message", [
    (dict(cp_size=1, cp_rank=0, sp_size=1, sp_rank=0, tp_size=2), r"unknown keys \['tp_size'\]"),
    (dict(cp_size="2"), "cp_size must be an int"),
    (dict(cp_size=2, cp_rank=2), "bad parallel layout"),
    ([1, 0, 1, 0], "parallel must be a dict"),
])
def test_parallel_layout_is_checked(make, parallel, message):
    with mg.replay_routing(make(), aux_loss="own") as driver, pytest.raises(RouteError, match=message):
        _set(driver, batch_routes(2), parallel=parallel)


def test_flat_routes_are_refused_for_padded_batches():
    """A flat [B*T, layers, k] table in sequence-first order (Megatron's own [s*b] rows) holds the same token
    rows as the batch-major one, so no token check could tell them apart: padded batches take [B, T, ...]."""
    ids = inputs(1)[0]
    seq_first = batch_routes(4).reshape(B, T, 2, K).transpose(0, 1).reshape(B * T, 2, K)
    with pytest.raises(RouteError, match="batch-major or sequence-first"):
        ReplayBatch.padded(seq_first, input_ids=ids, attention_mask=torch.ones_like(ids), moe_layers=(0, 1))
    with pytest.raises(RouteError, match=r"route_mask \(30,\) must be \[batch, seq\]"):
        ReplayBatch.padded(seq_first.reshape(B, T, 2, K), input_ids=ids, attention_mask=torch.ones_like(ids),
                           moe_layers=(0, 1), route_mask=torch.ones(B * T, dtype=torch.bool))
    batch = ReplayBatch.padded(seq_first.reshape(B, T, 2, K), input_ids=ids, attention_mask=torch.ones_like(ids),
                               moe_layers=(0, 1))                       # control: named dims are accepted
    assert torch.equal(batch.grid()[0], seq_first.reshape(B, T, 2, K).to(batch.routes.dtype))


@pytest.mark.parametrize("cu", [[0.0, 4.5, 9.0], [0, 4.5, 9], [False, True], "0,9"])
def test_fractional_or_odd_offsets_are_refused_not_truncated(cu):
    """cu_seqlens of a packed batch and of the THD layouts: fractional values were truncated to integers."""
    from moealign.routing_replay.layouts import packed_source_rows

    ids = torch.arange(9)
    routes = torch.zeros(9, 2, K, dtype=torch.int64) + torch.arange(K)
    with pytest.raises(RouteError, match="cu_seqlens"):
        ReplayBatch.packed(routes, input_ids=ids, cu_seqlens=cu, moe_layers=(0, 1))
    with pytest.raises(RouteError, match="cu_seqlens_padded"):
        packed_source_rows(torch.tensor([0, 4, 9]), cu)
    assert ReplayBatch.packed(routes, input_ids=ids, cu_seqlens=[0.0, 4.0, 9.0], moe_layers=(0, 1)).cu_seqlens.tolist() \
        == [0, 4, 9]                                                        # control: integral floats are fine
