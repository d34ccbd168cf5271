"""Shared helpers of the Megatron-core CPU tests: a tiny GPT-MoE config, its build, a gloo world."""

from __future__ import annotations

import warnings

import torch

B, T, E, K, V = 3, 10, 8, 2, 512


def config(**overrides):
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


def build(cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=64,
                        position_embedding_type="rope")


def inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    pos = torch.arange(T).expand(B, T)
    mask = ~torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
    return ids, pos, mask


def batch_routes(seed: int, layers: int = 2) -> torch.Tensor:
    """Distinct random experts per row, [B*T, layers, K] in padded batch order (row = b*T + t)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * layers)]).reshape(B * T, layers, K)


def routing_maps(model, routers):
    """Forward hooks on the routers: each call's routing_map [tokens, E] bool."""
    maps, handles = [], []
    for _, router in routers:
        handles.append(router.register_forward_hook(lambda m, a, out, maps=maps: maps.append(out[1].detach())))
    return maps, handles


def replay_batch(routes: torch.Tensor, ids: torch.Tensor, route_mask: torch.Tensor | None = None, layers=(0, 1)):
    """The padded ReplayBatch of ``routes`` [B*T, layers, K] for the token batch ``ids`` [B, T] (no padding)."""
    from moealign.routing_replay.protocol import ReplayBatch

    mask = None if route_mask is None else route_mask.reshape(ids.shape)
    return ReplayBatch.padded(routes.reshape(*ids.shape, *routes.shape[-2:]), input_ids=ids,
                              attention_mask=torch.ones_like(ids), moe_layers=layers, route_mask=mask)


def random_record(lengths, prompt_lens, seed: int, dtype: str, *, experts: int = 16, top_k: int = 4, layers: int = 4,
                  vocab: int = 2048):
    """A record of random tokens and routes in the embedded model's shape (16 experts top-4, 4 MoE layers, vocabulary
    2048): what the sharded-trainer tests score (one sample per length, its prompt ``prompt_lens[i]`` tokens)."""
    from moealign.record import RecordMeta, RolloutRecord, Sample

    g = torch.Generator().manual_seed(seed)
    meta = RecordMeta(engine="test", engine_version="0", model_fingerprint="test", num_layers=layers,
                      moe_layers=tuple(range(layers)), num_experts=experts, top_k=top_k, vocab_size=vocab, dtype=dtype)
    samples = []
    for length, prompt in zip(lengths, prompt_lens):
        ids = torch.randint(2, vocab, (length,), generator=g)
        routes = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range((length - 1) * layers)])
        samples.append(Sample(token_ids=ids, prompt_len=prompt, logprobs=torch.full((length - prompt,), -1.0),
                              routes=routes.reshape(length - 1, layers, top_k).to(torch.uint8)))
    return RolloutRecord(meta, samples)


def cpu_world(seed: int = 123):
    """A gloo world of one (TP = 1) for a test module (use as a module-scoped pytest fixture); RouterReplay's global
    list of instances and the CPU patches are put back afterwards."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moealign.patches import megatron as mg

    saved = list(RouterReplay.global_router_replay_instances)
    try:
        with mg.init_single_process(seed=seed, device="cpu"):
            yield
    finally:
        RouterReplay.global_router_replay_instances[:] = saved


def build_from_hf(hf_model, **kw):
    """``build_megatron_from_hf(hf_model, **kw)`` in eval mode, Megatron's construction warnings hidden."""
    from moealign.patches.megatron import checkpoint as mc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mc.build_megatron_from_hf(hf_model, **kw).eval()
