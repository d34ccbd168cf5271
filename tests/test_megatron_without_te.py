"""Megatron-core without transformer-engine (issue 24, item 1): 0.16.1's ``moe_utils`` binds ``te_general_gemm``
only when transformer-engine imports, and every router forward reads it (``NameError`` on CUDA without
transformer-engine). :func:`enable_megatron_without_te` binds it (and the other TE-only names) to None; the CPU
mode nests it, :func:`init_single_process` applies it on CUDA. The missing name is simulated on CPU by
deleting it from the module."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")       # Megatron's CPU mode, pinned (device="cpu") on any machine

import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: E402
from megatron_util import build, config, inputs  # noqa: E402

from moealign.patches import megatron as mg  # noqa: E402

NAMES = mg.TE_ONLY_MOE_UTILS_NAMES


def _bound():
    return {name: vars(moe_utils)[name] for name in NAMES if name in vars(moe_utils)}


def _forward_backward(model):
    ids, pos, mask = inputs(3)
    out = model(ids, pos, mask)
    out.float().sum().backward()        # RouterGatingLinearFunction.backward reads te_general_gemm too
    return out


@pytest.fixture(scope="module")
def world_and_model():
    with mg.init_single_process(seed=5, device="cpu"):
        torch.manual_seed(0)
        yield build(config(moe_enable_routing_replay=False)).eval()     # no dropout: forwards compare bitwise


def test_transformer_engine_is_absent_here():
    # the premise of the simulation: this machine's moe_utils took the TE-less branch
    assert moe_utils.HAVE_TE is False


def test_missing_name_fails_without_the_patch_and_runs_with_it(world_and_model, monkeypatch):
    model = world_and_model
    assert all(vars(moe_utils)[n] is None for n in NAMES)     # the CPU mode nests the patch
    reference = _forward_backward(model).detach()

    # the TE-less module as 0.16.1 leaves it on CUDA: no patch, the names absent
    for name in NAMES:
        monkeypatch.delattr(moe_utils, name)
    with pytest.raises(NameError, match="te_general_gemm"):        # negative control
        _forward_backward(model)

    with mg.enable_megatron_without_te() as handle:
        assert handle.active and len(handle.patched) == len(NAMES)
        assert "without transformer-engine" in repr(handle) and "scope=module" in repr(handle)
        assert torch.equal(_forward_backward(model).detach(), reference)
    assert _bound() == {}                                          # undo() restored the module (names absent)
    with pytest.raises(NameError, match="te_general_gemm"):
        _forward_backward(model)


def test_cpu_mode_nests_it_and_undo_removes_the_names(monkeypatch):
    for name in NAMES:
        monkeypatch.delattr(moe_utils, name, raising=False)
    mode = mg.enable_megatron_cpu(pin_cpu=True)
    try:
        assert set(_bound()) == set(NAMES)
        assert any("without transformer-engine" in label for label in mode.patched)
    finally:
        mode.undo()
    assert _bound() == {}


def test_transformer_engine_users_keep_their_route(monkeypatch):
    def te_gemm(*args, **kwargs):      # stands for transformer-engine's GEMM
        raise AssertionError("not called here")

    for name in NAMES:
        monkeypatch.setattr(moe_utils, name, te_gemm if name == "te_general_gemm" else object(), raising=False)
    before = _bound()
    with mg.enable_megatron_without_te() as handle:
        assert handle.patched == [] and "nothing missing" in handle.target
        assert _bound() == before and moe_utils.te_general_gemm is te_gemm
    assert _bound() == before


def test_init_single_process_applies_it_on_cuda(world_and_model, monkeypatch):
    """The CUDA branch of init_single_process (the Megatron engine's world), driven on CPU inside an existing
    world: no CPU mode, the TE-less patch instead."""
    import megatron.core.tensor_parallel.random as mrandom

    for name in NAMES:
        monkeypatch.delattr(moe_utils, name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mrandom, "model_parallel_cuda_manual_seed", lambda seed: None)
    world = mg.init_single_process()
    try:
        assert world.cpu_mode is None and "CUDA, nccl" in world.target
        assert any("without transformer-engine" in label for label in world.patched)
        assert moe_utils.te_general_gemm is None
        _forward_backward(world_and_model)
    finally:
        world.undo()
    assert _bound() == {}
