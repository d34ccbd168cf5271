"""Exact refits on MLA (issue 37 item 4, issue 38 item 4; ``embedded:tiny_deepseek``): vLLM derives MLA's absorbed
matrices ``W_UK_T`` / ``W_UV`` from ``kv_b_proj`` at load. The refit does not stream them, proves vLLM recomputed
them, and the verifier recomputes them from the held ``kv_b_proj`` in every worker and compares bitwise.

One vLLM child process (tests/vllm_deepseek_refit_child.py) holds every engine check: identical refit bitwise
(prefill and decode), a refit of changed weights equal to a cold engine loaded from them (bitwise), and two negative
controls by construction (vLLM's recompute suppressed for a refit; a held ``W_UV`` nudged). Then a short
``moealign rl-check --model embedded:tiny_deepseek --aligned --train-ep 2`` with every refit verified. Skipped only where vLLM (and, for
rl-check, Megatron-core) is not installed."""

from __future__ import annotations

import json
import sys

import pytest

from moealign._optional import probe
from moealign.families import get_family
from moealign.rl.refit import RefitCheck

from vllm_util import child_env, run_child
import warm

pytestmark = pytest.mark.heavy          # engines (a vLLM child, a CLI run): scheduled first, tests/conftest.py

VLLM, MEGATRON = probe("vllm"), probe("megatron.core")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")
needs_engines = pytest.mark.skipif(not (VLLM.available and MEGATRON.available),
                                   reason=f"vLLM / Megatron-core not installed: {VLLM.error or MEGATRON.error}")
#: W_UK_T and W_UV in each of tiny_deepseek's 3 MLA layers
DERIVED = 6
#: the (tensor, worker) pairs the digests compare on tiny_deepseek at TP 1 (fused_qkv_a_proj un-fused, experts per
#: expert, the router's correction bias, the shared experts)
TENSORS = 107
MLA = "model.layers.{}.self_attn.mla_attn.mla_attn.{}"


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    return run_child("vllm_deepseek_refit_child.py", str(tmp_path_factory.mktemp("ds_refit")))


# ------------------------------------------------------------------------------------------------ engine-free
def test_the_family_states_what_mla_derives():
    assert dict(get_family("deepseek_v3").derived_tensors) == {"W_UK_T": "self_attn.kv_b_proj.weight",
                                                               "W_UV": "self_attn.kv_b_proj.weight"}
    assert "refit" in get_family("deepseek_v3").verified
    assert get_family("qwen3_moe").derived_tensors == ()


def test_a_stale_derived_tensor_fails_the_refit_check():
    from moealign.patches.vllm.refit import WeightCheck

    good = WeightCheck(checked=1, workers=1)
    fresh = RefitCheck(good, derived={"checked": 2, "problems": [], "unchecked": []})
    assert fresh.ok and "2 tensor(s) derived at load equal" in fresh.describe()
    stale = RefitCheck(good, derived={"checked": 2, "problems": [(0, "x.W_UV: differs")], "unchecked": []})
    assert not stale.ok and "x.W_UV: differs" in stale.describe()
    assert stale.to_dict()["derived"]["problems"] == [[0, "x.W_UV: differs"]]


# ------------------------------------------------------------------------------------------------ on the engine
@needs_vllm
def test_identical_refit_is_bitwise_prefill_and_decode(child):
    assert child["identical"] == {"prefill": True, "decode": True}
    assert child["identical_verify_ok"] and child["identical_checked"] == TENSORS
    assert child["identical_derived"] == {"checked": DERIVED, "problems": [], "unchecked": []}
    assert child["identical_certify_ok"]
    assert child["identical_certify_derived"]["status"] == "passed"


@needs_vllm
def test_changed_refit_equals_a_cold_engine_bitwise(child):
    assert child["changed_verify_ok"] and child["changed_derived_checked"] == DERIVED
    assert child["changed_decode_moved"]                    # the weights did change what the engine decodes
    assert child["changed_vs_cold"] == {"prefill": True, "decode": True}
    assert child["cold_derived_checked"] == DERIVED


@needs_vllm
def test_vllm_recomputes_the_absorbed_matrices_on_a_refit(child):
    # unquantized, in the engine's dtype, W_UK_T / W_UV are views of kv_b_proj's storage
    assert child["aliased_at_load"] == [True, True, True]
    # rebound to copies (values unchanged), they follow kv_b_proj only through vLLM's recompute, which the refit runs
    assert child["unaliased_unchanged"] == {"prefill": True, "decode": True}
    assert child["unaliased_refit"] == {"prefill": True, "decode": True} and child["unaliased_derived_ok"]


@needs_vllm
def test_suppressed_recompute_is_named_by_the_refit_and_the_verifier(child):
    every = sorted(MLA.format(i, leaf) for i in range(3) for leaf in ("W_UK_T", "W_UV"))
    error = child["suppressed_refit_error"]
    assert error is not None and "6 tensor(s) derived at load stale" in error and every[0] in error
    assert child["suppressed_digests_ok"]                   # kv_b_proj is right: a weight digest cannot see it
    assert not child["suppressed_verify_ok"]
    assert child["suppressed_named"] == every
    # the prefill reads kv_b_proj, the decode reads the stale matrices
    assert child["suppressed_vs_refitted"] == {"prefill": True, "decode": False}
    assert child["restored"] == {"prefill": True, "decode": True} and child["restored_verify_ok"]


@needs_vllm
def test_a_perturbed_held_matrix_is_named(child):
    assert child["perturbed_digests_ok"] and not child["perturbed_verify_ok"]
    assert child["perturbed_named"] == [MLA.format(1, "W_UV")]
    assert child["perturbed_first_failed"] == "derived_buffers"
    assert MLA.format(1, "W_UV") in child["perturbed_certify_detail"]


# ------------------------------------------------------------------------------------------------ rl-check
@needs_engines
def test_rl_check_aligned_on_tiny_deepseek_verifies_every_refit_and_is_bitwise(tmp_path):
    """``rl-check --model embedded:tiny_deepseek --aligned --train-ep 2``: the sharded trainer (2 rank processes, the
    experts split, the all-to-all dispatcher) under the canonical forward with MLA; every refit streamed from the
    ranks and verified (tensors and MLA's derived matrices) and the three log-probs bitwise equal at every step,
    through refits of changed weights (3 steps: this seed's step 0 has equal rewards, a zero gradient; step 1's update
    is what step 2 rolls out on). The single-rank trainer's canonical forward on MLA: tests/test_aligned_deepseek.py."""
    cmd = [sys.executable, "-m", "moealign", "rl-check", "--model", "embedded:tiny_deepseek", "--aligned",
           "--train-ep", "2", "--steps", "3", "--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "8",
           "--json", str(tmp_path / "rl.json"), "-q"]
    proc = warm.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "rl.json").read_text())
    assert report["train"]["parallel"] == {"tp": 1, "ep": 2, "pp": 1, "dp": 2, "world": 2}
    (run,) = report["runs"]
    verifies = [run["initial_refit"]["verify"]] + [s["verify"] for s in run["steps"]]
    assert [s["step"] for s in run["steps"]] == [0, 1, 2]
    for v in verifies:
        assert v["ok"] and v["weights"]["checked"] == TENSORS
        assert v["derived"] == {"checked": DERIVED, "problems": [], "unchecked": []}
    for s in run["steps"]:
        assert s["refit"]["tensors"] > 0 and s["verify"]["probe_gap"] <= s["verify"]["probe_bound"]
        cert = s["aligned"]
        assert cert["bitwise_equal"] and cert["mismatch_count"] == 0 and cert["tokens"] == s["response_tokens"], cert
    # the weights moved before the last rollout: a refit of changed weights was certified bitwise
    assert any(s["grad_norm"] > 0 for s in run["steps"][:-1])
