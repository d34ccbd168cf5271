"""Qwen3-MoE (``model_type="qwen3_moe"``, e.g. Qwen3-30B-A3B; the embedded test model).

Router ``Qwen3MoeTopKRouter``: softmax over all experts in float32, top-k, divided by the sum of the chosen
probabilities when ``norm_topk_prob``, weights cast back to the logits dtype. Sparse layers: every
``decoder_sparse_step``-th layer not in ``mlp_only_layers``. Per-head q/k RMSNorm (``head_dim`` wide), which
is Megatron's ``qk_layernorm``.
"""

from __future__ import annotations

from . import (
    ARCH_KEYS,
    CheckpointTensors,
    MegatronSpec,
    MoEFamily,
    RouterScoring,
    TensorPair,
    attention_biases,
    checkpoint_tensors,
    config_size,
    head_dim,
    routed_experts,
    sparse_by_step,
)


def router_scoring(config) -> RouterScoring:
    return RouterScoring(score="softmax", renormalize=bool(getattr(config, "norm_topk_prob", False)))


def num_experts(config) -> int:
    return int(config.num_experts)


def _unsupported(config) -> str | None:
    if getattr(config, "attention_bias", False):
        return "attention_bias=True (bias on o_proj as well as q/k/v)"
    return None


def _attention_tensors(config) -> tuple[TensorPair, ...]:
    return (TensorPair("same", ("self_attn.q_norm.weight",), "self_attention.q_layernorm.weight"),
            TensorPair("same", ("self_attn.k_norm.weight",), "self_attention.k_layernorm.weight"))


def _sparse_mlp(config) -> tuple[dict, dict, dict]:
    usual, fused = routed_experts("mlp", config_size(config, "num_experts"),
                                  config_size(config, "moe_intermediate_size"), config_size(config, "hidden_size"))
    return usual, fused, {}


def _attention_checkpoint(config) -> dict:
    extra = {"self_attn.q_norm.weight": (head_dim(config),), "self_attn.k_norm.weight": (head_dim(config),)}
    if getattr(config, "attention_bias", False):
        extra.update(attention_biases(config, output=True))
    return extra


def checkpoint(config) -> CheckpointTensors:
    """The safetensors tensors of a Qwen3-MoE checkpoint: per-head q/k norms (``head_dim``), routed experts of
    ``moe_intermediate_size``, dense layers (``mlp_only_layers``) of ``intermediate_size``."""
    return checkpoint_tensors(config, attention=_attention_checkpoint, sparse_mlp=_sparse_mlp)


FAMILY = MoEFamily(
    model_type="qwen3_moe",
    router_class="Qwen3MoeTopKRouter",
    scoring=router_scoring,
    num_experts=num_experts,
    scores_in_fp32=False,
    moe_layer_pattern=sparse_by_step,
    arch_keys=ARCH_KEYS,
    megatron=MegatronSpec(
        expert_ffn_size=lambda c: int(c.moe_intermediate_size),
        unsupported=_unsupported,
        config_fields=lambda c: {"qk_layernorm": True},
        attention_tensors=_attention_tensors,
    ),
    checkpoint_tensors=checkpoint,
    vllm_classes=("Qwen3MoeForCausalLM", "Qwen3MoeModel", "Qwen3MoeDecoderLayer", "Qwen3MoeAttention",
                  "Qwen3MoeSparseMoeBlock"),
    verified=frozenset({"aligned", "vllm_digests", "refit"}),
)
