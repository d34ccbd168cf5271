"""vLLM adapter: opening the engine (:mod:`.engine`, the CPU build's traps guarded) and the TP-invariant tree
all-reduce (:mod:`.tree_reduce`); route and kept-set recording land here next.

vLLM is imported only inside this package, lazily, through :mod:`moealign._optional`.
"""

from __future__ import annotations

from .engine import SUPPORTED_VLLM_ENGINE, open_llm, vllm_environment
from .tree_reduce import SUPPORTED_VLLM, patch_vllm_all_reduce

__all__ = ["SUPPORTED_VLLM", "SUPPORTED_VLLM_ENGINE", "open_llm", "patch_vllm_all_reduce", "vllm_environment"]
