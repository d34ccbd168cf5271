"""Apply a precision policy to a live transformers MoE model (per instance, reversible).

::

    from moealign.patches.hf import precision as hf_precision
    from moealign.precision.audit import audit

    handle = hf_precision.apply_precision(model, "fp16-fp32-router-head")
    audit(model, "fp16-fp32-router-head", {"input_ids": ids}, roles=handle.roles)
    ...
    handle.undo()                      # hooks removed, original dtypes (and values with keep_original=True)

What it does, in order: casts the model to the policy's ``dtype`` (floating buffers matching
``policy.fp32_buffers``, such as the rotary ``inv_freq``, keep their original float32 values); casts the
MoE routers (found through the :mod:`moealign.patches.hf` family registry) and the LM head to their
override dtype and gives each a forward pre-hook that casts its floating inputs to that dtype (an fp32
router in an fp16 model would otherwise get fp16 hidden states and fail, or silently compute in fp16);
for FP8 policies, fake-quantises the other linear layers and the expert matrices
(:func:`moealign.precision.fp8.fake_quant_fp8_`).

The router's outputs are left as computed: an fp32 router returns fp32 logits and fp32 gate weights,
which the experts multiply into their fp16 outputs before casting back (as Megatron's
``moe_router_dtype="fp32"`` does).
"""

from __future__ import annotations

import re

import torch

from ...errors import ConfigError
from ...handle import PatchHandle
from ...precision.fp8 import FakeQuantHandle, fake_quant_fp8_, fp8_fake_quant_config
from ...precision.policy import LM_HEAD, ROUTER, PrecisionPolicy, dtype_name, get_policy

__all__ = ["module_roles", "apply_precision", "PrecisionHandle"]


def module_roles(model: torch.nn.Module) -> dict[str, str]:
    """``{qualified module name: role}`` for the MoE routers and the LM head of a transformers model."""
    from .model import describe_model

    info = describe_model(model)
    router_ids = {id(m) for _, m in info.routers}
    roles = {name: ROUTER for name, m in model.named_modules() if id(m) in router_ids}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        head_names = [name for name, m in model.named_modules() if m is head]
        if head_names:
            roles[head_names[0]] = LM_HEAD
    return roles


def _cast_inputs_hook(dtype: torch.dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    def hook(module, args, kwargs):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
    return hook


class PrecisionHandle(PatchHandle):
    """What :func:`apply_precision` changed (a :class:`~moealign.handle.PatchHandle`, scope ``"instance"``);
    ``undo()`` puts it back, in reverse: fake quantisation, input-cast hooks, then every parameter and buffer
    cast back to its original dtype (the original values when applied with ``keep_original=True``)."""

    def __init__(self, model: torch.nn.Module, policy: PrecisionPolicy, roles: dict[str, str]):
        super().__init__(f"precision policy {policy.name!r} on {type(model).__name__}", "instance")
        self.model = model
        self.policy = policy
        self.roles = roles
        self.fp8: FakeQuantHandle | None = None
        self._hooks: list = []                             # the input-cast hooks (also registered to undo)
        self._dtypes: dict[str, torch.dtype] = {}          # "p:<name>" / "b:<name>" -> original dtype
        self._originals: dict[str, torch.Tensor] = {}      # same keys, with keep_original=True
        self.add_callback(self._restore_dtypes, "parameter and buffer dtypes")

    def _add_input_cast(self, name: str, module: torch.nn.Module, dtype: torch.dtype) -> None:
        hook = module.register_forward_pre_hook(_cast_inputs_hook(dtype), with_kwargs=True)
        self._hooks.append(hook)
        self.add_hook(hook, f"{name or '<root>'} inputs -> {dtype_name(dtype)}")

    def _add_fp8(self, fp8: FakeQuantHandle) -> None:
        self.fp8 = fp8

        def undo_fp8() -> None:
            fp8.undo()
            self.fp8 = None

        self.add_callback(undo_fp8, fp8.target)

    def _restore_dtypes(self) -> None:
        self._hooks.clear()
        with torch.no_grad():
            for mname, module in self.model.named_modules():
                for kind, store in (("p", module._parameters), ("b", module._buffers)):
                    for name, t in store.items():
                        key = f"{kind}:{mname}.{name}" if mname else f"{kind}:{name}"
                        if t is None or key not in self._dtypes:
                            continue
                        value = self._originals.get(key)
                        if value is None:
                            value = t.detach().to(self._dtypes[key])
                        if kind == "p":
                            t.data = value
                        else:
                            store[name] = value
        self._dtypes.clear()
        self._originals.clear()


def apply_precision(model: torch.nn.Module, policy: str | PrecisionPolicy, *, keep_original: bool = False,
                    roles: dict[str, str] | None = None) -> PrecisionHandle:
    """Apply ``policy`` to ``model`` in place; returns a :class:`PrecisionHandle` (``.undo()``).

    ``keep_original=True`` keeps a copy of every tensor whose dtype changes, so ``undo()`` restores
    exact values (otherwise ``undo()`` casts back and values keep the rounding of the narrower dtype).
    ``roles`` overrides :func:`module_roles` (for models outside the family registry).
    """
    policy = get_policy(policy)
    roles = module_roles(model) if roles is None else dict(roles)
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
    kept_buffers: dict[tuple[str, str], torch.Tensor] = {}
    for mname, module in modules.items():
        for kind, store in (("p", module._parameters), ("b", module._buffers)):
            for name, t in store.items():
                if t is None or not t.is_floating_point():
                    continue
                qual = f"{mname}.{name}" if mname else name
                handle._dtypes[f"{kind}:{qual}"] = t.dtype
                if keep_original:
                    handle._originals[f"{kind}:{qual}"] = t.detach().clone()
                if kind == "b" and any(r.search(qual) for r in fp32_buffers):
                    kept_buffers[(mname, name)] = t.detach().clone()

    model.to(policy.dtype)
    for role_module, role in roles.items():
        dtype = policy.module_dtype(role)
        if dtype == policy.dtype:
            continue
        module = modules[role_module]
        module.to(dtype)
        handle._add_input_cast(role_module, module, dtype)
    with torch.no_grad():
        for (mname, name), value in kept_buffers.items():
            modules[mname]._buffers[name] = value.to(torch.float32)
    if policy.fp8 is not None:
        handle._add_fp8(fake_quant_fp8_(model, fp8_fake_quant_config(policy, roles)))
    return handle
