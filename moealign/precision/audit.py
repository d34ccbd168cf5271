"""Audit a live model against a precision policy: stored dtypes, and the dtypes it really computes in.

:func:`audit` checks

* every parameter: the dtype of its module's role (:data:`~moealign.precision.policy.ROUTER`,
  :data:`~moealign.precision.policy.LM_HEAD`, :data:`~moealign.precision.policy.ATTENTION`,
  :data:`~moealign.precision.policy.EXPERTS` or none) under the policy;
* every floating buffer: float32 if it matches ``policy.fp32_buffers``, else its module's dtype;
* with ``inputs``, one forward (no grad) with hooks on every module that holds parameters itself: the
  first floating input *as the module's forward sees it* (after other pre-hooks, so a missing input cast
  in front of an fp32 router shows) and the first floating output must have the module's dtype (the
  root module of an attention / experts role returns the policy's ``dtype``: its output is cast back);
  for FP8 policies, every module FP8 applies to must have its weights fake-quantised in that forward
  (:mod:`moealign.precision.fp8`), and no other module may.

It raises :class:`PrecisionAuditError` listing every deviation (a forward that raises is one of them),
or returns an :class:`AuditReport`.

Roles: ``roles`` maps qualified module names to a role (sub-modules inherit it). Without it, names are
matched: ``...gate`` / ``...router`` are routers, ``lm_head`` / ``output_layer`` the LM head. The
transformers adapter (:func:`moealign.patches.hf.precision.module_roles`) finds them exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..errors import InputError, PrecisionAuditError
from .fp8 import FP8_MARK, fp8_fake_quant_config
from .policy import LM_HEAD, OUTPUT_CAST_ROLES, ROLES, ROUTER, PrecisionPolicy, dtype_name, get_policy

__all__ = ["PrecisionAuditError", "AuditReport", "audit", "guess_roles", "resolve_roles"]

_ROLE_PATTERNS = {ROUTER: r"(^|\.)(gate|router)$", LM_HEAD: r"(^|\.)(lm_head|output_layer)$"}


@dataclass
class AuditReport:
    """A clean audit: what was checked."""

    policy: str
    parameters: int
    buffers: int
    forward_checked: bool
    computed: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)  # module -> (input, output)
    fp8_modules: list[str] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"policy {self.policy}: {self.parameters} parameters, {self.buffers} buffers, "
                f"{len(self.computed)} computing modules checked in a forward" if self.forward_checked else
                f"policy {self.policy}: {self.parameters} parameters, {self.buffers} buffers (no forward)") + \
            (f", {len(self.fp8_modules)} FP8 modules" if self.fp8_modules else "")


def guess_roles(model: torch.nn.Module) -> dict[str, str]:
    """Roles from module names (``...gate`` / ``...router``: router; ``lm_head`` / ``output_layer``)."""
    roles = {}
    for name, module in model.named_modules():
        for role, pattern in _ROLE_PATTERNS.items():
            if name and re.search(pattern, name) and any(True for _ in module.parameters()):
                roles[name] = role
    return roles


def resolve_roles(model: torch.nn.Module, roles: Mapping[str, str] | None) -> dict[str, str]:
    """Every module's role: the given (or guessed) roles, inherited by sub-modules."""
    roles = dict(guess_roles(model) if roles is None else roles)
    names = {name for name, _ in model.named_modules()}
    unknown = sorted(set(roles) - names)
    if unknown:
        raise InputError(f"roles name modules the model does not have: {unknown}")
    bad = {n: r for n, r in roles.items() if r not in ROLES}
    if bad:
        raise InputError(f"unknown module roles {bad} (known: {', '.join(repr(r) for r in ROLES)})")
    full = {}
    for name, _ in model.named_modules():
        owner = max((r for r in roles if name == r or name.startswith(r + ".")), key=len, default=None)
        if owner is not None:
            full[name] = roles[owner]
    return full


def first_float(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    elif hasattr(obj, "to_tuple") and callable(obj.to_tuple):   # transformers ModelOutput
        obj = obj.to_tuple()
    if isinstance(obj, (tuple, list)):
        for item in obj:
            found = first_float(item)
            if found is not None:
                return found
    return None


def _run(model: torch.nn.Module, inputs: Any, forward: Callable | None) -> None:
    if forward is not None:
        forward(model, inputs)
    elif isinstance(inputs, Mapping):
        model(**inputs)
    elif isinstance(inputs, (tuple, list)):
        model(*inputs)
    else:
        model(inputs)


def audit(model: torch.nn.Module, policy: str | PrecisionPolicy, inputs: Any = None, *,
          roles: Mapping[str, str] | None = None, forward: Callable[[torch.nn.Module, Any], Any] | None = None,
          ) -> AuditReport:
    """Check ``model`` against ``policy``; raise :class:`PrecisionAuditError` listing every deviation.

    ``inputs``: passed to one forward (a dict as keywords, a tuple positionally, else as the only
    argument; ``forward(model, inputs)`` replaces that call); ``None`` checks stored dtypes only.
    """
    policy = get_policy(policy)
    all_roles = resolve_roles(model, roles)
    top_roles = dict(guess_roles(model) if roles is None else roles)
    deviations: list[str] = []
    fp32_buffers = [re.compile(p) for p in policy.fp32_buffers]

    def expected(module_name: str) -> torch.dtype:
        return policy.module_dtype(all_roles.get(module_name))

    def expected_out(module_name: str) -> torch.dtype:
        # an attention / experts region returns the model's dtype (its output is cast back)
        if top_roles.get(module_name) in OUTPUT_CAST_ROLES:
            return policy.dtype
        return expected(module_name)

    n_params = n_buffers = 0
    for mname, module in model.named_modules():
        want = expected(mname)
        for pname, p in module.named_parameters(recurse=False):
            n_params += 1
            if p.dtype != want:
                deviations.append(f"parameter {_q(mname, pname)}: {dtype_name(p.dtype)}, policy says "
                                  f"{dtype_name(want)}{_role_note(all_roles.get(mname))}")
        for bname, b in module.named_buffers(recurse=False):
            if b is None or not b.is_floating_point():
                continue
            n_buffers += 1
            qual = _q(mname, bname)
            want_b = torch.float32 if any(r.search(qual) for r in fp32_buffers) else want
            if b.dtype != want_b:
                deviations.append(f"buffer {qual}: {dtype_name(b.dtype)}, policy says {dtype_name(want_b)}")

    # FP8: which modules it applies to, and are they marked as fake-quantised
    fp8_modules: list[str] = []
    if policy.fp8 is not None:
        cfg = fp8_fake_quant_config(policy, {n: r for n, r in top_roles.items() if r in (ROUTER, LM_HEAD)})
        fp8_modules = [n for n, m in model.named_modules() if cfg.selects(n, m)]
        if not fp8_modules:
            deviations.append("policy uses FP8 but no module of the model qualifies for it")
    fp8_set = set(fp8_modules)
    for mname, module in model.named_modules():
        marked = bool(module.__dict__.get(FP8_MARK))
        if mname in fp8_set and not marked:
            deviations.append(f"module {mname}: not FP8 fake-quantised, policy {policy.name} quantises it")
        elif marked and mname not in fp8_set:
            deviations.append(f"module {mname}: FP8 fake-quantised, policy {policy.name} keeps it in "
                              f"{dtype_name(expected(mname))}")

    computed: dict[str, tuple[str | None, str | None]] = {}
    if inputs is not None:
        handles = []
        seen_fp8: set[str] = set()

        def pre(mname: str, weight_names: list[str]):
            def hook(module, args):
                if mname in fp8_set and all(isinstance(module.__dict__.get(w), torch.Tensor) for w in weight_names):
                    seen_fp8.add(mname)
                x = first_float(args)
                computed[mname] = (dtype_name(x.dtype) if x is not None else None, None)
            return hook

        def post(mname: str):
            def hook(module, args, output):
                y = first_float(output)
                computed[mname] = (computed.get(mname, (None, None))[0],
                                   dtype_name(y.dtype) if y is not None else None)
            return hook

        for mname, module in model.named_modules():
            own = [n for n, p in module.named_parameters(recurse=False) if p.is_floating_point()]
            if not own:
                continue
            weights = [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2]
            handles.append(module.register_forward_pre_hook(pre(mname, weights)))
            handles.append(module.register_forward_hook(post(mname)))
        try:
            with torch.no_grad():
                _run(model, inputs, forward)
        except Exception as exc:  # noqa: BLE001 - a dtype clash inside the forward is itself a finding
            deviations.append(f"forward raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        finally:
            for h in handles:
                h.remove()
        for mname, (x_dtype, y_dtype) in computed.items():
            want = dtype_name(expected(mname))
            want_out = dtype_name(expected_out(mname))
            note = _role_note(all_roles.get(mname))
            if x_dtype is not None and x_dtype != want:
                deviations.append(f"module {mname} computes on {x_dtype} input, policy says {want}{note}")
            if y_dtype is not None and y_dtype != want_out:
                deviations.append(f"module {mname} returns {y_dtype}, policy says {want_out}{note}")
        for mname in fp8_modules:
            if mname in computed and mname not in seen_fp8:
                deviations.append(f"module {mname}: weights were not FP8-rounded in the forward")

    if deviations:
        raise PrecisionAuditError(policy.name, deviations)
    return AuditReport(policy=policy.name, parameters=n_params, buffers=n_buffers, forward_checked=inputs is not None,
                       computed=computed, fp8_modules=fp8_modules, roles=top_roles)


def _q(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def _role_note(role: str | None) -> str:
    return f" (role {role})" if role else ""
