"""The router-precision audit (moealign.precision.router_audit): four stages (weight, projection, scores, top-k
input) observed in the live routers of transformers and Megatron-core models."""

from __future__ import annotations

import pytest
import torch

from moealign.precision.router_audit import STAGES, RouterAudit, check_router_audit, observe_routers

F32, BF16 = torch.float32, torch.bfloat16


# ----------------------------------------------------------------------------------------------- engine-free


class _Router(torch.nn.Module):
    """A toy router: projection -> (optional cast) -> softmax -> topk."""

    def __init__(self, dtype=F32, scores_dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 8, dtype=dtype))
        self.scores_dtype = scores_dtype

    def forward(self, x):
        logits = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight)
        if self.scores_dtype is not None:
            logits = logits.to(self.scores_dtype)
        scores = torch.softmax(logits, dim=-1)
        return torch.topk(scores, 2, dim=-1)


def _ops():
    return [(torch.nn.functional, "linear", "projection", "output"), (torch, "softmax", "scores", "output")]


def test_observer_records_each_stage_per_router_and_undoes():
    routers = {0: _Router(), 3: _Router(scores_dtype=BF16)}
    topk, linear, tensor_topk = torch.topk, torch.nn.functional.linear, torch.Tensor.topk
    x = torch.randn(5, 8)
    with observe_routers(routers, ops=_ops(), engine="toy") as obs:
        torch.topk(x, 2)                                  # outside a router: not attributed
        assert torch.topk is not topk and obs.current_layer is None
        for layer in (0, 3):
            routers[layer](x)
    assert torch.topk is topk and torch.nn.functional.linear is linear and torch.Tensor.topk is tensor_topk
    assert "topk" not in vars(torch.Tensor)
    result = obs.result
    assert isinstance(result, RouterAudit) and list(result) == [0, 3] and result.engine == "toy"
    assert result[0] == dict.fromkeys(STAGES, F32)
    assert result[3] == {"weight": F32, "projection": F32, "scores": BF16, "topk_input": BF16}
    assert check_router_audit(result, F32) == ["layer 3 scores: bfloat16, expected float32",
                                               "layer 3 topk_input: bfloat16, expected float32"]
    assert check_router_audit(result, {"weight": F32, "projection": F32}) == []
    assert result.names()[3]["scores"] == "bfloat16" and "layers 0:" in result.summary()
    # a router that raises is left again (always_call), the patches still come off
    bad = {1: _Router()}
    with observe_routers(bad) as obs:
        with pytest.raises(RuntimeError):
            bad[1](torch.randn(5, 7))
        assert obs.current_layer is None
    assert torch.topk is topk
    # an unobserved stage is a failure; a stage seen in two dtypes is noted
    assert check_router_audit(obs.result, F32) == [f"layer 1 {s}: not observed, expected float32"
                                                   for s in ("projection", "scores", "topk_input")]
    with observe_routers({0: routers[0]}, ops=_ops()) as obs:
        def adapter_hook(module, args):                   # an adapter's own hook, inside the router
            obs.note("scores", torch.zeros(1, dtype=BF16))
        h = routers[0].register_forward_pre_hook(adapter_hook)
        routers[0](x)
        h.remove()
        obs.note("scores", torch.zeros(1, dtype=F32))     # outside every router: ignored
    assert obs.result[0]["scores"] == BF16 and "also seen in float32" in obs.result.notes[0]   # softmax: fp32
    assert obs.result[0]["topk_input"] == F32
    assert check_router_audit({}, F32) == ["no router was observed"]
    with pytest.raises(ValueError, match="unknown router audit stages"):
        check_router_audit(result, {"logits": F32})
    with pytest.raises(ValueError):
        observe_routers({})


# ----------------------------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("transformers")
    from moealign.embedded import embedded_model_path
    from moealign.patches.hf.loading import load_model

    model, _ = load_model(embedded_model_path(), "fp32", "cpu")
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(2, 2048, (2, 10), generator=torch.Generator().manual_seed(0))


def test_hf_fp32_router_is_fp32_at_every_stage(hf_model, ids):
    from moealign.patches.hf.precision import apply_precision, audit_router

    with apply_precision(hf_model, "bf16-fp32-router"):
        result = audit_router(hf_model, {"input_ids": ids})
    assert list(result) == [0, 1, 2, 3]
    assert check_router_audit(result, F32) == []
    assert all(result[layer] == dict.fromkeys(STAGES, F32) for layer in result)


def test_hf_bf16_router_rounds_at_the_projection(hf_model, ids):
    """Plain bf16: weight and logits bf16; transformers' Qwen3-MoE router takes softmax(dtype=float), so its scores
    and top-k input are float32 of bf16-rounded logits (not bf16)."""
    from moealign.patches.hf.precision import apply_precision, audit_router

    with apply_precision(hf_model, "bf16"):
        result = audit_router(hf_model, {"input_ids": ids})
    assert all(result[layer] == {"weight": BF16, "projection": BF16, "scores": F32, "topk_input": F32}
               for layer in range(4))
    failures = check_router_audit(result, F32)
    assert len(failures) == 8 and all(("weight" in f or "projection" in f) for f in failures)
    assert failures[0] == "layer 0 weight: bfloat16, expected float32"
    assert check_router_audit(result, {"weight": BF16, "projection": BF16}) == []


def test_hf_negative_control_scores_cast_down(hf_model, ids):
    """An fp32-weight router whose logits are cast down to bf16 before its softmax (in bf16): the audit names that
    layer's scores and top-k input, and nothing else."""
    from moealign.patches.hf.precision import apply_precision, audit_router

    with apply_precision(hf_model, "bf16-fp32-router"):
        gate = hf_model.model.layers[2].mlp.gate

        def cast_down_forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden_states, gate.weight).to(BF16)   # the bug under test
            probs = torch.nn.functional.softmax(logits, dim=-1)
            top, idx = torch.topk(probs, gate.top_k, dim=-1)
            top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        gate.forward = cast_down_forward
        try:
            result = audit_router(hf_model, {"input_ids": ids})
        finally:
            del gate.forward
    assert check_router_audit(result, F32) == ["layer 2 scores: bfloat16, expected float32",
                                               "layer 2 topk_input: bfloat16, expected float32"]
    assert result[2]["weight"] == F32 and result[2]["projection"] == F32


def test_hf_missing_input_cast_is_refused_by_torch(hf_model, ids):
    """The other way a router drops precision: an fp32 weight fed a bf16 input without the pre-hook. F.linear
    refuses mixed dtypes, so that router cannot silently compute in bf16; the audit's forward raises."""
    from moealign.patches.hf.precision import apply_precision, audit_router

    with apply_precision(hf_model, "bf16-fp32-router") as handle:
        for h in handle._hooks:
            h.remove()
        with pytest.raises(RuntimeError, match="dtype"):
            audit_router(hf_model, {"input_ids": ids})
    assert torch.topk.__module__ != __name__ and not hasattr(torch.topk, "__wrapped__")


# ----------------------------------------------------------------------------------------------- Megatron-core


@pytest.fixture(scope="module")
def megatron_build(hf_model):
    pytest.importorskip("megatron.core")
    import warnings

    from moealign.patches import megatron as mg
    from moealign.patches.megatron import checkpoint as mc
    from moealign.precision.policy import to_megatron_config_fields

    world = mg.init_single_process(device="cpu")

    def build(policy):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return mc.build_megatron_from_hf(hf_model, **to_megatron_config_fields(policy, te_available=False)).eval()

    yield build
    world.undo()


def _mcore_inputs(ids):
    B, T = ids.shape
    return ids, torch.arange(T).expand(B, T), torch.ones(T, T, dtype=torch.bool).triu(1)[None, None]


def test_megatron_router_stages(megatron_build, ids):
    """moe_router_dtype=None (bf16): bf16 at all four stages. moe_router_dtype="fp32" (bf16-fp32-router): the
    logits, scores and top-k input are fp32, but the weight is still held in bf16 (params_dtype): Megatron casts
    the bf16-rounded weight up, it does not hold an fp32 router. The audit says so at stage "weight"."""
    from moealign.patches.megatron.router_audit import audit_router

    topk = torch.topk
    plain = audit_router(megatron_build("bf16"), _mcore_inputs(ids))
    assert list(plain) == [0, 1, 2, 3] and check_router_audit(plain, BF16) == []
    fp32 = audit_router(megatron_build("bf16-fp32-router"), _mcore_inputs(ids))
    assert "moe_router_dtype='fp32'" in fp32.notes[0]
    assert check_router_audit(fp32, F32) == [f"layer {i} weight: bfloat16, expected float32" for i in range(4)]
    assert check_router_audit(fp32, {"weight": BF16, "projection": F32, "scores": F32, "topk_input": F32}) == []
    assert torch.topk is topk
    ref = audit_router(megatron_build("fp32"), _mcore_inputs(ids))
    assert check_router_audit(ref, F32) == []
