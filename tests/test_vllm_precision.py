"""Precision policies inside vLLM (``moealign.patches.vllm.precision``): an fp32 router and LM head built with
the checkpoint's fp32 parameters, audited in the live model's workers. The negative control is vLLM's own
arguments alone (``head_dtype=float32`` casts the fp16 head weights up; the gate stays fp16): the audit names
every router and the LM head. Engines run in child processes (vLLM keeps process-wide state)."""

from __future__ import annotations

import pytest

from moealign._optional import probe
from vllm_util import run_child

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

VLLM = probe("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")


def _child(mode: str) -> dict:
    return run_child("vllm_precision_child.py", mode)


@needs_vllm
def test_fp32_router_and_head_are_built_and_audited_and_args_alone_are_not_enough():
    patched = _child("patched")
    params, computed = patched["report"]["parameters"], patched["report"]["computed"]
    roles = {}
    for role, dtype in params.values():
        roles.setdefault(role, set()).add(dtype)
    assert roles["router"] == {"float32"} and roles["lm_head"] == {"float32"} and roles["linear"] == {"float16"}
    assert sum(role == "router" for role, _ in params.values()) == 4          # one gate per MoE layer
    assert set(computed.values()) == {"float32"} and len(computed) == 5      # 4 gates + the logits
    deviations = _child("args-only")["deviations"]
    assert sum("router" in line and "float16 parameters" in line for line in deviations) == 4
    assert any("lm_head" in line and "float16 parameters" in line for line in deviations)
    assert sum("gate computed float16" in line for line in deviations) == 4


@needs_vllm
def test_apply_precision_patches_constructors_and_undo_restores():
    from vllm.model_executor.layers import vocab_parallel_embedding
    from vllm.model_executor.layers.fused_moe.router import gate_linear

    from moealign.patches.vllm.precision import apply_precision, needs_patch

    gate, head = gate_linear.GateLinear.__init__, vocab_parallel_embedding.ParallelLMHead.__init__
    assert needs_patch("fp16-fp32-router-head") and not needs_patch("bf16")
    with apply_precision("fp16-fp32-router-head") as handle:
        assert handle.scope == "process" and handle.policy.name == "fp16-fp32-router-head"
        assert gate_linear.GateLinear.__init__ is not gate and vocab_parallel_embedding.ParallelLMHead.__init__ is not head
    assert gate_linear.GateLinear.__init__ is gate and vocab_parallel_embedding.ParallelLMHead.__init__ is head
    with apply_precision("bf16"):   # nothing to build: no class is touched
        assert gate_linear.GateLinear.__init__ is gate


@needs_vllm
def test_plugin_precision_spec():
    from moealign.errors import ConfigError
    from moealign.patches.vllm import plugin

    spec = plugin.spec_for(tree=True, precision="fp16-fp32-router-head")
    assert plugin.parse_spec(spec) == [("precision", {"policy": "fp16-fp32-router-head"}), ("tree", {})]
    with pytest.raises(ConfigError, match="takes"):
        plugin.parse_spec("precision:dtype=fp32")
