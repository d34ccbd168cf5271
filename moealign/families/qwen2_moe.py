"""Qwen2-MoE (``model_type="qwen2_moe"``, e.g. Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Router ``Qwen2MoeTopKRouter``: softmax over all experts in float32, top-k, divided by the sum of the chosen
probabilities when ``norm_topk_prob`` (False in the released checkpoints), weights cast back to the logits
dtype. Sparse layers: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``. q/k/v bias
(``qkv_bias``), no q/k norm, and a shared expert whose output is scaled by ``sigmoid(x @ shared_expert_gate.T)``
(Megatron's ``moe_shared_expert_gate``). Sliding-window attention (``use_sliding_window``) is not converted.
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
    glu_mlp,
    routed_experts,
    sparse_by_step,
)


def router_scoring(config) -> RouterScoring:
    return RouterScoring(score="softmax", renormalize=bool(getattr(config, "norm_topk_prob", False)))


def num_experts(config) -> int:
    return int(config.num_experts)


def _qkv_bias(config) -> bool:
    return bool(getattr(config, "qkv_bias", False))


def _shared_size(config) -> int:
    return int(getattr(config, "shared_expert_intermediate_size", 0) or 0)


def _unsupported(config) -> str | None:
    if getattr(config, "use_sliding_window", False):
        return "use_sliding_window=True (sliding-window attention)"
    return None      # attention_bias is not a Qwen2-MoE field (o_proj has no bias; q/k/v follow qkv_bias)


def _config_fields(config) -> dict:
    fields = {"add_qkv_bias": _qkv_bias(config)}
    if _shared_size(config):
        fields.update(moe_shared_expert_intermediate_size=_shared_size(config), moe_shared_expert_gate=True)
    return fields


def _attention_tensors(config) -> tuple[TensorPair, ...]:
    if not _qkv_bias(config):
        return ()
    return (TensorPair("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                       "self_attention.linear_qkv.bias"),)


def _sparse_mlp_tensors(config) -> tuple[TensorPair, ...]:
    if not _shared_size(config):
        return ()
    return (TensorPair("glu", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
                       "mlp.shared_experts.linear_fc1.weight"),
            TensorPair("same", ("mlp.shared_expert.down_proj.weight",), "mlp.shared_experts.linear_fc2.weight"),
            TensorPair("same", ("mlp.shared_expert_gate.weight",), "mlp.shared_experts.gate_weight"))


def _sparse_mlp(config) -> tuple[dict, dict, dict]:
    hidden = config_size(config, "hidden_size")
    usual, fused = routed_experts("mlp", config_size(config, "num_experts"),
                                  config_size(config, "moe_intermediate_size"), hidden)
    shared = config_size(config, "shared_expert_intermediate_size")
    return usual, fused, {**glu_mlp("mlp.shared_expert", shared, hidden), "mlp.shared_expert_gate.weight": (1, hidden)}


def _optional(config) -> bool:
    """A zero-width shared expert: transformers still saves it (``[0, hidden]`` tensors), other tools may not."""
    return config_size(config, "shared_expert_intermediate_size") == 0


def checkpoint(config) -> CheckpointTensors:
    """The safetensors tensors of a Qwen2-MoE checkpoint: q/k/v biases (``qkv_bias``, transformers' default True),
    routed experts of ``moe_intermediate_size``, the shared expert (``shared_expert_intermediate_size``) and its
    gate ``[1, hidden]``, dense layers of ``intermediate_size``."""
    bias = getattr(config, "qkv_bias", True)
    tensors = checkpoint_tensors(config, attention=lambda c: attention_biases(c, output=False) if bias else {},
                                 sparse_mlp=_sparse_mlp)
    if not _optional(config):
        return tensors
    shared = {n: s for n, s in tensors.required.items() if ".mlp.shared_expert" in n}
    return CheckpointTensors({n: s for n, s in tensors.required.items() if n not in shared},
                             {**tensors.optional, **shared}, tensors.alternatives)


FAMILY = MoEFamily(
    model_type="qwen2_moe",
    router_class="Qwen2MoeTopKRouter",
    scoring=router_scoring,
    num_experts=num_experts,
    scores_in_fp32=False,
    moe_layer_pattern=sparse_by_step,
    arch_keys=ARCH_KEYS,
    megatron=MegatronSpec(
        expert_ffn_size=lambda c: int(c.moe_intermediate_size),
        unsupported=_unsupported,
        config_fields=_config_fields,
        attention_tensors=_attention_tensors,
        sparse_mlp_tensors=_sparse_mlp_tensors,
    ),
    checkpoint_tensors=checkpoint,
)
