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
separately; ``linear_qkv`` slices whole query groups).

Sharded worlds (Megatron's own ``parallel_state``, one process per rank): :func:`load_hf_into_megatron` loads, on
each rank, only that rank's shards: its pipeline stage's decoder layers (global layer = the stage's offset + the
local index, read from each layer's ``layer_number``), the embedding on the first stage, the final norm and the
output layer on the last (with tied embeddings a later last stage fills ``output_layer.weight`` from the
embedding), its local experts (global expert ``ep_rank * num_local_experts + i``, as Megatron numbers them) and
the tensor-parallel slices of all of them. Given a checkpoint path it reads only those tensors from the
safetensors file(s) (``safe_open``, one tensor or expert-row slice at a time; experts stored fused or one by one).
:func:`check_parallel_layout` refuses the layouts Megatron cannot build, before any process starts.
:func:`iter_hf_tensors_from_megatron` yields whole tensors (a single rank, or a pipeline stage's own);
:func:`iter_hf_shards_from_megatron` yields any rank's own pieces with their offsets in the full tensors.

mbridge / Megatron-Bridge (evaluated from the mbridge 0.15.1 and megatron-bridge 0.3.1 wheels):
mbridge builds the transformer-engine layer spec (``use_transformer_engine=True``, TE fused names such as
``linear_qkv.layer_norm_weight``), so its mapping does not fit the local spec and its import needs einops;
Megatron-Bridge requires transformer-engine and ``transformers<5``. Neither runs here, hence this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from ...errors import CheckpointMismatchError, ConfigError, MissingFileError, UnsupportedConversionError
from ...families import FAMILIES, MoEFamily, TensorPair
from .version import megatron_version

__all__ = [
    "convertible_families",
    "check_family_convertible",
    "UnsupportedConversionError",
    "CheckpointMismatchError",
    "megatron_config_from_hf",
    "megatron_layer_spec",
    "SequenceParallelTorchNorm",
    "build_megatron_from_hf",
    "load_hf_into_megatron",
    "hf_state_dict_from_megatron",
    "iter_hf_tensors_from_megatron",
    "megatron_state_dict_from_hf",
    "ParallelLayout",
    "check_parallel_layout",
    "HFCheckpoint",
    "open_hf_checkpoint",
    "HFShard",
    "iter_hf_shards_from_megatron",
    "HFShardGroups",
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
    return check_family_convertible(_get(config, "model_type"))


def check_family_convertible(model_type) -> MoEFamily:
    """The registered family of ``model_type`` if it has a Megatron conversion; else
    :class:`UnsupportedConversionError` naming why (the family's reason, or the families that convert). Decided by
    the model_type alone: a check before any work (a config's own features are checked when it is converted)."""
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
    return _router_fields(config)[1]


def _router_fields(config) -> tuple[dict, bool]:
    """(Megatron's router fields for the family's :class:`~moealign.routing_replay.gates.RouterScoring`, whether it
    renormalises the top-k). Softmax -> top-k (renormalised, or not: ``moe_router_pre_softmax``), or sigmoid scores
    (always renormalised by Megatron; the family refuses the rest) with optional groups and a scaling factor; a
    selection bias when the family has one (``bias_attr``: Megatron's ``expert_bias``)."""
    family = _family(config)
    scoring = family.scoring(config)
    if scoring.score == "softmax" and not scoring.grouped and scoring.scaling_factor == 1.0:
        return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": not scoring.renormalize}, \
            scoring.renormalize
    if scoring.score == "sigmoid":
        if not scoring.renormalize and int(config.num_experts_per_tok) > 1:
            raise _unsupported(config.model_type, "a sigmoid router without renormalisation (Megatron's sigmoid "
                                                  "router divides the top-k scores by their sum)")
        fields = {"moe_router_score_function": "sigmoid",
                  "moe_router_topk_scaling_factor": None if scoring.scaling_factor == 1.0 else scoring.scaling_factor,
                  "moe_router_enable_expert_bias": bool(family.bias_attr)}
        if scoring.grouped:
            fields.update(moe_router_num_groups=int(scoring.n_group), moe_router_group_topk=int(scoring.topk_group))
        return fields, True
    raise _unsupported(config.model_type, f"router scoring {scoring} (softmax -> top-k, optionally renormalised, or "
                                          f"sigmoid -> (grouped) top-k, renormalised and scaled, are mapped)")


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
    renormalize = _renormalize(config)          # also refuses a scoring Megatron's router does not compute
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
        moe_router_load_balancing_type="aux_loss" if aux_coeff else "none",
        moe_aux_loss_coeff=aux_coeff,
        moe_grouped_gemm=False,
        moe_router_fusion=False,
        moe_enable_routing_replay=True,
    )
    kw.update(_router_fields(hf_config)[0])                   # softmax / sigmoid, groups, scaling, expert bias
    kw.update(family.megatron.config_fields(hf_config))      # q/k norm, q/k/v bias, shared expert, MLA, ...
    config_class = TransformerConfig
    if kw.get("multi_latent_attention"):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
        kw.setdefault("rotary_base", _rope_theta(hf_config))    # MLA applies its own RoPE (GPTModel's is unused)
    jitter = float(_get(hf_config, "router_jitter_noise", 0.0) or 0.0)
    if jitter:
        # training-only noise U(1-eps, 1+eps) on the router input (transformers also feeds it to the experts)
        kw["moe_input_jitter_eps"] = jitter
    if cpu:
        kw.update(_CPU_SETTINGS)
    kw.update(overrides)
    return config_class(**kw)


def megatron_layer_spec(config):
    """The local (transformer-engine-free) decoder block spec for ``config``: dense and MoE layers as
    ``config.moe_layer_freq`` says. With ``config.sequence_parallel`` every norm of the spec is
    :class:`SequenceParallelTorchNorm` (Megatron's ``WrappedTorchNorm`` refuses sequence parallelism)."""
    megatron_version()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if getattr(config, "multi_latent_attention", False):
        from .mla import mla_local_block_spec        # MLA: a local core attention with separate k / v head sizes

        spec = mla_local_block_spec(config)
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    if getattr(config, "sequence_parallel", False):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        spec = _swap_module(spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    return spec


class SequenceParallelTorchNorm:
    """Megatron's ``WrappedTorchNorm`` (a plain ``torch.nn.RMSNorm``) for a sequence-parallel model: Megatron refuses
    torch's norms under sequence parallelism only because they do not mark their weight, whose gradient each TP rank
    then holds for its own sequence chunk; this one marks it ``sequence_parallel`` (as transformer-engine's and apex's
    norms do), so the gradient is summed over the TP group with the other marked parameters (the routers' weights)
    after the backward (:class:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer`'s step). RMSNorm only
    (every family mapped here)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        unsupported = [f"{name}=True" for name in ("layernorm_zero_centered_gamma", "persist_layer_norm",
                                                   "memory_efficient_layer_norm") if getattr(config, name, False)]
        if config.normalization != "RMSNorm":
            unsupported.insert(0, f"normalization={config.normalization!r}")
        if unsupported:
            raise UnsupportedConversionError(f"the sequence-parallel torch norm is a plain RMSNorm; not "
                                             f"{', '.join(unsupported)}")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        setattr(norm.weight, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def _swap_module(spec, old: type, new: type):
    """``spec`` (a Megatron ModuleSpec / submodules dataclass / list of them) with every ``old`` module class
    replaced by ``new`` (copies; the original spec is untouched)."""
    import dataclasses

    if spec is old:
        return new
    if isinstance(spec, (list, tuple)):
        return type(spec)(_swap_module(item, old, new) for item in spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _swap_module(getattr(spec, f.name), old, new)
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def build_megatron_from_hf(hf_model: torch.nn.Module, *, parallel_output: bool = True, **config_kwargs):
    """Build a Megatron ``GPTModel`` equivalent to ``hf_model`` and load its weights (this rank's shards).

    Needs ``megatron.core.parallel_state`` initialised; in a sharded world the model is this rank's pipeline stage
    (see :func:`build_megatron_stage`). ``config_kwargs`` go to :func:`megatron_config_from_hf`.
    ``parallel_output=True`` (Megatron's default) returns vocab-parallel logits when TP > 1.
    """
    return build_megatron_stage(hf_model.config, hf_model.state_dict(), parallel_output=parallel_output,
                                **config_kwargs)


def build_megatron_stage(hf_config, checkpoint, *, parallel_output: bool = True, **config_kwargs):
    """This rank's ``GPTModel`` (its pipeline stage: ``pre_process`` on the first, ``post_process`` on the last) for
    the transformers config ``hf_config``, with this rank's shards of ``checkpoint`` loaded
    (:func:`load_hf_into_megatron`: a state dict, or a checkpoint directory / safetensors file read tensor by tensor).

    Needs ``megatron.core.parallel_state`` initialised with the sizes the config states (``config_kwargs`` such as
    ``tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` / ``expert_model_parallel_size`` go to
    :func:`megatron_config_from_hf`; the parallel sizes default to ``parallel_state``'s)."""
    megatron_version()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    kwargs = dict(config_kwargs)
    first = last = True
    if ps.model_parallel_is_initialized():
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
        kwargs.setdefault("tensor_model_parallel_size", tp)
        kwargs.setdefault("pipeline_model_parallel_size", pp)
        kwargs.setdefault("expert_model_parallel_size", ep)
        kwargs.setdefault("expert_tensor_parallel_size", etp)
        if pp > 1:
            kwargs.setdefault("pipeline_dtype", kwargs.get("params_dtype", torch.float32))
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    config = megatron_config_from_hf(hf_config, **kwargs)
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
        pre_process=first,
        post_process=last,
    )
    load_hf_into_megatron(model, checkpoint, hf_config)
    return model


# --------------------------------------------------------------------------------------------------
# parallel layouts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelLayout:
    """A Megatron world: ``world = tp * pp * dp`` ranks; the experts are carved from the ``dp * tp`` ranks of a
    stage as Megatron does (expert tensor parallel ``etp`` = ``tp``, Megatron's default; ``ep`` ranks per expert
    group; ``edp = dp * tp / (etp * ep)`` expert-data-parallel copies)."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def etp(self) -> int:
        return self.tp

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.dp * self.tp // (self.etp * self.ep)

    def as_dict(self) -> dict:
        """The report's ``train.parallel``: ``{"tp", "ep", "pp", "dp", "world"}``."""
        return {"tp": self.tp, "ep": self.ep, "pp": self.pp, "dp": self.dp, "world": self.world}

    def __str__(self) -> str:
        return f"TP {self.tp} x EP {self.ep} x PP {self.pp} (DP {self.dp}, world {self.world})"


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _config_view(hf_config):
    if isinstance(hf_config, dict):
        from ...model_config import ConfigView

        return ConfigView(**hf_config)
    return hf_config


def check_parallel_layout(hf_config, *, tp: int = 1, ep: int = 1, pp: int = 1, dp: int | None = None,
                          world: int | None = None) -> ParallelLayout:
    """The :class:`ParallelLayout` of TP ``tp`` x EP ``ep`` x PP ``pp`` for a transformers config (a config object,
    or a ``config.json`` dict), or :class:`~moealign.errors.ConfigError` naming the first thing Megatron cannot
    build: ``world`` not divisible by TP x PP, EP not dividing the experts, PP not dividing the layers, EP not
    dividing the data-parallel x tensor-parallel ranks (Megatron carves the expert grid ETP x EP out of them; ETP =
    TP), TP not dividing the heads, query groups, vocabulary or MLP widths (with MLA also ``q_lora_rank`` and
    ``kv_lora_rank + qk_rope_head_dim``). ``dp`` (or ``world``) defaults to the
    smallest world Megatron accepts: ``dp = ep``. Pure: no process, no Megatron import; a family without a
    Megatron conversion is :class:`~moealign.errors.UnsupportedConversionError`."""
    tp, ep, pp = _positive("tp", tp), _positive("ep", ep), _positive("pp", pp)
    if world is not None:
        world = _positive("world", world)
        if world % (tp * pp):
            raise ConfigError(f"a world of {world} ranks is not divisible by TP x PP = {tp} x {pp} = {tp * pp}")
        if dp is not None and _positive("dp", dp) * tp * pp != world:
            raise ConfigError(f"dp={dp} with TP {tp} x PP {pp} is a world of {dp * tp * pp}, not {world}")
        dp = world // (tp * pp)
    dp = ep if dp is None else _positive("dp", dp)
    config = _config_view(hf_config)
    family = _check_expressible(config)
    experts = int(family.num_experts(config))
    layers = int(config.num_hidden_layers)
    if experts % ep:
        raise ConfigError(f"expert parallel size {ep} does not divide the model's {experts} experts")
    if layers % pp:
        raise ConfigError(f"pipeline parallel size {pp} does not divide the model's {layers} decoder layers (Megatron's "
                          f"even split; uneven first / last stages are not set up here)")
    if (dp * tp) % (tp * ep):
        raise ConfigError(f"expert parallel size {ep} does not divide the data-parallel x tensor-parallel ranks of a "
                          f"stage (DP {dp} x TP {tp} = {dp * tp}) as Megatron requires: its expert grid ETP {tp} x EP "
                          f"{ep} must tile them (world {tp * pp * dp}; use a data-parallel size that EP divides)")
    heads = int(config.num_attention_heads)
    groups = int(_get(config, "num_key_value_heads") or heads)
    sizes = [("attention heads", heads), ("query groups (num_key_value_heads)", groups),
             ("vocabulary", int(config.vocab_size)), ("expert MLP width", int(family.megatron.expert_ffn_size(config)))]
    if not all(_moe_layer_pattern(config)):
        sizes.append(("dense MLP width (intermediate_size)", int(config.intermediate_size)))
    fields = family.megatron.config_fields(config)
    shared = _get(config, "shared_expert_intermediate_size") or fields.get("moe_shared_expert_intermediate_size")
    if shared:
        sizes.append(("shared expert width", int(shared)))
    if fields.get("multi_latent_attention"):
        # MLA: Megatron builds both down projections column-parallel on the local spec (their output rows split over
        # TP; the kv one is then gathered whole on every rank, patches/megatron/mla.py), the up projections and
        # o_proj split by heads
        sizes += [("q LoRA rank (q_lora_rank)", int(fields["q_lora_rank"])),
                  ("kv down projection (kv_lora_rank + qk_rope_head_dim)",
                   int(fields["kv_lora_rank"]) + int(fields["qk_pos_emb_head_dim"]))]
    for what, size in sizes:
        if size % tp:
            raise ConfigError(f"tensor parallel size {tp} does not divide the model's {what} ({size})")
    return ParallelLayout(tp=tp, ep=ep, pp=pp, dp=dp)


# --------------------------------------------------------------------------------------------------
# the tensor mapping
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """``hf_keys`` <-> ``mcore_keys``: ``to_mcore(list of HF tensors) -> list of Megatron tensors`` and back.
    ``rows``: the group maps rows ``[start, stop)`` of dim 0 of its transformers tensors (a rank's local experts);
    None: whole tensors. ``expert``: the transformers tensors carry the expert axis in front (dim 0)."""

    hf_keys: tuple[str, ...]
    mcore_keys: tuple[str, ...]
    to_mcore: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    to_hf: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    rows: tuple[int, int] | None = None
    expert: bool = False


def _same(hf: str, mc: str) -> _Group:
    return _Group((hf,), (mc,), lambda t: [t[0]], lambda t: [t[0].clone()])


def _glu(hf_gate: str, hf_up: str, mc: str) -> _Group:
    def to_hf(t):
        gate, up = t[0].chunk(2, dim=0)
        return [gate.clone(), up.clone()]

    return _Group((hf_gate, hf_up), (mc,), lambda t: [torch.cat(t, dim=0)], to_hf)


def _qkv(hf_config, q: str, k: str, v: str, mc: str) -> _Group:
    """Per query group: [q heads of the group, k, v] (weights ``[rows, hidden]`` or biases ``[rows]``). The group
    count is read from the tensors: the same functions map a tensor-parallel rank's slice (whole query groups)."""
    groups = int(_get(hf_config, "num_key_value_heads") or hf_config.num_attention_heads)
    per_group = hf_config.num_attention_heads // groups
    head_dim = _head_dim(hf_config)

    def to_mcore(t):
        q_, k_, v_ = t
        tail = q_.shape[1:]
        g = k_.shape[0] // head_dim
        parts = (q_.reshape(g, per_group * head_dim, *tail), k_.reshape(g, head_dim, *tail),
                 v_.reshape(g, head_dim, *tail))
        return [torch.cat(parts, dim=1).reshape(g * (per_group + 2) * head_dim, *tail)]

    def to_hf(t):
        qkv = t[0]
        tail = qkv.shape[1:]
        g = qkv.shape[0] // ((per_group + 2) * head_dim)
        q_, k_, v_ = qkv.reshape(g, (per_group + 2) * head_dim, *tail).split(
            [per_group * head_dim, head_dim, head_dim], dim=1)
        return [x.reshape(-1, *tail).clone() for x in (q_, k_, v_)]

    return _Group((q, k, v), (mc,), to_mcore, to_hf)


def _experts(hf_gate_up: str, hf_down: str, mc_prefix: str, start: int, count: int, total: int) -> list[_Group]:
    """Experts ``[start, start + count)`` of ``total`` (Megatron's local experts ``0 .. count - 1`` of this EP rank)."""
    fc1 = tuple(f"{mc_prefix}.local_experts.{e}.linear_fc1.weight" for e in range(count))
    fc2 = tuple(f"{mc_prefix}.local_experts.{e}.linear_fc2.weight" for e in range(count))
    unstack = lambda t: list(t[0].unbind(0))            # noqa: E731
    stack = lambda t: [torch.stack(t, dim=0)]           # noqa: E731
    rows = None if (start, count) == (0, total) else (start, start + count)
    return [_Group((hf_gate_up,), fc1, unstack, stack, rows, True),
            _Group((hf_down,), fc2, unstack, stack, rows, True)]


def _pair(hf_config, pair: TensorPair, hf: str, mc: str) -> _Group:
    """A family's :class:`TensorPair` of decoder layer ``hf`` / ``mc`` as a mapping group."""
    names = tuple(f"{hf}.{name}" for name in pair.hf)
    target = f"{mc}.{pair.mcore}"
    if pair.kind == "same":
        return _same(*names, target)
    if pair.kind == "glu":
        return _glu(*names, target)
    return _qkv(hf_config, *names, target)


@dataclass(frozen=True)
class _Shard:
    """What one rank holds: ``layers`` the global decoder layer of each local layer (local index = position),
    experts ``[expert_start, expert_start + local_experts)``, the embedding (``first``), final norm and output
    layer (``last``)."""

    layers: tuple[int, ...]
    expert_start: int
    local_experts: int
    first: bool = True
    last: bool = True


def _whole(hf_config) -> _Shard:
    return _Shard(tuple(range(int(hf_config.num_hidden_layers))), 0, _num_experts(hf_config))


def _model_shard(model: torch.nn.Module, hf_config) -> _Shard:
    """The shard ``model`` (this rank's GPTModel) holds: its decoder layers by ``layer_number`` (global, 1-based),
    its stage's ends (``pre_process`` / ``post_process``) and this rank's experts in Megatron's numbering."""
    from megatron.core import parallel_state as ps

    experts = _num_experts(hf_config)
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        return _whole(hf_config)
    numbers = tuple(int(layer.layer_number) - 1 for layer in layers)
    ep_size = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    ep_rank = ps.get_expert_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    if experts % ep_size:
        raise CheckpointMismatchError(f"expert parallel size {ep_size} does not divide the {experts} experts")
    local = experts // ep_size
    return _Shard(numbers, ep_rank * local, local, bool(getattr(model, "pre_process", True)),
                  bool(getattr(model, "post_process", True)))


def _mapping(hf_config, shard: _Shard | None = None) -> list[_Group]:
    """Every tensor of the transformers model (or of one rank's ``shard``), grouped with the Megatron parameters
    it becomes (Megatron names local to the rank: its stage's layers from 0, its experts from 0)."""
    spec = _check_expressible(hf_config).megatron
    tied = bool(_get(hf_config, "tie_word_embeddings", False))
    total = _num_experts(hf_config)
    shard = shard or _whole(hf_config)
    groups = []
    if shard.first:
        groups.append(_same("model.embed_tokens.weight", "embedding.word_embeddings.weight"))
    if shard.last:
        groups.append(_same("model.norm.weight", "decoder.final_layernorm.weight"))
        if not tied:
            groups.append(_same("lm_head.weight", "output_layer.weight"))
        elif not shard.first:         # a later last stage holds its own copy of the tied embedding
            groups.append(_same("model.embed_tokens.weight", "output_layer.weight"))
    attention_extra = spec.attention_tensors(hf_config)
    own_attention = bool(spec.own_attention(hf_config))
    sparse_extra = spec.sparse_mlp_tensors(hf_config)
    pattern = _moe_layer_pattern(hf_config)
    for j, i in enumerate(shard.layers):
        if not 0 <= i < len(pattern):
            raise CheckpointMismatchError(f"the Megatron model holds decoder layer {i}, the checkpoint has "
                                          f"{len(pattern)} layers")
        hf, mc = f"model.layers.{i}", f"decoder.layers.{j}"
        attn = f"{hf}.self_attn"
        groups += [
            _same(f"{hf}.input_layernorm.weight", f"{mc}.input_layernorm.weight"),
            _same(f"{hf}.post_attention_layernorm.weight", f"{mc}.pre_mlp_layernorm.weight"),
        ]
        if not own_attention:               # the family's attention_tensors are the whole attention (MLA)
            groups += [
                _qkv(hf_config, f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight",
                     f"{mc}.self_attention.linear_qkv.weight"),
                _same(f"{attn}.o_proj.weight", f"{mc}.self_attention.linear_proj.weight"),
            ]
        groups += [_pair(hf_config, pair, hf, mc) for pair in attention_extra]
        if not pattern[i]:
            groups += [_glu(f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight", f"{mc}.mlp.linear_fc1.weight"),
                       _same(f"{hf}.mlp.down_proj.weight", f"{mc}.mlp.linear_fc2.weight")]
            continue
        groups.append(_same(f"{hf}.mlp.gate.weight", f"{mc}.mlp.router.weight"))
        groups += _experts(f"{hf}.mlp.experts.gate_up_proj", f"{hf}.mlp.experts.down_proj", f"{mc}.mlp.experts",
                           shard.expert_start, shard.local_experts, total)
        groups += [_pair(hf_config, pair, hf, mc) for pair in sparse_extra]
    return groups


#: Megatron buffers that hold checkpoint state (filled and read back like parameters): the router's selection bias
#: (``moe_router_enable_expert_bias``; transformers' ``e_score_correction_bias``).
STATE_BUFFERS = ("expert_bias",)


def _state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters and its state buffers (:data:`STATE_BUFFERS`), by name."""
    out = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        if buf is not None and name.rsplit(".", 1)[-1] in STATE_BUFFERS:
            out[name] = buf
    return out


def _key_report(missing, unused, what_missing: str, what_unused: str) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} {what_missing}: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")
    if unused:
        parts.append(f"{len(unused)} {what_unused}: {sorted(unused)[:8]}{' ...' if len(unused) > 8 else ''}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------------
# where the transformers tensors come from: a state dict, or safetensors files read tensor by tensor
# --------------------------------------------------------------------------------------------------


class _DictSource:
    def __init__(self, state_dict):
        self.state_dict = state_dict

    def names(self) -> set[str]:
        return set(self.state_dict)

    def check(self, wanted: set[str], ignorable: set[str]) -> None:
        missing = wanted - self.names()
        unused = self.names() - wanted - ignorable
        if missing or unused:
            raise CheckpointMismatchError("transformers state dict does not match the Megatron mapping: " +
                                          _key_report(missing, unused, "missing transformers keys",
                                                      "transformers keys nothing consumes"))

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        tensor = self.state_dict[name]
        return tensor if rows is None else tensor[rows[0]:rows[1]]


class HFCheckpoint:
    """A transformers checkpoint on disk, read tensor by tensor (``safetensors.safe_open``; no full-model load):
    :meth:`get` returns one tensor in transformers' in-memory names (experts fused, ``experts.gate_up_proj`` /
    ``down_proj``), or rows ``[start, stop)`` of its dim 0 (a range of experts), from whichever layout the files
    hold (fused, or one expert at a time under the family's checkpoint names). Made by
    :func:`open_hf_checkpoint`."""

    def __init__(self, files: dict[str, str], hf_config, where: str):
        self.where = where
        self._file_of = files                      # stored name -> file
        self._handles: dict[str, object] = {}
        family = _family(hf_config)
        self._alias: dict[str, str] = {}                                # in-memory name -> stored name
        self._gate_up: dict[str, list[tuple[str, str]]] = {}            # fused -> per expert (gate, up)
        self._down: dict[str, list[str]] = {}                           # fused -> per expert down
        tensors = family.checkpoint_tensors(hf_config)
        for usual, fused in tensors.alternatives:
            f_router = next(n for n in fused if n.endswith(".gate.weight"))
            f_gate_up = next(n for n in fused if n.endswith(".experts.gate_up_proj"))
            f_down = next(n for n in fused if n.endswith(".experts.down_proj"))
            if f_gate_up in files or f_down in files:
                continue                                                # stored fused, as transformers 5 holds them
            u_router = next(n for n in usual if n.endswith(".gate.weight") and ".experts." not in n)
            per_expert = [n for n in usual if ".experts." in n]
            if len(per_expert) % 3:
                raise CheckpointMismatchError(f"{where}: the family's one-by-one expert names are not gate/up/down "
                                              f"triples ({per_expert[:3]} ...)")
            triples = [per_expert[i:i + 3] for i in range(0, len(per_expert), 3)]
            if f_router not in files:
                self._alias[f_router] = u_router
            self._gate_up[f_gate_up] = [(g, u) for g, u, _ in triples]
            self._down[f_down] = [d for _, _, d in triples]

    def stored_names(self) -> set[str]:
        return set(self._file_of)

    def sources(self, name: str) -> list[str]:
        """The stored names in-memory tensor ``name`` is read from."""
        if name in self._file_of:
            return [name]
        if name in self._alias:
            return [self._alias[name]]
        if name in self._gate_up:
            return [n for pair in self._gate_up[name] for n in pair]
        if name in self._down:
            return list(self._down[name])
        return [name]

    def check(self, wanted: set[str], ignorable: set[str]) -> None:
        stored = self.stored_names()
        needed = {n: self.sources(n) for n in wanted}
        missing = {n for n, srcs in needed.items() if any(src not in stored for src in srcs)}
        used = {src for srcs in needed.values() for src in srcs}
        unused = stored - used - ignorable
        if missing or unused:
            raise CheckpointMismatchError(f"{self.where} does not match the Megatron mapping: " +
                                          _key_report(missing, unused, "missing transformers tensors",
                                                      "stored tensors nothing consumes"))

    def _read(self, stored: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        from safetensors import safe_open

        path = self._file_of.get(stored)
        if path is None:
            raise CheckpointMismatchError(f"{self.where} has no tensor {stored!r}")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt", device="cpu")
        if rows is None:
            return handle.get_tensor(stored)
        return handle.get_slice(stored)[rows[0]:rows[1]]

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """In-memory tensor ``name`` (rows ``[start, stop)`` of dim 0 when given)."""
        if name in self._file_of:
            return self._read(name, rows)
        if name in self._alias:
            return self._read(self._alias[name], rows)
        if name in self._gate_up:
            pairs = self._gate_up[name]
            chosen = pairs if rows is None else pairs[rows[0]:rows[1]]
            return torch.stack([torch.cat([self._read(g), self._read(u)], dim=0) for g, u in chosen])
        if name in self._down:
            downs = self._down[name]
            chosen = downs if rows is None else downs[rows[0]:rows[1]]
            return torch.stack([self._read(d) for d in chosen])
        raise CheckpointMismatchError(f"{self.where} has no tensor {name!r}")

    def close(self) -> None:
        self._handles.clear()


def open_hf_checkpoint(path: str | os.PathLike, hf_config) -> HFCheckpoint:
    """A checkpoint directory (``model.safetensors``, or ``model.safetensors.index.json`` and its shards) or one
    ``.safetensors`` file, for reading tensor by tensor (:class:`HFCheckpoint`). Only the headers are read here."""
    from safetensors import safe_open

    root = Path(path)
    if root.is_dir():
        index = root / "model.safetensors.index.json"
        if index.is_file():
            from ..._files import read_json_file

            weight_map = read_json_file(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointMismatchError(f"{index}: no weight_map")
            shards = sorted({str(root / f) for f in weight_map.values()})
        elif (root / "model.safetensors").is_file():
            shards = [str(root / "model.safetensors")]
        else:
            raise MissingFileError(f"{root}: no model.safetensors or model.safetensors.index.json")
    elif root.is_file():
        shards = [str(root)]
    else:
        raise MissingFileError(f"{root}: no such checkpoint directory or safetensors file")
    files: dict[str, str] = {}
    for shard in shards:
        if not os.path.isfile(shard):
            raise MissingFileError(f"{shard}: a shard the index names is missing")
        with safe_open(shard, framework="pt", device="cpu") as handle:
            for name in handle.keys():
                files[name] = shard
    return HFCheckpoint(files, hf_config, str(root))


def _source(checkpoint, hf_config):
    if isinstance(checkpoint, HFCheckpoint):
        return checkpoint
    if isinstance(checkpoint, (str, os.PathLike)):
        return open_hf_checkpoint(checkpoint, hf_config)
    if hasattr(checkpoint, "keys") and hasattr(checkpoint, "__getitem__"):
        return _DictSource(checkpoint)
    raise CheckpointMismatchError(f"the checkpoint must be a state dict, a checkpoint path or an HFCheckpoint, got "
                                  f"{type(checkpoint).__name__}")


def _check_source(source, hf_config) -> None:
    """Every transformers name of the full mapping present, nothing left over (names only; nothing read)."""
    wanted = {k for g in _mapping(hf_config) for k in g.hf_keys}
    tied = bool(_get(hf_config, "tie_word_embeddings", False))
    source.check(wanted, {"lm_head.weight"} if tied else set())      # the tied alias of the embedding


def megatron_state_dict_from_hf(hf_state_dict: dict, hf_config) -> dict[str, torch.Tensor]:
    """Full (unsliced) Megatron tensors from a transformers state dict; raises
    :class:`CheckpointMismatchError` naming missing transformers keys and keys nothing consumes."""
    source = _DictSource(hf_state_dict)
    _check_source(source, hf_config)
    out = {}
    for g in _mapping(hf_config):
        tensors = g.to_mcore([source.get(k, g.rows) for k in g.hf_keys])
        out.update(zip(g.mcore_keys, tensors))
    return out


# --------------------------------------------------------------------------------------------------
# tensor parallel slicing
# --------------------------------------------------------------------------------------------------


def _parallel_ranks(name: str) -> tuple[int, int]:
    """(rank, world size) of the tensor-parallel group that shards parameter ``name`` (the expert tensor-parallel
    group for experts)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
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


def load_hf_into_megatron(megatron_model: torch.nn.Module, hf_state_dict, hf_config) -> None:
    """Copy a transformers checkpoint into ``megatron_model`` (in place): this rank's shards only (its pipeline
    stage's layers and ends, its experts, its tensor-parallel slices; see the module docstring).

    ``hf_state_dict``: a state dict, a checkpoint directory / ``.safetensors`` path (only this rank's tensors are
    read, one at a time) or an :class:`HFCheckpoint`. Every transformers tensor of the checkpoint must be mapped
    (names only are compared for what other ranks hold) and every Megatron parameter filled, with matching shapes;
    otherwise :class:`CheckpointMismatchError` names the keys.
    """
    megatron_version()
    source = _source(hf_state_dict, hf_config)
    _check_source(source, hf_config)
    groups = _mapping(hf_config, _model_shard(megatron_model, hf_config))
    params = _state_tensors(megatron_model)
    mapped = {k for g in groups for k in g.mcore_keys}
    missing = set(params) - mapped
    unused = mapped - set(params)
    if missing or unused:
        raise CheckpointMismatchError("Megatron model does not match the mapping: " +
                                      _key_report(missing, unused, "Megatron parameters left unfilled",
                                                  "mapped tensors with no Megatron parameter"))
    config = megatron_model.config
    with torch.no_grad():
        for g in groups:
            tensors = g.to_mcore([source.get(k, g.rows) for k in g.hf_keys])
            for name, full in zip(g.mcore_keys, tensors):
                param = params[name]
                local = _tp_slice(name, full, param, config)
                if local.shape != param.shape:
                    raise CheckpointMismatchError(f"{name}: converted tensor has shape {tuple(local.shape)}, the "
                                                  f"Megatron parameter {tuple(param.shape)}")
                param.copy_(local)


# --------------------------------------------------------------------------------------------------
# the inverse: Megatron -> transformers names
# --------------------------------------------------------------------------------------------------


class HFShard(NamedTuple):
    """One rank's piece of a transformers tensor: ``tensor == full[offsets[0]:offsets[0] + tensor.shape[0], ...]``
    for the transformers tensor ``name`` of shape ``full_shape`` (offsets all 0 and ``tensor.shape == full_shape``
    for a whole tensor)."""

    name: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    full_shape: tuple[int, ...]

    @property
    def whole(self) -> bool:
        return tuple(self.tensor.shape) == tuple(self.full_shape)


def _mapped_params(megatron_model, hf_config, meta: bool):
    shard = _model_shard(megatron_model, hf_config)
    raw = _state_tensors(megatron_model)
    params = {name: (p.detach().to("meta") if meta else p.detach()) for name, p in raw.items()}
    groups = _mapping(hf_config, shard)
    wanted = {k for g in groups for k in g.mcore_keys}
    missing, unused = wanted - set(params), set(params) - wanted
    if missing or unused:
        raise CheckpointMismatchError("Megatron model does not match the mapping: " +
                                      _key_report(missing, unused, "mapped Megatron parameters missing",
                                                  "Megatron parameters with no transformers key"))
    return shard, groups, params, raw


def iter_hf_tensors_from_megatron(megatron_model: torch.nn.Module, hf_config, *, meta: bool = False):
    """``(transformers name, tensor)`` of a Megatron model, one mapping group at a time (a weight refit streams
    these: at most one group's tensors exist beyond the model's own). ``meta=True`` yields meta-device tensors
    (names and shapes only, nothing copied: the refit's manifest, checked before any weight moves).

    Whole tensors only: a single rank, or a pipeline stage (its own layers and ends). A rank holding tensor- or
    expert-parallel pieces is refused (:class:`UnsupportedConversionError`): use
    :func:`iter_hf_shards_from_megatron`, which yields each piece with its offsets. Raises
    :class:`CheckpointMismatchError` if a mapped parameter is missing or a parameter is unmapped, before the first
    tensor is yielded."""
    megatron_version()
    for name, param in megatron_model.named_parameters():
        if getattr(param, "tensor_model_parallel", False) and _parallel_ranks(name)[1] != 1:
            raise UnsupportedConversionError("tensor parallelism in hf_state_dict_from_megatron: gather the "
                                             "slices first (TP=1 only), or take each rank's pieces with "
                                             "iter_hf_shards_from_megatron")
    shard, groups, params, _ = _mapped_params(megatron_model, hf_config, meta)
    if shard.local_experts != _num_experts(hf_config):
        raise UnsupportedConversionError(f"expert parallelism: this rank holds experts {shard.expert_start}.."
                                         f"{shard.expert_start + shard.local_experts - 1} of "
                                         f"{_num_experts(hf_config)}; take its pieces with "
                                         f"iter_hf_shards_from_megatron")
    return _iter_groups(groups, params, bool(_get(hf_config, "tie_word_embeddings", False)) and shard.first)


def _iter_groups(groups, params, tied: bool):
    embedding = None
    for g in groups:
        for key, tensor in zip(g.hf_keys, g.to_hf([params[k] for k in g.mcore_keys])):
            if key == "model.embed_tokens.weight":
                embedding = tensor
            yield key, tensor
    if tied and embedding is not None:
        yield "lm_head.weight", embedding


def iter_hf_shards_from_megatron(megatron_model: torch.nn.Module, hf_config, *, meta: bool = False):
    """This rank's own tensors in transformers names, as :class:`HFShard` pieces (``name``, ``tensor``, ``offsets``
    in the full tensor, ``full_shape``): its pipeline stage's layers and ends, its experts (rows of the fused
    ``experts.*`` tensors), its tensor-parallel slices (whole query groups of q / k / v, the gate and up halves of
    a GLU, columns of row-parallel weights, vocabulary rows). Every rank together yields every element once per
    data-parallel copy. ``meta=True``: meta-device tensors. Nothing is gathered."""
    source = HFShardGroups(megatron_model, hf_config, meta=meta)
    for index in range(len(source)):
        yield from source.group(index)


class HFShardGroups:
    """This rank's pieces (:func:`iter_hf_shards_from_megatron`) one mapping group at a time, each group converted
    only when asked for (``group(i)``: the :class:`HFShard` pieces of group ``i``, e.g. q / k / v, or one layer's
    experts): what a rank streams a chunk of a refit from without converting (or holding) the rest. The mapping is
    checked once, when built (:class:`CheckpointMismatchError`)."""

    def __init__(self, megatron_model: torch.nn.Module, hf_config, *, meta: bool = False):
        megatron_version()
        _, self._groups, self._params, self._raw = _mapped_params(megatron_model, hf_config, meta)
        self._total = _num_experts(hf_config)
        self._config = megatron_model.config

    def __len__(self) -> int:
        return len(self._groups)

    def megatron_tensors(self, index: int) -> list[tuple[str, tuple[str, ...], torch.Tensor]]:
        """Group ``index`` as this rank holds it, unconverted: ``(Megatron name, the transformers names it maps to,
        tensor)`` per Megatron tensor (no copy; a check over values needs no conversion)."""
        g = self._groups[index]
        return [(key, tuple(g.hf_keys), self._params[key]) for key in g.mcore_keys]

    def names(self, index: int) -> list[str]:
        """The transformers names of group ``index``."""
        return list(self._groups[index].hf_keys)

    def expert_parts(self, index: int, j: int) -> list[torch.Tensor] | None:
        """Piece ``j`` of expert group ``index`` as :meth:`group` gives it, unstacked: one view per local expert
        (its weight, or its tensor-parallel half of a fused gate / up), ``torch.stack(parts)`` being the piece; a
        writer copies each into its row of the piece's place with no stacked copy of the rank's experts. None for a
        group that is not an expert group."""
        g = self._groups[index]
        if not g.expert:
            return None
        tensors = [self._params[k] for k in g.mcore_keys]
        param = self._raw[g.mcore_keys[0]]
        split = bool(getattr(param, "tensor_model_parallel", False))
        _, size = _parallel_ranks(g.mcore_keys[0]) if split else (0, 1)
        if size > 1 and _is_glu_fc1(g.mcore_keys[0], self._config):
            dim = int(getattr(param, "partition_dim", 0))        # the stacked piece's axis dim + 1 (experts in front)
            half = tensors[0].shape[dim] // 2
            if j not in (0, 1):
                raise CheckpointMismatchError(f"expert group {index} has 2 pieces on this rank, not {j + 1}")
            return [t.narrow(dim, j * half, half) for t in tensors]
        if j != 0:
            raise CheckpointMismatchError(f"expert group {index} has 1 piece on this rank, not {j + 1}")
        return tensors

    def group(self, index: int) -> list[HFShard]:
        g = self._groups[index]
        param = self._raw[g.mcore_keys[0]]
        split = bool(getattr(param, "tensor_model_parallel", False))
        rank, size = _parallel_ranks(g.mcore_keys[0]) if split else (0, 1)
        dim = int(getattr(param, "partition_dim", 0)) if split else 0
        out = []
        for key, tensor in zip(g.hf_keys, g.to_hf([self._params[k] for k in g.mcore_keys])):
            offsets = [0] * tensor.dim()
            full = list(tensor.shape)
            if g.expert:
                offsets[0] = g.rows[0] if g.rows is not None else 0
                full[0] = self._total
            if size > 1:
                hf_dim = dim + 1 if g.expert else dim
                if g.expert and _is_glu_fc1(g.mcore_keys[0], self._config):
                    # fused [gate; up] rows: this rank holds a slice of each half, two pieces of the full tensor
                    half = tensor.shape[hf_dim] // 2
                    full[hf_dim] = size * tensor.shape[hf_dim]
                    for part, base in ((0, 0), (1, full[hf_dim] // 2)):
                        offsets[hf_dim] = base + rank * half
                        out.append(HFShard(key, tensor.narrow(hf_dim, part * half, half), tuple(offsets),
                                           tuple(full)))
                    continue
                offsets[hf_dim] = rank * tensor.shape[hf_dim]
                full[hf_dim] = size * tensor.shape[hf_dim]
            out.append(HFShard(key, tensor, tuple(offsets), tuple(full)))
        return out


def hf_state_dict_from_megatron(megatron_model: torch.nn.Module, hf_config) -> dict[str, torch.Tensor]:
    """The transformers state dict of a (TP=1) Megatron model: the reverse of :func:`load_hf_into_megatron`.

    Raises :class:`CheckpointMismatchError` if a mapped parameter is missing or a parameter is unmapped.
    """
    return dict(iter_hf_tensors_from_megatron(megatron_model, hf_config))
