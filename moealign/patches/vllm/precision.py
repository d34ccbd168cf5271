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

:func:`audit_router_vllm` is the four-stage router audit (:mod:`moealign.precision.router_audit`) in vLLM's
workers, per MoE layer (see its docstring for where each stage is read in vLLM 0.32).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from ...errors import (ConfigError, EngineError, InputError, InputTypeError, PrecisionAuditError,
                       UnsupportedEngineError, UnsupportedModelError)
from ...handle import PatchHandle
from ...precision.capability import request_amx_tiles
from ...precision.policy import PrecisionPolicy, dtype_name, get_policy
from ...precision.router_audit import RouterAudit, RouterStageObserver, observe_routers
from .._version import check_engine_version, engine_version, require_attr
from .engine import SUPPORTED_VLLM_ENGINE
from .rollout import InWorkers, moe_routers

__all__ = ["VllmPrecisionPatch", "apply_precision", "audit_vllm", "audit_router_vllm", "needs_patch"]


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
    request_amx_tiles()         # the patched forward may skip the oneDNN GEMM that asks for AMX (vLLM's kernels need it)
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


def audit_vllm(llm: Any, policy: str | PrecisionPolicy, *, prompt: str = "def f(x):",
               router_compute: torch.dtype | None = None) -> dict:
    """Check the model ``llm`` runs, in every worker, against ``policy``: the parameter dtype of the routers, the
    LM head and the other linear layers, and, through one generated token, the dtype of the router logits and of the logits. Returns ``{"parameters", "computed"}``
    (rank 0); raises :class:`~moealign.errors.PrecisionAuditError` with every deviation on any rank.
    ``router_compute``: the dtype the router logits are computed in when it is not the policy's (the canonical
    forward keeps them in fp32 from the policy's parameters)."""
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
            if _dtype_short(dtype) != want[role]:
                deviations.append(f"rank {rank}: {role} {name} holds {dtype} parameters, policy: {want[role]}")
        computed = report["computed"]
        if not computed:
            deviations.append(f"rank {rank}: no router or logits output was seen in the audited forward")
        for name, dtype in sorted(computed.items()):
            role = "lm_head" if name.endswith("logits_processor") else "router"
            expected = dtype_name(router_compute) if role == "router" and router_compute is not None else want[role]
            if _dtype_short(dtype) != expected:
                deviations.append(f"rank {rank}: {name} computed {dtype}, policy: {expected}")
    if deviations:
        raise PrecisionAuditError(policy.name, deviations)
    return per_rank[0]


def _dtype_short(dtype: str) -> str:
    return dtype_name(getattr(torch, dtype))



# --------------------------------------------------------------------------------------------------
# the four-stage router audit (in the workers)
# --------------------------------------------------------------------------------------------------

#: the layer number in a vLLM module name (``model.layers.3.mlp.gate``)
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")

#: the score functions observed inside a router's routing (their output is the ``scores`` stage): softmax and
#: sigmoid in every spelling, and ``Tensor.exp`` (the CPU router without ``renormalize`` computes
#: ``exp(logit - logsumexp)``)
_SCORE_OPS = ((torch, "softmax", "scores", "output"), (torch.Tensor, "softmax", "scores", "output"),
              (torch.nn.functional, "softmax", "scores", "output"), (torch, "sigmoid", "scores", "output"),
              (torch.Tensor, "sigmoid", "scores", "output"), (torch.Tensor, "exp", "scores", "output"))


def _gate_of(model: torch.nn.Module, name: str, layer: int):
    """The ``GateLinear`` of the MoE layer at module ``name`` (the MoE runner's ``gate``, else the sibling
    ``gate`` of the MoE block) and its module name; its name must carry ``layer``."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    moe = model.get_submodule(name)
    gate = getattr(moe, "gate", None)
    if not isinstance(gate, GateLinear):
        parent = name.rpartition(".")[0]
        try:
            gate = model.get_submodule(f"{parent}.gate" if parent else "gate")
        except AttributeError:
            gate = None
    if not isinstance(gate, GateLinear):
        raise UnsupportedModelError(f"the MoE layer {name!r} has no GateLinear router (runner.gate or a sibling "
                                    f"'gate'): its router cannot be audited")
    gate_name = next((n for n, m in model.named_modules() if m is gate), None)
    match = _LAYER_RE.search(f".{gate_name}") if gate_name is not None else None
    if match is None or int(match.group(1)) != layer:
        raise UnsupportedModelError(f"the router {gate_name!r} of the MoE layer {name!r} (decoder layer {layer}) "
                                    f"does not name that layer: its observations could not be attributed")
    return gate, gate_name


def _routing_window(obs: RouterStageObserver, layer: int, original, seen: dict):
    """``router._compute_routing`` run as "inside router ``layer``" for the observer (top-k and the score
    function observed there), noting the logits it receives (``projection``) and the weights it returns."""

    def _compute_routing(hidden_states, router_logits, indices_type, *args, **kwargs):
        with obs.inside(layer):          # the observer's router window, opened around the routing too
            obs.note("projection", router_logits)
            out = original(hidden_states, router_logits, indices_type, *args, **kwargs)
        entry = seen.setdefault(layer, {"calls": 0, "logits": None, "weights": None})
        entry["calls"] += 1
        if isinstance(router_logits, torch.Tensor):
            entry["logits"] = entry["logits"] or _short_name(router_logits.dtype)
        weights = out[0] if isinstance(out, tuple) and out else None
        if isinstance(weights, torch.Tensor):
            entry["weights"] = entry["weights"] or _short_name(weights.dtype)
        return out

    return _compute_routing


def _attach_router_audit(runner) -> RouterStageObserver:
    """(In each worker) a :class:`RouterStageObserver` on every MoE layer's ``GateLinear`` (weight as held,
    projection = the gate's output) with each router's ``_compute_routing`` observed as part of that layer's
    router (scores: the score function's output; topk_input: what ``torch.topk`` received)."""
    model = runner.model
    found = moe_routers(model)
    gates, described = {}, {}
    for layer, name, router in found:
        gate, gate_name = _gate_of(model, name, layer)
        gates[layer] = gate
        described[layer] = {"moe": name, "gate": gate_name, "router": type(router).__name__,
                            "scoring_func": getattr(router, "scoring_func", None),
                            "renormalize": getattr(router, "renormalize", None),
                            "grouped": bool(getattr(router, "use_grouped_topk", False)),
                            "custom_routing": getattr(router, "custom_routing_function", None) is not None}
    obs = observe_routers(gates, ops=_SCORE_OPS, engine="vllm")
    try:
        obs.routing_seen, obs.described = {}, described
        for layer, gate in gates.items():
            def projection(module, args, output, layer=layer):
                out = output[0] if isinstance(output, tuple) else output
                if isinstance(out, torch.Tensor):
                    obs.note("projection", out)
            # prepended: runs before the observer's own "leave" hook, while the window of this layer is open
            obs.add_hook(gate.register_forward_hook(projection, prepend=True), f"layer {layer} gate output")
        for layer, _, router in found:
            if "_compute_routing" in vars(router):
                raise UnsupportedEngineError(f"the router of layer {layer} already has an instance-level "
                                             f"_compute_routing (another moealign patch attached?)")
            obs.set_attr(router, "_compute_routing",
                         _routing_window(obs, layer, router._compute_routing, obs.routing_seen),
                         f"router of layer {layer}._compute_routing (audit window)")
    except BaseException:
        obs.undo()
        raise
    return obs


def _read_router_audit(obs: RouterStageObserver) -> dict:
    """(In each worker) the observed stages by dtype name, the observer's notes, what each routing saw."""
    return {"stages": {layer: dict(stages) for layer, stages in obs.result.names().items()},
            "notes": list(obs.result.notes), "routing": {k: dict(v) for k, v in obs.routing_seen.items()},
            "described": obs.described}


def _short_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def audit_router_vllm(llm: Any, *, prompt: str = "def f(x):") -> RouterAudit:
    """The router-precision audit (:mod:`moealign.precision.router_audit`) of the model ``llm`` runs, in every
    vLLM worker, through one generated token: a :class:`~moealign.precision.router_audit.RouterAudit` keyed by
    decoder layer (rank 0's; ranks that saw other dtypes are named in ``notes``). Check it with
    :func:`~moealign.precision.router_audit.check_router_audit`.

    Where the stages are read in vLLM 0.32 (each MoE layer: a ``GateLinear`` gate called by the ``MoERunner``,
    then ``router.select_experts`` -> ``_compute_routing``):

    * ``weight``: ``GateLinear.weight.dtype`` when the gate runs. vLLM's CPU build repacks the gate weight for
      its GEMM kernel and leaves an empty parameter of the same dtype: the dtype *held*, read directly;
    * ``projection``: the router logits the gate returns (a forward hook; the GEMM itself is a C++ kernel). The
      logits ``_compute_routing`` receives are noted for the same stage: a different dtype there is named in
      ``notes``;
    * ``scores``: the output of the score function (``torch.softmax`` / ``sigmoid`` / ``Tensor.exp``) called
      inside ``_compute_routing``. vLLM's CPU router (``CPURouter``, softmax) takes top-k of the *logits* first
      and, with ``renormalize``, a softmax over the k chosen logits in the logits' dtype, returned cast to
      float32 (the dtype returned is in ``notes``);
    * ``topk_input``: the tensor ``torch.topk`` / ``Tensor.topk`` receives inside ``_compute_routing``.

    A router that computes scores or top-k inside a custom op (a C++ / CUDA kernel: vLLM's GPU
    ``FusedTopKRouter``, the CPU ``sqrtsoftplus`` kernels) shows neither op; such a stage is reported as the
    dtype of the kernel's input, the router logits ``_compute_routing`` received, and ``notes`` says so for each
    layer (what the kernel computes in internally is not known here)."""
    from vllm import SamplingParams

    if not isinstance(prompt, str):
        raise InputTypeError(f"prompt must be a string, got {type(prompt).__name__}")
    if not prompt:
        raise InputError("prompt is empty")
    version = engine_version("vllm", "moealign.patches.vllm.audit_router_vllm needs vLLM")[1]
    with InWorkers(llm, _attach_router_audit, (), _read_router_audit) as hooked:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=1.0), use_tqdm=False)
    per_rank = hooked.per_rank
    if not per_rank:
        raise EngineError("no vLLM worker answered the router audit")
    first = per_rank[0]
    stages = {int(layer): {s: (getattr(torch, d) if d is not None else None) for s, d in st.items()}
              for layer, st in first["stages"].items()}
    notes = [f"vllm {version}: weight = GateLinear.weight.dtype as held; projection = the logits the gate returns "
             f"(and that _compute_routing receives); scores = the score function's output inside _compute_routing; "
             f"topk_input = what torch.topk received inside _compute_routing"]
    described = first["described"]
    kinds = sorted({(d["router"], d["scoring_func"], d["renormalize"]) for d in described.values()}, key=str)
    for router, scoring, renorm in kinds:
        notes.append(f"router {router} (scoring_func={scoring!r}, renormalize={renorm})")
    for layer in sorted(stages):
        routing = first["routing"].get(layer)
        if not routing or not routing["calls"]:
            notes.append(f"layer {layer}: its routing (_compute_routing) did not run in the audited step: scores "
                         f"and topk_input not observed")
            continue
        if routing["weights"] is not None and routing["weights"] != (first["stages"][layer].get("scores")):
            notes.append(f"layer {layer}: _compute_routing returns its top-k weights in {routing['weights']} "
                         f"(scores are reported as the score function produced them)")
        for stage in ("scores", "topk_input"):
            if stages[layer][stage] is None and routing["logits"] is not None:
                stages[layer][stage] = getattr(torch, routing["logits"])
                notes.append(f"layer {layer} {stage}: not observable (computed inside a custom op of "
                             f"{described[layer]['router']}); reported as the dtype of that op's input, the "
                             f"router logits ({routing['logits']}), not the kernel's internal dtype")
    notes.extend(first["notes"])
    for rank, other in enumerate(per_rank[1:], start=1):
        if other["stages"] != first["stages"]:
            notes.append(f"TP rank {rank} observed other dtypes than rank 0: {other['stages']}")
    return RouterAudit(stages, engine=f"vllm {version}", notes=notes)
