"""Qwen3-MoE (``model_type="qwen3_moe"``, e.g. Qwen3-30B-A3B; the embedded test model).

Router ``Qwen3MoeTopKRouter``: softmax over all experts in float32, top-k, divided by the sum of the chosen
probabilities when ``norm_topk_prob``, weights cast back to the logits dtype. Sparse layers: every
``decoder_sparse_step``-th layer not in ``mlp_only_layers``. Per-head q/k RMSNorm (``head_dim`` wide), which
is Megatron's ``qk_layernorm``.
"""

from __future__ import annotations

from . import (
    ARCH_KEYS,
    MegatronSpec,
    MoEFamily,
    RouterScoring,
    TensorPair,
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
)
