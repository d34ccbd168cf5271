"""In-place refit of a running vLLM engine (issue 21 parts 1-2) on the real engine: the embedded model in vLLM's CPU
build, fp32, TP = 1 and TP = 2, refit from a Megatron-core trainer (tests/vllm_refit_child.py, one child process per
TP size). Engine-free pieces (manifest, checkpoint naming, shard slicing, fingerprints) are tested without vLLM.
Skipped only where vLLM is not installed."""

from __future__ import annotations

import pytest
import torch

from moealign._optional import probe
from moealign.contract import tensor_fingerprint
from moealign.errors import RefitError

from vllm_util import run_child

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

VLLM = probe("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")


@pytest.fixture(scope="module")
def tp1() -> dict:
    return run_child("vllm_refit_child.py", "1")


@pytest.fixture(scope="module")
def tp2() -> dict:
    return run_child("vllm_refit_child.py", "2")


# --------------------------------------------------------------------------------------------------
# on the engine
# --------------------------------------------------------------------------------------------------


@needs_vllm
@pytest.mark.parametrize("which", ["tp1", "tp2"])
def test_identical_refit_is_bitwise_and_verified(which, request):
    r = request.getfixturevalue(which)
    assert r["identical_bitwise"], "log-probs after refitting identical weights differ from before"
    assert r["identical_verify_ok"]
    assert r["workers"] == r["tp"]
    # every shard of every worker compared; the packed ones (oneDNN linears, prepacked experts) read through vLLM
    assert r["identical_checked"] == 167 * r["tp"] and r["identical_packed"] > 0


@needs_vllm
def test_stock_reload_corrupts_and_the_verifier_sees_it(tp1):
    # negative control: vLLM 0.32 CPU's own reload of the same identical tensors skips the MoE prepack
    assert tp1["stock_reload_max_diff"] > 0.1
    assert all(name.startswith("model.layers.0.mlp.experts.") for name, _ in tp1["stock_reload_verify"])
    assert tp1["restored_bitwise"]          # moealign's refit puts the engine back exactly


@needs_vllm
@pytest.mark.parametrize("which", ["tp1", "tp2"])
def test_mangled_refit_is_named_per_tensor_and_worker(which, request):
    r = request.getfixturevalue(which)
    expected = []
    for rank in range(r["tp"]):
        expected += [["model.layers.1.self_attn.q_proj.weight", rank],
                     ["model.layers.2.mlp.experts.gate_up_proj[3]", rank]]
    assert r["mangled"] == sorted(expected)
    # the engine holds exactly what was sent (the refit itself is exact; the stream was wrong)
    assert r["mangled_vs_what_was_sent"]


@needs_vllm
@pytest.mark.parametrize("which", ["tp1", "tp2"])
def test_weight_manifest_verifies_and_names_the_same_tensors(which, request):
    # the check from digests alone (tests/test_weight_manifest.py): the TP 2 engine's shards summed over workers
    r = request.getfixturevalue(which)
    assert r["manifest_ok"]
    assert r["manifest_mangled"] == r["mangled"]


@needs_vllm
@pytest.mark.parametrize("which", ["tp1", "tp2"])
def test_interrupted_stream_raises_and_is_named(which, request):
    r = request.getfixturevalue(which)
    assert "model.layers.2.self_attn.o_proj.weight" in r["interrupted_error"]
    assert r["interrupted_named"] == [["model.layers.2.self_attn.o_proj.weight", rank] for rank in range(r["tp"])]


@needs_vllm
@pytest.mark.parametrize("which", ["tp1", "tp2"])
def test_real_update_refit_verified_within_probe_bound(which, request):
    r = request.getfixturevalue(which)
    assert r["updated_moved"] > 1e-3          # the update changed what vLLM computes
    assert r["updated_verify_ok"]
    assert 0 <= r["updated_probe_gap"] <= r["updated_probe_bound"] < 1e-4


@needs_vllm
@pytest.mark.parametrize("which", ["tp1", "tp2"])
def test_refused_before_any_weight_moved(which, request):
    r = request.getfixturevalue(which)
    assert "lm_head.weight" in r["missing_refused"]
    assert "vocab_size" in r["arch_refused"]
    assert r["unchanged_after_refusals"]


# --------------------------------------------------------------------------------------------------
# engine-free pieces
# --------------------------------------------------------------------------------------------------


def test_fingerprint_detects_changes_and_equals_on_equal():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 48, generator=g)
    assert tensor_fingerprint(a) == tensor_fingerprint(a.clone())
    b = a.clone()
    b[5, 7] = torch.nextafter(b[5, 7], torch.tensor(10.0))          # one ulp
    assert tensor_fingerprint(a) != tensor_fingerprint(b)
    sq = torch.randn(32, 32, generator=g)
    assert tensor_fingerprint(sq) != tensor_fingerprint(sq.t().contiguous())
    assert tensor_fingerprint(a.to(torch.bfloat16)) != tensor_fingerprint(a)       # dtype is part of it
    rows = tensor_fingerprint(torch.stack([a, b]), rows=True)
    assert rows[0] == tensor_fingerprint(a) and rows[1] == tensor_fingerprint(b)
    odd = torch.arange(7, dtype=torch.int16)                                      # not a multiple of 8 bytes
    assert tensor_fingerprint(odd) != tensor_fingerprint(odd.flip(0))


def test_check_manifest_names_missing_extra_and_shapes():
    from moealign.patches.vllm.refit import check_manifest

    layout = {"a": (2, 3), "b": (4,), "c": (1,)}
    check_manifest(dict(layout), layout)
    with pytest.raises(RefitError, match=r"not in the refit: \['c'\]"):
        check_manifest({"a": (2, 3), "b": (4,)}, layout)
    with pytest.raises(RefitError, match=r"does not have: \['d'\]"):
        check_manifest({**layout, "d": (1,)}, layout)
    with pytest.raises(RefitError, match=r"b \(5,\) vs the engine's \(4,\)"):
        check_manifest({**layout, "b": (5,)}, layout)


def test_checkpoint_named_splits_fused_experts_only_where_the_checkpoint_does():
    from moealign.patches.vllm.refit import checkpoint_named

    E, I, H = 3, 4, 5
    gate_up = torch.arange(E * 2 * I * H, dtype=torch.float32).reshape(E, 2 * I, H)
    down = torch.arange(E * H * I, dtype=torch.float32).reshape(E, H, I)
    named = [("model.layers.0.mlp.experts.gate_up_proj", gate_up), ("model.layers.0.mlp.experts.down_proj", down),
             ("model.norm.weight", torch.ones(H))]
    per_expert = dict(checkpoint_named(named, {}))
    assert torch.equal(per_expert["model.layers.0.mlp.experts.2.gate_proj.weight"], gate_up[2, :I])
    assert torch.equal(per_expert["model.layers.0.mlp.experts.2.up_proj.weight"], gate_up[2, I:])
    assert torch.equal(per_expert["model.layers.0.mlp.experts.1.down_proj.weight"], down[1])
    assert len(per_expert) == 3 * E + 1
    fused = dict(checkpoint_named(named, {"model.layers.0.mlp.experts.gate_up_proj": (E, 2 * I, H),
                                          "model.layers.0.mlp.experts.down_proj": (E, H, I)}))
    assert set(fused) == {n for n, _ in named}


def test_expected_shards_match_vllm_tp_layouts():
    from moealign.patches.vllm.refit import _expected

    full = torch.arange(2 * 8 * 3).reshape(2, 8, 3)                 # experts [E, 2I, H], I = 4
    r1 = _expected(full, ("glu", 1, 1, 2))                          # rank 1 of 2: [gate rows 2:4; up rows 6:8]
    assert torch.equal(r1, torch.cat([full[:, 2:4], full[:, 6:8]], dim=1))
    assert torch.equal(_expected(full, ("expert", 1, ("glu", 1, 0, 2))), torch.cat([full[1, 0:2], full[1, 4:6]]))
    w = torch.arange(12).reshape(3, 4)
    assert torch.equal(_expected(w, ("chunk", 1, 1, 2)), w[:, 2:])
    assert torch.equal(_expected(w, ("rows", 1, 3)), w[1:3])
    assert torch.equal(_expected(w, ("full",)), w)
