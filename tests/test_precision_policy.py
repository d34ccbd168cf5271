"""Precision policies (moealign.precision.policy), their engine translations, device capability checks,
and audits of the embedded model (moealign.precision.audit + moealign.patches.hf.precision)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moealign.errors import MoealignWarning
from moealign.precision import capability
from moealign.precision.audit import PrecisionAuditError, audit
from moealign.precision.capability import GpuCapability, required_capability, supports
from moealign.precision.policy import (
    LM_HEAD,
    POLICIES,
    ROUTER,
    Fp8Spec,
    PrecisionPolicy,
    UnknownPolicyError,
    get_policy,
    to_megatron_config_fields,
    to_megatron_optimizer_fields,
    to_transformers,
    to_vllm_engine_args,
    vllm_gaps,
)

NAMES = ["fp32", "bf16", "fp16", "fp16-fp32-router-head", "fp8-e4m3-tensor", "fp8-e4m3-block"]


# ----------------------------------------------------------------------------------------------
# registry and translators
# ----------------------------------------------------------------------------------------------


def test_registry():
    assert set(NAMES) <= set(POLICIES)
    assert get_policy("fp16") is POLICIES["fp16"]
    assert get_policy(POLICIES["bf16"]) is POLICIES["bf16"]
    with pytest.raises(UnknownPolicyError, match=r"unknown precision policy 'fp9'.*fp16-fp32-router-head"):
        get_policy("fp9")
    with pytest.raises(TypeError):
        get_policy(16)
    with pytest.raises(ValueError, match="already registered"):
        from moealign.precision.policy import register_policy
        register_policy(POLICIES["fp32"])
    with pytest.raises(ValueError, match="router_dtype"):
        PrecisionPolicy("x", torch.float16, router_dtype=torch.int8)
    with pytest.raises(ValueError, match="scaling"):
        Fp8Spec("e4m3", "channel")
    p = get_policy("fp16-fp32-router-head")
    assert p.module_dtype(ROUTER) == torch.float32 and p.module_dtype(LM_HEAD) == torch.float32
    assert p.module_dtype(None) == torch.float16 and p.overrides == {ROUTER: torch.float32, LM_HEAD: torch.float32}
    assert get_policy("fp16").overrides == {}
    assert get_policy("fp8-e4m3-block").replace(dtype=torch.float32).dtype == torch.float32


def test_to_transformers():
    t = to_transformers("fp16-fp32-router-head")
    assert t["dtype"] == torch.float16 and t["module_dtypes"] == {ROUTER: torch.float32, LM_HEAD: torch.float32}
    assert t["fp8"] is None and to_transformers("fp8-e4m3-block")["fp8"].scaling == "block"


def test_to_vllm_engine_args():
    assert to_vllm_engine_args("fp32") == {"dtype": "float32", "quantization": None, "kv_cache_dtype": "auto"}
    assert to_vllm_engine_args("bf16")["dtype"] == "bfloat16"
    assert to_vllm_engine_args("fp16")["dtype"] == "float16"
    head = to_vllm_engine_args("fp16-fp32-router-head")
    assert head["dtype"] == "float16" and head["hf_overrides"] == {"head_dtype": "float32"}
    assert to_vllm_engine_args("fp8-e4m3-tensor")["quantization"] == "fp8_per_tensor"
    assert to_vllm_engine_args("fp8-e4m3-block")["quantization"] == "fp8_per_block"
    assert vllm_gaps("fp16") == [] and vllm_gaps("fp16-fp32-router-head") == []   # the vLLM adapter builds fp32
    narrow = get_policy("fp32").replace(name="fp32-bf16-router", router_dtype=torch.bfloat16)
    assert "router in bfloat16" in vllm_gaps(narrow)[0]
    with pytest.raises(ValueError, match="e4m3"):
        to_vllm_engine_args(PrecisionPolicy("x", torch.bfloat16, fp8=Fp8Spec("e5m2")))


def test_to_megatron_fields():
    assert to_megatron_config_fields("bf16") == {"fp16": False, "bf16": True, "params_dtype": torch.bfloat16,
                                                 "moe_router_dtype": None}
    f = to_megatron_config_fields("fp16-fp32-router-head")
    assert f["fp16"] and not f["bf16"] and f["params_dtype"] == torch.float16 and f["moe_router_dtype"] == "fp32"
    assert to_megatron_config_fields("fp8-e4m3-tensor", te_available=True)["fp8_recipe"] == "tensorwise"
    block = to_megatron_config_fields("fp8-e4m3-block", te_available=True)
    assert block["fp8"] == "e4m3" and block["fp8_recipe"] == "blockwise" and block["bf16"]
    with pytest.raises(RuntimeError, match="transformer-engine"):
        to_megatron_config_fields("fp8-e4m3-block", te_available=False)
    sim = to_megatron_config_fields("fp8-e4m3-block", te_available=False, simulate_fp8=True)
    assert "fp8" not in sim and sim["bf16"]
    # no transformer-engine on this machine: probing finds none
    from moealign._optional import probe
    if not probe("transformer_engine").available:
        with pytest.raises(RuntimeError, match="simulate_fp8"):
            to_megatron_config_fields("fp8-e4m3-tensor")
    opt = to_megatron_optimizer_fields("fp16")
    assert opt["loss_scale"] is None and opt["initial_loss_scale"] == 2.0 ** 16 and opt["loss_scale_window"] == 400
    assert "initial_loss_scale" not in to_megatron_optimizer_fields("bf16")


def test_megatron_field_names_exist():
    """The translated names are real TransformerConfig / OptimizerConfig fields of the installed megatron-core."""
    pytest.importorskip("megatron.core")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer import TransformerConfig
    tc = {f.name for f in dataclasses.fields(TransformerConfig)}
    oc = {f.name for f in dataclasses.fields(OptimizerConfig)}
    for name in NAMES:
        assert set(to_megatron_config_fields(name, te_available=True)) <= tc, name
        assert set(to_megatron_optimizer_fields(name)) <= oc, name
    assert "not_a_field" not in tc                                # control


# ----------------------------------------------------------------------------------------------
# capability
# ----------------------------------------------------------------------------------------------

A100 = [GpuCapability(0, "A100", 8, 0, "given")]
H100 = [GpuCapability(0, "H100", 9, 0, "given")]
V100 = [GpuCapability(0, "V100", 7, 0, "given")]


def test_required_capability():
    assert required_capability("fp32") is None
    assert required_capability("fp16") == (7, 0)
    assert required_capability("bf16") == (8, 0)
    assert required_capability("fp8-e4m3-block") == (8, 9)


@pytest.mark.parametrize("policy,gpus,ok", [
    ("bf16", A100, True), ("fp8-e4m3-tensor", A100, False), ("fp8-e4m3-block", H100, True),
    ("bf16", V100, False), ("fp16", V100, True), ("fp32", V100, True),
    ("bf16", A100 + [GpuCapability(1, "V100", 7, 0, "given")], False),
])
def test_supports_given_gpus(policy, gpus, ok):
    answer, reason = supports(policy, "cuda", gpus=gpus)
    assert answer is ok and policy in reason
    if not ok:
        assert "compute capability" in reason


def test_supports_device_index_and_cpu():
    two = A100 + [GpuCapability(1, "V100", 7, 0, "given")]
    assert supports("bf16", "cuda:0", gpus=two)[0] and not supports("bf16", "cuda:1", gpus=two)[0]
    assert not supports("bf16", "cuda:5", gpus=two)[0]
    ok, reason = supports("fp8-e4m3-block", "cpu")
    assert ok and "simulated" in reason


def test_supports_degrades_without_gpu_or_pynvml(monkeypatch):
    from moealign import info
    from moealign._optional import Backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(info, "probe", lambda *a, **k: Backend("pynvml", None, None, "ModuleNotFoundError: pynvml"))
    gpus, note = capability.gpu_capabilities()
    assert gpus == [] and "nvidia-ml-py not importable" in note
    ok, reason = supports("bf16")
    assert not ok and "needs a CUDA GPU" in reason and "nvidia-ml-py" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer of this machine")
def test_supports_on_this_machine_without_gpu():
    ok, reason = supports("fp8-e4m3-block")
    assert ok is False and "needs a CUDA GPU" in reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_supports_on_this_gpu():
    major, minor = torch.cuda.get_device_capability(0)
    assert supports("bf16", "cuda:0")[0] is ((major, minor) >= (8, 0))
    assert supports("fp8-e4m3-tensor", "cuda:0")[0] is ((major, minor) >= (8, 9))


# ----------------------------------------------------------------------------------------------
# audits of the embedded model
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    transformers = pytest.importorskip("transformers")
    from moealign.embedded import embedded_model_path

    m = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_path())
    m.eval()
    return m


@pytest.fixture(scope="module")
def ids():
    return torch.randint(2, 2048, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def applied(model):
    from moealign.patches.hf.precision import apply_precision

    handles = []

    def apply(policy):
        handles.append(apply_precision(model, policy, keep_original=True))
        return handles[-1]

    yield apply
    for h in reversed(handles):
        h.undo()


def test_roles_of_embedded_model(model):
    from moealign.patches.hf.precision import module_roles

    roles = module_roles(model)
    assert roles == {**{f"model.layers.{i}.mlp.gate": ROUTER for i in range(4)}, "lm_head": LM_HEAD}


@pytest.mark.parametrize("name", NAMES)
def test_audit_passes_after_apply(model, ids, applied, name):
    with torch.no_grad():
        ref = model(ids).logits
    handle = applied(name)
    report = audit(model, name, {"input_ids": ids}, roles=handle.roles)
    policy = get_policy(name)
    assert report.forward_checked and report.computed["lm_head"] == (str(policy.module_dtype(LM_HEAD))[6:],) * 2
    assert report.computed["model.layers.0.mlp.gate"][0] == str(policy.module_dtype(ROUTER))[6:]
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert bool(report.fp8_modules) == (policy.fp8 is not None)
    with torch.no_grad():
        out = model(ids).logits
    assert out.dtype == policy.module_dtype(LM_HEAD)
    assert torch.equal(out, ref) == (name == "fp32")
    # the same audit without hooks' roles (guessed from names) agrees
    audit(model, name, {"input_ids": ids})


def test_undo_restores_exactly(model, ids):
    from moealign.patches.hf.precision import apply_precision

    with torch.no_grad():
        ref = model(ids).logits
        state = {k: v.clone() for k, v in model.state_dict().items()}
        h = apply_precision(model, "fp16-fp32-router-head", keep_original=True)
        h.undo()
        assert torch.equal(model(ids).logits, ref)
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        assert all(not m._forward_pre_hooks for _, m in model.named_modules())
        # control: with keep_original=False the values keep fp16's rounding (and undo says so)
        h = apply_precision(model, "fp16", keep_original=False)
        with pytest.warns(MoealignWarning, match="keep the rounding of float16"):
            h.undo()
        assert next(model.parameters()).dtype == torch.float32
        assert not torch.equal(model(ids).logits, ref)
        model.load_state_dict(state)


def deviations(model, policy, ids, **kw):
    with pytest.raises(PrecisionAuditError) as info:
        audit(model, policy, {"input_ids": ids}, **kw)
    return info.value.deviations


def test_audit_lists_every_wrongly_cast_module(model, ids, applied):
    applied("fp16-fp32-router-head")
    model.model.layers[1].mlp.gate.half()
    model.model.layers[2].self_attn.q_proj.float()
    found = deviations(model, "fp16-fp32-router-head", ids)
    assert any("model.layers.1.mlp.gate.weight: float16, policy says float32 (role router)" in d for d in found)
    assert any("model.layers.2.self_attn.q_proj.weight: float32, policy says float16" in d for d in found)
    assert any("forward raised" in d for d in found)          # fp16 input meets the fp32 q_proj
    assert not any("layers.0" in d or "layers.3" in d for d in found)


def test_audit_catches_missing_input_cast(model, ids, applied):
    handle = applied("fp16-fp32-router-head")
    for h in handle._hooks:            # drop the input casts, keep the fp32 routers and head
        h.remove()
    found = deviations(model, "fp16-fp32-router-head", ids)
    assert any("forward raised" in d for d in found) and not any("parameter" in d for d in found)


def test_audit_catches_wrong_compute_dtype_with_right_parameters(model, ids, applied):
    applied("fp16")
    norm = model.model.layers[3].post_attention_layernorm
    hook = norm.register_forward_pre_hook(lambda m, args: (args[0].float(),))
    try:
        found = deviations(model, "fp16", ids)
    finally:
        hook.remove()
    assert any("model.layers.3.post_attention_layernorm computes on float32 input, policy says float16" in d
               for d in found)
    assert not any("parameter" in d or "buffer" in d for d in found)
    audit(model, "fp16", {"input_ids": ids})                   # control: without the hook it is clean


def test_audit_wrong_policy_and_buffers(model, ids, applied):
    applied("bf16")
    found = deviations(model, "fp16", ids)
    n_params = sum(1 for _ in model.parameters())
    assert sum("parameter" in d for d in found) == n_params
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.bfloat16()
    found = deviations(model, "bf16", ids)
    assert found == ["buffer model.rotary_emb.inv_freq: bfloat16, policy says float32"]
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.float()


def test_audit_fp8_needs_fake_quant_and_only_where_due(model, ids, applied):
    from moealign.precision.fp8 import Fp8FakeQuantConfig, fake_quant_fp8_

    applied("bf16")
    found = deviations(model, "fp8-e4m3-block", ids)
    assert any("model.layers.0.mlp.experts: not FP8 fake-quantised" in d for d in found)
    assert any("weights were not FP8-rounded" in d for d in found)
    # quantising the routers too (skip nothing) is a deviation of its own
    with fake_quant_fp8_(model, Fp8FakeQuantConfig(scaling="block", skip=())):
        found = deviations(model, "fp8-e4m3-block", ids)
    assert any("model.layers.0.mlp.gate: FP8 fake-quantised" in d for d in found)
    assert any("lm_head: FP8 fake-quantised" in d for d in found)
    assert not any("experts" in d for d in found)


def test_tied_head_with_fp32_override_raises():
    transformers = pytest.importorskip("transformers")
    from moealign.patches.hf.precision import apply_precision

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      vocab_size=64, intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                                      num_experts_per_tok=2, num_hidden_layers=1, tie_word_embeddings=True)
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="tied"):
        apply_precision(m, "fp16-fp32-router-head")
    apply_precision(m, "fp16")       # no override: fine


# ----------------------------------------------------------------------------------------------
# per-region dtypes (attention / experts) and the router / head policies
# ----------------------------------------------------------------------------------------------


def test_router_and_head_policies_are_registered_separately():
    import moealign.precision.policy as policy_module
    from moealign.precision.policy import ATTENTION, EXPERTS, ROLES, megatron_gaps

    f32 = torch.float32
    want = {"bf16-fp32-router": (torch.bfloat16, {ROUTER: f32}), "bf16-fp32-head": (torch.bfloat16, {LM_HEAD: f32}),
            "bf16-fp32-router-head": (torch.bfloat16, {ROUTER: f32, LM_HEAD: f32}),
            "fp16-fp32-router": (torch.float16, {ROUTER: f32}), "fp16-fp32-head": (torch.float16, {LM_HEAD: f32}),
            "fp16-fp32-router-head": (torch.float16, {ROUTER: f32, LM_HEAD: f32})}
    for name, (dtype, overrides) in want.items():
        p = get_policy(name)
        assert p.dtype == dtype and p.overrides == overrides, name
        assert (p.loss_scaling is not None) == (dtype == torch.float16), name
        assert to_megatron_config_fields(name)["moe_router_dtype"] == ("fp32" if ROUTER in overrides else None)
        assert ("hf_overrides" in to_vllm_engine_args(name)) == (LM_HEAD in overrides)
        assert vllm_gaps(name) == []
        assert f"``{name}``" in policy_module.__doc__                  # the docstring's table lists it
    assert ROLES == (ROUTER, LM_HEAD, ATTENTION, EXPERTS)
    assert megatron_gaps("bf16") == [] and len(megatron_gaps("bf16-fp32-router")) == 1


def test_attention_and_experts_dtypes_in_the_policy():
    from moealign.precision.policy import ATTENTION, EXPERTS, megatron_gaps

    p = PrecisionPolicy("x", torch.bfloat16, attention_dtype=torch.float32, experts_dtype=torch.float32)
    assert p.module_dtype(ATTENTION) == torch.float32 and p.module_dtype(EXPERTS) == torch.float32
    assert p.module_dtype(ROUTER) == torch.bfloat16 and p.module_dtype(None) == torch.bfloat16
    assert p.overrides == {ATTENTION: torch.float32, EXPERTS: torch.float32}
    assert to_transformers(p)["module_dtypes"] == {ATTENTION: torch.float32, EXPERTS: torch.float32}
    mg, vg = megatron_gaps(p), vllm_gaps(p)
    assert len(mg) == 2 and "self-attention in float32" in mg[0] and "MoE experts in float32" in mg[1]
    assert "params_dtype" in mg[0] and "only moealign.patches.hf.precision.apply_precision" in mg[1]
    assert len(vg) == 2 and "vLLM" in vg[0] and "experts" in vg[1]
    same = PrecisionPolicy("y", torch.bfloat16, attention_dtype=torch.bfloat16)     # same as dtype: no gap
    assert same.overrides == {} and megatron_gaps(same) == [] and vllm_gaps(same) == []
    with pytest.raises(ValueError, match="attention_dtype"):
        PrecisionPolicy("z", torch.bfloat16, attention_dtype=torch.int32)
    with pytest.raises(ValueError, match="unknown module role"):
        p.module_dtype("mlp")


def test_module_roles_finds_attention_and_experts(model):
    from moealign.patches.hf.precision import module_roles
    from moealign.precision.policy import ATTENTION, EXPERTS, ROLES

    roles = module_roles(model, include=ROLES)
    assert roles == {**{f"model.layers.{i}.mlp.gate": ROUTER for i in range(4)}, "lm_head": LM_HEAD,
                     **{f"model.layers.{i}.self_attn": ATTENTION for i in range(4)},
                     **{f"model.layers.{i}.mlp.experts": EXPERTS for i in range(4)}}
    assert module_roles(model) == module_roles(model, include=(ROUTER, LM_HEAD))       # the default, as before
    assert module_roles(model, include=(EXPERTS,)) == {f"model.layers.{i}.mlp.experts": EXPERTS for i in range(4)}
    with pytest.raises(ValueError, match="unknown module roles"):
        module_roles(model, include=("mlp",))


def _run_layers(model, ids):
    """Logits and each decoder layer's output (the residual stream)."""
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple)
                                                                                 else o))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, outs


@pytest.mark.parametrize("region", ["attention", "experts"])
def test_fp32_region_in_bf16_model(ids, region):
    """The embedded model (load_model, fp32) under bf16 with fp32 attention (or experts): that region's parameters
    are fp32, everything else bf16, the residual stream stays bf16, the logits differ from plain bf16 and from fp32
    (both directions), the audit passes, and undo() restores bitwise."""
    pytest.importorskip("transformers")
    from moealign.embedded import embedded_model_path
    from moealign.patches.hf.loading import load_model
    from moealign.patches.hf.precision import apply_precision

    loaded, _ = load_model(embedded_model_path(), "fp32", "cpu")
    state = {k: v.clone() for k, v in loaded.state_dict().items()}
    fp32_logits, _ = _run_layers(loaded, ids)
    with apply_precision(loaded, "bf16"):
        bf16_logits, bf16_layers = _run_layers(loaded, ids)
    policy = get_policy("bf16").replace(name=f"bf16-fp32-{region}", **{f"{region}_dtype": torch.float32})
    marker = ".self_attn." if region == "attention" else ".mlp.experts."
    handle = apply_precision(loaded, policy)
    try:
        for name, p in loaded.named_parameters():
            assert p.dtype == (torch.float32 if marker in name else torch.bfloat16), name
        assert sum(marker in n for n, _ in loaded.named_parameters()) >= 4
        logits, layers = _run_layers(loaded, ids)
        assert len(layers) == 4 and all(h.dtype == torch.bfloat16 for h in layers.values())
        assert logits.dtype == torch.bfloat16
        assert not torch.equal(logits, bf16_logits)                               # the region runs in fp32 ...
        assert not torch.equal(logits.float(), fp32_logits)                       # ... and the rest in bf16
        d_bf16 = (logits.float() - fp32_logits).abs().max()
        assert d_bf16 <= (bf16_logits.float() - fp32_logits).abs().max() * 1.5  # not further from fp32 than bf16
        report = audit(loaded, policy, {"input_ids": ids}, roles=handle.roles)
        roots = [n for n, r in handle.roles.items() if r == region]
        assert len(roots) == 4
        if region == "experts":                                       # computes on fp32, returns the model's bf16
            assert report.computed["model.layers.0.mlp.experts"] == ("float32", "bfloat16")
        else:
            assert report.computed["model.layers.0.self_attn.q_proj"] == ("float32", "float32")
            assert report.computed["model.layers.0.post_attention_layernorm"][0] == "bfloat16"
        # control: without the output casts the residual stream turns fp32, and the next bf16 module refuses it
        for h in handle._hooks:
            h.remove()
        for root in roots:
            handle._add_input_cast(root, loaded.get_submodule(root), torch.float32, nested=True)
        with pytest.raises(RuntimeError, match="dtype"):
            _run_layers(loaded, ids)
    finally:
        handle.undo()
    after = loaded.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in state.items())
    assert torch.equal(_run_layers(loaded, ids)[0], fp32_logits)
