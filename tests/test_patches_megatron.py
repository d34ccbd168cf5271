"""Megatron-core adapter on CPU: CPU mode, replay audit, RouterReplay driver (binding, layout, counters)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_util import B, E, K, T  # noqa: E402
from megatron_util import batch_routes as _batch_routes  # noqa: E402
from megatron_util import build as _build  # noqa: E402
from megatron_util import config as _config  # noqa: E402
from megatron_util import inputs as _inputs_seeded  # noqa: E402
from megatron_util import replay_batch as _rb  # noqa: E402

from moealign.patches import megatron as mg  # noqa: E402
from moealign.routing_replay.protocol import ReplayBatch  # noqa: E402
from moealign.routing_replay.routes import RouteError  # noqa: E402


@pytest.fixture(scope="module")
def megatron_cpu():
    with mg.init_single_process(seed=123, device="cpu"):      # CPU mode + a gloo world of one, TP=1
        torch.manual_seed(0)
        model = _build(_config())
        with torch.no_grad():   # peaked routers, so a rotated assignment is a real change
            for _, router in mg.moe_routers(model):
                router.weight.mul_(20)
        yield model


def _inputs():
    return _inputs_seeded(1)


def _routing_maps(model):
    from megatron_util import routing_maps

    return routing_maps(model, mg.moe_routers(model))


def test_cpu_mode_is_reversible_and_refuses_cuda(megatron_cpu, monkeypatch):
    assert torch.cuda.current_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="refuses to run where CUDA is available"):
        mg.enable_megatron_cpu()
    with mg.enable_megatron_cpu(pin_cpu=True):       # a caller that pins the CPU on purpose gets the mode
        assert mg.megatron_cpu_mode_active() and torch.cuda.current_device() == "cpu"
    assert mg.megatron_cpu_mode_active()            # the fixture's outer mode is still on


def test_cpu_mode_undo_restores():
    before, active = torch.cuda.current_device, mg.megatron_cpu_mode_active()   # a module fixture's mode may be on
    mode = mg.enable_megatron_cpu(pin_cpu=True)
    assert torch.cuda.current_device() == "cpu" and mg.megatron_cpu_mode_active()
    assert any("current_device" in label for label in mode.patched)
    mode.undo()
    assert torch.cuda.current_device is before and mg.megatron_cpu_mode_active() is active


def test_routers_bound_by_layer_number(megatron_cpu):
    layers = [layer for layer, _ in mg.moe_routers(megatron_cpu)]
    assert layers == [0, 1]   # Megatron's 1-based layer_number -> the record's 0-based layers


def test_replay_forces_recorded_experts_in_sequence_first_order(megatron_cpu):
    model = megatron_cpu
    ids, pos, mask = _inputs()
    routes = _batch_routes(7)
    maps, handles = _routing_maps(model)
    try:
        with torch.no_grad():
            model(ids, pos, attention_mask=mask)            # native routing (negative control)
            native = [m.clone() for m in maps]
            maps.clear()
            with mg.RouterReplayDriver(model) as driver:
                driver.set_routes(_rb(routes, ids))
                with driver.forward():
                    model(ids, pos, attention_mask=mask)
                driver.check(calls=1)
    finally:
        for h in handles:
            h.remove()
    for layer, used in enumerate(maps):
        # Megatron flattens [s, b, h]: token row = t*B + b; the record's padded order is b*T + t
        want = torch.zeros(T, B, E, dtype=torch.bool)
        r = routes[:, layer].reshape(B, T, K).transpose(0, 1)
        want.scatter_(-1, r, True)
        assert torch.equal(used, want.reshape(T * B, E))
        assert not torch.equal(native[layer], used)


def test_replay_gradients_reach_router(megatron_cpu):
    model = megatron_cpu
    ids, pos, mask = _inputs()
    model.zero_grad(set_to_none=True)
    with mg.RouterReplayDriver(model) as driver:
        driver.set_routes(_rb(_batch_routes(3), ids))
        with driver.forward():
            out = model(ids, pos, attention_mask=mask)
        out.float().logsumexp(-1).mean().backward()
        driver.check(calls=1)
    for _, router in mg.moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_counters_catch_missing_rows_and_extra_forwards(megatron_cpu):
    model = megatron_cpu
    ids, pos, mask = _inputs()
    with mg.RouterReplayDriver(model) as driver:
        short = ReplayBatch.packed(_batch_routes(1)[: B * T - 3], input_ids=ids.reshape(-1)[: B * T - 3],
                                   cu_seqlens=[0, B * T - 3], moe_layers=(0, 1))   # 3 rows short
        driver.set_routes(short)
        with torch.no_grad(), driver.forward(), pytest.raises(mg.ReplayError, match=r"runs 30 token rows, the routes were laid out for 27"):
            model(ids, pos, attention_mask=mask)
        # the router-level count catches it too where the token check cannot see (no model pre-hook)
        driver._token_hook.remove()
        with torch.no_grad(), driver.forward(), pytest.raises(mg.ReplayError, match=r"layer 0: the router saw 30 tokens, the replay targets have 27 rows"):
            model(ids, pos, attention_mask=mask)
    with mg.RouterReplayDriver(model) as driver:
        with pytest.raises(mg.ReplayError, match="expected 1 calls"):
            driver.check(calls=1)   # no forward yet


@pytest.mark.parametrize("bad, message", [
    (lambda r: r[:, :1], "moe_layers lists 2"),
    (lambda r: r[..., :1], "routes the model routes top-2|k=1"),
    (lambda r: torch.where(r == r.max(), torch.full_like(r, E), r), "not an expert id"),
    (lambda r: torch.cat([r[..., :1], r[..., :1]], -1), "repeats expert"),
])
def test_set_routes_errors(megatron_cpu, bad, message):
    routes = _batch_routes(2)
    with mg.RouterReplayDriver(megatron_cpu) as driver, pytest.raises(RouteError, match=message):
        driver.set_routes(_rb(bad(routes), _inputs()[0]))


def test_set_routes_missing_layer(megatron_cpu):
    with mg.RouterReplayDriver(megatron_cpu) as driver, pytest.raises(RouteError, match=r"MoE layers \[1\]"):
        driver.set_routes(_rb(_batch_routes(2), _inputs()[0], layers=(0, 2)))


@pytest.mark.parametrize("field, value, message", [
    ("moe_enable_routing_replay", False, "moe_enable_routing_replay=False"),
    ("moe_router_fusion", True, "moe_router_fusion=True"),
    ("moe_router_load_balancing_type", "sinkhorn", "'sinkhorn': this routing type bypasses RouterReplay"),
    ("moe_expert_capacity_factor", 1.0, "moe_expert_capacity_factor=1.0"),
    ("moe_router_force_load_balancing", True, "random logits"),
    ("cuda_graph_impl", "local", "captured router graph"),
])
def test_audit_names_the_field(megatron_cpu, field, value, message):
    cfg = _config()
    object.__setattr__(cfg, field, value)
    with pytest.raises(mg.ReplayConfigError, match=message):
        mg.audit_replay_config(cfg)


def test_audit_aux_loss_warns_or_raises(megatron_cpu):
    cfg = _config()
    with pytest.warns(UserWarning, match="aux loss from the router's own top-k"):
        mg.audit_replay_config(cfg)
    with pytest.raises(mg.ReplayConfigError, match="own top-k"):
        mg.audit_replay_config(cfg, aux_loss="error")
    object.__setattr__(cfg, "moe_aux_loss_coeff", 0.0)
    assert mg.audit_replay_config(cfg) == []   # negative control: no aux loss, nothing to say


def test_stale_routers_are_refused(megatron_cpu):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    saved = list(RouterReplay.global_router_replay_instances)
    RouterReplay.clear_global_router_replay_instances()
    try:
        with pytest.raises(mg.ReplayConfigError, match="not in RouterReplay's global list"):
            mg.RouterReplayDriver(megatron_cpu)
    finally:
        RouterReplay.global_router_replay_instances.extend(saved)


def test_unsupported_version(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.15.0")
    with pytest.raises(mg.UnsupportedEngineError, match="megatron-core 0.15.0 is not supported"):
        mg.megatron_version()


def test_activation_recompute_replays_through_replay_backward(megatron_cpu):
    """Full activation recompute re-runs the routers in backward: REPLAY_BACKWARD serves the same targets."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build(_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    try:
        model.train()
        ids, pos, mask = _inputs()
        routes = _batch_routes(11)
        maps, handles = _routing_maps(model)
        with mg.RouterReplayDriver(model) as driver:
            driver.set_routes(_rb(routes, ids))
            with driver.forward():
                out = model(ids, pos, attention_mask=mask)
            driver.check(calls=1)
            with driver.backward():
                out.float().logsumexp(-1).mean().backward()
            driver.check(calls=2)     # forward + recompute, the same rows each time
        for h in handles:
            h.remove()
        assert len(maps) == 4         # 2 layers x (forward + recompute)
        # backward recomputes the last layer first: calls are L0, L1 (forward), L1, L0 (recompute)
        assert torch.equal(maps[0], maps[3]) and torch.equal(maps[1], maps[2])
        want = torch.zeros(T, B, E, dtype=torch.bool)
        want.scatter_(-1, routes[:, 0].reshape(B, T, K).transpose(0, 1), True)
        assert torch.equal(maps[3], want.reshape(T * B, E))
        for _, router in mg.moe_routers(model):
            assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    finally:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = {id(r.router_replay) for _, r in mg.moe_routers(model)}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]


def test_route_mask_fills_distinct_experts(megatron_cpu):
    """Unrecorded rows (padding) would be [0, 0]: a duplicate the dispatcher cannot take; they get fillers."""
    routes = _batch_routes(5)
    mask = torch.ones(B * T, dtype=torch.bool)
    mask[T - 1::T] = False            # each sample's last token
    routes[~mask] = 0                 # what a padded record holds there
    ids, pos, attn = _inputs()
    with mg.RouterReplayDriver(megatron_cpu) as driver:
        with pytest.raises(RouteError, match="repeats expert 0"):
            driver.set_routes(_rb(routes, ids))                             # negative control
        driver.set_routes(_rb(routes, ids, mask))
        with torch.no_grad(), driver.forward():
            megatron_cpu(ids, pos, attention_mask=attn)
        driver.check(calls=1)


class _FakeCPGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _megatron_cp_slice(tokens, cp_size, rank, monkeypatch):
    """megatron.core.utils.get_batch_on_this_cp_rank on ``tokens`` [b, s] for one CP rank, without a real CP group:
    0.16 asks the group for its size/rank, 0.19 asks torch.distributed (and takes ``is_hybrid_cp``)."""
    import inspect

    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = _FakeCPGroup(cp_size, rank)
    size, rank_of = dist.get_world_size, dist.get_rank
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: g.size() if isinstance(g, _FakeCPGroup) else size(g))
    monkeypatch.setattr(dist, "get_rank", lambda g=None: g.rank() if isinstance(g, _FakeCPGroup) else rank_of(g))
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:        # 0.19
        return get_batch_on_this_cp_rank({"tokens": tokens.clone(), "cu_seqlens": None}, False,
                                         cp_group=group)["tokens"]
    return get_batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=group)["tokens"]


@pytest.mark.parametrize("cp_size", [2, 4])
def test_local_rows_cp_match_megatrons_own_cp_slicing(megatron_cpu, cp_size, monkeypatch):
    """BSHD: our row map equals megatron.core.utils.get_batch_on_this_cp_rank applied to the row ids."""
    b, t = 3, 8 * cp_size
    for rank in range(cp_size):
        rows = torch.arange(b * t).reshape(b, t)
        theirs = _megatron_cp_slice(rows, cp_size, rank, monkeypatch)
        ours = mg.local_route_rows(batch_shape=(b, t), cp_size=cp_size, cp_rank=rank)
        assert torch.equal(ours, theirs.t().reshape(-1))          # sequence-first after the CP slice
        assert not torch.equal(ours, rows[:, rank * t // cp_size:(rank + 1) * t // cp_size].t().reshape(-1))


def test_local_rows_thd_cp_is_per_sequence_zigzag(megatron_cpu, monkeypatch):
    """THD: each packed sequence is CP-sliced on its own (what TE's thd_get_partitioned_indices does)."""
    cp = 2
    cu, _ = mg.pad_packed_rows(torch.tensor([0, 5, 6, 19]), 2 * cp)      # lengths 5, 1, 13 -> 8, 4, 16
    assert cu.tolist() == [0, 8, 12, 28]
    seen = []
    for rank in range(cp):
        ours = mg.local_route_rows(cu_seqlens_padded=cu, cp_size=cp, cp_rank=rank)
        want = torch.cat([_megatron_cp_slice(torch.arange(int(s), int(e))[None], cp, rank, monkeypatch)[0]
                          for s, e in zip(cu[:-1], cu[1:])])
        assert torch.equal(ours, want)
        seen.append(ours)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(28))   # every position exactly once
    with pytest.raises(RouteError, match="multiples of 2\\*cp_size=4"):
        mg.local_route_rows(cu_seqlens_padded=torch.tensor([0, 6]), cp_size=2, cp_rank=0)


def test_local_rows_sp_slices_the_sequence_first_rows(megatron_cpu):
    rows = mg.local_route_rows(batch_shape=(2, 4), sp_size=2, sp_rank=1)
    assert rows.tolist() == [2, 6, 3, 7]          # t = 2, 3 of both samples, sequence-first
    with pytest.raises(RouteError, match="not divisible by the sequence-parallel size 4"):
        mg.local_route_rows(batch_shape=(2, 6), sp_size=4, sp_rank=0)
    with pytest.raises(RouteError, match="exactly one of"):
        mg.local_route_rows()


def test_packed_thd_with_padding_replays_recorded_rows(megatron_cpu):
    """Packed routes [N] with cu_seqlens, padded THD slots get fillers; the router sees the padded row count."""
    routes = _batch_routes(9)[:19]                                     # 19 packed rows
    cu = torch.tensor([0, 5, 6, 19])
    cu_padded, source = mg.pad_packed_rows(cu, 4)
    tokens = torch.arange(19)
    with mg.RouterReplayDriver(megatron_cpu) as driver:
        driver.set_routes(ReplayBatch.packed(routes, input_ids=tokens, cu_seqlens=cu, moe_layers=(0, 1)),
                          cu_seqlens_padded=cu_padded, parallel=dict(cp_size=1, cp_rank=0, sp_size=1, sp_rank=0))
        targets = [r.router_replay.target_topk_idx for _, r in driver.routers]
    assert targets[0].shape == (28, 2)
    real = source >= 0
    assert torch.equal(targets[1][real], routes[source[real], 1])
    assert all(len(set(row.tolist())) == 2 for row in targets[0][~real])   # distinct fillers in padding slots
    with pytest.raises(RouteError, match="routes have 18 rows, the batch has 19 token positions"):
        ReplayBatch.packed(routes[:18], input_ids=tokens, cu_seqlens=cu, moe_layers=(0, 1))


def _tracked_aux(model, routes, aux_loss):
    """One training forward with replay: the per-layer load-balancing loss Megatron tracked, the driver's
    measured disagreement, and each router's input (to recompute the loss by hand)."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    ids, pos, mask = _inputs()
    clear_aux_losses_tracker()
    inputs = []
    handles = [r.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for _, r in mg.moe_routers(model)]
    model.train()
    try:
        with mg.RouterReplayDriver(model, aux_loss=aux_loss) as driver:
            if routes is not None:
                driver.set_routes(_rb(routes, ids))
                with driver.forward():
                    model(ids, pos, attention_mask=mask)
            else:
                model(ids, pos, attention_mask=mask)
            disagreement = list(driver.aux_disagreement)
        values = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()
    finally:
        for h in handles:
            h.remove()
        model.eval()
        model.zero_grad(set_to_none=True)
    return values, disagreement, inputs


def _aux_from_ids(model, routes, inputs):
    """Megatron's switch aux loss (per unit coefficient) computed by hand from the given experts."""
    out = []
    for layer, ((_, router), x) in enumerate(zip(mg.moe_routers(model), inputs)):
        scores = torch.softmax(x.reshape(-1, x.shape[-1]).float() @ router.weight.float().t(), -1)
        chosen = routes[:, layer].reshape(B, T, K).transpose(0, 1).reshape(-1, K)
        counts = torch.zeros(E).scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
        out.append(E * (counts / (chosen.shape[0] * K) * scores.mean(0)).sum())
    return torch.stack(out)


def test_aux_loss_from_replayed_choices(megatron_cpu):
    model = megatron_cpu
    routes = _batch_routes(13)
    own, dis_own, _ = _tracked_aux(model, routes, "own")
    replayed, dis, inputs = _tracked_aux(model, routes, "replayed")
    want = _aux_from_ids(model, routes, inputs)
    torch.testing.assert_close(replayed, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(own, want, rtol=1e-3)           # negative control: Megatron's own top-k count
    assert dis_own == [] and len(dis) == 2 and min(dis) > 0.5  # peaked routers: the rotation changes most rows
    with pytest.warns(UserWarning, match=r"differs from the replayed experts on \d+\.\d% of tokens"):
        _tracked_aux(model, routes, "warn")
    native, _, _ = _tracked_aux(model, None, "own")
    assert torch.isfinite(native).all()
    with pytest.raises(ValueError, match="aux_loss must be one of"):
        mg.RouterReplayDriver(model, aux_loss="mine")


def test_aux_patch_is_undone(megatron_cpu):
    import megatron.core.transformer.moe.router as router_mod

    before = router_mod.compute_routing_scores_for_aux_loss
    with mg.RouterReplayDriver(megatron_cpu, aux_loss="replayed"):
        assert router_mod.compute_routing_scores_for_aux_loss is not before
    assert router_mod.compute_routing_scores_for_aux_loss is before


def test_kept_logprob_on_the_model_logits(megatron_cpu):
    """The Megatron wrapper (TP group from parallel_state, here TP = 1) equals the core kept-set log-prob;
    TP = 2 is tested in test_vocab_parallel_mask.py."""
    from moealign.routing_replay.sampling_mask import (
        full_logprob,
        kept_logprob,
        kept_sets_from_logits,
        truncation_mask,
    )

    ids, pos, mask = _inputs()
    with torch.no_grad():
        logits = megatron_cpu(ids, pos, attention_mask=mask).reshape(-1, 512).float()
    tokens = logits.argmax(-1)
    processed = logits.masked_fill(~truncation_mask(logits, top_p=0.8), float("-inf"))
    offsets, kept_ids = kept_sets_from_logits(processed)
    got = mg.kept_logprob(logits, tokens, (offsets, kept_ids))
    torch.testing.assert_close(got, kept_logprob(logits, tokens, offsets, kept_ids), rtol=1e-6, atol=1e-6)
    full = mg.kept_logprob(logits, tokens, None)
    torch.testing.assert_close(full, full_logprob(logits, tokens), rtol=1e-6, atol=1e-6)
    assert (got > full).all()             # negative control: the kept set renormalises


# --------------------------------------------------------------------------------------------------
# the replay protocol: layout slips are detected, only this driver's routers are touched
# --------------------------------------------------------------------------------------------------


def test_driver_implements_the_protocol(megatron_cpu):
    from moealign.routing_replay.protocol import RoutingReplayAdapter

    with mg.replay_routing(megatron_cpu) as driver:
        assert isinstance(driver, RoutingReplayAdapter)
        assert "RouterReplayDriver(Megatron RouterReplay of 2 routers [0, 1] of GPTModel" in repr(driver)
        assert "scope=module, active" in repr(driver)
    assert "undone" in repr(driver)
    driver.undo()                                                    # idempotent


def test_transposed_layout_is_detected(megatron_cpu):
    """Routes laid out for a [T, B] view of the batch (today's batch_shape=(T, B) slip) are refused at forward."""
    ids, pos, mask = _inputs()
    routes = _batch_routes(4)
    with mg.replay_routing(megatron_cpu) as driver:
        driver.set_routes(_rb(routes, ids.t().contiguous()))        # same row count, other layout
        with torch.no_grad(), driver.forward():
            megatron_cpu(ids, pos, attention_mask=mask)             # checked on the device ...
        with pytest.raises(mg.ReplayError, match="not running the batch"):
            driver.check(calls=1)                                   # ... and raised here
        driver.reset_counters()
        driver.set_routes(_rb(routes, ids))                         # the right layout passes
        with torch.no_grad(), driver.forward():
            megatron_cpu(ids, pos, attention_mask=mask)
        driver.check(calls=1)


def test_padding_side_slip_is_detected(megatron_cpu):
    """Routes of a right-padded batch replayed on the left-padded batch of the same shape: refused."""
    ids, pos, mask = _inputs()
    lengths = torch.tensor([T, T - 3, T - 5])
    right = torch.arange(T)[None] < lengths[:, None]
    routes = _batch_routes(6)
    right_ids = torch.where(right, ids, 0)
    left_ids = torch.zeros_like(ids)
    for b in range(B):
        left_ids[b, T - int(lengths[b]):] = ids[b, :int(lengths[b])]
    batch = ReplayBatch.padded(routes.reshape(B, T, *routes.shape[1:]), input_ids=right_ids,
                               attention_mask=right.long(), moe_layers=(0, 1))
    with mg.replay_routing(megatron_cpu) as driver:
        driver.set_routes(batch)
        with torch.no_grad(), driver.forward():
            megatron_cpu(left_ids, pos, attention_mask=mask)        # checked on the device ...
        with pytest.raises(mg.ReplayError, match="padding-side, layout or batch"):
            driver.check(calls=1)                                   # ... and raised here
        driver.reset_counters()
        with torch.no_grad(), driver.forward():
            megatron_cpu(right_ids, pos, attention_mask=mask)      # negative control: the batch it was laid out for
        driver.check(calls=1)


def test_forward_without_routes_is_a_named_error(megatron_cpu):
    ids, pos, mask = _inputs()
    with mg.replay_routing(megatron_cpu) as driver:
        with torch.no_grad(), driver.forward(), pytest.raises(mg.ReplayError, match="no routes are set"):
            megatron_cpu(ids, pos, attention_mask=mask)


def test_nested_driver_is_refused_and_outer_keeps_working(megatron_cpu):
    ids, pos, mask = _inputs()
    with mg.replay_routing(megatron_cpu) as outer:
        with pytest.raises(mg.ReplayError, match="nested drivers"):
            mg.replay_routing(megatron_cpu)
        outer.set_routes(_rb(_batch_routes(2), ids))
        with torch.no_grad(), outer.forward():
            megatron_cpu(ids, pos, attention_mask=mask)
        outer.check(calls=1)


def test_set_routes_touches_only_this_drivers_routers(megatron_cpu):
    """A colocated second model (actor + reference): setting one driver's routes keeps the other's targets."""
    torch.manual_seed(1)
    other = _build(_config())
    try:
        ids, pos, mask = _inputs()
        with mg.replay_routing(megatron_cpu) as a, mg.replay_routing(other) as b:
            b.set_routes(_rb(_batch_routes(8), ids))
            a.set_routes(_rb(_batch_routes(9), ids))
            assert all(r.router_replay.target_topk_idx is not None for _, r in b.routers)
            with torch.no_grad(), b.forward():
                other(ids, pos, attention_mask=mask)
            b.check(calls=1)
    finally:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = {id(r.router_replay) for _, r in mg.moe_routers(other)}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]


def test_route_values_and_expert_count_are_checked(megatron_cpu):
    ids = _inputs()[0]
    with pytest.raises(RouteError, match="integer expert ids"):
        _rb(_batch_routes(2).float(), ids)
    with mg.replay_routing(megatron_cpu) as driver:
        with pytest.raises(RouteError, match="outside 1..8"):
            driver.set_routes(_rb(_batch_routes(2), ids), num_experts=E + 4)
        with pytest.raises(RouteError, match="takes a ReplayBatch"):
            driver.set_routes(_batch_routes(2))
