"""The undo handle the attribute-swapping patches share: set attributes, remember what was there, restore."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AttributePatches:
    """Attributes set on modules, classes or instances, restored by :meth:`undo` (also a context manager).

    An attribute the owner had itself is restored; one it only inherited (a class's method seen from an
    instance, a base class's method) or did not have is deleted again.
    """

    _saved: list[tuple[object, str, object, bool]] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)

    def _set(self, owner, name: str, value, label: str | None = None) -> None:
        had = name in vars(owner) if hasattr(owner, "__dict__") else hasattr(owner, name)
        self._saved.append((owner, name, getattr(owner, name, None), had))
        setattr(owner, name, value)
        if label is not None:
            self.patched.append(label)

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def undo(self) -> None:
        """Restore every patched attribute, last patched first."""
        for owner, name, value, had in reversed(self._saved):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        self._saved.clear()
        self.patched.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.undo()
