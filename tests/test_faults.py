"""Injected faults (moealign.mismatch.faults): parsing, a seeded weight perturbation of one decoder layer that
undoes bitwise, and the replay-off wrapper. A tiny Qwen3-MoE built from a config; no engine."""

from __future__ import annotations

import re

import pytest
import torch

from moealign.errors import ConfigError, MoealignError
from moealign.mismatch.faults import FAULT_KINDS, Fault, ReplayOffTrainer, apply_fault, parse_fault


# ------------------------------------------------------------------------------------------------- parsing
def test_parse_weights_layer():
    f = parse_fault("weights:layer=2")
    assert f == Fault("weights", 2, 0.05, 1234)
    assert "layer 2" in f.describe()


def test_parse_weights_all_options():
    f = parse_fault("weights:layer=2,scale=0.1,seed=3")
    assert (f.kind, f.layer, f.scale, f.seed) == ("weights", 2, 0.1, 3)
    assert parse_fault("weights:scale=0.5,layer=0").layer == 0


def test_parse_replay_off():
    f = parse_fault("replay-off")
    assert f.kind == "replay-off" and f.layer is None
    assert f.kind in FAULT_KINDS
    assert "replay" in f.describe()


@pytest.mark.parametrize("text,needle", [
    ("", "expected one of"),
    ("   ", "expected one of"),
    (None, "expected one of"),
    ("bogus", "unknown fault"),
    ("weights", "needs layer"),
    ("weights:", "needs layer"),
    ("weights:layer=x", "integers"),
    ("weights:layer=1.5", "integers"),
    ("weights:layer=-1", "layer must be >= 0"),
    ("weights:foo=1", "unknown option"),
    ("weights:layer", "unknown option"),
    ("weights:layer=2,seed=x", "integers"),
    ("weights:layer=2,scale=abc", "scale a number"),
    ("weights:layer=2,scale=0", "scale in (0, 10)"),
    ("weights:layer=2,scale=10", "scale in (0, 10)"),
    ("weights:layer=2,scale=-0.1", "scale in (0, 10)"),
    ("weights:layer=2,scale=nan", "scale in (0, 10)"),
    ("replay-off:x", "takes no options"),
])
def test_parse_refuses(text, needle):
    with pytest.raises(ConfigError) as info:
        parse_fault(text)
    assert isinstance(info.value, MoealignError)
    assert needle in str(info.value), str(info.value)


def test_parse_scale_just_inside_bounds():
    assert parse_fault("weights:layer=0,scale=1e-6").scale == 1e-6
    assert parse_fault("weights:layer=0,scale=9.99").scale == 9.99


# ------------------------------------------------------------------------------------------------- apply
def _tiny_moe(seed: int = 0, layers: int = 3):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=64, intermediate_size=64,
        num_experts_per_tok=2, head_dim=16, eos_token_id=2, bos_token_id=1, pad_token_id=0,
        num_hidden_layers=layers, num_experts=4, moe_intermediate_size=16)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():   # norm weights start as all ones (std 0: a fault leaves them); make them a checkpoint's
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape))
    return model


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _in_layer(name, layer):
    return re.search(rf"(^|\.)layers\.{layer}\.", name) is not None


def _is_router(name):
    return re.search(r"\.(gate|router)\.", name) is not None


def test_apply_perturbs_exactly_that_layer_and_undo_restores_bitwise():
    model = _tiny_moe()
    before = _snapshot(model)
    handle = apply_fault(model, parse_fault("weights:layer=1,scale=0.1,seed=3"))
    touched = 0
    for n, p in model.named_parameters():
        if _in_layer(n, 1) and not _is_router(n) and p.is_floating_point():
            assert not torch.equal(p, before[n]), n                     # perturbed
            touched += 1
        else:
            assert torch.equal(p, before[n]), n                         # untouched (other layers, the router)
    assert touched > 5
    # the router of the layer exists and is left as it is (the record's fingerprint catches router changes)
    assert "model.layers.1.mlp.gate.weight" in before
    assert any(_in_layer(n, 1) and "experts" in n for n in before)      # experts' fused params are perturbed
    assert len(handle.patched) == 1 and str(touched) in handle.patched[0]
    handle.undo()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_apply_context_manager_undoes():
    model = _tiny_moe()
    before = _snapshot(model)
    with apply_fault(model, Fault("weights", 0, 0.05, 7)):
        assert not torch.equal(dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"],
                               before["model.layers.0.self_attn.q_proj.weight"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_apply_matches_definition():
    # W + S * std(W) * noise, noise drawn from one generator seeded with the fault's seed, in parameter order
    model = _tiny_moe()
    before = _snapshot(model)
    fault = Fault("weights", 2, 0.2, 11)
    apply_fault(model, fault)
    gen = torch.Generator().manual_seed(11)
    for n, p in model.named_parameters():
        if not _in_layer(n, 2) or _is_router(n):
            continue
        w = before[n]
        noise = torch.randn(w.shape, generator=gen, dtype=torch.float32)
        std = w.float().std() if w.numel() > 1 else w.float().abs()
        assert torch.equal(p, w + (0.2 * std * noise).to(w.dtype)), n


def test_apply_layer_pattern_does_not_match_prefix():
    # layer 1 must not touch layer 10..; build 11 layers and check 10 is untouched
    model = _tiny_moe(layers=11)
    before = _snapshot(model)
    apply_fault(model, Fault("weights", 1, 0.05, 1))
    for n, p in model.named_parameters():
        if _in_layer(n, 10):
            assert torch.equal(p, before[n]), n


def test_apply_deterministic_per_seed():
    a, b, c = _tiny_moe(), _tiny_moe(), _tiny_moe()
    apply_fault(a, Fault("weights", 0, 0.05, 5))
    apply_fault(b, Fault("weights", 0, 0.05, 5))
    apply_fault(c, Fault("weights", 0, 0.05, 6))
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    layer0 = [n for n in pa if _in_layer(n, 0) and not _is_router(n)]
    assert layer0
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert all(not torch.equal(pa[n], pc[n]) for n in layer0)


def test_apply_bfloat16_model_keeps_dtype_and_undoes():
    model = _tiny_moe().to(torch.bfloat16)
    before = _snapshot(model)
    h = apply_fault(model, Fault("weights", 0, 0.5, 2))
    p = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert p.dtype == torch.bfloat16 and not torch.equal(p, before["model.layers.0.mlp.experts.gate_up_proj"])
    h.undo()
    assert all(torch.equal(q, before[n]) for n, q in model.named_parameters())


def test_apply_missing_layer_raises():
    model = _tiny_moe()
    before = _snapshot(model)
    with pytest.raises(ConfigError, match="no decoder layer 3"):
        apply_fault(model, Fault("weights", 3))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_apply_replay_off_refused():
    with pytest.raises(ConfigError, match="training engine"):
        apply_fault(_tiny_moe(), parse_fault("replay-off"))


# ------------------------------------------------------------------------------------------------- replay-off
class _FakeEngine:
    def __init__(self):
        self.calls = []
        self.name = "fake"

    def forward(self, record, indices, *, replay):
        self.calls.append((record, indices, replay))
        return ("out", replay)

    def close(self):
        self.calls.append("close")
        return "closed"


def test_replay_off_forces_replay_false():
    engine = _FakeEngine()
    wrapped = ReplayOffTrainer(engine)
    rec = object()
    assert wrapped.forward(rec, [0, 1], replay=True) == ("out", False)
    assert wrapped.forward(rec, [2], replay=False) == ("out", False)
    assert engine.calls == [(rec, [0, 1], False), (rec, [2], False)]
    # negative control: the bare engine does pass replay=True through
    assert engine.forward(rec, [0], replay=True) == ("out", True)


def test_replay_off_forwards_other_attributes():
    engine = _FakeEngine()
    wrapped = ReplayOffTrainer(engine)
    assert wrapped.name == "fake"
    assert wrapped.close() == "closed" and engine.calls[-1] == "close"
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute
