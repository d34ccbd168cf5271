"""Forced routes inside vLLM (``moealign.patches.vllm.replay``, issue 12 section 3) on a real engine: the embedded
model in vLLM's CPU build, fp32, chunked prefill (3 slots, a 16-token step budget). One child process
(tests/vllm_replay_child.py; vLLM keeps process-wide state) records a rollout, then scores it with
``score_with_routes``: unforced, with its own routes forced, with one expert swapped on every third row, and with the
routes transformers bf16 chooses on the same tokens. What ran is read through the routers' capture hook after
forcing, not from what was set. Skipped only where vLLM is not installed."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

from moealign._optional import probe
import warm

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

VLLM = probe("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")
SCRIPT = pathlib.Path(__file__).with_name("vllm_replay_child.py")


@pytest.fixture(scope="module")
def result() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = warm.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@needs_vllm
def test_own_routes_forced_zero_flips_same_logprobs(result):
    assert result["samples"] == 5 and result["response_tokens"] > 0
    # vLLM's own routing at scoring time is the record's (same engine, same tokens): the baseline
    assert result["native_flips_vs_record"] == 0
    # forcing the record's routes: the experts that ran are exactly the forced ones (slot order too), and the
    # log-probs equal the unforced scoring bitwise (same routes, same weights: the replay math matches the router)
    assert result["own_flips"] == 0 and result["own_exact_slots"]
    assert result["own_bitwise"] and result["own_max_diff"] == 0.0


@needs_vllm
def test_other_routes_forced_run_exactly(result):
    # one expert swapped on every third row: what ran is the forced table (0 flips), not the native one
    assert result["swap_rows_changed"] > 0
    assert result["swap_flips_vs_forced"] == 0
    assert result["swap_flips_vs_native"] == result["swap_rows_changed"]
    assert result["swap_max_diff"] > 1e-3
    # transformers bf16's routes on the same tokens differ from vLLM fp32's on some rows; forced, they run exactly
    # and move vLLM's log-probs toward transformers bf16's
    assert result["hf_route_flips_vs_vllm"] > 0
    assert result["hf_forced_flips"] == 0
    assert result["hf_max_diff_vs_native"] > 0
    assert result["hf_mean_abs_after"] < result["hf_mean_abs_before"]


@needs_vllm
def test_undo_and_refusals(result):
    # every patch undone after each call (also after refused ones); a later forward routes natively again
    for key in ("undone_after_native", "undone_after_forced", "undone_at_end", "undone_after_refusals"):
        assert result[key], key
    assert result["undo_native_routes_equal"] and result["undo_native_logprobs_equal"]
    assert result["refused"] == {"no_routes": "ReplayError", "other_model": "RecordMismatchError",
                                 "prefix_caching": None}


@needs_vllm
def test_replay_weights_match_vllm_router(result):
    # at the ids vLLM's CPU router chose, the replay weights (the router's RouterScoring) are its weights bitwise
    # with renormalize (Qwen3-MoE); without it, equal up to rounding; the family's scoring differs by rounding only
    w = result["router_weights"]
    assert w["renorm=True,float32"][0] and w["renorm=True,bfloat16"][0]
    for key, (_, family_gap) in w.items():
        assert family_gap < (1e-6 if "float32" in key else 5e-2), key
