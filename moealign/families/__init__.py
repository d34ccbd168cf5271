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

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError, UnsupportedModelError
from ..routing_replay.gates import RouterScoring

__all__ = [
    "ARCH_KEYS",
    "TENSOR_KINDS",
    "FAMILIES",
    "REFUSED",
    "MoEFamily",
    "MegatronSpec",
    "TensorPair",
    "register_family",
    "get_family",
    "arch_keys",
    "every_layer_sparse",
    "sparse_by_step",
    "RouterScoring",
    "CheckpointTensors",
    "checkpoint_tensors",
    "glu_mlp",
    "size_product",
    "routed_experts",
    "attention_biases",
    "head_dim",
    "config_size",
    "VERIFIED_PATHS",
    "verified_families",
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


def _stock_attention(config: Config) -> bool:
    return False


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
    (a shared expert and its gate; a router's correction bias, which Megatron holds in its ``expert_bias`` buffer).
    ``own_attention(config)``: True when ``attention_tensors`` are the whole attention and the stock q/k/v
    (interleaved) and o mapping is not used (multi-head latent attention: ``config_fields`` then sets
    ``multi_latent_attention=True``).
    """

    refused: str | None = None
    expert_ffn_size: Callable[[Config], int] | None = None
    unsupported: Callable[[Config], str | None] = _no_feature
    config_fields: Callable[[Config], dict] = _no_fields
    attention_tensors: Callable[[Config], tuple[TensorPair, ...]] = _no_tensors
    sparse_mlp_tensors: Callable[[Config], tuple[TensorPair, ...]] = _no_tensors
    own_attention: Callable[[Config], bool] = _stock_attention

    def __post_init__(self):
        if self.refused is None and self.expert_ffn_size is None:
            raise ConfigError("a convertible MegatronSpec needs expert_ffn_size (or give refused=<reason>)")

    @property
    def convertible(self) -> bool:
        return self.refused is None


# --------------------------------------------------------------------------------------------------
# the checkpoint's tensors (names and shapes) a config implies
# --------------------------------------------------------------------------------------------------

Shape = tuple  # of int, or None for a dimension the config does not state (any size is accepted)


@dataclass(frozen=True)
class CheckpointTensors:
    """The safetensors tensors (transformers names) a checkpoint of one config holds, and their shapes.

    ``required``: ``{name: shape}`` every checkpoint of the config has; ``optional``: tensors it may hold (an
    ``lm_head.weight`` next to tied embeddings); ``alternatives``: ``(usual, other)`` pairs of ``{name: shape}``
    groups, ``other`` replacing ``usual`` when the checkpoint holds any of its names (experts stored fused,
    ``[E, 2I, H]`` / ``[E, H, I]``, instead of one by one). A ``None`` dimension is one the config does not state.
    """

    required: dict
    optional: dict = field(default_factory=dict)
    alternatives: tuple = ()


def config_size(config: Config, name: str) -> int | None:
    """``config.<name>`` as a size: a positive int, or None when absent (a bad value is a :class:`ConfigError`)."""
    value = getattr(config, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config.json {name} must be a non-negative integer, got {value!r}")
    return value


def size_product(*dims):
    """The product of sizes, None when any is unknown (a config without the field): a tensor's expected size."""
    out = 1
    for d in dims:
        if d is None:
            return None
        out *= d
    return out


def glu_mlp(prefix: str, inner: int | None, hidden: int | None, names=("gate_proj", "up_proj", "down_proj")) -> dict:
    """A SiLU GLU MLP's three weights under ``prefix`` (gate, up: ``[inner, hidden]``; down: ``[hidden, inner]``)."""
    gate, up, down = names
    return {f"{prefix}.{gate}.weight": (inner, hidden), f"{prefix}.{up}.weight": (inner, hidden),
            f"{prefix}.{down}.weight": (hidden, inner)}


def routed_experts(prefix: str, experts: int | None, inner: int | None, hidden: int | None,
                   names=("gate_proj", "up_proj", "down_proj"), fused_prefix: str | None = None) -> tuple[dict, dict]:
    """``(one by one, fused)``: a sparse block's router (``{prefix}.gate.weight``, ``[E, hidden]``) and its experts
    stored one by one (``{prefix}.experts.{e}.<gate|up|down>``), or fused as transformers 5 holds them
    (``{fused_prefix}.experts.gate_up_proj`` ``[E, 2 inner, hidden]``, ``down_proj`` ``[E, hidden, inner]``)."""
    usual = {f"{prefix}.gate.weight": (experts, hidden)}
    for e in range(experts or 0):
        usual.update(glu_mlp(f"{prefix}.experts.{e}", inner, hidden, names))
    fused_prefix = fused_prefix or prefix
    fused = {f"{fused_prefix}.gate.weight": (experts, hidden),
             f"{fused_prefix}.experts.gate_up_proj": (experts, size_product(2, inner), hidden),
             f"{fused_prefix}.experts.down_proj": (experts, hidden, inner)}
    return usual, fused


def checkpoint_tensors(config: Config, *, attention: Callable[[Config], dict] | None = None,
                       sparse_mlp: Callable[[Config], tuple[dict, dict, dict]],
                       dense_inner: str = "intermediate_size", layer_pattern=None) -> CheckpointTensors:
    """The tensors of a decoder-only MoE checkpoint in transformers naming: embedding, final norm, LM head (optional
    with ``tie_word_embeddings``); per layer the two RMSNorms, q/k/v/o (``head_dim``, else ``hidden_size //
    num_attention_heads``; ``num_key_value_heads``, else the head count), the family's ``attention(config)`` extras
    (``{name relative to the layer: shape}``), and the MLP: ``sparse_mlp(config)`` ->
    ``(one-by-one experts, fused experts, other tensors)`` in sparse layers, a GLU of ``dense_inner`` in dense ones
    (``layer_pattern``: the family's ``moe_layer_pattern``, default :func:`sparse_by_step`)."""
    hidden, vocab = config_size(config, "hidden_size"), config_size(config, "vocab_size")
    layers, heads = config_size(config, "num_hidden_layers"), config_size(config, "num_attention_heads")
    kv, hd = config_size(config, "num_key_value_heads") or heads, head_dim(config)
    required = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    optional = {}
    (optional if getattr(config, "tie_word_embeddings", False) else required)["lm_head.weight"] = (vocab, hidden)
    alternatives = []
    pattern = (layer_pattern or sparse_by_step)(config)
    extra = attention(config) if attention is not None else {}
    for i in range(layers or 0):
        p = f"model.layers.{i}."
        required.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                         p + "self_attn.q_proj.weight": (size_product(heads, hd), hidden),
                         p + "self_attn.k_proj.weight": (size_product(kv, hd), hidden),
                         p + "self_attn.v_proj.weight": (size_product(kv, hd), hidden),
                         p + "self_attn.o_proj.weight": (hidden, size_product(heads, hd))})
        required.update({p + name: shape for name, shape in extra.items()})
        if pattern[i]:
            usual, fused, other = sparse_mlp(config)
            usual, fused = ({p + n: s for n, s in group.items()} for group in (usual, fused))
            required.update(usual)
            alternatives.append((usual, fused))
            required.update({p + name: shape for name, shape in other.items()})
        else:
            required.update(glu_mlp(p + "mlp", config_size(config, dense_inner), hidden))
    return CheckpointTensors(required, optional, tuple(alternatives))


def attention_biases(config: Config, *, output: bool) -> dict:
    """q/k/v (and o, with ``output``) projection biases, relative to a decoder layer."""
    hidden, heads = config_size(config, "hidden_size"), config_size(config, "num_attention_heads")
    kv, hd = config_size(config, "num_key_value_heads") or heads, head_dim(config)
    out = {"self_attn.q_proj.bias": (size_product(heads, hd),), "self_attn.k_proj.bias": (size_product(kv, hd),),
           "self_attn.v_proj.bias": (size_product(kv, hd),)}
    if output:
        out["self_attn.o_proj.bias"] = (hidden,)
    return out


def head_dim(config: Config) -> int | None:
    """``head_dim``, else ``hidden_size // num_attention_heads`` (None when the config states neither)."""
    hidden, heads = config_size(config, "hidden_size"), config_size(config, "num_attention_heads")
    return config_size(config, "head_dim") or (hidden // heads if hidden and heads else None)


# --------------------------------------------------------------------------------------------------
# the family and the registry
# --------------------------------------------------------------------------------------------------


#: The paths a family can be verified on beyond routing replay (:attr:`MoEFamily.verified`).
VERIFIED_PATHS = ("aligned", "vllm_digests", "refit")


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
    ``logits_in_fp32``: the transformers router computes its logits in float32 (``x.float() @ W.float().T``,
    DeepSeek-V3) instead of the model's dtype.
    ``bias_attr``: the router's selection-bias buffer (DeepSeek-V3's ``e_score_correction_bias``), added to the scores
    for the top-k choice only; ``""``: the router has none.
    ``moe_layer_pattern(config)``: per decoder layer, 1 if sparse (MoE), 0 if dense.
    ``arch_keys``: the config keys of the record fingerprint (:data:`ARCH_KEYS`, plus the family's own).
    ``megatron``: the Megatron-core conversion pieces, or why it is refused (None: nobody wrote one).
    ``checkpoint_tensors(config)``: the :class:`CheckpointTensors` (names and shapes) a safetensors checkpoint of
    ``config`` holds, checked by :func:`moealign.checkpoint_check.check_checkpoint_tensors` before any engine
    loads it (None: only names, layer numbers and the vocabulary / hidden / expert sizes are checked).
    ``vllm_classes``: the family's own vLLM module classes that hold no arithmetic of their own (the model, its
    decoder layer, attention and sparse-block containers): the canonical forward's audit passes them.
    ``verified``: the paths beyond routing replay verified on this family, of :data:`VERIFIED_PATHS` (``"aligned"``:
    the canonical forward on both engines, bitwise; ``"vllm_digests"``: vLLM's contract states weight digests;
    ``"refit"``: the refit verifier reads vLLM's fused tensors back). Every other family is refused by name there.
    ``derived_tensors``: ``(engine tensor name, checkpoint tensor it is computed from, relative to a decoder layer)``
    pairs an engine derives at load rather than loading (DeepSeek-V3's MLA: ``W_UK_T`` / ``W_UV`` from
    ``self_attn.kv_b_proj.weight``): a refit does not stream them, it has them recomputed and checks them; the refit
    verifier recomputes them from what the engine holds and compares bitwise.
    """

    model_type: str
    router_class: str
    scoring: Callable[[Config], RouterScoring]
    num_experts: Callable[[Config], int]
    scores_in_fp32: bool = False
    logits_in_fp32: bool = False
    bias_attr: str = ""
    moe_layer_pattern: Callable[[Config], tuple[int, ...]] = sparse_by_step
    arch_keys: tuple[str, ...] = ARCH_KEYS
    megatron: MegatronSpec | None = None
    checkpoint_tensors: Callable[[Config], CheckpointTensors] | None = None
    vllm_classes: tuple[str, ...] = ()
    verified: frozenset = frozenset()
    derived_tensors: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ConfigError(f"MoEFamily.model_type must be a non-empty str, got {self.model_type!r}")
        if "model_type" not in self.arch_keys:
            raise ConfigError(f"MoEFamily {self.model_type!r}: arch_keys must include 'model_type'")
        unknown = set(self.verified) - set(VERIFIED_PATHS)
        if unknown:
            raise ConfigError(f"MoEFamily {self.model_type!r}: verified names unknown paths {sorted(unknown)}; known: "
                              f"{list(VERIFIED_PATHS)}")


FAMILIES: dict[str, MoEFamily] = {}


def verified_families(path: str) -> tuple[str, ...]:
    """The registered families on which ``path`` (one of :data:`VERIFIED_PATHS`) is verified, in registration order."""
    if path not in VERIFIED_PATHS:
        raise ConfigError(f"unknown path {path!r}; known: {list(VERIFIED_PATHS)}")
    return tuple(name for name, family in FAMILIES.items() if path in family.verified)
#: model types refused by name (a family module's ``REFUSED_MODEL_TYPES``: a relative it does not cover, and why)
REFUSED: dict[str, str] = {}


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
    if family is None and isinstance(model_type, str) and model_type in REFUSED:
        raise UnsupportedModelError(f"model_type {model_type!r} is not covered: {REFUSED[model_type]}")
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

from . import deepseek_v3, mixtral, olmoe, qwen2_moe, qwen3_moe  # noqa: E402  (they import the classes above)

_BUILTIN = (qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3)

for _module in _BUILTIN:
    register_family(_module.FAMILY)
    REFUSED.update(getattr(_module, "REFUSED_MODEL_TYPES", {}))
del _module
