"""Tree-reduction patches: Megatron RowParallelLinear and vocab-parallel cross-entropy in a real 2-process
gloo TP group (CPU mode), and the loud failures. The vLLM patch at import level: test_patches_vllm_tree.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from moealign.patches import UnsupportedEngineError  # noqa: E402
from moealign.patches.megatron import tree_reduce as tr  # noqa: E402
from moealign.precision.tree import (  # noqa: E402
    TreeReductionError,
    row_parallel_linear_tree,
    vocab_parallel_logprob_tree,
)
from moealign.tp_check import run_gloo  # noqa: E402

K, N, V = 512, 32, 8192


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    bias = torch.randn(N, generator=gen)
    logits = 4.0 * torch.randn(32, 4, V, generator=gen)
    target = torch.randint(0, V, (32, 4), generator=gen)
    return x, w, bias, logits, target


def _megatron_worker(rank, world):
    import torch.distributed as dist

    from moealign.patches import megatron as mg

    mode = mg.enable_megatron_cpu()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        x, w, bias, logits, target = _inputs()
        shard = lambda t: t.chunk(world, -1)[rank].contiguous()  # noqa: E731
        cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                                  perform_initialization=False, gradient_accumulation_fusion=False)
        layer = RowParallelLinear(K, N, config=cfg, init_method=lambda t: None, bias=True, input_is_parallel=True,
                                  skip_bias_add=False)
        with torch.no_grad():
            layer.weight.copy_(shard(w))
            layer.bias.copy_(bias)
        out = {"stock": layer(shard(x))[0].detach()}
        with pytest.raises(TreeReductionError, match="not a multiple of leaf_width=96"):
            tr.patch_megatron_row_parallel(layer, leaf_width=96)
        assert "forward" not in vars(layer)  # a refused patch patches nothing
        handle = tr.patch_megatron_row_parallel(layer)
        xg = shard(x).requires_grad_()
        y, _ = layer(xg)
        y.square().sum().backward()
        out.update(tree=y.detach(), grad_x=xg.grad, grad_w=layer.weight.grad.clone())
        handle.undo()
        out["after_undo"] = layer(shard(x))[0].detach()
        out["forward_restored"] = "forward" not in vars(layer)

        stock_fn = tensor_parallel.vocab_parallel_cross_entropy
        out["ce_stock"] = stock_fn(shard(logits).clone(), target)
        with tr.patch_megatron_vocab_parallel_cross_entropy() as ce_patch:
            assert len(ce_patch.patched) == 2
            out["ce_tree"] = tensor_parallel.vocab_parallel_cross_entropy(shard(logits), target)
            with pytest.raises(ValueError, match="label smoothing"):
                tensor_parallel.vocab_parallel_cross_entropy(shard(logits), target, 0.1)
        out["ce_restored"] = tensor_parallel.vocab_parallel_cross_entropy is stock_fn

        class _Coordinator:  # the attribute vLLM's replacement body reads
            device_group = dist.group.WORLD

        from moealign.patches.vllm.tree_reduce import _tree_all_reduce_out_place

        out["vllm_body"] = _tree_all_reduce_out_place(_Coordinator(), torch.full((3,), float(rank + 1)))
        return out
    finally:
        parallel_state.destroy_model_parallel()
        mode.undo()


def test_megatron_patches_in_a_tp2_gloo_group():
    x, w, bias, logits, target = _inputs()
    results = run_gloo(2, _megatron_worker, timeout=180)
    y_ref = row_parallel_linear_tree(x, w) + bias  # what the patched layer computes at TP = 1
    ce_ref = -vocab_parallel_logprob_tree(logits, target)
    stock_tp1 = F.linear(x, w) + bias
    m = logits.amax(-1, keepdim=True)  # Megatron's arithmetic at TP = 1
    ce_stock_tp1 = torch.log(torch.exp(logits - m).sum(-1)) - (logits.gather(-1, target.unsqueeze(-1)) - m).squeeze(-1)
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    F.linear(xg, wg).add(bias).square().sum().backward()
    for rank, out in enumerate(results):
        assert torch.equal(out["tree"], y_ref), rank
        assert torch.equal(out["ce_tree"], ce_ref), rank
        torch.testing.assert_close(out["grad_x"], xg.grad.chunk(2, -1)[rank], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out["grad_w"], wg.grad.chunk(2, -1)[rank], rtol=1e-4, atol=1e-4)
        assert out["forward_restored"] and torch.equal(out["after_undo"], out["stock"]), rank
        assert out["ce_restored"], rank
        assert torch.equal(out["vllm_body"], torch.full((3,), 3.0)), rank
    # negative controls: Megatron's stock paths at TP = 2 differ from TP = 1
    assert not torch.equal(results[0]["stock"], stock_tp1)
    assert not torch.equal(results[0]["ce_stock"], ce_stock_tp1)


def test_megatron_patch_fails_loudly(monkeypatch):
    with pytest.raises(ValueError, match="no megatron RowParallelLinear"):
        tr.patch_megatron_row_parallel(torch.nn.Linear(4, 4))
    monkeypatch.setattr(tr, "SUPPORTED_MEGATRON", "<0.1")
    with pytest.raises(UnsupportedEngineError, match="not supported"):
        tr.patch_megatron_vocab_parallel_cross_entropy()
    monkeypatch.undo()
    import megatron.core.tensor_parallel.cross_entropy as ce_mod

    monkeypatch.delattr(ce_mod, "vocab_parallel_cross_entropy")
    with pytest.raises(UnsupportedEngineError, match="has no attribute 'vocab_parallel_cross_entropy'"):
        tr.patch_megatron_vocab_parallel_cross_entropy()
