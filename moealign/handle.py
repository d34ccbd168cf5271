"""One undo handle for every patch moealign applies: :class:`PatchHandle`.

Attribute swaps, forward hooks, registry entries and ``torch.library`` overrides all come back as a
``PatchHandle`` (or a subclass that carries extra state). The verb is always ``undo()``:

* ``undo()`` restores everything the handle patched, last patched first; calling it again does nothing;
* a handle is a context manager (``with fake_quant_fp8_(model): ...`` undoes on exit, also on an exception);
* ``active`` is True until ``undo()``; ``patched`` lists what was patched (one label per entry);
* ``scope`` says how far the patch reaches (:data:`SCOPES`): ``"instance"`` (one object), ``"class"``
  (every instance of a class), ``"module"`` (functions or globals of Python modules), ``"process"``
  (process-wide registries, the dispatcher, process groups);
* ``repr(handle)`` names the target and the scope:
  ``PatchHandle(fp8 fake-quant on 42 Linear modules of Qwen3MoeForCausalLM, scope=instance, active)``.

Building one: create the handle, then register each change *as it is made* with the primitives
:meth:`~PatchHandle.set_attr`, :meth:`~PatchHandle.set_item`, :meth:`~PatchHandle.add_hook`,
:meth:`~PatchHandle.add_callback` and :meth:`~PatchHandle.add_handle` (a nested handle). A function that
fails half way calls ``handle.undo()`` before raising, and nothing is left behind.

Subclasses keep extra state (counters, configs) and register their cleanup through the same primitives
instead of overriding ``undo()``; one that does override it calls ``super().undo()``. A dataclass subclass
is declared ``@dataclass(eq=False, repr=False)`` and calls ``PatchHandle.__init__(self, target, scope)``
from ``__post_init__``.

Pure python (torch is not even imported): core packages such as :mod:`moealign.precision` use it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

from .errors import ConfigError, InputTypeError

__all__ = ["SCOPES", "PatchHandle"]

#: How far a patch reaches, narrowest first.
SCOPES = ("instance", "class", "module", "process")

_T = TypeVar("_T")
_MISSING = object()


def _describe(owner: object) -> str:
    """A short name for the owner of a patched attribute (for labels)."""
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return owner.__qualname__
    return type(owner).__name__


class PatchHandle:
    """What one patch changed, and how to put it back (see the module docstring).

    ``target`` is a human-readable description of what is patched (it can be refined after construction,
    once the patch knows, e.g., how many modules it touched); ``scope`` is one of :data:`SCOPES`.
    """

    def __init__(self, target: str = "", scope: str = "instance"):
        if scope not in SCOPES:
            raise ConfigError(f"scope must be one of {list(SCOPES)}, got {scope!r}")
        self.target = target
        self.scope = scope
        self.patched: list[str] = []
        self._steps: list[tuple[Callable[[], Any], str | None]] = []
        self._undone = False

    # ------------------------------------------------------------------------------------------ primitives
    def _push(self, undo: Callable[[], Any], label: str | None) -> None:
        self._steps.append((undo, label))
        if label is not None:
            self.patched.append(label)
        self._undone = False

    def set_attr(self, owner: object, name: str, value: Any, label: str | None = None) -> None:
        """``setattr(owner, name, value)``, undone by restoring what ``owner`` had.

        An attribute the owner had itself (in its own ``__dict__``, or any attribute of a slotted object) is
        set back to that value (the raw ``__dict__`` entry, so a class's ``staticmethod`` stays one); one the
        owner only inherited (a class's method seen from an instance, a base class's method) or did not have
        is deleted again. ``label`` defaults to ``"<owner>.<name>"``.
        """
        if hasattr(owner, "__dict__"):
            own = vars(owner)
            had = name in own
            saved = own[name] if had else None
        else:
            had = hasattr(owner, name)
            saved = getattr(owner, name, None)
        setattr(owner, name, value)

        def restore() -> None:
            if had:
                setattr(owner, name, saved)
            elif hasattr(owner, "__dict__") and name not in vars(owner):
                pass   # already gone (removed by someone else): nothing to undo
            else:
                delattr(owner, name)

        self._push(restore, f"{_describe(owner)}.{name}" if label is None else label)

    def set_item(self, mapping: MutableMapping, key: Any, value: Any, label: str | None = None) -> None:
        """``mapping[key] = value`` (a registry entry), undone by restoring the previous entry or removing it."""
        saved = mapping.get(key, _MISSING)
        mapping[key] = value

        def restore() -> None:
            if saved is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = saved

        self._push(restore, f"[{key!r}]" if label is None else label)

    def add_hook(self, removable: _T, label: str | None = None) -> _T:
        """Register a hook handle (anything with ``.remove()``, e.g. torch's ``RemovableHandle``); returns it."""
        remove = getattr(removable, "remove", None)
        if not callable(remove):
            raise InputTypeError(f"add_hook needs a handle with a remove() method, got {type(removable).__name__}")
        self._push(remove, label)
        return removable

    def add_callback(self, fn: Callable[[], Any], label: str | None = None) -> Callable[[], Any]:
        """Register any undo function (called once, with no arguments); returns it."""
        if not callable(fn):
            raise InputTypeError(f"add_callback needs a callable, got {type(fn).__name__}")
        self._push(fn, label)
        return fn

    def add_handle(self, child: PatchHandle, label: str | None = None) -> PatchHandle:
        """Nest another handle: it is undone, in order, with this one. ``label`` defaults to its target."""
        if not isinstance(child, PatchHandle):
            raise InputTypeError(f"add_handle needs a PatchHandle, got {type(child).__name__}")
        self._push(child.undo, (child.target or type(child).__name__) if label is None else label)
        return child

    # ------------------------------------------------------------------------------------------ the verb
    def undo(self) -> None:
        """Restore everything, last patched first. Idempotent.

        Every step runs even when an earlier one raises; the first error is raised at the end.
        """
        error: BaseException | None = None
        steps = self._steps
        while steps:
            fn, _ = steps.pop()        # popped before it runs: a step never runs twice
            try:
                fn()
            except BaseException as exc:   # noqa: BLE001 - re-raised below, after the other steps
                if error is None:
                    error = exc
        self.patched.clear()
        self._undone = True
        if error is not None:
            raise error

    @property
    def active(self) -> bool:
        """True while something is patched (before :meth:`undo`)."""
        return bool(self._steps)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else ("undone" if self._undone else "nothing patched")
        return f"{type(self).__name__}({self.target or '?'}, scope={self.scope}, {state})"
