"""Simulated FP8 (moealign.precision.fp8): scaled casts, round-trip bounds, block scales, fake quantisation."""

from __future__ import annotations

import math

import pytest
import torch

from moealign.precision.fp8 import (
    Fp8FakeQuantConfig,
    Fp8FakeQuantLinear,
    dequantize_fp8,
    fake_quant_fp8_,
    fake_quantize_fp8,
    fp8_max,
    quantize_fp8,
)

# round-to-nearest relative error bound of a normal FP8 value: half a unit in the last place
REL = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}


def normal_range(shape, seed=0, lo=0.1, hi=1.0):
    """Values with magnitudes in [lo, hi] (a ratio far inside FP8's normal range) and random signs."""
    g = torch.Generator().manual_seed(seed)
    mag = lo + (hi - lo) * torch.rand(shape, generator=g)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return mag * sign


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [None, (128, 128), (1, 128)])
def test_round_trip_error_bound(fmt, block):
    x = normal_range((300, 200), seed=1) * 37.0
    q, scale = quantize_fp8(x, fmt, block)
    assert q.dtype == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt] and q.shape == x.shape
    y = dequantize_fp8(q, scale, block)
    rel = ((y - x).abs() / x.abs()).max().item()
    assert 0 < rel <= REL[fmt] * (1 + 1e-6)          # it rounds, and no more than half an ulp
    assert torch.equal(fake_quantize_fp8(x, fmt, block), y)
    # the scale maps amax onto the format's largest value
    assert q.float().abs().max().item() == pytest.approx(fp8_max(fmt), rel=REL[fmt])


def test_fp8_max():
    assert fp8_max("e4m3") == 448.0 and fp8_max("e5m2") == 57344.0
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8_max("e3m4")


@pytest.mark.parametrize("shape,block,want", [
    ((300, 200), (128, 128), (3, 2)),
    ((256, 128), (128, 128), (2, 1)),
    ((4, 300, 200), (128, 128), (4, 3, 2)),
    ((5, 7, 300), (1, 128), (5, 7, 3)),
])
def test_block_scale_shape(shape, block, want):
    x = torch.randn(shape)
    q, scale = quantize_fp8(x, "e4m3", block)
    assert tuple(scale.shape) == want
    expect = tuple(shape[:-2]) + (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    assert tuple(scale.shape) == expect
    # each scale is its tile's amax / 448
    tile = x[..., : block[0], : block[1]]
    assert torch.allclose(scale[..., 0, 0], tile.abs().amax(dim=(-2, -1)) / 448.0)


def test_per_tensor_scale_is_scalar():
    x = torch.randn(3, 5, 7)
    _, scale = quantize_fp8(x)
    assert scale.dim() == 0 and scale.item() == pytest.approx(x.abs().max().item() / 448.0)


def test_block_scaling_keeps_small_tiles_that_tensor_scaling_flushes():
    x = normal_range((256, 256), seed=2)
    x[:128, :128] *= 1e4          # one loud tile
    x[128:, 128:] *= 1e-5         # one quiet tile
    quiet = (slice(128, None), slice(128, None))
    blk = fake_quantize_fp8(x, "e4m3", (128, 128))
    rel_blk = ((blk[quiet] - x[quiet]).abs() / x[quiet].abs()).max().item()
    assert rel_blk <= REL["e4m3"]
    # negative control: one scale for the whole tensor puts the quiet tile below FP8's smallest subnormal
    tensor = fake_quantize_fp8(x, "e4m3", None)
    assert (tensor[quiet] == 0).float().mean().item() > 0.9


def test_zeros():
    z = torch.zeros(4, 300)
    for block in (None, (1, 128), (128, 128)):
        q, scale = quantize_fp8(z, "e4m3", block)
        assert torch.all(scale == 1.0)
        assert torch.equal(dequantize_fp8(q, scale, block), z)
    # an all-zero tile next to non-zero ones: scale 1 there, exact zeros back, others unaffected
    x = torch.randn(256, 256)
    x[:128, 128:] = 0
    q, scale = quantize_fp8(x, "e4m3", (128, 128))
    assert scale[0, 1].item() == 1.0 and scale[0, 0].item() != 1.0
    assert torch.equal(dequantize_fp8(q, scale, (128, 128))[:128, 128:], x[:128, 128:])
    assert torch.isfinite(scale).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(8, 8)
    x[3, 4] = bad
    with pytest.raises(ValueError, match="NaN" if math.isnan(bad) else "infinite"):
        quantize_fp8(x)
    with pytest.raises(ValueError):
        quantize_fp8(x, "e4m3", (4, 4))


def test_bad_arguments():
    with pytest.raises(TypeError, match="floating"):
        quantize_fp8(torch.arange(4))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        quantize_fp8(torch.randn(10), "e4m3", (1, 128))
    with pytest.raises(ValueError, match="two positive ints"):
        quantize_fp8(torch.randn(4, 4), "e4m3", (0, 4))
    q, scale = quantize_fp8(torch.randn(300, 200), "e4m3", (128, 128))
    with pytest.raises(ValueError, match="must have shape"):
        dequantize_fp8(q, scale[:2], (128, 128))
    with pytest.raises(TypeError, match="FP8 tensor"):
        dequantize_fp8(torch.randn(3, 3), scale)


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_fake_quant_linear_close_to_fp32_and_different(scaling):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 160, bias=False)
    with torch.no_grad():
        lin.weight.copy_(normal_range((160, 256), seed=3) * 0.05)
    x = normal_range((6, 9, 256), seed=4)
    ref = lin(x)
    fq = Fp8FakeQuantLinear.from_linear(lin, Fp8FakeQuantConfig(scaling=scaling))
    assert fq.weight is lin.weight                      # shares the parameter
    out = fq(x)
    # |x_q w_q - x w| <= sum |x||w| (2 r + r^2) for relative errors r of each factor (all values normal)
    r = REL["e4m3"]
    bound = (x.abs() @ lin.weight.abs().t()) * (2 * r + r * r) + 1e-5
    assert torch.all((out - ref).abs() <= bound)
    assert (out - ref).abs().max().item() > 1e-4       # it really quantises
    # weight-only: closer, still different
    wo = Fp8FakeQuantLinear.from_linear(lin, Fp8FakeQuantConfig(scaling=scaling, activations=False))(x)
    assert torch.all((wo - ref).abs() <= (x.abs() @ lin.weight.abs().t()) * r + 1e-5)
    assert not torch.equal(wo, ref) and not torch.equal(wo, out)


class Toy(torch.nn.Module):
    """Linear layers, stacked 'expert' matrices, a router and a head (the last two stay wide)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 32)
        self.proj = torch.nn.Linear(32, 32)
        self.experts = Experts()
        self.gate = torch.nn.Linear(32, 4, bias=False)
        self.lm_head = torch.nn.Linear(32, 50, bias=False)

    def forward(self, ids):
        h = self.proj(self.embed(ids))
        h = h + self.experts(h, torch.softmax(self.gate(h), -1))
        return self.lm_head(h)


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 32, 32) * 0.1)

    def forward(self, h, probs):
        return sum(probs[..., e:e + 1] * (h @ self.w[e].t()) for e in range(self.w.shape[0]))


def test_fake_quant_model_selects_reverses_and_trains():
    torch.manual_seed(0)
    model = Toy()
    ids = torch.randint(0, 50, (3, 7))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model(ids)
    handle = fake_quant_fp8_(model, Fp8FakeQuantConfig(scaling="block"))
    assert sorted(handle.modules) == ["experts", "proj"]             # not embed, gate, lm_head
    assert handle.modules["experts"] == ["w"]
    out = model(ids)
    assert not torch.equal(out, ref) and torch.allclose(out, ref, atol=0.1)
    # parameters untouched, nothing left on the instances after the forward
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "w" not in model.experts.__dict__ and "weight" not in model.proj.__dict__
    # straight-through gradients reach the real parameters
    out.square().mean().backward()
    assert model.experts.w.grad is not None and model.proj.weight.grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="already fake-quantised"):
        fake_quant_fp8_(model)
    # a forward that raises leaves no shadowed weight behind
    with pytest.raises(Exception):
        model.proj(torch.randn(2, 5))
    assert "weight" not in model.proj.__dict__
    handle.undo()
    assert not handle.active
    assert torch.equal(model(ids), ref)
    with fake_quant_fp8_(model, Fp8FakeQuantConfig(skip=(r"^experts$", r"gate", r"lm_head"))) as h2:
        assert sorted(h2.modules) == ["proj"]
    assert torch.equal(model(ids), ref)


def test_fake_quant_finds_nothing_raises():
    with pytest.raises(ValueError, match="no module"):
        fake_quant_fp8_(torch.nn.Sequential(torch.nn.ReLU()))
    with pytest.raises(TypeError, match="Fp8FakeQuantConfig"):
        fake_quant_fp8_(Toy(), {"fmt": "e4m3"})


def test_embedded_model_fp8_rollout_vs_bf16_training_and_aligned():
    """FP8 on both sides gives bitwise-equal logits; FP8 rollout against a bf16 trainer does not."""
    transformers = pytest.importorskip("transformers")
    from moealign.embedded import embedded_model_path
    from moealign.patches.hf.precision import apply_precision

    path = embedded_model_path()
    rollout = transformers.AutoModelForCausalLM.from_pretrained(path)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(2, 2048, (2, 12), generator=torch.Generator().manual_seed(5))
    apply_precision(rollout, "fp8-e4m3-block")
    h = apply_precision(trainer, "bf16")
    with torch.no_grad():
        a = rollout(ids).logits
        b = trainer(ids).logits
        assert not torch.equal(a, b)
        h.undo()
        apply_precision(trainer, "fp8-e4m3-block")
        assert torch.equal(trainer(ids).logits, a)
