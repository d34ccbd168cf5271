"""Apply a precision policy to a live transformers MoE model (per instance, reversible).

::

    from moealign.patches.hf import precision as hf_precision
    from moealign.precision.audit import audit

    handle = hf_precision.apply_precision(model, "fp16-fp32-router-head")
    audit(model, "fp16-fp32-router-head", {"input_ids": ids}, roles=handle.roles)
    ...
    handle.undo()                      # hooks removed, original dtypes and values (bitwise)

What it does, in order: casts the model to the policy's ``dtype`` (floating buffers matching
``policy.fp32_buffers``, such as the rotary ``inv_freq``, keep their original float32 values); casts the
MoE routers (found through the :mod:`moealign.patches.hf` family registry) and the LM head to their
override dtype and gives each a forward pre-hook that casts its floating inputs to that dtype (an fp32
router in an fp16 model would otherwise get fp16 hidden states and fail, or silently compute in fp16);
for FP8 policies, fake-quantises the other linear layers and the expert matrices
(:func:`moealign.precision.fp8.fake_quant_fp8_`).

Two more regions (``attention_dtype``, ``experts_dtype``: each decoder layer's ``self_attn`` and each MoE
layer's experts module, :data:`~moealign.precision.policy.ATTENTION` / :data:`~moealign.precision.policy.EXPERTS`)
are cast the same way, their floating inputs cast up (also inside tuples: the rotary ``(cos, sin)``), and, in
addition, their floating outputs cast back to the policy's ``dtype`` by a forward hook: an fp32 attention in a
bf16 model must not turn the residual stream (and everything after it) into fp32.

The router's outputs are left as computed: an fp32 router returns fp32 logits and fp32 gate weights,
which the experts multiply into their fp16 outputs before casting back (as Megatron's
``moe_router_dtype="fp32"`` does).
"""

from __future__ import annotations

import re
import warnings

import torch

from ...errors import ConfigError, MoealignWarning
from ...handle import PatchHandle
from ...precision.fp8 import FakeQuantHandle, fake_quant_fp8_, fp8_fake_quant_config
from ...precision.policy import (
    ATTENTION,
    EXPERTS,
    LM_HEAD,
    OUTPUT_CAST_ROLES,
    ROLES,
    ROUTER,
    PrecisionPolicy,
    dtype_name,
    get_policy,
)

__all__ = ["module_roles", "apply_precision", "PrecisionHandle", "audit_router"]

_SELF_ATTN_RE = re.compile(r"(?:^|\.)layers\.\d+\.self_attn$")


def module_roles(model: torch.nn.Module, *, include: tuple[str, ...] | None = None) -> dict[str, str]:
    """``{qualified module name: role}`` of a transformers MoE model, for the roles in ``include``.

    Roles (:data:`~moealign.precision.policy.ROLES`): the MoE routers (the family's router class, through
    :func:`~moealign.patches.hf.model.describe_model`), the LM head (``get_output_embeddings()``), each decoder
    layer's self-attention (``...layers.<i>.self_attn``: ATTENTION) and each MoE layer's experts module (the
    ``experts`` sibling of its router: EXPERTS; a shared expert is not part of it). The default, ``include=None``,
    is the router and the LM head only (modules holding a ``.weight``, as callers have always iterated);
    ``include=ROLES`` gives all four."""
    from .model import describe_model

    include = (ROUTER, LM_HEAD) if include is None else tuple(include)
    unknown = [r for r in include if r not in ROLES]
    if unknown:
        raise ConfigError(f"unknown module roles {unknown} (known: {list(ROLES)})")
    info = describe_model(model)
    named = list(model.named_modules())
    router_names = {id(m): name for name, m in named if any(m is r for _, r in info.routers)}
    roles: dict[str, str] = {}
    if ROUTER in include:
        roles.update({name: ROUTER for name in router_names.values()})
    if LM_HEAD in include:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None:
            head_names = [name for name, m in named if m is head]
            if head_names:
                roles[head_names[0]] = LM_HEAD
    if ATTENTION in include:
        attn = [name for name, _ in named if _SELF_ATTN_RE.search(name)]
        if not attn:
            raise ConfigError(f"no '...layers.<i>.self_attn' modules in this {type(model).__name__}: cannot place the "
                              f"attention role (pass roles= explicitly)")
        roles.update({name: ATTENTION for name in attn})
    if EXPERTS in include:
        modules = dict(named)
        for router_name in router_names.values():
            parent = router_name.rpartition(".")[0]
            experts = f"{parent}.experts" if parent else "experts"
            if experts not in modules:
                raise ConfigError(f"router {router_name!r} has no 'experts' sibling module: cannot place the experts "
                                  f"role (pass roles= explicitly)")
            roles[experts] = EXPERTS
    return roles


def _lossy(original: torch.dtype, current: torch.dtype) -> bool:
    """Did casting ``original`` floats to ``current`` round them (float32 holds every fp16 / bf16 value)?"""
    return current != original and torch.finfo(current).bits <= torch.finfo(original).bits


def _cast_inputs_hook(dtype: torch.dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    def hook(module, args, kwargs):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
    return hook


def _cast_nested(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_cast_nested(v, dtype) for v in x)
    if isinstance(x, list):
        return [_cast_nested(v, dtype) for v in x]
    return x


def _cast_inputs_nested_hook(dtype: torch.dtype):
    """Pre-hook of the attention / experts regions: floating inputs cast, also inside tuples and lists
    (the rotary ``position_embeddings=(cos, sin)``)."""
    def hook(module, args, kwargs):
        return _cast_nested(args, dtype), {k: _cast_nested(v, dtype) for k, v in kwargs.items()}
    return hook


def _cast_output_hook(dtype: torch.dtype):
    """Forward hook of the attention / experts regions: floating outputs (tensors in tuples too) back to ``dtype``."""
    def hook(module, args, output):
        return _cast_nested(output, dtype)
    return hook


class PrecisionHandle(PatchHandle):
    """What :func:`apply_precision` changed (a :class:`~moealign.handle.PatchHandle`, scope ``"instance"``);
    ``undo()`` puts it back, in reverse: fake quantisation, input-cast hooks, then every parameter and buffer
    whose dtype changed gets its original tensor back (bitwise; applied with ``keep_original=False``: cast back,
    keeping the narrower dtype's rounding, with a :class:`~moealign.errors.MoealignWarning`). A tensor changed in
    place since (an optimizer step) is cast back instead, so the change survives (warned too)."""

    def __init__(self, model: torch.nn.Module, policy: PrecisionPolicy, roles: dict[str, str]):
        super().__init__(f"precision policy {policy.name!r} on {type(model).__name__}", "instance")
        self.model = model
        self.policy = policy
        self.roles = roles
        self.fp8: FakeQuantHandle | None = None
        self._hooks: list = []                             # the input-cast hooks (also registered to undo)
        self._dtypes: dict[str, torch.dtype] = {}          # "p:<name>" / "b:<name>" -> original dtype
        self._originals: dict[str, torch.Tensor] = {}      # same keys: the replaced tensors (keep_original=True)
        self._applied: dict[str, int] = {}                 # same keys: the tensor's version right after apply
        self.keep_original = True
        self.add_callback(self._restore_dtypes, "parameter and buffer dtypes")

    def _add_input_cast(self, name: str, module: torch.nn.Module, dtype: torch.dtype, nested: bool = False) -> None:
        make = _cast_inputs_nested_hook if nested else _cast_inputs_hook
        hook = module.register_forward_pre_hook(make(dtype), with_kwargs=True)
        self._hooks.append(hook)
        self.add_hook(hook, f"{name or '<root>'} inputs -> {dtype_name(dtype)}")

    def _add_output_cast(self, name: str, module: torch.nn.Module, dtype: torch.dtype) -> None:
        hook = module.register_forward_hook(_cast_output_hook(dtype))
        self._hooks.append(hook)
        self.add_hook(hook, f"{name or '<root>'} outputs -> {dtype_name(dtype)}")

    def _add_fp8(self, fp8: FakeQuantHandle) -> None:
        self.fp8 = fp8

        def undo_fp8() -> None:
            fp8.undo()
            self.fp8 = None

        self.add_callback(undo_fp8, fp8.target)

    def _tensors(self):
        """``(key, store, name, tensor)`` for every parameter and buffer of the model, keys as in ``_dtypes``
        (``"p:<name>"`` / ``"b:<name>"``)."""
        for mname, module in self.model.named_modules():
            for kind, store in (("p", module._parameters), ("b", module._buffers)):
                for name, t in store.items():
                    if t is not None:
                        yield (f"{kind}:{mname}.{name}" if mname else f"{kind}:{name}"), store, name, t

    def _mark_applied(self) -> None:
        """Forget originals the policy did not replace; fingerprint the rest to see in-place changes at undo."""
        live = {key: t for key, _, _, t in self._tensors()}
        for key in list(self._originals):
            t = live.get(key)
            if t is None or t.data_ptr() == self._originals[key].data_ptr():
                del self._originals[key]                   # not replaced (same dtype): nothing to restore
            else:
                self._applied[key] = t._version   # in-place ops (optimizer steps) bump it; .to(device) does not

    def _restore_dtypes(self) -> None:
        self._hooks.clear()
        rounded, changed = [], []
        with torch.no_grad():
            for key, store, name, t in list(self._tensors()):
                if key not in self._dtypes:
                    continue
                value = self._originals.get(key)
                if value is not None and self._applied.get(key) != t._version:
                    changed.append(key[2:])                # changed in place since apply: keep the change
                    value = None
                elif value is None and _lossy(self._dtypes[key], t.dtype):
                    # nothing kept: with keep_original, the dtype was changed after apply (module.half())
                    (changed if self.keep_original else rounded).append(key[2:])
                if value is None:
                    value = t.detach().to(self._dtypes[key])
                value = value.to(t.device)
                if key.startswith("p:"):
                    t.data = value
                else:
                    store[name] = value
        self._dtypes.clear()
        self._originals.clear()
        self._applied.clear()
        if changed:
            warnings.warn(f"undo of precision policy {self.policy.name!r}: {len(changed)} tensors were changed "
                          f"after it was applied (first: {changed[0]}); they are cast back to their original dtypes "
                          f"with their new values, not restored", MoealignWarning, stacklevel=3)
        if rounded:
            warnings.warn(f"undo of precision policy {self.policy.name!r} applied with keep_original=False: "
                          f"{len(rounded)} tensors are cast back to their original dtypes and keep the rounding of "
                          f"{dtype_name(self.policy.dtype)} (first: {rounded[0]})", MoealignWarning, stacklevel=3)


def apply_precision(model: torch.nn.Module, policy: str | PrecisionPolicy, *, keep_original: bool = True,
                    roles: dict[str, str] | None = None) -> PrecisionHandle:
    """Apply ``policy`` to ``model`` in place; returns a :class:`PrecisionHandle` (``.undo()``, a context manager).

    ``undo()`` restores the exact original values: the tensors the policy replaces (those whose dtype changes)
    are kept (references, no copy), costing their memory for as long as the patch is on.
    ``keep_original=False`` drops them (for a model that is never given back, as
    :func:`~moealign.patches.hf.loading.load_model`'s): ``undo()`` then casts back, values keep the narrower
    dtype's rounding, and says so (:class:`~moealign.errors.MoealignWarning`).
    Every module is cast from its original values: an fp32 router or LM head in an fp16 policy holds the
    checkpoint's fp32 weights, not fp16-rounded ones.
    ``roles`` overrides :func:`module_roles` (for models outside the family registry); by default the routers and
    the LM head, plus the attention / experts modules when the policy gives them their own dtype. Attention and
    experts modules kept in another dtype also get their floating outputs cast back to the policy's ``dtype``.
    """
    if not isinstance(keep_original, bool):
        raise ConfigError(f"keep_original must be True or False, got {keep_original!r}")
    policy = get_policy(policy)
    if roles is None:
        include = (ROUTER, LM_HEAD) + tuple(r for r in OUTPUT_CAST_ROLES if policy.module_dtype(r) != policy.dtype)
        roles = module_roles(model, include=include)
    else:
        roles = dict(roles)
    bad = {n: r for n, r in roles.items() if r not in ROLES}
    if bad:
        raise ConfigError(f"unknown module roles {bad} (known: {list(ROLES)})")
    modules = dict(model.named_modules())
    missing = sorted(set(roles) - set(modules))
    if missing:
        raise ConfigError(f"roles name modules the model does not have: {missing}")
    head_names = [n for n, r in roles.items() if r == LM_HEAD]
    if policy.module_dtype(LM_HEAD) != policy.dtype and head_names:
        head = modules[head_names[0]]
        tied = [n for n, p in model.named_parameters(remove_duplicate=False)
                if not n.startswith(head_names[0] + ".") and any(p is q for q in head.parameters())]
        if tied:
            raise ConfigError(f"the LM head {head_names[0]!r} shares its weight with {tied} (tied embeddings): "
                             f"an {dtype_name(policy.module_dtype(LM_HEAD))} LM head would change those too")

    handle = PrecisionHandle(model, policy, roles)
    fp32_buffers = [re.compile(p) for p in policy.fp32_buffers]
    overrides = [(r, policy.module_dtype(role)) for r, role in roles.items()
                 if policy.module_dtype(role) != policy.dtype]

    def override(mname: str) -> torch.dtype | None:
        dtype = None
        for r, d in overrides:       # in roles' order: a later (nested) role wins, as module.to() in turn would
            if mname == r or mname.startswith(r + ".") or not r:
                dtype = d
        return dtype

    # (store, name, key, original tensor, dtype it ends in) of every floating tensor
    plan = []
    for mname, module in modules.items():
        dtype_here = override(mname)
        for kind, store in (("p", module._parameters), ("b", module._buffers)):
            for name, t in store.items():
                if t is None or not t.is_floating_point():
                    continue
                qual = f"{mname}.{name}" if mname else name
                key = f"{kind}:{qual}"
                handle._dtypes[key] = t.dtype
                if kind == "b" and any(r.search(qual) for r in fp32_buffers):
                    plan.append((store, name, key, t.detach(), torch.float32))
                elif dtype_here is not None:
                    plan.append((store, name, key, t.detach(), dtype_here))
                elif keep_original:
                    plan.append((store, name, key, t.detach(), None))

    model.to(policy.dtype)
    with torch.no_grad():
        for store, name, key, original, dtype in plan:     # overrides and fp32 buffers from the original values
            if dtype is None:
                continue
            if key.startswith("p:"):
                store[name].data = original.to(dtype)
            else:
                store[name] = original.to(dtype)
    for role_module, dtype in overrides:
        cast_out = roles[role_module] in OUTPUT_CAST_ROLES
        handle._add_input_cast(role_module, modules[role_module], dtype, nested=cast_out)
        if cast_out:
            handle._add_output_cast(role_module, modules[role_module], policy.dtype)
    handle.keep_original = keep_original
    if keep_original:
        handle._originals = {key: original for _, _, key, original, _ in plan}
        handle._mark_applied()
    del plan
    if policy.fp8 is not None:
        spared = {n: r for n, r in roles.items() if r in (ROUTER, LM_HEAD)}   # FP8 spares router and head only
        handle._add_fp8(fake_quant_fp8_(model, fp8_fake_quant_config(policy, spared)))
    return handle


# --------------------------------------------------------------------------------------------------
# the router-precision audit (4 stages)
# --------------------------------------------------------------------------------------------------


def audit_router(model: torch.nn.Module, inputs, *, forward=None):
    """The dtype each MoE router of ``model`` works in, stage by stage, observed in one forward (no grad) on
    ``inputs`` (a dict: keywords; a tuple: positional; else the only argument; ``forward(model, inputs)``
    replaces the call): a :class:`~moealign.precision.router_audit.RouterAudit` ``{layer: {"weight",
    "projection", "scores", "topk_input"}}``; check it with
    :func:`~moealign.precision.router_audit.check_router_audit`.

    Observed in the router module (the family's router class, e.g. Qwen3-MoE's ``mlp.gate``): ``weight`` its
    ``weight`` when it runs; ``projection`` the output of ``torch.nn.functional.linear``; ``scores`` the output
    of ``F.softmax`` / ``torch.softmax`` / ``torch.sigmoid``; ``topk_input`` the input of ``torch.topk``. (Qwen3-MoE's
    router computes ``softmax(logits, dtype=torch.float)``: its scores and top-k input are float32 in a bf16
    model too; the projection is where a bf16 router rounds.)
    """
    from ...precision.router_audit import observe_routers
    from .model import describe_model

    info = describe_model(model)
    functional = torch.nn.functional
    ops = [(functional, "linear", "projection", "output"), (functional, "softmax", "scores", "output"),
           (torch, "softmax", "scores", "output"), (torch, "sigmoid", "scores", "output")]
    with observe_routers(dict(info.routers), ops=ops, engine=f"transformers {info.transformers_version}") as obs:
        with torch.no_grad():
            if forward is not None:
                forward(model, inputs)
            elif isinstance(inputs, dict):
                model(**inputs)
            elif isinstance(inputs, (tuple, list)):
                model(*inputs)
            else:
                model(inputs)
    obs.result.notes.insert(0, "projection: F.linear output; scores: softmax / sigmoid output; topk_input: the "
                               "tensor torch.topk received; weight: router.weight as held")
    return obs.result
