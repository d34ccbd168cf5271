"""The MoE model families moealign knows, one module per family, in one registry.

Everything that differs between families lives here, and only here: the transformers router (class name,
scoring, float32 scores), the number of experts, which decoder layers are sparse, the config keys of the
record fingerprint, and the transformers <-> Megatron-core conversion pieces (or the reason there is none).
The engine adapters read it: :mod:`moealign.patches.hf.model` (live routers, record metadata),
:mod:`moealign.patches.megatron.checkpoint` (conversion) and :func:`moealign.record.config_fingerprint`.

This package is pure data (+ torch through :class:`~moealign.routing_replay.gates.RouterScoring`): it
imports no engine, so it describes a family without transformers, Megatron or vLLM installed.

Adding a family is one module (a ``FAMILY = MoEFamily(...)``) plus its registration: list it in
``_BUILTIN`` below, or call :func:`register_family` from your own code::

    from moealign.families import MoEFamily, register_family

    register_family(MoEFamily("my_moe", "MyMoeTopKRouter", scoring=lambda c: RouterScoring(renormalize=True),
                              num_experts=lambda c: c.num_experts))

Config arguments of the family functions are transformers config objects or anything with the same
attributes (``getattr`` with defaults: missing optional keys read as their transformers defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError, UnsupportedModelError
from ..routing_replay.gates import RouterScoring

__all__ = [
    "ARCH_KEYS",
    "TENSOR_KINDS",
    "FAMILIES",
    "MoEFamily",
    "MegatronSpec",
    "TensorPair",
    "register_family",
    "get_family",
    "arch_keys",
    "every_layer_sparse",
    "sparse_by_step",
    "RouterScoring",
]

Config = Any   # a transformers PretrainedConfig, or any object with its attributes


# --------------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------------

# The config keys :func:`moealign.record.config_fingerprint` hashes for every family (and for a model_type no
# family is registered for). Changing this tuple changes the fingerprint of every record already saved:
# a family that needs more keys adds them in its own ``arch_keys`` (``ARCH_KEYS + ("its_key",)``).
ARCH_KEYS: tuple[str, ...] = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace",
    "moe_layer_freq", "n_group", "topk_group", "routed_scaling_factor", "scoring_func",
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters", "tie_word_embeddings",
    "sliding_window", "qk_norm", "clip_qkv",
)


def every_layer_sparse(config: Config) -> tuple[int, ...]:
    """MoE layer pattern of a family whose every decoder layer is sparse (Mixtral, OLMoE)."""
    return (1,) * int(config.num_hidden_layers)


def sparse_by_step(config: Config) -> tuple[int, ...]:
    """MoE layer pattern of the Qwen-MoE families, as their transformers decoder layers decide it: layer ``i``
    is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (or there are no
    experts)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    experts = int(getattr(config, "num_experts", 1) or 0)
    return tuple(int(experts > 0 and i not in dense and (i + 1) % step == 0)
                 for i in range(int(config.num_hidden_layers)))


# --------------------------------------------------------------------------------------------------
# Megatron conversion pieces
# --------------------------------------------------------------------------------------------------

TENSOR_KINDS = ("same", "glu", "qkv")


@dataclass(frozen=True)
class TensorPair:
    """One transformers <-> Megatron tensor correspondence inside decoder layer ``i``.

    ``hf`` names are relative to ``model.layers.<i>.``, ``mcore`` to ``decoder.layers.<i>.``. ``kind``:

    * ``"same"``: one tensor, copied (``hf`` has one name);
    * ``"glu"``: ``hf`` = (gate, up), Megatron's fused ``linear_fc1`` is ``[gate; up]``;
    * ``"qkv"``: ``hf`` = (q, k, v) weights or biases, Megatron's ``linear_qkv`` interleaves them per query group.
    """

    kind: str
    hf: tuple[str, ...]
    mcore: str

    def __post_init__(self):
        want = {"same": 1, "glu": 2, "qkv": 3}.get(self.kind)
        if want is None:
            raise ConfigError(f"TensorPair kind {self.kind!r} is not one of {TENSOR_KINDS}")
        if len(self.hf) != want:
            raise ConfigError(f"TensorPair {self.kind!r} takes {want} transformers name(s), got {self.hf}")


def _no_feature(config: Config) -> str | None:
    return None


def _no_fields(config: Config) -> dict:
    return {}


def _no_tensors(config: Config) -> tuple[TensorPair, ...]:
    return ()


@dataclass(frozen=True)
class MegatronSpec:
    """What a family adds to the stock transformers <-> Megatron-core (local spec) conversion.

    The stock part, shared by every family, lives in :mod:`moealign.patches.megatron.checkpoint`: embedding,
    final norm, output layer; per layer the two RMSNorms, q/k/v (interleaved) and o projections, the dense
    GLU MLP or the router (``mlp.gate``) and the transformers-5 fused experts (``mlp.experts.gate_up_proj``,
    ``down_proj``); RMSNorm, SiLU GLU, softmax router, plain RoPE.

    ``refused``: why this family cannot be converted at all (None: convertible; the other fields are then unused).
    ``expert_ffn_size(config)``: ``moe_ffn_hidden_size`` (the routed experts' intermediate size).
    ``unsupported(config)``: the first family feature this config uses that the local spec cannot express
    (a short text naming it, e.g. ``"sliding_window=16 (sliding-window attention)"``), or None.
    ``config_fields(config)``: Megatron ``TransformerConfig`` fields (by name) the family sets beyond the stock
    ones (e.g. ``qk_layernorm``, ``add_qkv_bias``, the shared expert).
    ``attention_tensors(config)``: per decoder layer, the family's extra attention tensors (q/k norm, q/k/v bias).
    ``sparse_mlp_tensors(config)``: per sparse layer, tensors beyond the router and the routed experts
    (a shared expert and its gate).
    """

    refused: str | None = None
    expert_ffn_size: Callable[[Config], int] | None = None
    unsupported: Callable[[Config], str | None] = _no_feature
    config_fields: Callable[[Config], dict] = _no_fields
    attention_tensors: Callable[[Config], tuple[TensorPair, ...]] = _no_tensors
    sparse_mlp_tensors: Callable[[Config], tuple[TensorPair, ...]] = _no_tensors

    def __post_init__(self):
        if self.refused is None and self.expert_ffn_size is None:
            raise ConfigError("a convertible MegatronSpec needs expert_ffn_size (or give refused=<reason>)")

    @property
    def convertible(self) -> bool:
        return self.refused is None


# --------------------------------------------------------------------------------------------------
# the family and the registry
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEFamily:
    """Everything moealign needs to know about one MoE model family.

    ``model_type``: the transformers ``config.model_type``.
    ``router_class``: class name of the transformers router module (``.gate`` of each sparse block).
    ``scoring(config)``: the :class:`RouterScoring` of its router (how logits become top-k and gate weights;
    ``renormalize`` is what ``norm_topk_prob`` means for it).
    ``num_experts(config)``: number of routed experts.
    ``scores_in_fp32``: the transformers router returns its gate weights in float32 (Mixtral) instead of the
    logits dtype.
    ``moe_layer_pattern(config)``: per decoder layer, 1 if sparse (MoE), 0 if dense.
    ``arch_keys``: the config keys of the record fingerprint (:data:`ARCH_KEYS`, plus the family's own).
    ``megatron``: the Megatron-core conversion pieces, or why it is refused (None: nobody wrote one).
    """

    model_type: str
    router_class: str
    scoring: Callable[[Config], RouterScoring]
    num_experts: Callable[[Config], int]
    scores_in_fp32: bool = False
    moe_layer_pattern: Callable[[Config], tuple[int, ...]] = sparse_by_step
    arch_keys: tuple[str, ...] = ARCH_KEYS
    megatron: MegatronSpec | None = None

    def __post_init__(self):
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ConfigError(f"MoEFamily.model_type must be a non-empty str, got {self.model_type!r}")
        if "model_type" not in self.arch_keys:
            raise ConfigError(f"MoEFamily {self.model_type!r}: arch_keys must include 'model_type'")


FAMILIES: dict[str, MoEFamily] = {}


def register_family(family: MoEFamily, *, overwrite: bool = False) -> None:
    """Add ``family`` to :data:`FAMILIES` (every adapter sees it at once); an existing model_type needs
    ``overwrite=True``."""
    if not isinstance(family, MoEFamily):
        raise ConfigError(f"register_family takes a MoEFamily, got {type(family).__name__}")
    if family.model_type in FAMILIES and not overwrite:
        raise ConfigError(f"MoE family {family.model_type!r} is already registered (pass overwrite=True)")
    FAMILIES[family.model_type] = family


def get_family(model_type) -> MoEFamily:
    """The registered family of ``model_type``; raises :class:`UnsupportedModelError` naming the known ones."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not a MoE family moealign knows "
                                    f"(known: {sorted(FAMILIES)}); register one with register_family()")
    return family


def arch_keys(model_type) -> tuple[str, ...]:
    """The config keys the record fingerprint of ``model_type`` hashes (:data:`ARCH_KEYS` when no family is
    registered for it)."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    return family.arch_keys if family is not None else ARCH_KEYS


# --------------------------------------------------------------------------------------------------
# the built-in families (registration: one line each)
# --------------------------------------------------------------------------------------------------

from . import mixtral, olmoe, qwen2_moe, qwen3_moe  # noqa: E402  (they import the classes above)

_BUILTIN = (qwen3_moe, qwen2_moe, mixtral, olmoe)

for _module in _BUILTIN:
    register_family(_module.FAMILY)
del _module
