"""The Megatron-core versions the adapter supports, checked on import of every entry point."""

from __future__ import annotations

from .._version import check_engine_version, engine_version

SUPPORTED_MEGATRON = ">=0.16.1,<0.20"


def megatron_version():
    """Import megatron.core and check its version against :data:`SUPPORTED_MEGATRON`."""
    _, version = engine_version("megatron.core", "moealign.patches.megatron needs megatron-core")
    check_engine_version("megatron-core", version, SUPPORTED_MEGATRON)
    return version
