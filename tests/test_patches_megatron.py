"""Megatron-core adapter on CPU: CPU mode, replay audit, RouterReplay driver (binding, layout, counters)."""

from __future__ import annotations

import os
import socket
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from moealign.patches import megatron as mg  # noqa: E402
from moealign.routing_replay.routes import RouteError  # noqa: E402

B, T, E, K, V = 3, 10, 8, 2, 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=E,
              moe_router_topk=K, moe_ffn_hidden_size=32, moe_token_dispatcher_type="allgather",
              moe_grouped_gemm=False, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
              moe_enable_routing_replay=True, use_cpu_initialization=True, params_dtype=torch.float32,
              add_bias_linear=False, gradient_accumulation_fusion=False, bias_activation_fusion=False,
              masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
              apply_rope_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _build(cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=64,
                    position_embedding_type="rope")


@pytest.fixture(scope="module")
def megatron_cpu():
    import torch.distributed as dist

    mode = mg.enable_megatron_cpu()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build(_config())
    with torch.no_grad():   # peaked routers, so a rotated assignment is a real change
        for _, router in mg.moe_routers(model):
            router.weight.mul_(20)
    yield model
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    mode.undo()


def _inputs():
    torch.manual_seed(1)
    ids = torch.randint(0, V, (B, T))
    pos = torch.arange(T).expand(B, T)
    mask = ~torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
    return ids, pos, mask


def _routing_maps(model):
    """Forward hooks on the routers: each call's routing_map [tokens, E] bool."""
    maps, handles = [], []
    for _, router in mg.moe_routers(model):
        handles.append(router.register_forward_hook(lambda m, a, out, maps=maps: maps.append(out[1].detach())))
    return maps, handles


def _batch_routes(seed: int) -> torch.Tensor:
    """Distinct random experts per row, [B*T, 2 layers, K] in padded batch order (row = b*T + t)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * 2)]).reshape(B * T, 2, K)


def test_cpu_mode_is_reversible_and_refuses_cuda(megatron_cpu, monkeypatch):
    assert torch.cuda.current_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="refuses to run where CUDA is available"):
        mg.enable_megatron_cpu()


def test_cpu_mode_undo_restores():
    before = torch.cuda.current_device
    mode = mg.enable_megatron_cpu()
    assert torch.cuda.current_device is not before
    mode.undo()
    assert torch.cuda.current_device is before


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
                driver.set_routes(routes, (0, 1), batch_shape=(B, T))
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
        driver.set_routes(_batch_routes(3), (0, 1), batch_shape=(B, T))
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
        driver.set_routes(_batch_routes(1)[: B * T - 3], (0, 1))   # packed-style, 3 rows short
        with torch.no_grad(), driver.forward(), pytest.raises(mg.ReplayCounterError, match=r"layer 0: the router saw 30 tokens, the replay targets have 27 rows"):
            model(ids, pos, attention_mask=mask)
    with mg.RouterReplayDriver(model) as driver:
        with pytest.raises(mg.ReplayCounterError, match="expected 1 calls"):
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
        driver.set_routes(bad(routes), (0, 1) if bad(routes).shape[1] == 2 else (0, 1), batch_shape=(B, T))


def test_set_routes_missing_layer(megatron_cpu):
    with mg.RouterReplayDriver(megatron_cpu) as driver, pytest.raises(RouteError, match=r"MoE layers \[1\]"):
        driver.set_routes(_batch_routes(2), (0, 2), batch_shape=(B, T))


@pytest.mark.parametrize("field, value, message", [
    ("moe_enable_routing_replay", False, "moe_enable_routing_replay=False"),
    ("moe_router_fusion", True, "moe_router_fusion=True"),
    ("moe_router_load_balancing_type", "sinkhorn", "'sinkhorn': this routing type bypasses RouterReplay"),
    ("moe_expert_capacity_factor", 1.0, "moe_expert_capacity_factor=1.0"),
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
            driver.set_routes(routes, (0, 1), batch_shape=(B, T))
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
    with mg.RouterReplayDriver(megatron_cpu) as driver:
        with pytest.raises(RouteError, match="repeats expert 0"):
            driver.set_routes(routes, (0, 1), batch_shape=(B, T))          # negative control
        driver.set_routes(routes, (0, 1), batch_shape=(B, T), route_mask=mask)
        ids, pos, attn = _inputs()
        with torch.no_grad(), driver.forward():
            megatron_cpu(ids, pos, attention_mask=attn)
        driver.check(calls=1)
