"""Checkpoint conversion between transformers MoE models and Megatron-core ``GPTModel`` (local spec).

Families: Qwen3-MoE (the embedded model), Qwen2-MoE (shared expert with a sigmoid gate, qkv bias, dense
layers via ``mlp_only_layers`` / ``decoder_sparse_step``) and Mixtral (without sliding window). OLMoE is
refused: its q/k RMSNorm spans all heads (``hidden_size`` wide), Megatron's ``qk_layernorm`` is per head.
What differs between families (expert size, layer pattern, extra tensors, extra config fields, refusals) is
read from each family's ``megatron`` section in :mod:`moealign.families`; this module holds the stock mapping.
::

    from moealign.patches.megatron import checkpoint as mc

    config = mc.megatron_config_from_hf(hf_model.config)           # TransformerConfig (CPU-safe on CPU)
    gpt = mc.build_megatron_from_hf(hf_model)                      # GPTModel, weights loaded (TP slices)
    hf_sd = mc.hf_state_dict_from_megatron(gpt, hf_model.config)   # the reverse direction (TP=1)

Megatron side: ``get_gpt_decoder_block_spec(config, use_transformer_engine=False)`` (local modules,
``SequentialMLP`` experts, ``torch.nn.RMSNorm``), so the same model builds on CPU and GPU without
transformer-engine. Layout facts the mapping relies on:

* ``linear_qkv.weight`` (and ``.bias``) is interleaved per query group: for each of the G kv heads, the
  q heads that share it, then its k head, then its v head (``[G, (heads/G + 2) * head_dim, hidden]``).
* GLU ``linear_fc1.weight`` is ``[gate; up]``; transformers 5 stores experts fused as
  ``experts.gate_up_proj [E, 2I, H]`` (gate first), ``experts.down_proj [E, H, I]``.
* ``mlp.router.weight [E, H]`` = ``mlp.gate.weight``; Qwen2-MoE's ``shared_expert_gate.weight [1, H]`` =
  ``mlp.shared_experts.gate_weight`` (both apply ``sigmoid(x @ w.T)`` to the shared expert output).
* Routing: Megatron's default (softmax over the top-k logits) equals softmax -> top-k -> renormalise
  (``norm_topk_prob=True``, Mixtral); ``norm_topk_prob=False`` maps to ``moe_router_pre_softmax=True``.

Loading checks that every transformers tensor is consumed and every Megatron parameter filled, and
raises :class:`CheckpointMismatchError` naming the missing / unused keys. With tensor parallelism the
full tensors are sliced by each parameter's own ``partition_dim`` (GLU ``fc1`` slices gate and up
separately; ``linear_qkv`` slices whole query groups); expert and pipeline parallelism are refused.

mbridge / Megatron-Bridge (evaluated from the mbridge 0.15.1 and megatron-bridge 0.3.1 wheels):
mbridge builds the transformer-engine layer spec (``use_transformer_engine=True``, TE fused names such as
``linear_qkv.layer_norm_weight``), so its mapping does not fit the local spec and its import needs einops;
Megatron-Bridge requires transformer-engine and ``transformers<5``. Neither runs here, hence this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import CheckpointMismatchError, UnsupportedConversionError
from ...families import FAMILIES, MoEFamily, TensorPair
from .version import megatron_version

__all__ = [
    "convertible_families",
    "UnsupportedConversionError",
    "CheckpointMismatchError",
    "megatron_config_from_hf",
    "megatron_layer_spec",
    "build_megatron_from_hf",
    "load_hf_into_megatron",
    "hf_state_dict_from_megatron",
    "iter_hf_tensors_from_megatron",
    "megatron_state_dict_from_hf",
]


def convertible_families() -> tuple[str, ...]:
    """model_types of the registered families with a Megatron conversion, in registration order."""
    return tuple(t for t, f in FAMILIES.items() if f.megatron is not None and f.megatron.convertible)


def __getattr__(name: str):
    if name == "CONVERTIBLE_FAMILIES":          # the former constant, now live: follows register_family()
        return convertible_families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------


def _get(config, name, default=None):
    return getattr(config, name, default)


def _unsupported(model_type: str, feature: str) -> UnsupportedConversionError:
    return UnsupportedConversionError(f"{model_type}: {feature} cannot be expressed by Megatron-core's local spec")


def _head_dim(config) -> int:
    head_dim = _get(config, "head_dim")
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def _rope_theta(config) -> float:
    params = _get(config, "rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _unsupported(config.model_type, f"rope_type={rope_type!r} (only plain RoPE maps to rotary_base)")
    theta = params.get("rope_theta", _get(config, "rope_theta"))
    if theta is None:
        raise UnsupportedConversionError(f"{config.model_type}: the config has no rope_theta")
    return float(theta)


def _family(config) -> MoEFamily:
    """The registered family of ``config``, if it has a Megatron conversion (else
    :class:`UnsupportedConversionError` with the family's reason)."""
    model_type = _get(config, "model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    spec = family.megatron if family is not None else None
    if spec is not None and not spec.convertible:
        raise _unsupported(model_type, spec.refused)
    if spec is None:
        raise UnsupportedConversionError(f"model_type {model_type!r} has no Megatron conversion (supported: "
                                         f"{list(convertible_families())})")
    return family


def _moe_layer_pattern(config) -> list[int]:
    """1 for a sparse (MoE) decoder layer, 0 for a dense MLP layer, as transformers decides it."""
    return [int(bool(s)) for s in _family(config).moe_layer_pattern(config)]


def _num_experts(config) -> int:
    return int(_family(config).num_experts(config))


def _renormalize(config) -> bool:
    """Whether the family's router divides the top-k probabilities by their sum (``norm_topk_prob``)."""
    scoring = _family(config).scoring(config)
    if scoring.score != "softmax" or scoring.grouped or scoring.scaling_factor != 1.0:
        raise _unsupported(config.model_type, f"router scoring {scoring} (only softmax -> top-k, optionally "
                                              f"renormalised, is mapped)")
    return scoring.renormalize


def _check_expressible(config) -> MoEFamily:
    """Raise :class:`UnsupportedConversionError` naming the first feature the local spec cannot express;
    return the family."""
    family = _family(config)
    model_type = family.model_type
    if _get(config, "hidden_act", "silu") != "silu":
        raise _unsupported(model_type, f"hidden_act={config.hidden_act!r} (only SiLU-gated MLPs are mapped)")
    feature = family.megatron.unsupported(config)
    if feature:
        raise _unsupported(model_type, feature)
    layer_types = _get(config, "layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise _unsupported(model_type, f"layer_types={sorted(set(layer_types))} (sliding-window attention)")
    renormalize = _renormalize(config)          # also refuses a scoring other than softmax -> top-k
    if int(config.num_experts_per_tok) == 1 and renormalize:
        raise _unsupported(model_type, "top-1 routing with norm_topk_prob=True (a weight of exactly 1.0)")
    if _get(config, "num_key_value_heads") and config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedConversionError(f"{model_type}: num_attention_heads={config.num_attention_heads} is not a "
                                         f"multiple of num_key_value_heads={config.num_key_value_heads}")
    _rope_theta(config)
    return family


_CPU_SETTINGS = dict(
    use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
    masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
    moe_token_dispatcher_type="allgather", moe_permute_fusion=False,
)


def megatron_config_from_hf(hf_config, *, params_dtype: torch.dtype = torch.float32, cpu: bool | None = None,
                            **overrides):
    """The Megatron ``TransformerConfig`` equivalent to a transformers MoE config.

    Maps RMSNorm + eps, SiLU GLU, query groups, ``kv_channels`` (head_dim), per-head q/k norm (Qwen3),
    q/k/v bias (Qwen2), the router (softmax; ``norm_topk_prob=False`` -> ``moe_router_pre_softmax``),
    the Qwen2 shared expert with its sigmoid gate, dense layers (``moe_layer_freq``), dropout off as in
    transformers' configs, and ``moe_enable_routing_replay=True``. Load balancing: ``aux_loss`` with
    ``router_aux_loss_coef`` when the config trains with it (``output_router_logits``), else ``none``
    (Megatron averages the aux loss per layer; transformers pools all layers: not bitwise the same loss).
    ``cpu`` (default: no CUDA, or the CPU mode active) adds the CPU-safe settings: CPU initialisation, every
    fusion off, allgather dispatcher. ``overrides`` are applied last. The rotary base is not a config field: see
    :func:`build_megatron_from_hf`. Raises :class:`UnsupportedConversionError` naming the feature a
    family uses that the local spec cannot express.
    """
    megatron_version()
    from megatron.core.transformer.transformer_config import TransformerConfig

    family = _check_expressible(hf_config)
    model_type = family.model_type
    if cpu is None:         # the CPU mode pins the CPU even where CUDA is available
        from .world import megatron_cpu_mode_active

        cpu = not torch.cuda.is_available() or megatron_cpu_mode_active()
    cpu = bool(cpu)
    pattern = _moe_layer_pattern(hf_config)
    if not any(pattern):
        raise UnsupportedConversionError(f"{model_type}: no sparse layer (mlp_only_layers / decoder_sparse_step)")
    expert_ffn = family.megatron.expert_ffn_size(hf_config)
    train_aux = bool(_get(hf_config, "output_router_logits", False))
    aux_coeff = float(_get(hf_config, "router_aux_loss_coef", 0.0) or 0.0) if train_aux else 0.0
    kw = dict(
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        num_attention_heads=int(hf_config.num_attention_heads),
        num_query_groups=int(_get(hf_config, "num_key_value_heads") or hf_config.num_attention_heads),
        kv_channels=_head_dim(hf_config),
        ffn_hidden_size=int(hf_config.intermediate_size),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        hidden_dropout=0.0,
        attention_dropout=float(_get(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(_get(hf_config, "initializer_range", 0.02)),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        num_moe_experts=_num_experts(hf_config),
        moe_router_topk=int(hf_config.num_experts_per_tok),
        moe_ffn_hidden_size=int(expert_ffn),
        moe_layer_freq=pattern,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not _renormalize(hf_config),
        moe_router_load_balancing_type="aux_loss" if aux_coeff else "none",
        moe_aux_loss_coeff=aux_coeff,
        moe_grouped_gemm=False,
        moe_router_fusion=False,
        moe_enable_routing_replay=True,
    )
    kw.update(family.megatron.config_fields(hf_config))      # q/k norm, q/k/v bias, shared expert, ...
    jitter = float(_get(hf_config, "router_jitter_noise", 0.0) or 0.0)
    if jitter:
        # training-only noise U(1-eps, 1+eps) on the router input (transformers also feeds it to the experts)
        kw["moe_input_jitter_eps"] = jitter
    if cpu:
        kw.update(_CPU_SETTINGS)
    kw.update(overrides)
    return TransformerConfig(**kw)


def megatron_layer_spec(config):
    """The local (transformer-engine-free) decoder block spec for ``config``: dense and MoE layers as
    ``config.moe_layer_freq`` says."""
    megatron_version()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)


def build_megatron_from_hf(hf_model: torch.nn.Module, *, parallel_output: bool = True, **config_kwargs):
    """Build a Megatron ``GPTModel`` equivalent to ``hf_model`` and load its weights (this TP rank's slices).

    Needs ``megatron.core.parallel_state`` initialised (expert and pipeline parallel size 1).
    ``config_kwargs`` go to :func:`megatron_config_from_hf`. ``parallel_output=True`` (Megatron's default)
    returns vocab-parallel logits when TP > 1.
    """
    megatron_version()
    from megatron.core.models.gpt.gpt_model import GPTModel

    hf_config = hf_model.config
    config = megatron_config_from_hf(hf_config, **config_kwargs)
    theta = _rope_theta(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=megatron_layer_spec(config),
        vocab_size=int(hf_config.vocab_size),
        max_sequence_length=int(_get(hf_config, "max_position_embeddings", 4096)),
        share_embeddings_and_output_weights=bool(_get(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        parallel_output=parallel_output,
    )
    load_hf_into_megatron(model, hf_model.state_dict(), hf_config)
    return model


# --------------------------------------------------------------------------------------------------
# the tensor mapping
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """``hf_keys`` <-> ``mcore_keys``: ``to_mcore(list of HF tensors) -> list of Megatron tensors`` and back."""

    hf_keys: tuple[str, ...]
    mcore_keys: tuple[str, ...]
    to_mcore: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    to_hf: Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _same(hf: str, mc: str) -> _Group:
    return _Group((hf,), (mc,), lambda t: [t[0]], lambda t: [t[0].clone()])


def _glu(hf_gate: str, hf_up: str, mc: str) -> _Group:
    def to_hf(t):
        gate, up = t[0].chunk(2, dim=0)
        return [gate.clone(), up.clone()]

    return _Group((hf_gate, hf_up), (mc,), lambda t: [torch.cat(t, dim=0)], to_hf)


def _qkv(hf_config, q: str, k: str, v: str, mc: str) -> _Group:
    """Per query group: [q heads of the group, k, v] (weights ``[rows, hidden]`` or biases ``[rows]``)."""
    groups = int(_get(hf_config, "num_key_value_heads") or hf_config.num_attention_heads)
    per_group = hf_config.num_attention_heads // groups
    head_dim = _head_dim(hf_config)

    def to_mcore(t):
        q_, k_, v_ = t
        tail = q_.shape[1:]
        parts = (q_.reshape(groups, per_group * head_dim, *tail), k_.reshape(groups, head_dim, *tail),
                 v_.reshape(groups, head_dim, *tail))
        return [torch.cat(parts, dim=1).reshape(groups * (per_group + 2) * head_dim, *tail)]

    def to_hf(t):
        qkv = t[0]
        tail = qkv.shape[1:]
        q_, k_, v_ = qkv.reshape(groups, (per_group + 2) * head_dim, *tail).split(
            [per_group * head_dim, head_dim, head_dim], dim=1)
        return [x.reshape(-1, *tail).clone() for x in (q_, k_, v_)]

    return _Group((q, k, v), (mc,), to_mcore, to_hf)


def _experts(hf_gate_up: str, hf_down: str, mc_prefix: str, num_experts: int) -> list[_Group]:
    fc1 = tuple(f"{mc_prefix}.local_experts.{e}.linear_fc1.weight" for e in range(num_experts))
    fc2 = tuple(f"{mc_prefix}.local_experts.{e}.linear_fc2.weight" for e in range(num_experts))
    unstack = lambda t: list(t[0].unbind(0))            # noqa: E731
    stack = lambda t: [torch.stack(t, dim=0)]           # noqa: E731
    return [_Group((hf_gate_up,), fc1, unstack, stack), _Group((hf_down,), fc2, unstack, stack)]


def _pair(hf_config, pair: TensorPair, hf: str, mc: str) -> _Group:
    """A family's :class:`TensorPair` of decoder layer ``hf`` / ``mc`` as a mapping group."""
    names = tuple(f"{hf}.{name}" for name in pair.hf)
    target = f"{mc}.{pair.mcore}"
    if pair.kind == "same":
        return _same(*names, target)
    if pair.kind == "glu":
        return _glu(*names, target)
    return _qkv(hf_config, *names, target)


def _mapping(hf_config) -> list[_Group]:
    """Every tensor of the transformers model, grouped with the Megatron parameters it becomes."""
    spec = _check_expressible(hf_config).megatron
    tied = bool(_get(hf_config, "tie_word_embeddings", False))
    groups = [_same("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
              _same("model.norm.weight", "decoder.final_layernorm.weight")]
    if not tied:
        groups.append(_same("lm_head.weight", "output_layer.weight"))
    attention_extra = spec.attention_tensors(hf_config)
    sparse_extra = spec.sparse_mlp_tensors(hf_config)
    for i, sparse in enumerate(_moe_layer_pattern(hf_config)):
        hf, mc = f"model.layers.{i}", f"decoder.layers.{i}"
        attn = f"{hf}.self_attn"
        groups += [
            _same(f"{hf}.input_layernorm.weight", f"{mc}.input_layernorm.weight"),
            _same(f"{hf}.post_attention_layernorm.weight", f"{mc}.pre_mlp_layernorm.weight"),
            _qkv(hf_config, f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight",
                 f"{mc}.self_attention.linear_qkv.weight"),
            _same(f"{attn}.o_proj.weight", f"{mc}.self_attention.linear_proj.weight"),
        ]
        groups += [_pair(hf_config, pair, hf, mc) for pair in attention_extra]
        if not sparse:
            groups += [_glu(f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight", f"{mc}.mlp.linear_fc1.weight"),
                       _same(f"{hf}.mlp.down_proj.weight", f"{mc}.mlp.linear_fc2.weight")]
            continue
        groups.append(_same(f"{hf}.mlp.gate.weight", f"{mc}.mlp.router.weight"))
        groups += _experts(f"{hf}.mlp.experts.gate_up_proj", f"{hf}.mlp.experts.down_proj", f"{mc}.mlp.experts",
                           _num_experts(hf_config))
        groups += [_pair(hf_config, pair, hf, mc) for pair in sparse_extra]
    return groups


def _key_report(missing, unused, what_missing: str, what_unused: str) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} {what_missing}: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")
    if unused:
        parts.append(f"{len(unused)} {what_unused}: {sorted(unused)[:8]}{' ...' if len(unused) > 8 else ''}")
    return "; ".join(parts)


def megatron_state_dict_from_hf(hf_state_dict: dict, hf_config) -> dict[str, torch.Tensor]:
    """Full (unsliced) Megatron tensors from a transformers state dict; raises
    :class:`CheckpointMismatchError` naming missing transformers keys and keys nothing consumes."""
    groups = _mapping(hf_config)
    wanted = {k for g in groups for k in g.hf_keys}
    tied = bool(_get(hf_config, "tie_word_embeddings", False))
    ignorable = {"lm_head.weight"} if tied else set()      # the tied alias of the embedding
    missing = wanted - set(hf_state_dict)
    unused = set(hf_state_dict) - wanted - ignorable
    if missing or unused:
        raise CheckpointMismatchError("transformers state dict does not match the Megatron mapping: " +
                                      _key_report(missing, unused, "missing transformers keys",
                                                  "transformers keys nothing consumes"))
    out = {}
    for g in groups:
        tensors = g.to_mcore([hf_state_dict[k] for k in g.hf_keys])
        out.update(zip(g.mcore_keys, tensors))
    return out


# --------------------------------------------------------------------------------------------------
# tensor parallel slicing
# --------------------------------------------------------------------------------------------------


def _parallel_ranks(name: str) -> tuple[int, int]:
    """(rank, world size) of the tensor-parallel group that shards parameter ``name``."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() != 1:
        raise UnsupportedConversionError("pipeline parallelism: the converter maps all layers onto one stage")
    if ps.get_expert_model_parallel_world_size() != 1:
        raise UnsupportedConversionError("expert parallelism: the converter maps all experts onto one rank")
    if ".experts." in name:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _is_glu_fc1(name: str, config) -> bool:
    return config.gated_linear_unit and name.endswith("linear_fc1.weight")


def _tp_slice(name: str, full: torch.Tensor, param: torch.Tensor, config) -> torch.Tensor:
    """This rank's slice of ``full`` for ``param`` (by Megatron's ``partition_dim``)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = int(param.partition_dim)
    rank, size = _parallel_ranks(name)
    if size == 1:
        return full
    if _is_glu_fc1(name, config):       # [gate; up]: each rank holds [gate slice; up slice]
        return torch.cat([half.chunk(size, dim=dim)[rank] for half in full.chunk(2, dim=0)], dim=0)
    if full.shape[dim] % size:
        raise CheckpointMismatchError(f"{name}: dim {dim} of size {full.shape[dim]} does not split over TP={size}")
    return full.chunk(size, dim=dim)[rank]


def load_hf_into_megatron(megatron_model: torch.nn.Module, hf_state_dict: dict, hf_config) -> None:
    """Copy a transformers state dict into ``megatron_model`` (in place, this TP rank's slices).

    Every transformers tensor must be consumed and every Megatron parameter filled, with matching
    shapes; otherwise :class:`CheckpointMismatchError` names the keys.
    """
    megatron_version()
    full = megatron_state_dict_from_hf(hf_state_dict, hf_config)
    params = dict(megatron_model.named_parameters())
    missing = set(params) - set(full)
    unused = set(full) - set(params)
    if missing or unused:
        raise CheckpointMismatchError("Megatron model does not match the mapping: " +
                                      _key_report(missing, unused, "Megatron parameters left unfilled",
                                                  "mapped tensors with no Megatron parameter"))
    config = megatron_model.config
    with torch.no_grad():
        for name, param in params.items():
            local = _tp_slice(name, full[name], param, config)
            if local.shape != param.shape:
                raise CheckpointMismatchError(f"{name}: converted tensor has shape {tuple(local.shape)}, the "
                                              f"Megatron parameter {tuple(param.shape)}")
            param.copy_(local)


def iter_hf_tensors_from_megatron(megatron_model: torch.nn.Module, hf_config, *, meta: bool = False):
    """``(transformers name, tensor)`` of a (TP=1) Megatron model, one mapping group at a time (a weight refit
    streams these: at most one group's tensors exist beyond the model's own). ``meta=True`` yields meta-device
    tensors (names and shapes only, nothing copied: the refit's manifest, checked before any weight moves).

    Raises :class:`CheckpointMismatchError` if a mapped parameter is missing or a parameter is unmapped, before
    the first tensor is yielded."""
    megatron_version()
    for name, param in megatron_model.named_parameters():
        if getattr(param, "tensor_model_parallel", False) and _parallel_ranks(name)[1] != 1:
            raise UnsupportedConversionError("tensor parallelism in hf_state_dict_from_megatron: gather the "
                                             "slices first (TP=1 only)")
    params = {name: (p.detach().to("meta") if meta else p.detach()) for name, p in megatron_model.named_parameters()}
    groups = _mapping(hf_config)
    wanted = {k for g in groups for k in g.mcore_keys}
    missing, unused = wanted - set(params), set(params) - wanted
    if missing or unused:
        raise CheckpointMismatchError("Megatron model does not match the mapping: " +
                                      _key_report(missing, unused, "mapped Megatron parameters missing",
                                                  "Megatron parameters with no transformers key"))
    return _iter_groups(groups, params, bool(_get(hf_config, "tie_word_embeddings", False)))


def _iter_groups(groups, params, tied: bool):
    embedding = None
    for g in groups:
        for key, tensor in zip(g.hf_keys, g.to_hf([params[k] for k in g.mcore_keys])):
            if key == "model.embed_tokens.weight":
                embedding = tensor
            yield key, tensor
    if tied:
        yield "lm_head.weight", embedding


def hf_state_dict_from_megatron(megatron_model: torch.nn.Module, hf_config) -> dict[str, torch.Tensor]:
    """The transformers state dict of a (TP=1) Megatron model: the reverse of :func:`load_hf_into_megatron`.

    Raises :class:`CheckpointMismatchError` if a mapped parameter is missing or a parameter is unmapped.
    """
    return dict(iter_hf_tensors_from_megatron(megatron_model, hf_config))
