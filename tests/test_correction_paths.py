"""The blocked eager pass, the single-block pass, the compiled (fused) pass and a CUDA device must agree."""

import pytest
import torch

import moealign.correction.pipeline as pipeline
from moealign.correction import (
    RolloutCorrectionConfig,
    compute_rollout_correction_and_rejection_mask,
)

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py


def _inputs(B=37, T=129, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    rollout = (old + torch.randn(B, T, generator=g) * 0.05).clamp(max=0.0)  # log-probs <= 0
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    mask[0] = 1.0
    old[mask == 0] = float("nan")  # garbage at padding must not leak
    return old, rollout, mask


def _compare(a, b, rtol=1e-5, atol=1e-6):
    (wa, ma, xa), (wb, mb, xb) = a, b
    assert (wa is None) == (wb is None)
    if wa is not None:
        torch.testing.assert_close(wa.cpu(), wb.cpu(), rtol=rtol, atol=atol)
    assert torch.equal(ma.cpu(), mb.cpu())
    fa, fb = xa.to_floats(), xb.to_floats()
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k] == pytest.approx(fb[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("preset", ["decoupled_geo_rs_seq_tis", "decoupled_token_icepop", "decoupled_k3_rs_token_tis"])
def test_blocked_equals_single_block(preset, monkeypatch):
    old, rollout, mask = _inputs()
    kw = RolloutCorrectionConfig.preset(preset).to_kwargs()
    kw["rollout_is_batch_normalize"] = kw["rollout_is"] is not None
    monkeypatch.setattr(pipeline, "_BLOCK_ELEMENTS", 1 << 30)
    whole = compute_rollout_correction_and_rejection_mask(old, rollout, mask, agreement_metrics=True, **kw)
    monkeypatch.setattr(pipeline, "_BLOCK_ELEMENTS", 3 * old.shape[1])  # blocks of 3 rows, ragged last block
    blocked = compute_rollout_correction_and_rejection_mask(old, rollout, mask, agreement_metrics=True, **kw)
    _compare(whole, blocked)
    assert torch.isfinite(whole[0]).all()


def test_fused_equals_eager():
    old, rollout, mask = _inputs()
    kw = RolloutCorrectionConfig.decoupled_geo_rs_seq_tis().to_kwargs()
    eager = compute_rollout_correction_and_rejection_mask(old, rollout, mask, agreement_metrics=True, **kw)
    fused = compute_rollout_correction_and_rejection_mask(old, rollout, mask, agreement_metrics=True, fused=True, **kw)
    _compare(eager, fused)
    # a new shape reuses the compiled pass (dynamic shapes) and still agrees
    old2, rollout2, mask2 = _inputs(B=5, T=17, seed=1)
    _compare(
        compute_rollout_correction_and_rejection_mask(old2, rollout2, mask2, **kw),
        compute_rollout_correction_and_rejection_mask(old2, rollout2, mask2, fused=True, **kw),
    )
    with pytest.raises(ValueError, match="rollout_log_prob has non-finite"):
        rollout2[0, 0] = float("inf")
        compute_rollout_correction_and_rejection_mask(old2, rollout2, mask2, fused=True, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_matches_cpu(fused):
    old, rollout, mask = _inputs(B=64, T=300)
    kw = RolloutCorrectionConfig.decoupled_geo_rs_token_tis().to_kwargs()
    cpu = compute_rollout_correction_and_rejection_mask(old, rollout, mask, agreement_metrics=True, **kw)
    gpu = compute_rollout_correction_and_rejection_mask(
        old.cuda(), rollout.cuda(), mask.cuda(), agreement_metrics=True, fused=fused, **kw)
    assert gpu[0].device.type == "cuda" and gpu[1].device.type == "cuda"
    _compare(cpu, gpu, rtol=1e-4, atol=1e-5)


def test_fused_failure_is_reported(monkeypatch):
    def broken(plan, dtype):
        def run(*args):
            raise OSError("no C++ compiler")
        return run

    monkeypatch.setattr(pipeline, "_compiled", broken)
    old, rollout, mask = _inputs(B=3, T=5)
    with pytest.raises(RuntimeError, match="fused=True compiles.*OSError: no C\\+\\+ compiler.*fused=False"):
        compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_is="token", fused=True)
