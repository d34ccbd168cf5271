"""The one helper for module paths that moved: the old path stays importable for one release as a thin shim that
re-exports the new module's objects (the same objects) and warns, naming the new path."""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Callable, Iterable

__all__ = ["moved_module", "moved_names"]


def _message(old: str, new: str) -> str:
    return f"{old} moved to {new}: import it from there ({old} goes in the next release)"


def moved_module(old_globals: dict, new: ModuleType) -> None:
    """Turn the module whose globals are ``old_globals`` into a shim of ``new``: every name of ``new`` but its
    dunders (its ``__all__`` kept) bound to the same object, and a :class:`DeprecationWarning` naming the new path.
    Called once, at the shim's top level."""
    old = old_globals["__name__"]
    old_globals.update({k: v for k, v in vars(new).items() if not (k.startswith("__") and k.endswith("__"))})
    if hasattr(new, "__all__"):
        old_globals["__all__"] = list(new.__all__)
    # stacklevel 3: the importer (warnings skips the frames of importlib)
    warnings.warn(_message(old, new.__name__), DeprecationWarning, stacklevel=3)


def moved_names(namespace: dict, new: str, load: Callable[[], ModuleType], names: Iterable[str]):
    """A module ``__getattr__`` for the module whose globals are ``namespace``, whose attributes ``names`` moved to
    the module ``new`` (``load()`` imports and returns it, a visible import in the caller): the first access warns
    (:class:`DeprecationWarning` naming the new path) and binds the new module's object in ``namespace``."""
    package, names = namespace["__name__"], frozenset(names)

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(_message(f"{package}.{name}", f"{new}.{name}"), DeprecationWarning, stacklevel=2)
        namespace[name] = getattr(load(), name)
        return namespace[name]

    return __getattr__
