"""OLMoE (``model_type="olmoe"``, e.g. OLMoE-1B-7B).

Router ``OlmoeTopKRouter``: softmax over all experts in float32, top-k, divided by the sum of the chosen
probabilities when ``norm_topk_prob`` (False in the released checkpoints), weights cast back to the logits
dtype. Every decoder layer is sparse.

Megatron conversion is refused: OLMoE's q_norm / k_norm is one RMSNorm over all heads (``hidden_size`` wide,
applied before the heads are split), while Megatron's ``qk_layernorm`` normalises each head separately.
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
    head_dim,
    routed_experts,
)


def router_scoring(config) -> RouterScoring:
    return RouterScoring(score="softmax", renormalize=bool(getattr(config, "norm_topk_prob", False)))


def num_experts(config) -> int:
    return int(config.num_experts)


def _sparse_mlp(config) -> tuple[dict, dict, dict]:
    usual, fused = routed_experts("mlp", config_size(config, "num_experts"), config_size(config, "intermediate_size"),
                                  config_size(config, "hidden_size"))
    return usual, fused, {}


def _attention_checkpoint(config) -> dict:
    heads = config_size(config, "num_attention_heads")
    kv, dim = config_size(config, "num_key_value_heads") or heads, head_dim(config)
    extra = {"self_attn.q_norm.weight": (None if heads is None or dim is None else heads * dim,),
             "self_attn.k_norm.weight": (None if kv is None or dim is None else kv * dim,)}
    if getattr(config, "attention_bias", False):
        extra.update(attention_biases(config, output=True))
    return extra


def checkpoint(config) -> CheckpointTensors:
    """The safetensors tensors of an OLMoE checkpoint: full-width q/k norms (``heads x head_dim``, ``kv heads x
    head_dim``), every layer sparse, experts of ``intermediate_size``."""
    return checkpoint_tensors(config, attention=_attention_checkpoint, sparse_mlp=_sparse_mlp,
                              layer_pattern=every_layer_sparse)


FAMILY = MoEFamily(
    model_type="olmoe",
    router_class="OlmoeTopKRouter",
    scoring=router_scoring,
    num_experts=num_experts,
    scores_in_fp32=False,
    moe_layer_pattern=every_layer_sparse,
    arch_keys=ARCH_KEYS,
    megatron=MegatronSpec(
        refused="full-width q_norm/k_norm (one RMSNorm over all heads; Megatron's qk_layernorm normalises each "
                "head separately)",
    ),
    checkpoint_tensors=checkpoint,
)
