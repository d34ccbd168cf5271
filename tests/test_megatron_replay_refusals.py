"""Megatron-core: the configurations in which replay would not apply are refused at setup, naming the cause
(renumbered layers / a chunk of another virtual-pipeline stage, dense layers in the record's MoE list, routes for MTP
layers); and the one that looks dangerous but is not (aux-loss-free routing with an expert bias) replays exactly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_util import B, E, K, T, V  # noqa: E402
from megatron_util import batch_routes, build, config, inputs, replay_batch, routing_maps  # noqa: E402

from moealign.errors import ReplayConfigError  # noqa: E402
from moealign.patches import megatron as mg  # noqa: E402
from moealign.patches.megatron.audit import audit_layers, check_record_layers  # noqa: E402


@pytest.fixture(scope="module")
def world():
    with mg.init_single_process(seed=123, device="cpu"):
        yield


def test_layer_numbering_is_checked_and_dense_layers_reported(world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    cfg = config(num_layers=3, moe_layer_freq=[1, 0, 1])   # the block spec honours moe_layer_freq: layer 1 dense
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_decoder_block_spec(cfg, use_transformer_engine=False),
                     vocab_size=V, max_sequence_length=64, position_embedding_type="rope")
    assert audit_layers(model) == (1,)
    assert [layer for layer, _ in mg.moe_routers(model)] == [0, 2]
    # a chunk whose layers were renumbered (as a chunk built for another virtual-pipeline stage would be)
    for layer in model.decoder.layers:
        layer.layer_number += 3
        if hasattr(layer.mlp, "router"):
            layer.mlp.router.layer_number = layer.layer_number
    with pytest.raises(ReplayConfigError, match=r"numbers its layers \[4, 5, 6\].*gives \[1, 2, 3\]"):
        audit_layers(model)


def test_routes_for_mtp_layers_are_refused(world):
    cfg = config(num_layers=2, mtp_num_layers=1)
    with pytest.raises(ReplayConfigError, match=r"layers \[2\], beyond the decoder's 2 layers: the model's 1 MTP"):
        check_record_layers(cfg, (0, 1, 2))
    check_record_layers(cfg, (0, 1))
    with pytest.raises(ReplayConfigError, match="there is no such layer"):
        check_record_layers(config(num_layers=2), (0, 5))


def test_aux_loss_free_routing_with_expert_bias_replays_exactly(world):
    """sigmoid scores + expert bias (DeepSeek-V3's aux-free balancing): Megatron takes the top-k of scores + bias
    through RouterReplay's hook, so the replayed experts run; negative control: the native routing differs."""
    torch.manual_seed(0)
    cfg = config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    model = build(cfg)
    routers = mg.moe_routers(model)
    with torch.no_grad():
        for _, router in routers:
            router.weight.mul_(20)
            router.expert_bias.copy_(torch.linspace(-0.5, 0.5, E))
    mg.audit_replay_config(cfg)
    ids, pos, mask = inputs(1)
    routes = batch_routes(7)
    maps, handles = routing_maps(model, routers)
    try:
        with torch.no_grad():
            model(ids, pos, attention_mask=mask)
            native = [m.clone() for m in maps]
            maps.clear()
            with mg.RouterReplayDriver(model) as driver:
                driver.set_routes(replay_batch(routes, ids))
                with driver.forward():
                    model(ids, pos, attention_mask=mask)
                driver.check(calls=1)
    finally:
        for h in handles:
            h.remove()
    for layer, used in enumerate(maps):
        want = torch.zeros(T, B, E, dtype=torch.bool)
        want.scatter_(-1, routes[:, layer].reshape(B, T, K).transpose(0, 1), True)
        assert torch.equal(used, want.reshape(T * B, E))
        assert not torch.equal(native[layer], used)


def _flat_routes(seed, layers):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * layers)]).reshape(B * T, layers, K)


def test_the_driver_refuses_dense_layers_mtp_layers_and_renumbered_blocks(world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from moealign.errors import ReplayError

    torch.manual_seed(0)
    cfg = config(num_layers=3, moe_layer_freq=[1, 0, 1])
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_decoder_block_spec(cfg, use_transformer_engine=False),
                     vocab_size=V, max_sequence_length=64, position_embedding_type="rope")
    ids, _, _ = inputs(1)
    with mg.RouterReplayDriver(model) as driver:
        assert driver.dense_layers == (1,)
        driver.set_routes(replay_batch(_flat_routes(1, 2), ids, layers=(0, 2)))          # the MoE layers: fine
        with pytest.raises(ReplayError, match=r"dense_layers: routes for layers \[1\]"):
            driver.set_routes(replay_batch(_flat_routes(1, 3), ids, layers=(0, 1, 2)))  # a stale, all-layer list
        with pytest.raises(ReplayConfigError, match=r"layers \[3\], beyond the decoder's 3 layers"):
            driver.set_routes(replay_batch(_flat_routes(1, 3), ids, layers=(0, 2, 3)))
    for layer in model.decoder.layers:
        layer.layer_number += 2
    with pytest.raises(ReplayConfigError, match="numbers its layers"):
        mg.RouterReplayDriver(model)
