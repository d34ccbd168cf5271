"""The four-stage router-precision audit (moealign.precision.router_audit) on vLLM, the rollout engine
(``moealign.patches.vllm.precision.audit_router_vllm``): the embedded model opened in bf16 under the policy
``bf16-fp32-router`` (moealign's fp32 GateLinear) is float32 at every stage in every MoE layer; plain ``bf16`` is
the negative control (bfloat16 from the weight on). Both engines run in one child process, the fp32-router one
first, so the bf16 engine built after the patch's undo also shows that nothing of the patch is left behind."""

from __future__ import annotations

import pytest
import torch

from moealign._optional import probe
from moealign.precision.router_audit import STAGES, check_router_audit
from vllm_util import run_child

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

VLLM = probe("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")

LAYERS = {"0", "1", "2", "3"}        # the embedded model: 4 decoder layers, every one MoE


def _audit(stages: dict) -> dict:
    return {int(layer): {s: (getattr(torch, d) if d else None) for s, d in st.items()} for layer, st in stages.items()}


@needs_vllm
def test_vllm_router_audit_fp32_router_is_float32_at_every_stage_and_bf16_is_not():
    result = run_child("vllm_router_audit_child.py", "bf16-fp32-router", "bf16")
    for policy, got in result.items():     # the report, per stage per layer (shown with -s / on failure)
        print(f"{policy}: {got['summary']}")
    fp32, bf16 = result["bf16-fp32-router"], result["bf16"]
    assert set(fp32["stages"]) == LAYERS and set(bf16["stages"]) == LAYERS
    for run in (fp32, bf16):
        assert all(set(st) == set(STAGES) for st in run["stages"].values())
        assert not any("also seen" in n for n in run["notes"]), run["notes"]     # one dtype per stage and router
        if any("router CPURouter (scoring_func='softmax'" in n for n in run["notes"]):
            # vLLM's CPU router computes scores and top-k with torch ops: observed directly, nothing inferred
            assert not any("not observable" in n for n in run["notes"]), run["notes"]
            assert not any("did not run" in n for n in run["notes"]), run["notes"]

    # bf16-fp32-router: float32 at every stage the engine expresses (weight and projection at least), all four here
    assert check_router_audit(_audit(fp32["stages"]), torch.float32, stages=("weight", "projection")) == []
    assert check_router_audit(_audit(fp32["stages"]), torch.float32) == [], fp32["notes"]
    assert fp32["failures_fp32"] == []

    # negative control: plain bf16 differs at the weight stage (and, on vLLM's CPU router, at every stage)
    weight_failures = check_router_audit(_audit(bf16["stages"]), torch.float32, stages=("weight",))
    assert weight_failures == [f"layer {layer} weight: bfloat16, expected float32" for layer in sorted(map(int, LAYERS))]
    assert check_router_audit(_audit(bf16["stages"]), torch.bfloat16, stages=("weight", "projection")) == []


@needs_vllm
def test_audit_router_vllm_refuses_a_bad_prompt_before_touching_the_engine():
    from moealign.errors import InputError, InputTypeError
    from moealign.patches.vllm.precision import audit_router_vllm

    with pytest.raises(InputTypeError, match="prompt must be a string"):
        audit_router_vllm(object(), prompt=["def f(x):"])
    with pytest.raises(InputError, match="prompt is empty"):
        audit_router_vllm(object(), prompt="")
