"""One way to import optional backends (engines, PyYAML, cupy, NVML).

Any exception at import counts as "not available" and is reported with its reason: transformer-engine
raises RuntimeError (not ImportError) when its CUDA libraries are missing, and a half-installed engine
can raise almost anything.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from .errors import MissingDependencyError

__all__ = ["Backend", "probe", "require", "BACKENDS"]

# name shown to users -> (module to import, distribution whose version to report)
BACKENDS = {
    "transformers": ("transformers", "transformers"),
    "megatron-core": ("megatron.core", "megatron-core"),
    "vllm": ("vllm", "vllm"),
    "transformer-engine": ("transformer_engine", "transformer-engine"),
    "cupy": ("cupy", None),
    "triton": ("triton", "triton"),
}


@dataclass(frozen=True)
class Backend:
    name: str
    module: ModuleType | None
    version: str | None
    error: str | None

    @property
    def available(self) -> bool:
        return self.module is not None


def _dist_version(dist: str | None, module: ModuleType) -> str | None:
    version = getattr(module, "__version__", None)
    if version is None and dist is not None:
        try:
            from importlib.metadata import version as _v

            version = _v(dist)
        except Exception:
            version = None
    if version is None:
        try:
            from importlib.metadata import packages_distributions
            from importlib.metadata import version as _v

            top = module.__name__.split(".")[0]
            dists = packages_distributions().get(top) or []
            version = _v(dists[0]) if dists else None
        except Exception:
            version = None
    return str(version) if version is not None else None


def probe(module_name: str, dist: str | None = None, name: str | None = None) -> Backend:
    """Import ``module_name``; never raises. The error string says why it is unavailable."""
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:  # noqa: BLE001 - any failure at import means "not available"
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        reason = f"{type(exc).__name__}: {exc}".strip()
        first = reason.splitlines()[0] if reason else type(exc).__name__
        return Backend(name or module_name, None, None, first[:300])
    return Backend(name or module_name, module, _dist_version(dist, module), None)


def require(module_name: str, why: str) -> ModuleType:
    """Import or raise ImportError that names the purpose and the underlying reason."""
    backend = probe(module_name)
    if backend.module is None:
        raise MissingDependencyError(f"{why}; import {module_name!r} failed: {backend.error}")
    return backend.module
