"""vLLM adapter. Today: the TP-invariant tree all-reduce (:mod:`.tree_reduce`); the rollout engine lands here next.

vLLM is imported only inside this package, lazily, through :mod:`moealign._optional`.
"""

from __future__ import annotations

from .tree_reduce import SUPPORTED_VLLM, patch_vllm_all_reduce

__all__ = ["SUPPORTED_VLLM", "patch_vllm_all_reduce"]
