"""Named precision policies and their translation into each engine's settings.

A :class:`PrecisionPolicy` says, for one rollout/training pair, which dtype the model's parameters and
compute use, which modules are kept in a wider dtype (the MoE routers, the LM head), whether FP8 is
used for the linear layers (format and scaling granularity) and whether the trainer needs loss scaling.
The same policy is translated for every engine, so both sides of an RL loop are configured from one
name:

==========================  ==========  =========  ========  ===================================  ============
name                        dtype       router     lm_head   fp8                                  loss scaling
==========================  ==========  =========  ========  ===================================  ============
``fp32``                    float32     -          -         -                                    none
``bf16``                    bfloat16    -          -         -                                    none
``fp16``                    float16     -          -         -                                    dynamic
``bf16-fp32-router``        bfloat16    float32    -         -                                    none
``bf16-fp32-head``          bfloat16    -          float32   -                                    none
``bf16-fp32-router-head``   bfloat16    float32    float32   -                                    none
``fp16-fp32-router``        float16     float32    -         -                                    dynamic
``fp16-fp32-head``          float16     -          float32   -                                    dynamic
``fp16-fp32-router-head``   float16     float32    float32   -                                    dynamic
``fp8-e4m3-tensor``         bfloat16    -          -         e4m3, one scale per tensor           none
``fp8-e4m3-block``          bfloat16    -          -         e4m3, 128x128 weights, 1x128 inputs  none
==========================  ==========  =========  ========  ===================================  ============

("-": same as ``dtype``.) Two more regions can be set per policy (no registered policy does):
``attention_dtype`` (each decoder layer's self-attention module) and ``experts_dtype`` (each MoE layer's
experts module, not its router nor a shared expert). Unlike the router and the head, their *outputs* are cast
back to ``dtype`` (the residual stream stays in ``dtype``); only transformers can express them
(:func:`megatron_gaps` / :func:`vllm_gaps` say so). FP8 policies quantise the inputs and weights of the linear layers (attention
projections, expert matrices); embeddings, norms, routers and the LM head stay in ``dtype``, as in
the DeepSeek-V3 / transformer-engine recipes. Where no FP8 kernels exist (CPU, no transformer-engine) the
same policy is *simulated* by :mod:`moealign.precision.fp8`: values are rounded to FP8 and rescaled
(fake quantisation) and the matmul runs in ``dtype`` (bf16 by default; use
``policy.replace(dtype=torch.float32)`` to isolate the FP8 rounding from bf16 rounding).

Translators (all pure; none imports an engine):

* :func:`to_transformers` -> ``{"dtype", "module_dtypes", "fp32_buffers", "fp8"}``, applied to a live
  transformers model by :func:`moealign.patches.hf.precision.apply_precision`.
* :func:`to_megatron_config_fields` -> ``TransformerConfig`` fields; :func:`to_megatron_optimizer_fields`
  -> ``OptimizerConfig`` fields (Megatron keeps loss scaling in the optimizer config); :func:`megatron_gaps`
  lists what the config fields cannot express.
* :func:`to_vllm_engine_args` -> ``vllm.LLM`` / ``EngineArgs`` keyword arguments; :func:`vllm_gaps` lists
  what those arguments cannot express.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._validate import POLICY_DTYPES as _FLOAT_DTYPES
from ..errors import ConfigError, EngineError, InputTypeError, UnknownPolicyError

__all__ = [
    "Fp8Spec",
    "LossScaling",
    "PrecisionPolicy",
    "POLICIES",
    "register_policy",
    "get_policy",
    "UnknownPolicyError",
    "ROUTER",
    "LM_HEAD",
    "ATTENTION",
    "EXPERTS",
    "ROLES",
    "to_transformers",
    "to_megatron_config_fields",
    "to_megatron_optimizer_fields",
    "megatron_gaps",
    "to_vllm_engine_args",
    "vllm_gaps",
    "dtype_name",
]

# module roles a policy can override (the transformers side resolves them to module names)
ROUTER = "router"
LM_HEAD = "lm_head"
ATTENTION = "attention"    # each decoder layer's self-attention module (output cast back to the policy's dtype)
EXPERTS = "experts"        # each MoE layer's experts module (output cast back to the policy's dtype)
#: every role, in the order a policy names them
ROLES = (ROUTER, LM_HEAD, ATTENTION, EXPERTS)
#: the roles whose module output is cast back to the policy's ``dtype`` (regions inside the residual stream)
OUTPUT_CAST_ROLES = (ATTENTION, EXPERTS)


@dataclass(frozen=True)
class Fp8Spec:
    """FP8 for linear layers.

    ``fmt``: ``"e4m3"`` (float8_e4m3fn, max 448) or ``"e5m2"`` (max 57344).
    ``scaling``: ``"tensor"`` (one scale per tensor, from its current amax) or ``"block"`` (one scale per
    ``weight_block`` tile of each weight matrix and per ``act_block`` tile of each input, i.e. 128x128
    weight tiles and 1x128 per-token input tiles, transformer-engine's blockwise / DeepSeek-V3 layout).
    ``activations``: also quantise the inputs of the linear layers (not only the weights).
    """

    fmt: Literal["e4m3", "e5m2"] = "e4m3"
    scaling: Literal["tensor", "block"] = "tensor"
    weight_block: tuple[int, int] = (128, 128)
    act_block: tuple[int, int] = (1, 128)
    activations: bool = True

    def __post_init__(self):
        if self.fmt not in ("e4m3", "e5m2"):
            raise ConfigError(f"Fp8Spec.fmt must be 'e4m3' or 'e5m2', got {self.fmt!r}")
        if self.scaling not in ("tensor", "block"):
            raise ConfigError(f"Fp8Spec.scaling must be 'tensor' or 'block', got {self.scaling!r}")
        for label, block in (("weight_block", self.weight_block), ("act_block", self.act_block)):
            if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
                raise ConfigError(f"Fp8Spec.{label} must be two positive ints, got {block!r}")


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling for fp16 training (see :class:`moealign.precision.loss_scale.DynamicLossScaler`).

    Defaults follow the FP16-RL recipe (Qi et al. 2025: ``growth_interval=400``) and Megatron's
    ``--initial-loss-scale 2**32 --min-loss-scale 1``; ``hysteresis`` is Megatron's count of overflows
    tolerated before the scale backs off.
    """

    initial_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 400
    min_scale: float = 1.0
    hysteresis: int = 1


@dataclass(frozen=True)
class PrecisionPolicy:
    """One precision setup for rollout and training.

    ``dtype``: parameters and compute of every module not overridden. ``router_dtype`` /
    ``lm_head_dtype``: parameters and compute of the MoE routers / the LM head (``None``: ``dtype``); a
    module kept wider than the model gets its input cast up on entry. ``attention_dtype`` /
    ``experts_dtype``: the same for each decoder layer's self-attention / each MoE layer's experts module,
    whose floating outputs are also cast back to ``dtype`` (the residual stream keeps ``dtype``;
    transformers only, see :func:`megatron_gaps` / :func:`vllm_gaps`). ``fp8``: FP8 linear layers.
    ``loss_scaling``: the trainer scales the loss (fp16). ``fp32_buffers``: regular expressions
    (``re.search`` on the buffer's qualified name) of floating buffers kept in float32 whatever ``dtype``
    is (rotary frequencies are computed in fp32 by transformers and Megatron alike; DeepSeek-V3's router
    ``e_score_correction_bias`` is held in float32 by transformers, ``_keep_in_fp32_modules_strict``, and vLLM).
    """

    name: str
    dtype: torch.dtype
    router_dtype: torch.dtype | None = None
    lm_head_dtype: torch.dtype | None = None
    fp8: Fp8Spec | None = None
    loss_scaling: LossScaling | None = None
    fp32_buffers: tuple[str, ...] = (r"(^|\.)(original_)?inv_freq$", r"(^|\.)e_score_correction_bias$")
    description: str = ""
    attention_dtype: torch.dtype | None = None
    experts_dtype: torch.dtype | None = None

    def __post_init__(self):
        for label in ("dtype", "router_dtype", "lm_head_dtype", "attention_dtype", "experts_dtype"):
            value = getattr(self, label)
            if value is None and label != "dtype":
                continue
            if value not in _FLOAT_DTYPES:
                raise ConfigError(f"PrecisionPolicy.{label} must be one of "
                                 f"{[dtype_name(d) for d in _FLOAT_DTYPES]}, got {value!r}")
        if self.fp8 is not None and self.dtype == torch.float16:
            raise ConfigError("FP8 policies compute in bfloat16 or float32, not float16")

    def module_dtype(self, role: str | None) -> torch.dtype:
        """The dtype of a module with ``role`` (one of :data:`ROLES` or ``None``)."""
        if role is None:
            return self.dtype
        field_name = _ROLE_FIELDS.get(role) if isinstance(role, str) else None
        if field_name is None:
            raise ConfigError(f"unknown module role {role!r} (known: {', '.join(repr(r) for r in ROLES)})")
        value = getattr(self, field_name)
        return self.dtype if value is None else value

    @property
    def overrides(self) -> dict[str, torch.dtype]:
        """Roles whose dtype differs from ``dtype``."""
        return {role: self.module_dtype(role) for role in ROLES if self.module_dtype(role) != self.dtype}

    def replace(self, **changes: Any) -> "PrecisionPolicy":
        """A copy with ``changes`` (e.g. ``replace(dtype=torch.float32)`` for FP8 simulated over fp32)."""
        return dataclasses.replace(self, **changes)


_ROLE_FIELDS = {ROUTER: "router_dtype", LM_HEAD: "lm_head_dtype", ATTENTION: "attention_dtype",
                EXPERTS: "experts_dtype"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


POLICIES: dict[str, PrecisionPolicy] = {}


def register_policy(policy: PrecisionPolicy, *, overwrite: bool = False) -> PrecisionPolicy:
    if policy.name in POLICIES and not overwrite:
        raise ConfigError(f"precision policy {policy.name!r} is already registered (pass overwrite=True)")
    POLICIES[policy.name] = policy
    return policy


def get_policy(policy: str | PrecisionPolicy) -> PrecisionPolicy:
    """The registered policy called ``policy`` (a policy object passes through)."""
    if isinstance(policy, PrecisionPolicy):
        return policy
    if not isinstance(policy, str):
        raise InputTypeError(f"a precision policy is a name or a PrecisionPolicy, got {type(policy).__name__}")
    try:
        return POLICIES[policy]
    except KeyError:
        raise UnknownPolicyError(f"unknown precision policy {policy!r}; known: {sorted(POLICIES)}") from None


register_policy(PrecisionPolicy("fp32", torch.float32, description="everything in float32 (the reference)"))
register_policy(PrecisionPolicy("bf16", torch.bfloat16, description="everything in bfloat16 (the common default)"))
register_policy(PrecisionPolicy("fp16", torch.float16, loss_scaling=LossScaling(),
                                description="everything in float16 with dynamic loss scaling (Qi et al. 2025)"))
register_policy(PrecisionPolicy("bf16-fp32-router", torch.bfloat16, router_dtype=torch.float32,
                                description="bfloat16, MoE routers in float32 (inputs cast up)"))
register_policy(PrecisionPolicy("bf16-fp32-head", torch.bfloat16, lm_head_dtype=torch.float32,
                                description="bfloat16, LM head in float32 (inputs cast up)"))
register_policy(PrecisionPolicy("bf16-fp32-router-head", torch.bfloat16, router_dtype=torch.float32,
                                lm_head_dtype=torch.float32,
                                description="bfloat16, MoE routers and LM head in float32 (inputs cast up)"))
register_policy(PrecisionPolicy("fp16-fp32-router", torch.float16, router_dtype=torch.float32,
                                loss_scaling=LossScaling(),
                                description="float16, MoE routers in float32 (inputs cast up)"))
register_policy(PrecisionPolicy("fp16-fp32-head", torch.float16, lm_head_dtype=torch.float32,
                                loss_scaling=LossScaling(),
                                description="float16, LM head in float32 (inputs cast up)"))
register_policy(PrecisionPolicy("fp16-fp32-router-head", torch.float16, router_dtype=torch.float32,
                                lm_head_dtype=torch.float32, loss_scaling=LossScaling(),
                                description="float16, MoE routers and LM head in float32 (inputs cast up)"))
register_policy(PrecisionPolicy("fp8-e4m3-tensor", torch.bfloat16, fp8=Fp8Spec("e4m3", "tensor"),
                                description="FP8 e4m3 linear layers, per-tensor current scaling, bf16 compute"))
register_policy(PrecisionPolicy("fp8-e4m3-block", torch.bfloat16, fp8=Fp8Spec("e4m3", "block"),
                                description="FP8 e4m3 linear layers, 128x128 weight / 1x128 input blocks, "
                                            "bf16 compute"))


# --------------------------------------------------------------------------------------------------
# translators
# --------------------------------------------------------------------------------------------------


def to_transformers(policy: str | PrecisionPolicy) -> dict[str, Any]:
    """transformers settings: ``dtype`` (for ``from_pretrained(dtype=...)`` / ``model.to``),
    ``module_dtypes`` (role -> dtype overrides), ``fp32_buffers`` and ``fp8`` (an :class:`Fp8Spec` or None)."""
    policy = get_policy(policy)
    return {"dtype": policy.dtype, "module_dtypes": policy.overrides, "fp32_buffers": policy.fp32_buffers,
            "fp8": policy.fp8}


_MEGATRON_FP8_RECIPE = {"tensor": "tensorwise", "block": "blockwise"}


def _te_available() -> bool:
    from .._optional import (
        probe,  # stdlib-only helper; imports transformer_engine only when asked
    )

    return probe("transformer_engine").available


def to_megatron_config_fields(policy: str | PrecisionPolicy, te_available: bool | None = None, *,
                              simulate_fp8: bool = False) -> dict[str, Any]:
    """``megatron.core.transformer.TransformerConfig`` fields for ``policy``.

    ``fp16`` / ``bf16`` / ``params_dtype`` always; ``moe_router_dtype="fp32"`` when routers are kept in
    float32; ``fp8`` / ``fp8_recipe`` (``"tensorwise"`` or ``"blockwise"``) for FP8 policies, which need
    transformer-engine (``te_available=None`` probes for it). Without it this raises, unless
    ``simulate_fp8=True``: then the fields describe the ``dtype`` model and FP8 is simulated with
    :func:`moealign.precision.fp8.fake_quant_fp8_` on the built model.

    Megatron has no field for an fp32 output layer: with ``lm_head_dtype`` set, the caller (the Megatron
    adapter) casts the output layer itself. Loss scaling lives in :func:`to_megatron_optimizer_fields`.
    """
    policy = get_policy(policy)
    fields: dict[str, Any] = {
        "fp16": policy.dtype == torch.float16,
        "bf16": policy.dtype == torch.bfloat16,
        "params_dtype": policy.dtype,
        "moe_router_dtype": None,
    }
    if policy.router_dtype is not None and policy.router_dtype != policy.dtype:
        if policy.router_dtype != torch.float32:
            raise ConfigError(f"Megatron computes routers in fp32 or fp64 only, policy {policy.name!r} asks for "
                             f"{dtype_name(policy.router_dtype)}")
        fields["moe_router_dtype"] = "fp32"
    if policy.fp8 is not None:
        if te_available is None:
            te_available = _te_available()
        if te_available:
            if policy.fp8.fmt != "e4m3":
                raise ConfigError(f"Megatron's fp8 formats are 'e4m3' and 'hybrid' (e4m3 forward, e5m2 backward); "
                                 f"policy {policy.name!r} asks for {policy.fp8.fmt!r} everywhere")
            if policy.fp8.scaling == "block" and (policy.fp8.weight_block, policy.fp8.act_block) != ((128, 128), (1, 128)):
                raise ConfigError(f"transformer-engine's blockwise recipe uses 128x128 weight and 1x128 input tiles, "
                                 f"policy {policy.name!r} asks for {policy.fp8.weight_block} / {policy.fp8.act_block}")
            fields["fp8"] = "e4m3"
            fields["fp8_recipe"] = _MEGATRON_FP8_RECIPE[policy.fp8.scaling]
        elif not simulate_fp8:
            raise EngineError(f"policy {policy.name!r} needs FP8 and Megatron's FP8 needs transformer-engine, which "
                               f"is not available; pass simulate_fp8=True to simulate FP8 with "
                               f"moealign.precision.fp8.fake_quant_fp8_ instead")
    return fields


def to_megatron_optimizer_fields(policy: str | PrecisionPolicy) -> dict[str, Any]:
    """``megatron.core.optimizer.OptimizerConfig`` fields: precision and (fp16) dynamic loss scaling
    (``loss_scale=None`` selects dynamic scaling in Megatron)."""
    policy = get_policy(policy)
    fields: dict[str, Any] = {"fp16": policy.dtype == torch.float16, "bf16": policy.dtype == torch.bfloat16,
                              "params_dtype": policy.dtype}
    if policy.loss_scaling is not None:
        ls = policy.loss_scaling
        fields.update(loss_scale=None, initial_loss_scale=ls.initial_scale, min_loss_scale=ls.min_scale,
                      loss_scale_window=ls.growth_interval, hysteresis=ls.hysteresis)
    return fields


def megatron_gaps(policy: str | PrecisionPolicy) -> list[str]:
    """What the fields of :func:`to_megatron_config_fields` cannot express for ``policy`` (empty when
    nothing); a Megatron model built from those fields alone runs something else where a gap is listed.
    (FP8 without transformer-engine is not a gap: the translator refuses it, or simulates it when asked.)"""
    policy = get_policy(policy)
    gaps = []
    if policy.router_dtype is not None and policy.router_dtype != policy.dtype:
        gaps.append(f"router in {dtype_name(policy.router_dtype)}: Megatron's moe_router_dtype computes the router "
                    f"in fp32 from its weights stored (rounded) in {dtype_name(policy.dtype)}, not a "
                    f"{dtype_name(policy.router_dtype)} router; the Megatron adapter must keep the router weights in "
                    f"{dtype_name(policy.router_dtype)} itself")
    if policy.lm_head_dtype is not None and policy.lm_head_dtype != policy.dtype:
        gaps.append(f"LM head in {dtype_name(policy.lm_head_dtype)}: TransformerConfig has no output-layer dtype; "
                    f"the Megatron adapter must cast the output layer")
    gaps.extend(_region_gaps(policy, "Megatron-core: TransformerConfig has one params_dtype for every layer (no "
                                     "per-module dtype), and nothing in moealign's Megatron adapter casts these "
                                     "modules"))
    return gaps


def _region_gaps(policy: PrecisionPolicy, why: str) -> list[str]:
    """The attention / experts regions whose dtype differs from ``dtype``: no engine but transformers runs them."""
    gaps = []
    for what, dtype in (("self-attention", policy.attention_dtype), ("MoE experts", policy.experts_dtype)):
        if dtype is not None and dtype != policy.dtype:
            gaps.append(f"{what} in {dtype_name(dtype)} inside a {dtype_name(policy.dtype)} model: {why}; only "
                        f"moealign.patches.hf.precision.apply_precision runs it (outputs cast back to "
                        f"{dtype_name(policy.dtype)})")
    return gaps


_VLLM_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_VLLM_FP8 = {"tensor": "fp8_per_tensor", "block": "fp8_per_block"}


def to_vllm_engine_args(policy: str | PrecisionPolicy) -> dict[str, Any]:
    """``vllm.LLM(**args)`` precision arguments (vLLM 0.33 names).

    ``dtype``; ``quantization`` ``"fp8_per_tensor"`` / ``"fp8_per_block"`` (online FP8 of a bf16
    checkpoint, 128x128 blocks) for FP8 policies; ``kv_cache_dtype="auto"`` (the KV cache follows
    ``dtype``: the trainer does not quantise attention, so an FP8 KV cache would be a mismatch the
    policy does not ask for); ``hf_overrides={"head_dtype": "float32"}`` for an fp32 LM head.
    An fp32 router and fp32 LM-head parameters are built by :func:`moealign.patches.vllm.apply_precision`;
    :func:`vllm_gaps` lists what neither can express.
    """
    policy = get_policy(policy)
    args: dict[str, Any] = {"dtype": _VLLM_DTYPE[policy.dtype], "quantization": None, "kv_cache_dtype": "auto"}
    if policy.fp8 is not None:
        if policy.fp8.fmt != "e4m3":
            raise ConfigError(f"vLLM's online FP8 is e4m3; policy {policy.name!r} asks for {policy.fp8.fmt!r}")
        if policy.fp8.scaling == "block" and policy.fp8.weight_block != (128, 128):
            raise ConfigError(f"vLLM's fp8_per_block uses 128x128 weight blocks, policy {policy.name!r} asks for "
                             f"{policy.fp8.weight_block}")
        args["quantization"] = _VLLM_FP8[policy.fp8.scaling]
    if policy.lm_head_dtype is not None and policy.lm_head_dtype != policy.dtype:
        args["hf_overrides"] = {"head_dtype": _VLLM_DTYPE[policy.lm_head_dtype]}
    return args


def vllm_gaps(policy: str | PrecisionPolicy) -> list[str]:
    """What neither :func:`to_vllm_engine_args` nor moealign's vLLM adapter can express for ``policy`` (empty
    when nothing). An fp32 router or LM head is not a gap: vLLM has no engine argument for fp32 *parameters*,
    :func:`moealign.patches.vllm.apply_precision` builds them (in every worker through the plugin)."""
    policy = get_policy(policy)
    gaps = []
    for what, dtype in (("router", policy.router_dtype), ("LM head", policy.lm_head_dtype)):
        if dtype is not None and dtype not in (policy.dtype, torch.float32):
            gaps.append(f"{what} in {dtype_name(dtype)}: vLLM has no argument for it and moealign's vLLM adapter "
                        f"(moealign.patches.vllm.apply_precision) builds it in fp32 only")
    if policy.fp8 is not None and policy.fp8.scaling == "block" and policy.fp8.act_block != (1, 128):
        gaps.append(f"input tiles {policy.fp8.act_block}: vLLM's fp8_per_block quantises inputs in 1x128 groups")
    gaps.extend(_region_gaps(policy, "vLLM builds every attention and fused-MoE layer in the engine's one dtype "
                                     "(no engine argument per module), and moealign's vLLM adapter rebuilds only "
                                     "the router and the LM head"))
    return gaps
