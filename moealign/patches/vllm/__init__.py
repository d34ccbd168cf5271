"""vLLM adapter: opening the engine (:mod:`.engine`, the CPU build's traps guarded), recording routes, kept sets
and processed log-probs inside it, in every worker (:mod:`.rollout`), converting vLLM 0.33's own routed-experts
and sampling-mask outputs into the same record (:mod:`.harvest`), forcing recorded routes in its forwards
(:mod:`.replay`), precision policies vLLM's arguments cannot express, with an audit (:mod:`.precision`), the
TP-invariant tree forward (:mod:`.tree_reduce`), and the ``vllm.general_plugins`` entry point that applies these
patches in vLLM's worker processes (:mod:`.plugin`).

vLLM is imported only inside this package, lazily, through :mod:`moealign._optional`.
"""

from __future__ import annotations

from .engine import SUPPORTED_VLLM_ENGINE, open_llm, vllm_environment, vllm_version
from .harvest import record_from_outputs
from .precision import apply_precision, audit_vllm
from .replay import RouteForcer, force_routes, score_with_routes, vllm_router_scoring
from .rollout import VllmRecorder, generate_with_record, model_runner, moe_routers, record_meta
from .tree_reduce import SUPPORTED_VLLM, apply_tree_reductions, patch_vllm_all_reduce

__all__ = ["SUPPORTED_VLLM", "SUPPORTED_VLLM_ENGINE", "RouteForcer", "VllmRecorder", "apply_precision",
           "apply_tree_reductions", "audit_vllm", "force_routes", "generate_with_record", "model_runner",
           "moe_routers", "open_llm", "patch_vllm_all_reduce", "record_from_outputs", "record_meta",
           "score_with_routes", "vllm_environment", "vllm_router_scoring", "vllm_version"]
