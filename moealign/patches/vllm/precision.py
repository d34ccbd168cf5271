"""Precision policies inside vLLM: what engine arguments cannot express, done by a class-level patch before the
model is built (in every worker: :mod:`.plugin`, ``MOEALIGN_VLLM_PATCHES=precision:policy=NAME``), and an audit
of the live model in its workers.

vLLM's own knobs (:func:`moealign.precision.policy.to_vllm_engine_args`): ``dtype``, FP8 quantisation and
``hf_overrides={"head_dtype": "float32"}``, which runs the LM head in fp32 *on the model-dtype weights cast up*.
A trainer's fp32 LM head or router holds the checkpoint's fp32 values, so :func:`apply_precision` builds them
with fp32 parameters:

* **router** (``router_dtype`` fp32): every ``GateLinear`` is constructed with fp32 parameters, fp32 compute
  (``force_fp32_compute``) and fp32 output: its input is cast up, the router logits are fp32;
* **LM head** (``lm_head_dtype`` fp32): ``ParallelLMHead`` is constructed with fp32 parameters; with the
  engine argument ``head_dtype=float32`` the logits processor casts the hidden states up and multiplies in fp32.
  A head tied to the input embedding is refused (the embedding would turn fp32 too).

:func:`audit_vllm` checks the live model in every worker against the policy: the parameter dtype of the gates,
the LM head and every other linear layer, and, through one hooked generate step, the dtype the gates and the
logits were computed in; :class:`~moealign.errors.PrecisionAuditError` lists every deviation.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...errors import ConfigError, PrecisionAuditError, UnsupportedEngineError
from ...handle import PatchHandle
from ...precision.policy import PrecisionPolicy, dtype_name, get_policy
from .._version import check_engine_version, engine_version, require_attr
from .engine import SUPPORTED_VLLM_ENGINE
from .rollout import InWorkers

__all__ = ["VllmPrecisionPatch", "apply_precision", "audit_vllm", "needs_patch"]


class VllmPrecisionPatch(PatchHandle):
    """Undo handle of :func:`apply_precision` (``policy``: the policy applied)."""

    policy: PrecisionPolicy


def _wider(policy: PrecisionPolicy, dtype: torch.dtype | None) -> bool:
    return dtype is not None and dtype != policy.dtype


def needs_patch(policy: str | PrecisionPolicy) -> bool:
    """Does ``policy`` keep a router or the LM head in another dtype (what only :func:`apply_precision` does)?"""
    policy = get_policy(policy)
    return _wider(policy, policy.router_dtype) or _wider(policy, policy.lm_head_dtype)


def _check_fp32(policy: PrecisionPolicy, dtype: torch.dtype, what: str) -> None:
    if dtype != torch.float32:
        raise ConfigError(f"policy {policy.name!r} keeps the {what} in {dtype_name(dtype)}; the vLLM adapter keeps "
                          f"it in fp32 only")


def _wrap_init(cls, overrides: dict[str, Any]):
    """``cls.__init__`` with ``overrides`` forced onto its keyword arguments."""
    original = cls.__init__
    params = inspect.signature(original).parameters
    missing = [name for name in overrides if name not in params]
    if missing:
        raise UnsupportedEngineError(f"vllm {cls.__name__}.__init__ has no {missing} argument; nothing was patched")
    names = list(params)[1:]

    def __init__(self, *args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        bound.update(overrides)
        original(self, **bound)

    return __init__


def apply_precision(policy: str | PrecisionPolicy) -> VllmPrecisionPatch:
    """Build vLLM's routers and / or LM head in fp32 as ``policy`` asks (class level, scope ``"process"``; call
    before the engine builds its model, or let the plugin do it in every worker). The model dtype and the
    head's compute dtype stay engine arguments (:func:`moealign.precision.policy.to_vllm_engine_args`)."""
    policy = get_policy(policy)
    _, version = engine_version("vllm", "moealign.patches.vllm.apply_precision needs vLLM")
    check_engine_version("vllm", version, SUPPORTED_VLLM_ENGINE)
    handle = VllmPrecisionPatch(f"vLLM precision policy {policy.name!r} (router / LM head parameters)", "process")
    handle.policy = policy
    if _wider(policy, policy.router_dtype):
        _check_fp32(policy, policy.router_dtype, "router")
        from vllm.model_executor.layers.fused_moe.router import gate_linear

        cls = require_attr(gate_linear, "GateLinear", "vllm fused_moe.router.gate_linear")
        init = _wrap_init(cls, {"params_dtype": torch.float32, "out_dtype": torch.float32, "force_fp32_compute": True})
        handle.set_attr(cls, "__init__", init, "GateLinear.__init__ (fp32 router)")
    if _wider(policy, policy.lm_head_dtype):
        _check_fp32(policy, policy.lm_head_dtype, "LM head")
        from vllm.model_executor.layers import vocab_parallel_embedding

        cls = require_attr(vocab_parallel_embedding, "ParallelLMHead", "vllm vocab_parallel_embedding")
        init = _wrap_init(cls, {"params_dtype": torch.float32})
        handle.set_attr(cls, "__init__", init, "ParallelLMHead.__init__ (fp32 LM head)")
    return handle


# --------------------------------------------------------------------------------------------------
# audit (in the workers)
# --------------------------------------------------------------------------------------------------

def _attach_audit(runner) -> PatchHandle:
    """(In each worker) forward hooks noting the dtype each gate and the logits processor compute in."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    handle = PatchHandle("vLLM precision audit hooks (gates, logits processor)", "instance")
    handle.model, handle.seen = runner.model, {}

    def note(name):
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor):
                handle.seen.setdefault(name, str(out.dtype).replace("torch.", ""))
        return hook

    for name, module in runner.model.named_modules():
        if isinstance(module, GateLinear) or name.endswith("logits_processor"):
            handle.add_hook(module.register_forward_hook(note(name)), f"{name} forward hook")
    return handle


def _read_audit(handle: PatchHandle) -> dict:
    """(In each worker) the parameter dtype of every linear layer by role, and the computed dtypes noted."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    params = {}
    for name, module in handle.model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or not hasattr(module, "quant_method"):
            continue   # (the CPU build empties packed linear weights but keeps their dtype)
        role = "router" if isinstance(module, GateLinear) else "lm_head" if isinstance(module, ParallelLMHead) \
            else "embedding" if "embed" in name else "linear"
        params[name] = (role, str(weight.dtype).replace("torch.", ""))
    return {"parameters": params, "computed": dict(handle.seen)}


def audit_vllm(llm: Any, policy: str | PrecisionPolicy, *, prompt: str = "def f(x):") -> dict:
    """Check the model ``llm`` runs, in every worker, against ``policy``: the parameter dtype of the routers, the
    LM head and the other linear layers, and, through one generated token, the dtype of the router logits and of the logits. Returns ``{"parameters", "computed"}``
    (rank 0); raises :class:`~moealign.errors.PrecisionAuditError` with every deviation on any rank."""
    from vllm import SamplingParams

    policy = get_policy(policy)
    with InWorkers(llm, _attach_audit, (), _read_audit) as hooked:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=1.0), use_tqdm=False)
    per_rank = hooked.per_rank
    want = {"router": dtype_name(policy.router_dtype or policy.dtype),
            "lm_head": dtype_name(policy.lm_head_dtype or policy.dtype),
            "linear": dtype_name(policy.dtype), "embedding": dtype_name(policy.dtype)}
    deviations = []
    for rank, report in enumerate(per_rank):
        roles = {role for role, _ in report["parameters"].values()}
        for needed in ("router", "lm_head"):
            if needed not in roles:
                deviations.append(f"rank {rank}: no {needed} parameter was found to audit")
        for name, (role, dtype) in sorted(report["parameters"].items()):
            if _short(dtype) != want[role]:
                deviations.append(f"rank {rank}: {role} {name} holds {dtype} parameters, policy: {want[role]}")
        computed = report["computed"]
        if not computed:
            deviations.append(f"rank {rank}: no router or logits output was seen in the audited forward")
        for name, dtype in sorted(computed.items()):
            role = "lm_head" if name.endswith("logits_processor") else "router"
            if _short(dtype) != want[role]:
                deviations.append(f"rank {rank}: {name} computed {dtype}, policy: {want[role]}")
    if deviations:
        raise PrecisionAuditError(policy.name, deviations)
    return per_rank[0]


def _short(dtype: str) -> str:
    return dtype_name(getattr(torch, dtype))
