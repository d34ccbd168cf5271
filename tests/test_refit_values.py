"""The refit's value check in runs (issue 35 part 4): tensors laid end to end in one storage (a fused experts tensor
split per expert for a per-expert checkpoint) are checked in one pass per run, and a bad value inside a run is
still named by its own tensor. Engine-free."""

from __future__ import annotations

import pytest
import torch

from moealign.errors import RefitError


def _named(gate_up: torch.Tensor, down: torch.Tensor, extra: torch.Tensor):
    from moealign.patches.vllm.refit import checkpoint_named

    return list(checkpoint_named([("model.layers.0.mlp.experts.gate_up_proj", gate_up),
                                  ("model.layers.0.mlp.experts.down_proj", down), ("x.weight", extra)], {}))


def test_split_experts_are_one_run_each_and_other_tensors_their_own():
    from moealign.patches.vllm.refit import _value_runs

    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(4, 6, 5, generator=g), torch.randn(4, 5, 3, generator=g)
    extra = torch.randn(3, 4, generator=g).t()                       # not contiguous: a run of its own
    named = _named(gate_up, down, extra)
    assert len(named) == 3 * 4 + 1
    runs = list(_value_runs(named))
    assert [len(members) for _, members in runs] == [8, 4, 1]
    assert torch.equal(runs[0][0], gate_up.reshape(-1)) and torch.equal(runs[1][0], down.reshape(-1))
    assert runs[2][0] is extra
    # negative control: the same tensors as separate allocations are separate runs
    copies = [(n, t.clone()) for n, t in named]
    assert len(list(_value_runs(copies))) == len(copies)


def test_a_bad_value_in_a_run_is_named_by_its_tensor():
    from moealign.patches.vllm.refit import check_values

    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(4, 6, 5, generator=g), torch.randn(4, 5, 3, generator=g)
    named = _named(gate_up, down, torch.randn(2, 2, generator=g))
    assert len(check_values(named, torch.float16)) == 13               # control: all finite, all fit fp16
    gate_up[2, 4, 1] = float("nan")                                    # expert 2, the up half
    with pytest.raises(RefitError) as err:
        check_values(named, torch.float16)
    assert "'model.layers.0.mlp.experts.2.up_proj.weight' holds 1 NaN" in str(err.value)
    assert "(1 tensor(s))" in str(err.value)
    gate_up[2, 4, 1] = 0.0
    down[3, 0, 0] = 7e4                                                # overflows fp16, fits fp32
    with pytest.raises(RefitError, match=r"experts\.3\.down_proj\.weight' overflows the engine's float16"):
        check_values(named, torch.float16)
    check_values(named, torch.float32)


def test_padded_experts_are_read_as_the_checkpoints_slice():
    """vLLM 0.32's CPU build allocates a narrow expert slice wider than it is (DeepSeek-V3's expert width 32 at
    TP 2: moe_config says 16 per rank, w13 holds 2 x 32 rows, w2 32 columns): the refit check reads the slice (gate
    rows [0, 16), up rows [32, 48), w2 columns [0, 16)); an unpadded layout is read as held. Found on
    embedded:tiny_deepseek at --rollout-tp 2, where every expert was a false mismatch."""
    from types import SimpleNamespace

    from moealign.patches.vllm.refit import _expert_padding

    module = SimpleNamespace(moe_config=SimpleNamespace(intermediate_size_per_partition=16,
                                                        intermediate_size_per_partition_unpadded=None))
    e, h = 3, 8
    w13 = torch.randn(e, 64, h)
    shape, cut = _expert_padding(module, "w13_weight", (64, h))
    assert shape == (32, h)
    assert torch.equal(cut(w13), torch.cat([w13[:, :16], w13[:, 32:48]], dim=1))
    assert not torch.equal(cut(w13), w13[:, :32])                 # negative control: not the first 32 rows
    w2 = torch.randn(e, h, 32)
    shape, cut = _expert_padding(module, "w2_weight", (h, 32))
    assert shape == (h, 16) and torch.equal(cut(w2), w2[:, :, :16])
    # held exactly as wide as the slice: nothing to cut
    assert _expert_padding(module, "w13_weight", (32, h)) is None
    assert _expert_padding(module, "w2_weight", (h, 16)) is None
    assert _expert_padding(SimpleNamespace(), "w2_weight", (h, 16)) is None
