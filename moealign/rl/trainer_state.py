"""What a trainer states, engine-free: its tensors in transformers names (:func:`trainer_tensors`), its transformers
config (:func:`trainer_config`) and the config fields a refit compares with the engine's (:data:`ARCHITECTURE_FIELDS`,
:data:`FORWARD_FIELDS`, the RoPE settings: :func:`architecture_differences`, :func:`comparable_config`). Read by the
refit (:mod:`moealign.rl.refit`) and the weight manifest (:mod:`moealign.rl.manifest`) alike."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from ..errors import ConfigError, InputTypeError

__all__ = ["ARCHITECTURE_FIELDS", "FORWARD_FIELDS", "SHARDED_CHUNK_BYTES", "is_sharded_trainer", "trainer_tensors",
           "trainer_config", "architecture_differences", "comparable_config", "comparable_fields"]

#: Config fields that must agree between the trainer and the engine before any tensor moves: the shapes.
ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "moe_intermediate_size", "intermediate_size",
                       "num_experts", "num_local_experts", "num_experts_per_tok", "tie_word_embeddings",
                       "shared_expert_intermediate_size", "n_shared_experts", "n_routed_experts")
#: Config fields that change the forward without changing a tensor's shape (equal tensors, other logits): compared
#: too. The RoPE settings (``rope_parameters``, the older ``rope_scaling`` / ``rope_theta`` /
#: ``partial_rotary_factor``) are compared as one normalised set (:func:`architecture_differences`). Not compared:
#: the dtype (precision policies differ by design), training-only fields (dropout, ``router_aux_loss_coef``,
#: ``router_jitter_noise``, ``output_router_logits``), token ids.
FORWARD_FIELDS = ("hidden_act", "hidden_activation", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon",
                  "norm_eps", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "moe_layer_freq",
                  "first_k_dense_replace", "sliding_window", "use_sliding_window", "max_window_layers",
                  "layer_types", "attention_bias", "mlp_bias", "qkv_bias", "clip_qkv", "qk_layernorm",
                  "use_qk_norm", "routed_scaling_factor", "scoring_func", "topk_method", "n_group", "topk_group",
                  "moe_renormalize", "router_bias", "attn_logit_softcapping", "final_logit_softcapping",
                  "logit_scale", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                  "logits_scaling", "max_position_embeddings", "position_embedding_type")
_ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")
#: The chunk of a stream from a sharded trainer's ranks when the caller names none (the refit passes its own).
SHARDED_CHUNK_BYTES = 64 << 20


def _is_megatron(model) -> bool:
    return type(model).__module__.startswith("megatron.")


def is_sharded_trainer(trainer) -> bool:
    """Whether ``trainer`` is a :class:`moealign.patches.megatron.sharded.ShardedMegatronTrainer` (one process per
    rank: its tensors live in its ranks and are streamed from them; told by class, no engine import)."""
    return any(c.__name__ == "ShardedMegatronTrainer" and c.__module__ == "moealign.patches.megatron.sharded"
               for c in type(trainer).__mro__)


def _unwrap(trainer) -> tuple[torch.nn.Module, Any]:
    """``(model, hf_config)`` of a moealign train engine or a bare model."""
    model = getattr(trainer, "model", None)
    if isinstance(model, torch.nn.Module) and not isinstance(trainer, torch.nn.Module):
        config = getattr(trainer, "_hf_config", None) or getattr(model, "config", None)
        return model, config
    if isinstance(trainer, torch.nn.Module):
        return trainer, None if _is_megatron(trainer) else getattr(trainer, "config", None)
    if model is None and hasattr(trainer, "model"):
        raise InputTypeError(f"the {type(trainer).__name__} holds no model (closed?)")
    raise InputTypeError(f"trainer must be a moealign train engine, a Megatron GPTModel, a transformers model or a "
                         f"mapping of transformers names to tensors, got {type(trainer).__name__}")


def trainer_tensors(trainer, hf_config=None, *, meta: bool = False,
                    chunk_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(transformers name, full tensor)`` of the trainer's weights, streamed (``meta=True``: shapes only). A sharded
    trainer's come from its ranks in chunks of about ``chunk_bytes`` (default :data:`SHARDED_CHUNK_BYTES`), each
    tensor's pieces written into one buffer by the ranks that hold them
    (:meth:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer.hf_tensors`)."""
    if is_sharded_trainer(trainer):
        return trainer.hf_tensors(chunk_bytes=SHARDED_CHUNK_BYTES if chunk_bytes is None else chunk_bytes,
                                  meta=meta)
    model, own = _unwrap(trainer)
    config = hf_config if hf_config is not None else own
    if _is_megatron(model):
        if config is None:
            raise ConfigError("a Megatron GPTModel carries no transformers config: pass hf_config (the config of the "
                              "checkpoint it was converted from)")
        from ..patches.megatron.checkpoint import iter_hf_tensors_from_megatron

        return iter_hf_tensors_from_megatron(model, config, meta=meta)
    return ((n, (t.detach().to("meta") if meta else t.detach())) for n, t in model.state_dict().items())


def _config_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if hasattr(config, "__dict__"):
        return dict(vars(config))
    raise InputTypeError(f"hf_config must be a transformers config or a dict, got {type(config).__name__}")


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _rope(config: dict) -> dict | None:
    """The RoPE settings of a config as one flat dict (``rope_parameters`` / ``rope_scaling`` merged with the
    top-level ``rope_theta`` / ``partial_rotary_factor``; ``type`` read as ``rope_type``, absent as
    ``"default"``); ``None`` when the config states none."""
    if not any(config.get(k) is not None for k in _ROPE_FIELDS):
        return None
    out: dict = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, Mapping):
            nested = all(isinstance(v, Mapping) for v in value.values()) and value
            for k, v in value.items():           # per layer type (transformers 5: {"full_attention": {...}})
                if nested:
                    for kk, vv in v.items():
                        out[f"{k}.{'rope_type' if kk == 'type' else kk}"] = _plain(vv)
                else:
                    out["rope_type" if k == "type" else k] = _plain(v)
    for key in ("rope_theta", "partial_rotary_factor"):
        if config.get(key) is not None:
            out.setdefault(key, _plain(config[key]))
    if not any(k == "rope_type" or k.endswith(".rope_type") for k in out):
        out["rope_type"] = "default"
    return out


def architecture_differences(engine_config, trainer_config) -> list[str]:
    """``"field: trainer X, engine Y"`` for every :data:`ARCHITECTURE_FIELDS` / :data:`FORWARD_FIELDS` entry both
    configs state and that differs, and for every RoPE setting (:func:`_rope`) that differs (engine-free)."""
    engine, mine = _config_dict(engine_config), _config_dict(trainer_config)
    differ = [f"{k}: trainer {mine.get(k)!r}, engine {engine.get(k)!r}" for k in ARCHITECTURE_FIELDS + FORWARD_FIELDS
              if k in mine and k in engine and _plain(mine.get(k)) != _plain(engine.get(k))]
    rope_e, rope_m = _rope(engine), _rope(mine)
    if rope_e is not None and rope_m is not None:
        for k in sorted(set(rope_e) | set(rope_m)):
            if rope_e.get(k, "<absent>") != rope_m.get(k, "<absent>"):
                differ.append(f"rope {k}: trainer {rope_m.get(k, '<absent>')!r}, engine {rope_e.get(k, '<absent>')!r}")
    return differ


def _trainer_config(trainer, hf_config):
    if hf_config is not None:
        return hf_config
    if isinstance(trainer, Mapping):
        return None
    if is_sharded_trainer(trainer):
        return trainer.hf_config
    return _unwrap(trainer)[1]


def trainer_config(trainer, hf_config=None):
    """The transformers config a trainer states (``hf_config`` when given; ``None`` for a snapshot mapping)."""
    return _trainer_config(trainer, hf_config)


def comparable_config(config) -> dict:
    """The fields of ``config`` that :func:`architecture_differences` compares (:data:`ARCHITECTURE_FIELDS`,
    :data:`FORWARD_FIELDS`, the RoPE settings) that it states, as plain JSON values (what a weight manifest
    carries)."""
    data = _config_dict(config)
    return {k: _plain(data[k]) for k in ARCHITECTURE_FIELDS + FORWARD_FIELDS + _ROPE_FIELDS if k in data}


def comparable_fields() -> tuple[str, ...]:
    """Every config field :func:`comparable_config` may return."""
    return ARCHITECTURE_FIELDS + FORWARD_FIELDS + _ROPE_FIELDS
