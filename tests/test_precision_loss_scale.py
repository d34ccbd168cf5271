"""Dynamic loss scaling (moealign.precision.loss_scale): overflow skips the step, scale backs off and grows;
fp16 training of the embedded model on CPU."""

from __future__ import annotations

import pytest
import torch

from moealign.precision.loss_scale import DynamicLossScaler, has_overflow
from moealign.precision.policy import get_policy


def tiny(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def same(model, snap):
    return all(torch.equal(p, s) for p, s in zip(model.parameters(), snap))


def test_overflow_skips_step_and_backs_off():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(2.0 ** 10, growth_interval=3)
    x = torch.randn(4, 8)
    scaler.scale(model(x).sum()).backward()
    model[0].weight.grad[0, 0] = float("inf")                  # injected overflow
    snap = snapshot(model)
    assert scaler.step(opt) is False
    assert same(model, snap)                                    # parameters unchanged
    assert all(p.grad is None for p in model.parameters())      # gradients cleared
    assert scaler.loss_scale == 2.0 ** 9 and scaler.skipped_steps == 1 and scaler.steps == 1
    # a normal step updates, the scale stays until growth_interval good steps
    for i in range(3):
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        snap = snapshot(model)
        assert scaler.step(opt) is True
        assert not same(model, snap)
        assert scaler.loss_scale == (2.0 ** 9 if i < 2 else 2.0 ** 10)
    assert scaler.skipped_steps == 1 and scaler.steps == 4


def test_nan_gradient_is_an_overflow_too():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(8.0)
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    model[2].bias.grad[0] = float("nan")
    snap = snapshot(model)
    assert scaler.step(opt) is False and same(model, snap) and scaler.loss_scale == 4.0


def test_unscale_divides_exactly():
    model = tiny()
    x = torch.randn(4, 8)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(2.0 ** 12)
    scaler.scale(model(x).sum()).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(plain, scaled))     # control: scaled grads differ
    assert scaler.unscale_(opt) is False
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))   # power-of-two scale: exact
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt)
    assert scaler.step(opt) is True                                     # uses the recorded result


def test_hysteresis_min_and_max_scale():
    s = DynamicLossScaler(16.0, hysteresis=2, min_scale=4.0, growth_interval=1, max_scale=32.0)
    s.update(True)
    assert s.loss_scale == 16.0          # first overflow tolerated
    s.update(True)
    assert s.loss_scale == 8.0
    for _ in range(4):
        s.update(True)
    assert s.loss_scale == 4.0           # floor
    for _ in range(5):
        s.update(False)
    assert s.loss_scale == 32.0          # ceiling
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.state_dict() == state
    with pytest.raises(ValueError, match="misses"):
        t.load_state_dict({"loss_scale": 1.0})


def test_bad_configuration():
    with pytest.raises(ValueError, match="initial_scale"):
        DynamicLossScaler(float("inf"))
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicLossScaler(growth_interval=0)
    with pytest.raises(ValueError, match="scalar"):
        DynamicLossScaler().scale(torch.ones(3))
    with pytest.raises(ValueError, match="does not use loss scaling"):
        DynamicLossScaler.from_policy(get_policy("bf16"))


def test_scaling_rescues_fp16_gradients_that_underflow():
    model = tiny(torch.float16)
    x = torch.randn(4, 8, dtype=torch.float16)
    (model(x).float().sum() * 1e-7).backward()
    unscaled_zero = (model[0].weight.grad == 0).float().mean().item()
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(2.0 ** 24)
    scaler.scale(model(x).float().sum() * 1e-7).backward()
    rescued_zero = (model[0].weight.grad == 0).float().mean().item()
    assert unscaled_zero > 0.5 and rescued_zero < 0.1      # the scaled backward kept them
    # (unscaling back into fp16 storage underflows them again: that is why trainers keep fp32 master
    # gradients; the scaler divides whatever gradient dtype it is given)
    assert scaler.unscale_(opt) is False
    assert has_overflow([torch.tensor([1.0, float("inf")])]) and not has_overflow([torch.ones(3)])


@pytest.mark.parametrize("policy", ["fp16", "fp16-fp32-router-head"])
def test_fp16_training_embedded_model(policy):
    transformers = pytest.importorskip("transformers")
    from moealign.embedded import embedded_model_path
    from moealign.patches.hf.precision import apply_precision
    from moealign.precision.audit import audit

    model = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_path())
    handle = apply_precision(model, policy)
    ids = torch.randint(2, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    audit(model, policy, {"input_ids": ids}, roles=handle.roles)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = DynamicLossScaler.from_policy(get_policy(policy))
    scaler.loss_scale = 2.0 ** 40              # forces an overflow in the fp16 backward
    scaler.backoff_factor = 2.0 ** -28         # one back-off lands on 2**12
    losses, stepped = [], []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        losses.append(loss.item())
        scaler.scale(loss).backward()
        snap = snapshot(model)
        stepped.append(scaler.step(opt))
        assert same(model, snap) != stepped[-1]          # unchanged exactly when skipped
    assert stepped == [False, True, True, True]
    assert scaler.loss_scale == 2.0 ** 12 and scaler.skipped_steps == 1
    assert losses[1] == losses[0] and losses[-1] < losses[1]     # skipped step left the loss; training lowers it
    # parameters are still in the policy's dtypes after training
    audit(model, policy, roles=handle.roles)
