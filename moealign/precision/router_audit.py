"""The router-precision audit, engine-free: in which dtype each MoE router really works, stage by stage.

Four stages, observed in a live forward (not read from a config):

=============  ===========================================================================================
``weight``     the dtype the router's weight is *held* in (``router.weight.dtype`` when the router runs)
``projection`` the router projection's output: the router logits
``scores``     the score function's output (softmax / sigmoid) as the router carries it on
``topk_input`` the tensor top-k is taken on (what decides the experts)
=============  ===========================================================================================

A :class:`RouterAudit` is ``{layer: {stage: torch.dtype | None}}`` (``None``: the stage was not seen in that
router's forward); :func:`check_router_audit` lists every layer / stage whose dtype is not the expected one.

:class:`RouterStageObserver` does the observing: a forward pre-hook / hook pair on each router marks "inside
router ``L``" (hooks with ``always_call``: a router that raises is left again), and reversible patches of
functions (``torch.topk`` and ``torch.Tensor.topk`` always; an engine adapter adds its own, e.g.
``torch.nn.functional.linear`` for the projection) note the dtype of their input or output for the router that
is running. Calls outside a router pass through unobserved. Every patch is registered on the observer, a
:class:`~moealign.handle.PatchHandle` (scope ``"module"``: the patched functions are module attributes), so
``with observe_routers(...) as obs: model(...)`` leaves nothing behind. Engine adapters:
:func:`moealign.patches.hf.precision.audit_router` (transformers),
:func:`moealign.patches.megatron.router_audit.audit_router` (Megatron-core).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import InputError, InputTypeError
from ..handle import PatchHandle
from .policy import dtype_name

__all__ = ["STAGES", "RouterAudit", "RouterStageObserver", "observe_routers", "check_router_audit"]

#: the four stages, in the order the router runs them
STAGES = ("weight", "projection", "scores", "topk_input")

#: one observed op: ``(owner, attribute, stage, "input" | "output")``; the first floating tensor is read
OpSpec = tuple[Any, str, str, str]


class RouterAudit(dict):
    """``{layer: {stage: torch.dtype | None}}`` for every router observed (layers ascending, stages
    :data:`STAGES`). ``engine``: who ran it; ``notes``: what the adapter wants said with the numbers (how a stage
    was observed, a stage seen in several dtypes within one router call)."""

    def __init__(self, data: Mapping[int, Mapping[str, torch.dtype | None]] | None = None, *, engine: str = "",
                 notes: Iterable[str] = ()):
        super().__init__()
        for layer, stages in sorted((data or {}).items()):
            self[int(layer)] = {stage: stages.get(stage) for stage in STAGES}
        self.engine = engine
        self.notes = list(notes)

    def names(self) -> dict[int, dict[str, str | None]]:
        """The same with dtype names (``"bfloat16"``; ``None`` for an unseen stage), e.g. for JSON."""
        return {layer: {s: (dtype_name(d) if d is not None else None) for s, d in stages.items()}
                for layer, stages in self.items()}

    def summary(self) -> str:
        """One line per distinct stage pattern: ``layers 0,1,2,3: weight=bfloat16 projection=float32 ...``."""
        groups: dict[tuple, list[int]] = {}
        for layer, stages in self.names().items():
            groups.setdefault(tuple(stages.get(s) for s in STAGES), []).append(layer)
        lines = [f"layers {','.join(map(str, layers))}: " + " ".join(f"{s}={d}" for s, d in zip(STAGES, pattern))
                 for pattern, layers in groups.items()]
        return "\n".join(([f"router audit ({self.engine})"] if self.engine else []) + lines)


def check_router_audit(result: Mapping[int, Mapping[str, torch.dtype | None]],
                       expected: torch.dtype | Mapping[str, torch.dtype], *,
                       stages: Iterable[str] = STAGES) -> list[str]:
    """Failures of ``result`` against ``expected`` (one dtype for every stage, or ``{stage: dtype}``; stages
    missing from a mapping are not checked), one line per layer and stage: ``"layer 2 scores: bfloat16,
    expected float32"``; a stage that was not observed is a failure too. Empty: clean."""
    stages = tuple(stages)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise InputError(f"unknown router audit stages {unknown} (known: {list(STAGES)})")
    if isinstance(expected, torch.dtype):
        want = {s: expected for s in stages}
    elif isinstance(expected, Mapping):
        bad = [s for s in expected if s not in STAGES]
        if bad:
            raise InputError(f"unknown router audit stages {bad} (known: {list(STAGES)})")
        want = {s: expected[s] for s in stages if s in expected}
    else:
        raise InputTypeError(f"expected is a torch.dtype or {{stage: dtype}}, got {type(expected).__name__}")
    if not result:
        return ["no router was observed"]
    failures = []
    for layer in sorted(result):
        seen = result[layer]
        for stage, dtype in want.items():
            got = seen.get(stage)
            if got is None:
                failures.append(f"layer {layer} {stage}: not observed, expected {dtype_name(dtype)}")
            elif got != dtype:
                failures.append(f"layer {layer} {stage}: {dtype_name(got)}, expected {dtype_name(dtype)}")
    return failures


from .audit import first_float  # noqa: E402  (the first floating tensor of an output / arguments)


class RouterStageObserver(PatchHandle):
    """Observes the four stages of the routers ``{layer: module}`` while active (see the module docstring).

    ``ops``: extra functions to observe (:data:`OpSpec`), on top of ``torch.topk`` / ``torch.Tensor.topk``
    (stage ``topk_input``). ``weight_attr``: the router's attribute holding its weight (read at each call).
    ``note(stage, value)`` attributes a dtype (or a tensor's) to the router running now, for what a function
    patch cannot see (an adapter's own hook). ``result`` is the :class:`RouterAudit` being filled: the first
    dtype each stage shows in each router; a later, different one is added to ``result.notes``.
    """

    def __init__(self, routers: Mapping[int, torch.nn.Module], *, ops: Iterable[OpSpec] = (),
                 weight_attr: str = "weight", engine: str = ""):
        if not isinstance(routers, Mapping) or not routers:
            raise InputError("routers must be a non-empty {layer: router module} mapping")
        super().__init__(f"router-stage observer on {len(routers)} routers ({engine or 'any engine'})", "module")
        self.result = RouterAudit({layer: {} for layer in routers}, engine=engine)
        self._stack: list[int] = []
        self._weight_attr = weight_attr
        try:
            for layer, module in routers.items():
                if not isinstance(module, torch.nn.Module):
                    raise InputTypeError(f"router of layer {layer} is a {type(module).__name__}, not a module")
                self.add_hook(module.register_forward_pre_hook(self._enter(int(layer))), f"layer {layer} enter")
                self.add_hook(module.register_forward_hook(self._leave(int(layer)), always_call=True),
                              f"layer {layer} leave")
            for spec in ((torch, "topk", "topk_input", "input"), (torch.Tensor, "topk", "topk_input", "input"),
                         *ops):
                self._patch(*spec)
        except BaseException:
            self.undo()
            raise

    @property
    def current_layer(self) -> int | None:
        """The layer of the router running now (``None`` outside every router)."""
        return self._stack[-1] if self._stack else None

    @contextlib.contextmanager
    def inside(self, layer: int):
        """Count what runs in the block as router ``layer``'s (for an engine whose routing runs outside the
        router module: vLLM's scores and top-k)."""
        self._stack.append(layer)
        try:
            yield self
        finally:
            if self._stack and self._stack[-1] == layer:
                self._stack.pop()

    def note(self, stage: str, value: torch.dtype | torch.Tensor | None) -> None:
        """Record ``value``'s dtype for ``stage`` of the running router (ignored outside a router)."""
        if stage not in STAGES:
            raise InputError(f"unknown router audit stage {stage!r} (known: {list(STAGES)})")
        layer = self.current_layer
        if layer is None or value is None:
            return
        dtype = value.dtype if isinstance(value, torch.Tensor) else value
        seen = self.result[layer]
        if seen.get(stage) is None:
            seen[stage] = dtype
        elif seen[stage] != dtype:
            msg = (f"layer {layer} {stage}: also seen in {dtype_name(dtype)} (first {dtype_name(seen[stage])}, "
                   f"which is reported)")
            if msg not in self.result.notes:
                self.result.notes.append(msg)

    def _enter(self, layer: int) -> Callable:
        def hook(module, args):
            self._stack.append(layer)
            weight = getattr(module, self._weight_attr, None)
            if isinstance(weight, torch.Tensor):
                self.note("weight", weight.dtype)
        return hook

    def _leave(self, layer: int) -> Callable:
        def hook(module, args, output):
            if self._stack and self._stack[-1] == layer:
                self._stack.pop()
        return hook

    def _patch(self, owner: Any, attr: str, stage: str, which: str) -> None:
        if which not in ("input", "output"):
            raise InputError(f"an observed op reads its 'input' or 'output', got {which!r}")
        if stage not in STAGES:
            raise InputError(f"unknown router audit stage {stage!r} (known: {list(STAGES)})")
        original = getattr(owner, attr)
        observer = self

        def observed(*args, **kwargs):
            if observer._stack and which == "input":
                observer.note(stage, first_float(args[:1]) if args else first_float(list(kwargs.values())[:1]))
            out = original(*args, **kwargs)
            if observer._stack and which == "output":
                observer.note(stage, first_float(out))
            return out

        observed.__wrapped__ = original
        self.set_attr(owner, attr, observed, f"{getattr(owner, '__name__', type(owner).__name__)}.{attr} ({stage})")


def observe_routers(routers: Mapping[int, torch.nn.Module], *, ops: Iterable[OpSpec] = (),
                    weight_attr: str = "weight", engine: str = "") -> RouterStageObserver:
    """A :class:`RouterStageObserver` on ``routers`` (active until ``undo()``; a context manager): run the
    forward inside ``with observe_routers(...) as obs:`` and read ``obs.result``."""
    return RouterStageObserver(routers, ops=ops, weight_attr=weight_attr, engine=engine)
