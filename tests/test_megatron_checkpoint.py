"""transformers <-> Megatron-core checkpoint conversion on CPU: logits and routes agree in fp32, round trip
is exact, unsupported features and key mismatches raise."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from moealign.embedded import default_prompts, embedded_model_path  # noqa: E402
from moealign.patches import hf as hfp  # noqa: E402
from moealign.patches import megatron as mg  # noqa: E402
from moealign.patches.megatron import checkpoint as mc  # noqa: E402

import megatron_util as mu  # noqa: E402

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

LOGIT_TOL = 1e-4      # fp32; measured ~1e-5 (printed by the tests)


megatron_cpu = pytest.fixture(scope="module")(mu.cpu_world)     # a gloo world of one, RouterReplay's list kept
_build = mu.build_from_hf


@pytest.fixture(scope="module")
def embedded(megatron_cpu):
    path = embedded_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = default_prompts()[:4]
    enc = [tok(p)["input_ids"][:20 - 3 * i] for i, p in enumerate(prompts)]     # different lengths
    T = max(len(e) for e in enc)
    ids = torch.full((len(enc), T), tok.pad_token_id, dtype=torch.long)
    valid = torch.zeros(len(enc), T, dtype=torch.bool)
    for b, e in enumerate(enc):            # right padding: valid tokens never attend to pads (causal)
        ids[b, :len(e)] = torch.tensor(e)
        valid[b, :len(e)] = True
    return hf, _build(hf), ids, valid


def _tiny(model_type: str, **overrides):
    """A small random transformers model of ``model_type`` in fp32, every tensor randomised (biases and the
    shared-expert gate included, so a mapping that drops or misplaces one shows)."""
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if model_type == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                          mlp_only_layers=[1], norm_topk_prob=False, qkv_bias=True)
    elif model_type == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                         sliding_window=None)
    elif model_type == "olmoe":
        cfg = transformers.OlmoeConfig(**common, intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    else:
        raise AssertionError(model_type)
    for key, value in overrides.items():
        setattr(cfg, key, value)      # before the model is built (tie_word_embeddings acts at build)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


def _compare(hf_model, gpt, ids, valid):
    """(max |logit diff| over valid tokens, per MoE layer: routing maps [valid tokens, E] of HF, Megatron)."""
    B, T = ids.shape
    maps, handles = [], []
    for _, router in mg.moe_routers(gpt):
        handles.append(router.register_forward_hook(lambda m, a, out: maps.append(out[1].detach())))
    try:
        with torch.no_grad(), hfp.capture_routes(hf_model) as capture:
            ref = hf_model(ids, attention_mask=valid.long()).logits
            hf_routes = capture.last_forward()                       # [B*T, L, k], row = b*T + t
            pos = torch.arange(T).expand(B, T)
            causal = ~torch.tril(torch.ones(T, T, dtype=torch.bool))
            mask = (causal[None] | ~valid[:, None, :])[:, None]       # [B, 1, T, T], True = masked
            out = gpt(ids, pos, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    diff = (out - ref).abs()[valid].max().item()
    E = maps[0].shape[-1]
    pairs = []
    for layer, mmap in enumerate(maps):
        want = torch.zeros(B * T, E, dtype=torch.bool).scatter_(1, hf_routes[:, layer], True).reshape(B, T, E)
        got = mmap.reshape(T, B, E).transpose(0, 1)                  # Megatron is sequence-first
        pairs.append((want[valid], got[valid]))
    return diff, pairs


# --------------------------------------------------------------------------------------------------
# equivalence
# --------------------------------------------------------------------------------------------------


def test_embedded_logits_and_routes_match(embedded):
    hf_model, gpt, ids, valid = embedded
    diff, pairs = _compare(hf_model, gpt, ids, valid)
    print(f"\nembedded qwen3_moe: max |logit diff| = {diff:.3g} over {int(valid.sum())} tokens")
    assert diff < LOGIT_TOL
    assert len(pairs) == hf_model.config.num_hidden_layers
    for want, got in pairs:
        assert torch.equal(want, got)
        assert int(got.sum(-1).min()) == hf_model.config.num_experts_per_tok


def test_embedded_config_mapping(embedded):
    hf_model, gpt, _, _ = embedded
    cfg, c = hf_model.config, gpt.config
    assert (c.num_query_groups, c.kv_channels, c.qk_layernorm, c.add_qkv_bias) == (2, 32, True, False)
    assert (c.normalization, c.layernorm_epsilon, c.gated_linear_unit) == ("RMSNorm", cfg.rms_norm_eps, True)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (16, 4, 64)
    assert c.moe_router_pre_softmax is False and c.moe_enable_routing_replay is True
    mg.audit_replay_config(c)               # replay is live on the converted model


def test_negative_control_wrong_qkv_interleave(embedded):
    """Plain [q; k; v] instead of the per-group interleave changes the logits: the layout is tested."""
    hf_model, _, ids, valid = embedded
    gpt = _build(hf_model)
    sd = hf_model.state_dict()
    with torch.no_grad():
        for i in range(hf_model.config.num_hidden_layers):
            a = f"model.layers.{i}.self_attn"
            naive = torch.cat([sd[f"{a}.q_proj.weight"], sd[f"{a}.k_proj.weight"], sd[f"{a}.v_proj.weight"]])
            gpt.decoder.layers[i].self_attention.linear_qkv.weight.copy_(naive)
    diff, _ = _compare(hf_model, gpt, ids, valid)
    assert diff > 1e-2


def test_negative_control_perturbed_router_changes_experts(embedded):
    hf_model, _, ids, valid = embedded
    gpt = _build(hf_model)
    with torch.no_grad():
        w = gpt.decoder.layers[0].mlp.router.weight
        w.copy_(w.roll(1, dims=0))         # expert e now scores like expert e-1
    diff, pairs = _compare(hf_model, gpt, ids, valid)
    want, got = pairs[0]
    assert not torch.equal(want, got)
    assert diff > 1e-2


@pytest.mark.parametrize("model_type, tied", [("qwen2_moe", False), ("mixtral", False), ("mixtral", True)])
def test_family_logits_and_routes_match(megatron_cpu, model_type, tied):
    hf_model = _tiny(model_type, tie_word_embeddings=tied)
    assert (hf_model.lm_head.weight is hf_model.model.embed_tokens.weight) == tied
    gpt = _build(hf_model)
    assert (gpt.output_layer.weight is None) == tied      # Megatron reuses the embedding
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (3, 11))
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 8:] = False
    diff, pairs = _compare(hf_model, gpt, ids, valid)
    print(f"\n{model_type} (tied={tied}): max |logit diff| = {diff:.3g}")
    assert diff < LOGIT_TOL
    moe_layers = [i for i, s in enumerate(mc._moe_layer_pattern(hf_model.config)) if s]
    assert len(pairs) == len(moe_layers) and [layer for layer, _ in mg.moe_routers(gpt)] == moe_layers
    for want, got in pairs:
        assert torch.equal(want, got)
    if model_type == "qwen2_moe":           # the features this family adds are really in the model
        c = gpt.config
        assert c.moe_router_pre_softmax and c.add_qkv_bias and c.moe_shared_expert_gate
        assert c.moe_layer_freq == [1, 0, 1]


def test_qwen2_negative_control_shared_gate(megatron_cpu):
    """Dropping the shared expert's sigmoid gate (weight 0 -> gate 0.5) changes the logits."""
    hf_model = _tiny("qwen2_moe")
    gpt = _build(hf_model)
    with torch.no_grad():
        gpt.decoder.layers[0].mlp.shared_experts.gate_weight.zero_()
    ids = torch.randint(0, 256, (2, 9))
    diff, _ = _compare(hf_model, gpt, ids, torch.ones_like(ids, dtype=torch.bool))
    assert diff > 1e-3


# --------------------------------------------------------------------------------------------------
# unsupported features
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type, overrides, message", [
    ("olmoe", {}, r"full-width q_norm/k_norm"),
    ("mixtral", {"sliding_window": 16}, r"sliding_window=16"),
    ("qwen2_moe", {"use_sliding_window": True}, r"use_sliding_window=True"),
    ("mixtral", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ("qwen2_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"rope_type='yarn'"),
])
def test_unsupported_features_raise(megatron_cpu, model_type, overrides, message):
    cfg = _tiny(model_type).config
    for key, value in overrides.items():
        setattr(cfg, key, value)
    with pytest.raises(mc.UnsupportedConversionError, match=message) as info:
        mc.megatron_config_from_hf(cfg)
    assert isinstance(info.value, ValueError) and isinstance(info.value, hfp.UnsupportedModelError)


def test_unknown_family_raises(megatron_cpu):
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    with pytest.raises(mc.UnsupportedConversionError, match=r"'llama' has no Megatron conversion"):
        mc.megatron_config_from_hf(cfg)


# --------------------------------------------------------------------------------------------------
# round trip and key checks
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["embedded", "qwen2_moe", "mixtral", "mixtral_tied"])
def test_round_trip_is_exact(embedded, which):
    if which == "embedded":
        hf_model = embedded[0]
    else:
        hf_model = _tiny(which.removesuffix("_tied"), tie_word_embeddings=which.endswith("_tied"))
    gpt = embedded[1] if which == "embedded" else _build(hf_model)
    original = hf_model.state_dict()
    back = mc.hf_state_dict_from_megatron(gpt, hf_model.config)
    assert set(back) == set(original)
    for key, value in original.items():
        assert back[key].shape == value.shape and torch.equal(back[key], value), key
    # negative control: a change in one expert of the Megatron model shows in the converted state dict
    with torch.no_grad():
        p = gpt.decoder.layers[0].mlp.experts.local_experts[1].linear_fc2.weight
        p.add_(1.0)
        try:
            again = mc.hf_state_dict_from_megatron(gpt, hf_model.config)
        finally:
            p.sub_(1.0)
    key = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(again[key], original[key]) and torch.equal(again[key][0], original[key][0])


def test_missing_and_unused_hf_keys_raise(embedded):
    hf_model, gpt, _, _ = embedded
    sd = dict(hf_model.state_dict())
    dropped = sd.pop("model.layers.2.self_attn.k_norm.weight")
    with pytest.raises(mc.CheckpointMismatchError, match=r"missing transformers keys: \['model.layers.2.self_attn.k_norm.weight'\]"):
        mc.load_hf_into_megatron(gpt, sd, hf_model.config)
    sd["model.layers.2.self_attn.k_norm.weight"] = dropped
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(mc.CheckpointMismatchError, match=r"keys nothing consumes: \['model.layers.0.mlp.extra.weight'\]"):
        mc.load_hf_into_megatron(gpt, sd, hf_model.config)
    del sd["model.layers.0.mlp.extra.weight"]
    mc.load_hf_into_megatron(gpt, sd, hf_model.config)      # negative control: the full dict loads


def test_unfilled_megatron_parameters_and_shapes_raise(embedded):
    hf_model = embedded[0]
    with pytest.raises(mc.CheckpointMismatchError, match=r"left unfilled: \['decoder.layers.0.self_attention.linear_qkv.bias'"):
        _build(hf_model, add_qkv_bias=True)
    with pytest.raises(mc.CheckpointMismatchError, match=r"local_experts.0.linear_fc1.weight: converted tensor has shape \(128, 128\), the Megatron parameter \(64, 128\)"):
        _build(hf_model, moe_ffn_hidden_size=32)


# --------------------------------------------------------------------------------------------------
# tensor parallelism (two gloo processes)
# --------------------------------------------------------------------------------------------------


def _tp_worker(rank: int, world: int, out_dir: str) -> None:
    """One TP rank: build each model from the full transformers weights (this rank's slices), compare the
    gathered logits and the routes with transformers, save the figures."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    mode = mg.enable_megatron_cpu(pin_cpu=True)
    # a rendezvous file in the test's own directory: no TCP port, so parallel pytest workers never share a world
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        model_parallel_cuda_manual_seed(123)
        result = {}
        embedded_hf = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32)
        for name, hf_model in (("embedded", embedded_hf.eval()), ("qwen2_moe", _tiny("qwen2_moe"))):
            gpt = _build(hf_model, parallel_output=False)
            g = torch.Generator().manual_seed(5)
            ids = torch.randint(2, hf_model.config.vocab_size, (2, 13), generator=g)
            diff, pairs = _compare(hf_model, gpt, ids, torch.ones_like(ids, dtype=torch.bool))
            qkv = gpt.decoder.layers[0].self_attention.linear_qkv.weight
            result[name] = dict(diff=diff, routes_equal=all(torch.equal(w, m) for w, m in pairs),
                                qkv_rows=qkv.shape[0])
        # negative control: slicing GLU fc1 as one block (rank 0 all gate, rank 1 all up) is wrong
        real = mc._is_glu_fc1
        mc._is_glu_fc1 = lambda name, config: False
        try:
            mc.load_hf_into_megatron(gpt, hf_model.state_dict(), hf_model.config)
        finally:
            mc._is_glu_fc1 = real
        result["naive_glu_diff"] = _compare(hf_model, gpt, ids, torch.ones_like(ids, dtype=torch.bool))[0]
        try:
            mc.hf_state_dict_from_megatron(gpt, hf_model.config)
            result["reverse_refused"] = False
        except mc.UnsupportedConversionError:
            result["reverse_refused"] = True
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        mode.undo()


def test_tensor_parallel_slices_match(tmp_path):
    """TP=2: each rank loads its slices (qkv by query group, GLU fc1 gate/up halves, row-parallel dim 1,
    vocab-parallel embedding/output); gathered logits and routes equal transformers' in fp32."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a TP worker failed or hung (see its stderr)"
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name in ("embedded", "qwen2_moe"):
        print(f"\nTP=2 {name}: max |logit diff| = {max(r[name]['diff'] for r in results):.3g}")
        for r in results:
            assert r[name]["diff"] < LOGIT_TOL and r[name]["routes_equal"]
    # each rank holds one query group of the embedded model's two: (2 q heads + k + v) * head_dim rows
    assert results[0]["embedded"]["qkv_rows"] == (2 + 2) * 32
    assert all(r["reverse_refused"] for r in results)
    assert all(r["naive_glu_diff"] > 1e-3 for r in results)
