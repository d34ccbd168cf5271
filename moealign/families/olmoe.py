"""OLMoE (``model_type="olmoe"``, e.g. OLMoE-1B-7B).

Router ``OlmoeTopKRouter``: softmax over all experts in float32, top-k, divided by the sum of the chosen
probabilities when ``norm_topk_prob`` (False in the released checkpoints), weights cast back to the logits
dtype. Every decoder layer is sparse.

Megatron conversion is refused: OLMoE's q_norm / k_norm is one RMSNorm over all heads (``hidden_size`` wide,
applied before the heads are split), while Megatron's ``qk_layernorm`` normalises each head separately.
"""

from __future__ import annotations

from . import ARCH_KEYS, MegatronSpec, MoEFamily, RouterScoring, every_layer_sparse


def router_scoring(config) -> RouterScoring:
    return RouterScoring(score="softmax", renormalize=bool(getattr(config, "norm_topk_prob", False)))


def num_experts(config) -> int:
    return int(config.num_experts)


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
)
