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
