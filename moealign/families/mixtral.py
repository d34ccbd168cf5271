"""Mixtral (``model_type="mixtral"``, e.g. Mixtral-8x7B).

Router ``MixtralTopKRouter``: softmax over all experts in float32, top-k, always renormalised (there is no
``norm_topk_prob``), and the gate weights stay in float32 (``scores_in_fp32``). Experts:
``num_local_experts``, intermediate size ``intermediate_size``. Every decoder layer is sparse. No q/k norm,
no bias. Sliding-window attention (``sliding_window`` set) is not converted.
"""

from __future__ import annotations

from . import (
    ARCH_KEYS,
    CheckpointTensors,
    MegatronSpec,
    MoEFamily,
    RouterScoring,
    attention_biases,
    checkpoint_tensors,
    config_size,
    every_layer_sparse,
    routed_experts,
)


def router_scoring(config) -> RouterScoring:
    return RouterScoring(score="softmax", renormalize=True)


def num_experts(config) -> int:
    return int(config.num_local_experts)


def _unsupported(config) -> str | None:
    if getattr(config, "sliding_window", None) is not None:
        return f"sliding_window={config.sliding_window} (sliding-window attention)"
    if getattr(config, "attention_bias", False):
        return "attention_bias=True (bias on o_proj as well as q/k/v)"
    return None


def _sparse_mlp(config) -> tuple[dict, dict, dict]:
    usual, fused = routed_experts("block_sparse_moe", config_size(config, "num_local_experts"),
                                  config_size(config, "intermediate_size"), config_size(config, "hidden_size"),
                                  names=("w1", "w3", "w2"), fused_prefix="mlp")
    return usual, fused, {}


def checkpoint(config) -> CheckpointTensors:
    """The safetensors tensors of a Mixtral checkpoint: every layer sparse, the router
    ``block_sparse_moe.gate`` and the experts stored one by one (``block_sparse_moe.experts.{e}.w1`` / ``w3``:
    ``[intermediate_size, hidden]``, ``w2``: ``[hidden, intermediate_size]``)."""
    bias = getattr(config, "attention_bias", False)
    return checkpoint_tensors(config, attention=lambda c: attention_biases(c, output=True) if bias else {},
                              sparse_mlp=_sparse_mlp, layer_pattern=every_layer_sparse)


FAMILY = MoEFamily(
    model_type="mixtral",
    router_class="MixtralTopKRouter",
    scoring=router_scoring,
    num_experts=num_experts,
    scores_in_fp32=True,
    moe_layer_pattern=every_layer_sparse,
    arch_keys=ARCH_KEYS,
    megatron=MegatronSpec(
        expert_ffn_size=lambda c: int(c.intermediate_size),
        unsupported=_unsupported,
    ),
    checkpoint_tensors=checkpoint,
)
