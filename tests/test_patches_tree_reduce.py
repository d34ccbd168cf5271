"""Tree-reduction patches: Megatron RowParallelLinear and vocab-parallel cross-entropy in a real 2-process
gloo TP group (CPU mode), and the loud failures. The vLLM patch at import level: test_patches_vllm_tree.py.

The negative controls differ by construction: a naive TP = 2 path in the same gloo group that rounds each
rank's partial to fp32 before the all-reduce adds them, with every partial the exact sum of its share
(``math.fsum``) rounded once, so its bits do not depend on the BLAS or the thread split. (Whether Megatron's
stock TP = 2 output differs from a stock TP = 1 matmul depends on how the BLAS blocks K, so it is not asserted.)
"""

from __future__ import annotations

import math

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

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

K, N, V = 512, 32, 8192


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    bias = torch.randn(N, generator=gen)
    logits = 4.0 * torch.randn(32, 4, V, generator=gen)
    target = torch.randint(0, V, (32, 4), generator=gen)
    return x, w, bias, logits, target


def _exact_sum(t, dtype=torch.float32):
    """Sum over the last dim exactly (``math.fsum`` of the fp64 values), rounded to ``dtype``: the same bits on
    every machine."""
    rows = t.double().reshape(-1, t.shape[-1]).tolist()
    return torch.tensor([math.fsum(r) for r in rows], dtype=torch.float64).reshape(t.shape[:-1]).to(dtype)


def _exact_linear(x, w):
    """``F.linear(x, w)`` from exact products (exact in fp64) and an exact sum, rounded once to fp32."""
    return _exact_sum(x.double().unsqueeze(-2) * w.double())


def _exact_sum_exp(logits, m):
    """``sum(exp(logits - m))`` over the last dim: exp in fp64, summed exactly, rounded once to fp32."""
    return _exact_sum(torch.exp(logits.double() - m.double().unsqueeze(-1)))


def _ce_from_sum_exp(sum_exp, logits, target):
    """Megatron's cross-entropy from a (reduced) sum of exps: ``log(sum_exp) - (logit[target] - max)``, the log
    in fp64 rounded to fp32 (so no fp32 log kernel's last bit decides the result)."""
    m = logits.amax(-1)
    return torch.log(sum_exp.double()).float() - (logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - m)


def _megatron_worker(rank, world):
    import torch.distributed as dist

    from moealign.patches import megatron as mg

    mode = mg.enable_megatron_cpu(pin_cpu=True)
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
        out["forward_patched"] = "forward" in vars(layer)   # control of after_undo == stock: it was patched
        xg = shard(x).requires_grad_()
        y, _ = layer(xg)
        y.square().sum().backward()
        out.update(tree=y.detach(), grad_x=xg.grad, grad_w=layer.weight.grad.clone())
        handle.undo()
        out["after_undo"] = layer(shard(x))[0].detach()
        out["forward_restored"] = "forward" not in vars(layer)

        stock_fn = tensor_parallel.vocab_parallel_cross_entropy
        with tr.patch_megatron_vocab_parallel_cross_entropy() as ce_patch:
            assert len(ce_patch.patched) == 2
            out["ce_tree"] = tensor_parallel.vocab_parallel_cross_entropy(shard(logits), target)
            with pytest.raises(ValueError, match="label smoothing"):
                tensor_parallel.vocab_parallel_cross_entropy(shard(logits), target, 0.1)
        out["ce_restored"] = tensor_parallel.vocab_parallel_cross_entropy is stock_fn

        # negative controls, by construction: this rank's partial (exact, rounded once to fp32), then the
        # stock all-reduce SUM of the two ranks' rounded partials
        naive = _exact_linear(shard(x), shard(w))
        dist.all_reduce(naive)
        out["naive"] = naive + bias
        m = shard(logits).amax(-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        out["naive_sum_exp"] = _exact_sum_exp(shard(logits), m)
        dist.all_reduce(out["naive_sum_exp"])

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
    naive_tp1 = _exact_linear(x, w) + bias         # the naive path at TP = 1: one rounding of the exact sum
    sum_exp_tp1 = _exact_sum_exp(logits, logits.amax(-1))
    ce_naive_tp1 = _ce_from_sum_exp(sum_exp_tp1, logits, target)
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    F.linear(xg, wg).add(bias).square().sum().backward()
    for rank, out in enumerate(results):
        assert torch.equal(out["tree"], y_ref), rank
        assert torch.equal(out["ce_tree"], ce_ref), rank
        torch.testing.assert_close(out["grad_x"], xg.grad.chunk(2, -1)[rank], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out["grad_w"], wg.grad.chunk(2, -1)[rank], rtol=1e-4, atol=1e-4)
        assert out["forward_patched"] and out["forward_restored"], rank
        assert torch.equal(out["after_undo"], out["stock"]), rank
        assert out["ce_restored"], rank
        assert torch.equal(out["vllm_body"], torch.full((3,), 3.0)), rank
        # negative controls, by construction: on this data, rounding the rank partials before the all-reduce
        # changes the bits (linear: 53 of 256 outputs; sum of exps: 24 of 128 rows; cross-entropy: 2 rows,
        # the rest absorbed by the final subtraction). Sums are exact, exp and log run in fp64 (their last-bit
        # error is far below fp32's rounding), so these counts are the same on every machine.
        assert not torch.equal(out["naive"], naive_tp1), rank
        assert not torch.equal(out["naive_sum_exp"], sum_exp_tp1), rank
        assert not torch.equal(_ce_from_sum_exp(out["naive_sum_exp"], logits, target), ce_naive_tp1), rank


def test_megatron_patch_fails_loudly(monkeypatch):
    with pytest.raises(ValueError, match="no megatron RowParallelLinear"):
        tr.patch_megatron_row_parallel(torch.nn.Linear(4, 4))
    import moealign.patches.megatron.version as mversion

    monkeypatch.setattr(mversion, "SUPPORTED_MEGATRON", "<0.1")
    with pytest.raises(UnsupportedEngineError, match="not supported"):
        tr.patch_megatron_vocab_parallel_cross_entropy()
    monkeypatch.undo()
    import megatron.core.tensor_parallel.cross_entropy as ce_mod

    monkeypatch.delattr(ce_mod, "vocab_parallel_cross_entropy")
    with pytest.raises(UnsupportedEngineError, match="has no attribute 'vocab_parallel_cross_entropy'"):
        tr.patch_megatron_vocab_parallel_cross_entropy()
