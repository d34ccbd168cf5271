"""vLLM adapter: opening the engine (:mod:`.engine`, the CPU build's traps guarded), recording routes, kept sets
and processed log-probs inside it (:mod:`.rollout`), forcing recorded routes in its forwards (:mod:`.replay`), and the
TP-invariant tree all-reduce (:mod:`.tree_reduce`).

vLLM is imported only inside this package, lazily, through :mod:`moealign._optional`.
"""

from __future__ import annotations

from .engine import SUPPORTED_VLLM_ENGINE, open_llm, vllm_environment, vllm_version
from .harvest import record_from_outputs
from .replay import RouteForcer, force_routes, score_with_routes, vllm_router_scoring
from .rollout import VllmRecorder, generate_with_record, model_runner, moe_routers, record_meta
from .tree_reduce import SUPPORTED_VLLM, patch_vllm_all_reduce

__all__ = ["SUPPORTED_VLLM", "SUPPORTED_VLLM_ENGINE", "RouteForcer", "VllmRecorder", "force_routes",
           "generate_with_record", "model_runner", "moe_routers", "open_llm", "patch_vllm_all_reduce",
           "record_from_outputs", "record_meta", "score_with_routes", "vllm_environment", "vllm_router_scoring",
           "vllm_version"]
