"""moealign's ``vllm.general_plugins`` entry point: patches that must reach the processes running the model.

With ``tensor_parallel_size > 1`` (or the engine core in its own process) vLLM's model lives in worker
processes that moealign's caller cannot reach. vLLM calls every ``vllm.general_plugins`` entry point once in
each of its processes before the model is loaded; moealign registers :func:`load` there (``pyproject.toml``).
:func:`load` applies what the environment variable :data:`ENV` names, so a caller sets the variable before
opening the engine and every process (workers included) applies the same patches::

    MOEALIGN_VLLM_PATCHES=tree                 # apply_tree_reductions() (TP-invariant forward)
    MOEALIGN_VLLM_PATCHES=tree:leaf_width=16   # with a leaf width
    MOEALIGN_VLLM_PATCHES=precision:policy=fp16-fp32-router-head,tree   # apply_precision(), then the tree
    MOEALIGN_VLLM_PATCHES=canonical            # apply_canonical_forward() (every op moealign's one implementation)
    MOEALIGN_VLLM_PATCHES=canonical:skip=attention+rope   # ... with those ops left stock (negative controls)
    MOEALIGN_VLLM_PATCHES=quiet                # silence_cpu_memory_note() (open_llm adds it when the command is quiet)

Unset or empty: nothing is patched (the plugin is inert in every vLLM run that does not ask for it). An unknown
name or option raises :class:`~moealign.errors.ConfigError` naming it, in the worker that reads it (vLLM then
fails to start, with that message), never a silent no-op. :func:`loaded` returns the handles applied in this
process (``undo()`` each to restore vLLM's classes).
"""

from __future__ import annotations

import os

from ...errors import ConfigError
from ...handle import PatchHandle
from ...precision.capability import request_amx_tiles
from .patch_spec import ENV, PATCHES, parse_spec, spec_for

__all__ = ["ENV", "PATCHES", "load", "loaded", "parse_spec", "spec_for", "unload"]

_LOADED: dict[str, PatchHandle] = {}


def load() -> None:
    """The entry point vLLM calls in each of its processes: apply the patches :data:`ENV` names (idempotent:
    a patch already applied in this process is not applied twice). Every process first asks for AMX tiles
    (:func:`~moealign.precision.capability.request_amx_tiles`: a patched forward may never run the oneDNN GEMM that
    would have asked, and vLLM's AMX kernels would then die by SIGILL)."""
    specs = parse_spec(os.environ.get(ENV, ""))
    if specs:
        request_amx_tiles()
    for name, options in specs:
        if name in _LOADED and _LOADED[name].active:
            continue
        if name == "quiet":
            from .engine import silence_cpu_memory_note

            _LOADED[name] = silence_cpu_memory_note()
        elif name == "tree":
            from .tree_reduce import apply_tree_reductions

            _LOADED[name] = apply_tree_reductions(**options)
        elif name == "precision":
            if "policy" not in options:
                raise ConfigError(f"{ENV}: the precision patch needs policy=NAME")
            from .precision import apply_precision

            _LOADED[name] = apply_precision(options["policy"])
        elif name == "canonical":
            from .canonical import VLLM_OPS, apply_canonical_forward

            skip = [op for op in options.get("skip", "").split("+") if op]
            unknown = sorted(set(skip) - set(VLLM_OPS))
            if unknown:
                raise ConfigError(f"{ENV}: canonical:skip names unknown ops {unknown}; known: {list(VLLM_OPS)}")
            _LOADED[name] = apply_canonical_forward([op for op in VLLM_OPS if op not in skip])


def loaded() -> dict[str, PatchHandle]:
    """The patches :func:`load` applied in this process, by name."""
    return {name: handle for name, handle in _LOADED.items() if handle.active}


def unload(name: str) -> None:
    """Undo the patch :func:`load` applied under ``name`` in this process (nothing when it did not)."""
    handle = _LOADED.pop(name, None)
    if handle is not None:
        handle.undo()
