"""Version checks shared by the engine adapters: an adapter refuses an engine version it was not written for."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .._optional import require
from ..errors import UnsupportedEngineError

__all__ = ["UnsupportedEngineError", "check_engine_version", "engine_version", "require_attr"]


def engine_version(module_name: str, why: str) -> tuple[object, Version]:
    """Import ``module_name`` (ImportError naming ``why`` if it fails) and return it with its version."""
    module = require(module_name, why)
    raw = getattr(module, "__version__", None)
    if raw is None:
        from importlib.metadata import version

        raw = version(module_name.split(".")[0].replace("_", "-"))
    return module, Version(str(raw))


def check_engine_version(name: str, version: Version, supported: str) -> None:
    """Raise :class:`UnsupportedEngineError` unless ``version`` is in the specifier ``supported``."""
    spec = SpecifierSet(supported)
    if not spec.contains(version, prereleases=True):
        raise UnsupportedEngineError(
            f"{name} {version} is not supported by this moealign adapter (supported: {name}{supported}); "
            f"the patch points it targets may differ, so nothing was patched")


def require_attr(owner, name: str, where: str):
    """``getattr(owner, name)``, or :class:`UnsupportedEngineError` naming what is missing: a patch point this
    engine version does not have, so nothing is patched."""
    if not hasattr(owner, name):
        raise UnsupportedEngineError(f"{where} has no attribute {name!r}; this engine version's layout differs "
                                     f"from what moealign patches, nothing was patched")
    return getattr(owner, name)
