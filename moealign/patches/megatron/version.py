"""The Megatron-core versions the adapter supports, checked on import of every entry point."""

from __future__ import annotations

import warnings

from .._version import check_engine_version, engine_version

SUPPORTED_MEGATRON = ">=0.16.1,<0.20"

#: Warnings Megatron-core issues on every import or config on a machine without transformer-engine / Apex (its
#: documented fallbacks to plain torch, which moealign uses on purpose: the local spec) and for its own default
#: ``cuda_graph_scope="full"``: expected, harmless, and not about the user's run.
FALLBACK_WARNINGS = (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                     r"full scope is deprecated")


def megatron_version():
    """Import megatron.core and check its version against :data:`SUPPORTED_MEGATRON`."""
    _, version = engine_version("megatron.core", "moealign.patches.megatron needs megatron-core")
    check_engine_version("megatron-core", version, SUPPORTED_MEGATRON)
    return version


def quiet_fallback_warnings() -> None:
    """Hide :data:`FALLBACK_WARNINGS` (only those, only from Megatron's own modules) for the rest of this process:
    the commands call it unless ``-v`` is given. Every other warning is shown as before."""
    for message in FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron\.")
