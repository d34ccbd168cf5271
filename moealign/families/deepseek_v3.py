"""DeepSeek-V3 (``model_type="deepseek_v3"``: DeepSeek-V3 / R1 and the models that share its architecture, e.g.
Kimi K2; the embedded ``tiny_deepseek``).

Router ``DeepseekV3TopkRouter`` (transformers) / vLLM's grouped top-k: logits ``x @ W.T`` in float32, scores
``sigmoid(logits)``; the choice is made on ``scores + e_score_correction_bias`` (the per-expert bias of the
auxiliary-loss-free balancing) inside the best ``topk_group`` of ``n_group`` expert groups (a group ranked by the sum
of its two best biased scores); the gate weights are the chosen *unbiased* scores, divided by their sum
(``+ 1e-20``) when ``norm_topk_prob``, times ``routed_scaling_factor``. That is
``RouterScoring("sigmoid", renormalize=norm_topk_prob, scaling_factor=routed_scaling_factor, n_group, topk_group)``,
the bias given to :func:`~moealign.routing_replay.gates.select_topk` as ``expert_bias`` (``bias_attr`` below). The
transformers router returns its weights in float32 (``scores_in_fp32``) from float32 logits whatever the model's
dtype (``logits_in_fp32``).

**Replay semantics** (every engine; ``docs/replay.md``): the replayed experts are the recorded ids as they are (no
group limit, no bias: both decide *selection*, which the record replaces); the gate weights are the trainer's own
sigmoid scores of those experts without the bias, normalised when ``norm_topk_prob``, times
``routed_scaling_factor``; the shared expert runs on every token as always (it is not routed). The bias update of
the auxiliary-loss-free balancing counts the experts that ran, i.e. the replayed ones (the same choice as
``aux_loss="replayed"`` for the softmax routers): a trainer that updates the bias from its own top-k would balance
experts the tokens never reached.

Sparse layers: every layer from ``first_k_dense_replace`` on (transformers' rule; ``moe_layer_freq`` other than 1,
which vLLM honours and transformers ignores, is refused). Dense layers are a GLU of ``intermediate_size``.

Not covered, refused by name wherever the config is read (:func:`uncovered`): multi-token-prediction layers
(``num_nextn_predict_layers > 0``; transformers' default is 1 when config.json omits it), DeepSeek-V3.2's lightning
indexer / sparse attention (``index_topk`` in the config; ``model_type="deepseek_v32"`` is refused by
:func:`moealign.families.get_family`), a router other than ``topk_method="noaux_tc"`` / ``scoring_func="sigmoid"``
(vLLM reads these two fields and routes otherwise without them; transformers always routes as noaux_tc).

**Megatron-core** (``megatron`` below; the stock mapping in :mod:`moealign.patches.megatron.checkpoint`): MLA on the
local spec (``MLATransformerConfig``: ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim`` = ``qk_nope_head_dim``,
``qk_pos_emb_head_dim`` = ``qk_rope_head_dim``, ``v_head_dim``, the q / kv RMSNorms as ``qk_layernorm``, plain RoPE
``rope_type="rope"``; its core attention :mod:`moealign.patches.megatron.mla`), the router as
``moe_router_score_function="sigmoid"`` with ``moe_router_enable_expert_bias`` (``e_score_correction_bias`` <->
the router's ``expert_bias`` buffer), ``moe_router_num_groups`` / ``moe_router_group_topk``,
``moe_router_topk_scaling_factor``, the shared expert as ``moe_shared_expert_intermediate_size`` (no gate), the
first dense layers as ``moe_layer_freq``. Tensors: ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` ->
``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj``, ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` /
``kv_b_proj`` -> ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``, ``o_proj`` -> ``linear_proj``
(the same row layouts: per head ``[nope; rope]`` and ``[nope; v]``; at TP > 1 split by heads, ``q_a_proj`` by rows,
``kv_a_proj_with_mqa`` whole on every rank: :mod:`moealign.patches.megatron.mla`). Refused by name (:func:`megatron_unsupported`):
``rope_interleave=False`` (Megatron's MLA always de-interleaves the RoPE dims, as transformers does only with
``rope_interleave``), no q LoRA (``q_lora_rank`` null), ``attention_bias``, a group size other than
``num_experts_per_tok / topk_group = 2`` (Megatron ranks a group by its ``topk / group_topk`` best scores, DeepSeek by
its best two), ``norm_topk_prob=False`` (Megatron's sigmoid router always normalises); RoPE other than plain (YaRN) is refused by
the stock mapping. The shared experts are one GLU ``moe_intermediate_size x n_shared_experts`` wide, as in
transformers.
"""

from __future__ import annotations

from . import (
    ARCH_KEYS,
    CheckpointTensors,
    MegatronSpec,
    MoEFamily,
    RouterScoring,
    TensorPair,
    config_size,
    glu_mlp,
    routed_experts,
    size_product,
)
from ..errors import UnsupportedModelError

#: DeepSeek-V3's config keys beyond :data:`ARCH_KEYS` that change the forward (the record fingerprint hashes them).
DEEPSEEK_KEYS = ("n_shared_experts", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                 "v_head_dim", "topk_method", "num_nextn_predict_layers", "rope_interleave", "attention_bias",
                 "index_topk")

#: model types of the DeepSeek line that are not covered, and why (refused by :func:`moealign.families.get_family`).
REFUSED_MODEL_TYPES = {
    "deepseek_v32": "DeepSeek-V3.2's lightning indexer and sparse attention (DSA) are not covered: its attention "
                    "picks the keys each token attends to, which no engine pair here aligns or replays",
}

#: the transformers router's correction-bias buffer (the selection bias replay leaves alone).
BIAS_ATTR = "e_score_correction_bias"

#: What an engine derives from the checkpoint at load instead of loading it (engine-free fact; the names are the
#: ones vLLM gives them): MLA's absorbed matrices, per decoder layer, both from ``self_attn.kv_b_proj.weight``
#: (``[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``, each head's rows ``[nope; v]``). ``W_UK_T``: each
#: head's key rows, ``[heads, qk_nope_head_dim, kv_lora_rank]``; ``W_UV``: each head's value rows transposed,
#: ``[heads, kv_lora_rank, v_head_dim]``. The decode path reads them instead of ``kv_b_proj`` (the prefill path reads
#: ``kv_b_proj``), so a reload that leaves them stale corrupts decode only. A refit does not stream them: the engine
#: recomputes them after the reload, and the refit and its verifier recompute them from the held ``kv_b_proj`` and
#: compare bitwise (docs/refit.md).
DERIVED_TENSORS = (("W_UK_T", "self_attn.kv_b_proj.weight"), ("W_UV", "self_attn.kv_b_proj.weight"))


def uncovered(config) -> str | None:
    """The first feature of ``config`` moealign does not cover on this family (a text naming it), or None."""
    mtp = getattr(config, "num_nextn_predict_layers", None)
    if mtp is None:
        mtp = getattr(config, "num_mtp_layers", 1)      # transformers' default when config.json omits both
    if mtp:
        return (f"num_nextn_predict_layers={mtp} (multi-token-prediction layers: their routes are not recorded or "
                f"replayed; a checkpoint for this path sets it to 0)")
    if getattr(config, "index_topk", None) is not None:
        return "index_topk (DeepSeek-V3.2's lightning indexer / sparse attention)"
    freq = getattr(config, "moe_layer_freq", None)
    if freq not in (None, 1):
        return f"moe_layer_freq={freq!r} (vLLM honours it, transformers makes every layer from first_k_dense_replace sparse)"
    method, scoring = getattr(config, "topk_method", None), getattr(config, "scoring_func", None)
    if method != "noaux_tc" or scoring != "sigmoid":
        return (f"topk_method={method!r}, scoring_func={scoring!r} (DeepSeek-V3's router is topk_method 'noaux_tc' "
                f"with scoring_func 'sigmoid', as its config.json states; vLLM routes otherwise without them)")
    return None


def check_covered(config) -> None:
    """Raise :class:`~moealign.errors.UnsupportedModelError` naming what :func:`uncovered` finds."""
    reason = uncovered(config)
    if reason is not None:
        raise UnsupportedModelError(f"deepseek_v3: {reason} is not covered by moealign")


def router_scoring(config) -> RouterScoring:
    check_covered(config)
    n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    return RouterScoring(score="sigmoid", renormalize=bool(getattr(config, "norm_topk_prob", True)),
                         scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
                         n_group=None if n_group is None else int(n_group),
                         topk_group=None if topk_group is None else int(topk_group))


def num_experts(config) -> int:
    return int(config.n_routed_experts)


def moe_layer_pattern(config) -> tuple[int, ...]:
    """Dense below ``first_k_dense_replace``, sparse from there on (transformers' ``DeepseekV3DecoderLayer``)."""
    check_covered(config)
    first = int(getattr(config, "first_k_dense_replace", 0) or 0)
    experts = int(getattr(config, "n_routed_experts", 0) or 0)
    return tuple(int(experts > 0 and i >= first) for i in range(int(config.num_hidden_layers)))


def _attention(config) -> dict:
    """MLA's tensors relative to a decoder layer (q LoRA or a plain q projection, the joint kv down-projection with
    the decoupled RoPE key, kv up-projection, output), biases with ``attention_bias``."""
    hidden, heads = config_size(config, "hidden_size"), config_size(config, "num_attention_heads")
    q_rank, kv_rank = config_size(config, "q_lora_rank"), config_size(config, "kv_lora_rank")
    rope, nope, v = (config_size(config, n) for n in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    qk = None if rope is None or nope is None else rope + nope
    out = {}
    if q_rank:
        out.update({"self_attn.q_a_proj.weight": (q_rank, hidden), "self_attn.q_a_layernorm.weight": (q_rank,),
                    "self_attn.q_b_proj.weight": (size_product(heads, qk), q_rank)})
    else:
        out["self_attn.q_proj.weight"] = (size_product(heads, qk), hidden)
    out.update({"self_attn.kv_a_proj_with_mqa.weight": (None if kv_rank is None or rope is None else kv_rank + rope,
                                                         hidden),
                "self_attn.kv_a_layernorm.weight": (kv_rank,),
                "self_attn.kv_b_proj.weight": (size_product(heads, None if nope is None or v is None else nope + v), kv_rank),
                "self_attn.o_proj.weight": (hidden, size_product(heads, v))})
    if getattr(config, "attention_bias", False):
        if q_rank:
            out["self_attn.q_a_proj.bias"] = (q_rank,)
        out["self_attn.kv_a_proj_with_mqa.bias"] = out["self_attn.kv_a_proj_with_mqa.weight"][:1]
        out["self_attn.o_proj.bias"] = (hidden,)
    return out


def checkpoint(config) -> CheckpointTensors:
    """The safetensors tensors of a DeepSeek-V3 checkpoint (transformers names): MLA per layer, a GLU of
    ``intermediate_size`` in the first ``first_k_dense_replace`` layers, then the router (``mlp.gate.weight`` and its
    ``e_score_correction_bias``), the routed experts of ``moe_intermediate_size`` (one by one or fused) and the shared
    experts (``moe_intermediate_size x n_shared_experts`` wide)."""
    hidden, vocab = config_size(config, "hidden_size"), config_size(config, "vocab_size")
    experts, inner = config_size(config, "n_routed_experts"), config_size(config, "moe_intermediate_size")
    shared = size_product(inner, config_size(config, "n_shared_experts"))
    required = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    optional = {}
    (optional if getattr(config, "tie_word_embeddings", False) else required)["lm_head.weight"] = (vocab, hidden)
    alternatives = []
    attention = _attention(config)
    for i, sparse in enumerate(moe_layer_pattern(config)):
        p = f"model.layers.{i}."
        required.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
        required.update({p + n: s for n, s in attention.items()})
        if sparse:
            usual, fused = routed_experts("mlp", experts, inner, hidden)
            usual, fused = ({p + n: s for n, s in group.items()} for group in (usual, fused))
            required.update(usual)
            alternatives.append((usual, fused))
            required[p + "mlp.gate." + BIAS_ATTR] = (experts,)
            required.update(glu_mlp(p + "mlp.shared_experts", shared, hidden))
        else:
            required.update(glu_mlp(p + "mlp", config_size(config, "intermediate_size"), hidden))
    return CheckpointTensors(required, optional, tuple(alternatives))


# --------------------------------------------------------------------------------------------------
# Megatron-core
# --------------------------------------------------------------------------------------------------


def megatron_unsupported(config) -> str | None:
    """The first feature of ``config`` the Megatron conversion does not express (a text naming it), or None."""
    reason = uncovered(config)
    if reason is not None:
        return reason
    if not getattr(config, "rope_interleave", True):
        return ("rope_interleave=False (Megatron's MLA always de-interleaves the RoPE dims, which transformers does "
                "only with rope_interleave=True)")
    if not getattr(config, "q_lora_rank", None):
        return "q_lora_rank=None (MLA without the q LoRA: linear_q_proj is not mapped)"
    if getattr(config, "attention_bias", False):
        return "attention_bias=True (MLA's projections carry no bias in Megatron)"
    if not getattr(config, "norm_topk_prob", True) and int(config.num_experts_per_tok) > 1:
        return "norm_topk_prob=False (Megatron's sigmoid router always divides the top-k scores by their sum)"
    n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if n_group and int(n_group) > 1 and int(config.num_experts_per_tok) != 2 * int(topk_group):
        return (f"num_experts_per_tok={config.num_experts_per_tok} with topk_group={topk_group} (Megatron ranks an "
                f"expert group by the sum of its num_experts_per_tok / topk_group best scores, DeepSeek by its best "
                f"two: only num_experts_per_tok = 2 x topk_group agrees)")
    return None


def _shared_size(config) -> int:
    return int(config.moe_intermediate_size) * int(getattr(config, "n_shared_experts", 0) or 0)


def megatron_fields(config) -> dict:
    """Megatron ``MLATransformerConfig`` fields beyond the stock ones (see the module docstring; the router's
    sigmoid / groups / scaling / expert-bias fields come from :func:`router_scoring` in the stock mapping)."""
    check_covered(config)
    heads = int(config.num_attention_heads)
    fields = dict(
        multi_latent_attention=True,
        q_lora_rank=int(config.q_lora_rank),
        kv_lora_rank=int(config.kv_lora_rank),
        qk_head_dim=int(config.qk_nope_head_dim),
        qk_pos_emb_head_dim=int(config.qk_rope_head_dim),
        v_head_dim=int(config.v_head_dim),
        kv_channels=int(config.v_head_dim),
        num_query_groups=heads,
        qk_layernorm=True,                  # MLA's q_a_layernorm / kv_a_layernorm
        rope_type="rope",
        rotary_scaling_factor=1.0,          # unused by plain RoPE; MLA's softmax scale is then 1 / sqrt(qk head dim)
        mscale=1.0,
        mscale_all_dim=0.0,
        moe_router_dtype="fp32",            # transformers' router computes its logits in fp32 (logits_in_fp32)
    )
    if _shared_size(config):
        fields["moe_shared_expert_intermediate_size"] = _shared_size(config)
    return fields


def megatron_attention(config) -> tuple[TensorPair, ...]:
    """MLA's tensors (the whole attention: ``own_attention``), transformers -> Megatron, per decoder layer."""
    a, m = "self_attn.", "self_attention."
    return (TensorPair("same", (a + "q_a_proj.weight",), m + "linear_q_down_proj.weight"),
            TensorPair("same", (a + "q_a_layernorm.weight",), m + "q_layernorm.weight"),
            TensorPair("same", (a + "q_b_proj.weight",), m + "linear_q_up_proj.weight"),
            TensorPair("same", (a + "kv_a_proj_with_mqa.weight",), m + "linear_kv_down_proj.weight"),
            TensorPair("same", (a + "kv_a_layernorm.weight",), m + "kv_layernorm.weight"),
            TensorPair("same", (a + "kv_b_proj.weight",), m + "linear_kv_up_proj.weight"),
            TensorPair("same", (a + "o_proj.weight",), m + "linear_proj.weight"))


def megatron_sparse_mlp(config) -> tuple[TensorPair, ...]:
    """Per sparse layer beyond the router weight and the routed experts: the correction bias (Megatron's
    ``expert_bias`` buffer) and the shared expert (no gate)."""
    out = (TensorPair("same", ("mlp.gate." + BIAS_ATTR,), "mlp.router.expert_bias"),)
    if _shared_size(config):
        out += (TensorPair("glu", ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
                           "mlp.shared_experts.linear_fc1.weight"),
                TensorPair("same", ("mlp.shared_experts.down_proj.weight",), "mlp.shared_experts.linear_fc2.weight"))
    return out


FAMILY = MoEFamily(
    model_type="deepseek_v3",
    router_class="DeepseekV3TopkRouter",
    scoring=router_scoring,
    num_experts=num_experts,
    scores_in_fp32=True,
    logits_in_fp32=True,
    bias_attr=BIAS_ATTR,
    moe_layer_pattern=moe_layer_pattern,
    arch_keys=ARCH_KEYS + DEEPSEEK_KEYS,
    megatron=MegatronSpec(
        expert_ffn_size=lambda c: int(c.moe_intermediate_size),
        unsupported=megatron_unsupported,
        config_fields=megatron_fields,
        attention_tensors=megatron_attention,
        sparse_mlp_tensors=megatron_sparse_mlp,
        own_attention=lambda c: True,              # MLA: attention_tensors are the whole attention
    ),
    checkpoint_tensors=checkpoint,
    # --aligned (the canonical forward, moealign/precision/canonical.py): MLA non-absorbed, the sigmoid grouped router,
    # the shared expert and the first dense layers, verified bitwise vLLM (CPU_MLA) -> Megatron (local spec) at TP 1
    vllm_classes=("DeepseekV3ForCausalLM", "DeepseekV2Model", "DeepseekV2DecoderLayer", "DeepseekV2MLAAttention",
                  "MultiHeadLatentAttentionWrapper", "DeepseekV2MoE", "DeepseekV2MLP", "SharedExperts"),
    verified=frozenset({"refit", "aligned"}),
    derived_tensors=DERIVED_TENSORS,
)
