"""The canonical forward (:mod:`moealign.precision.canonical`) installed into a transformers ``qwen3_moe`` model
instance, so its logits and log-probs equal vLLM's and Megatron's under their own bindings
(:mod:`moealign.patches.vllm.canonical`, :mod:`moealign.patches.megatron.canonical`) bit for bit.

What is swapped (instance attributes and forward hooks of one model; the class is never touched):

* every ``nn.Linear`` of the attention (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) -> ``c_linear``; the LM head
  (``get_output_embeddings()``) -> ``c_linear`` (op ``lm_head``);
* every ``Qwen3MoeRMSNorm`` (input, post-attention, final, the per-head q / k norms) -> ``c_rms_norm``;
* ``Qwen3MoeAttention.forward`` -> the same steps in the same order, with ``c_rope`` from the canonical table (the
  positions are the ``position_ids`` the decoder passes, those ``generate()`` derives from the attention mask) and
  the canonical attention: the model's attention implementation becomes :data:`CANONICAL_ATTENTION`, whose mask is
  a boolean ``[B, 1, Q, K]`` (True = attend, never skipped) and whose function runs ``c_attention`` per sequence,
  each query row over its own valid keys, compacted (a decode step over the KV cache gives the full forward's
  row); a query row with no valid key (a left-padding row of a prefill) attends its first key, so padding rows
  stay finite and never reach a valid row;
* the router: a forward hook (registered first) replaces ``(logits, gates, ids)`` with the fp32 ``c_linear``
  logits, ``c_topk`` (ties: the lower id; a router whose ``forward`` was replaced on the instance, routing replay,
  keeps the forced ids) in ascending id and ``c_gates``; route capture and the replay verifier see these ids;
* ``Qwen3MoeExperts.forward`` -> ``c_experts`` per (token, expert) and ``c_combine`` in ascending expert id.

The log-softmax of the processed log-probs is not a module: the transformers rollout engine runs
:func:`~moealign.patches.hf.rollout.generate_with_record` under
:func:`~moealign.precision.canonical.log_softmax_mode` (:func:`canonical_log_softmax`), the scorer does the same.

Refused at setup, naming it (:class:`~moealign.errors.CanonicalError`): a family other than ``qwen3_moe``, a config
:func:`~moealign.precision.canonical.check_canonical_model` refuses (sliding window, scaled RoPE, dense MLP layers,
...), a dtype other than fp32 / bf16 or mixed dtypes, an attention implementation other than ``eager`` / ``sdpa`` /
``moealign_bi`` (flash, flex and paged attention keep their own masks and caches), a router with a bias or another
scoring, attention dropout in training mode, a module of a class the canonical forward does not know.

**On CUDA** the same binding runs the Triton kernels: every ``C.c_*`` call dispatches on its input's device
(:mod:`moealign.precision.canonical`, the backend), and :func:`apply_canonical_forward` calls
:func:`~moealign.precision.canonical_triton.check_canonical_cuda` once for the model's device and dtype (no Triton, a
GPU below compute capability 8.0, TF32 switched on: refused by name before any op is installed).
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch

from ...errors import CanonicalError, ConfigError
from ...handle import PatchHandle
from ...precision import canonical as C

__all__ = ["HF_OPS", "HF_FAMILIES", "MODEL_OPS", "CANONICAL_ATTENTION", "apply_canonical_forward",
           "canonical_log_softmax"]

#: The ops of :data:`~moealign.precision.canonical.SPEC` this binding covers (``log_softmax``: the rollout engine's
#: and the scorer's, :func:`canonical_log_softmax`).
HF_OPS = C.engine_ops("hf")
#: The ops installed into the model's modules (all of :data:`HF_OPS` but the log-softmax).
MODEL_OPS = tuple(op for op in HF_OPS if op != "log_softmax")

#: The name of the canonical attention in transformers' attention and mask registries.
CANONICAL_ATTENTION = "moealign_canonical"
#: The attention implementations whose masks and KV caches the canonical attention replaces (others refused).
_ATTENTION_REPLACEABLE = (None, "eager", "sdpa", "moealign_bi")

#: The families this binding covers (the commands refuse others before loading: MismatchConfig).
HF_FAMILIES = ("qwen3_moe",)
#: Module classes with no arithmetic of their own (containers, the embedding lookup, which is exact, the rotary
#: embedding whose cos / sin the canonical RoPE does not read) or whose arithmetic is replaced by a patched parent.
_PASSIVE = {"Qwen3MoeForCausalLM", "Qwen3MoeModel", "ModuleList", "Embedding", "Qwen3MoeDecoderLayer",
            "Qwen3MoeSparseMoeBlock", "Qwen3MoeRotaryEmbedding", "Dropout", "Identity"}


def canonical_log_softmax(ops=HF_OPS):
    """The context a transformers rollout records its processed log-probs in: the canonical log-softmax
    (:func:`~moealign.precision.canonical.log_softmax_mode`) when ``log_softmax`` is among ``ops``, else nothing."""
    return C.log_softmax_mode() if "log_softmax" in ops else contextlib.nullcontext()


def _attention_function(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature: ``query [B, H, Q, d]``, ``key`` / ``value [B, KVH, K, d]``, a
    boolean ``[B, 1, Q, K]`` mask (True = attend); returns ``([B, Q, H, d], None)``."""
    if dropout and module.training:
        raise CanonicalError(f"the canonical attention has no dropout (got dropout={dropout} in training mode)")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        raise CanonicalError(f"the canonical attention needs the boolean [B, 1, Q, K] mask of its own mask builder "
                             f"(attn_implementation={CANONICAL_ATTENTION!r}), got "
                             f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)}")
    B, H, Q, d = query.shape
    if scaling is not None and not math.isclose(scaling, 1.0 / math.sqrt(d), rel_tol=1e-12):
        raise CanonicalError(f"the canonical attention scales by 1 / sqrt(head_dim); this module scales by {scaling}")
    K = key.shape[2]
    head_map = torch.arange(H, device=query.device) // (H // key.shape[1])
    first = torch.arange(K, device=query.device) == 0
    mask = attention_mask.expand(B, 1, Q, K)
    outs = []
    for b in range(B):
        keep = mask[b, 0]
        keep = keep | (~keep.any(-1, keepdim=True) & first)        # a row with no valid key: its first key
        k = key[b][head_map].transpose(0, 1)[None]                   # [1, K, H, d]
        v = value[b][head_map].transpose(0, 1)[None]
        outs.append(C.c_attention(query[b].transpose(0, 1), k, v, keep))
    return torch.stack(outs), None


def _register_canonical_attention() -> str:
    """Register :data:`CANONICAL_ATTENTION` with transformers' attention registry (the canonical attention
    function) and mask registry (the batch-invariant attention's boolean mask builder, never skipped:
    :mod:`moealign.patches.hf.attention`) for the rest of the process (idempotent, as
    :func:`~moealign.patches.hf.attention.register_bi_attention`); returns the name."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from .attention import register_bi_attention

    bi = register_bi_attention()
    if AttentionInterface._global_mapping.get(CANONICAL_ATTENTION) is not _attention_function:
        AttentionInterface.register(CANONICAL_ATTENTION, _attention_function)
    if CANONICAL_ATTENTION not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(CANONICAL_ATTENTION, AttentionMaskInterface._global_mapping[bi])
    return CANONICAL_ATTENTION


def _linear_forward(module, out_dtype=None):
    def forward(x):
        return C.c_linear(x, module.weight, module.bias, out_dtype=out_dtype)
    return forward


def _norm_forward(module):
    def forward(x):
        return C.c_rms_norm(x, module.weight, module.variance_epsilon)
    return forward


def _attention_forward(module, ops, rot: int, base: float):
    """Qwen3MoeAttention.forward with the canonical RoPE and attention (the projections and norms are the module's
    own submodules, patched or not)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(module).__module__]
    stock_rope, eager = modeling.apply_rotary_pos_emb, modeling.eager_attention_forward

    def forward(hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, module.head_dim)
        q = module.q_norm(module.q_proj(hidden_states).view(hidden_shape))            # [B, S, H, d]
        k = module.k_norm(module.k_proj(hidden_states).view(hidden_shape))
        v = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if "rope" in ops:
            positions = kwargs.get("position_ids")
            if positions is None:
                raise CanonicalError("the canonical RoPE reads the decoder's position_ids; this call passed none")
            cos, sin = C.rope_cos_sin(positions, rot, base)                             # [B or 1, S, rot / 2]
            q, k = C.c_rope(q, cos, sin).transpose(1, 2), C.c_rope(k, cos, sin).transpose(1, 2)
        else:
            q, k = stock_rope(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, module.layer_idx)
        interface = (_attention_function if "attention" in ops      # called directly: never a registry fallback
                     else ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager))
        out, weights = interface(module, q, k, v, attention_mask,
                                 dropout=0.0 if not module.training else module.attention_dropout,
                                 scaling=module.scaling, sliding_window=module.sliding_window, **kwargs)
        return module.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
    return forward


def _router_hook(renormalize: bool):
    def hook(module, args, kwargs, output):
        h = (args[0] if args else kwargs["hidden_states"]).reshape(-1, module.hidden_dim)
        logits = C.c_linear(h, module.weight, out_dtype=torch.float32)
        if "forward" in vars(module):                    # routing replay: the forced ids, ascending
            ids = torch.sort(output[2], dim=-1).values
        else:
            ids = C.c_topk(logits, module.top_k)
        return logits, C.c_gates(logits, ids, renormalize=renormalize), ids
    return hook


def _experts_forward(module):
    def forward(hidden_states, top_k_index, top_k_weights):
        ids, order = torch.sort(top_k_index, dim=-1)
        gates = torch.gather(top_k_weights, 1, order)
        partials = C.c_experts(hidden_states, ids, module.gate_up_proj, module.down_proj)
        return C.c_combine(partials, gates, hidden_states.dtype)
    return forward


def _check_model(model, ops) -> tuple[int, float]:
    """The refusals of the module docstring; returns the RoPE's ``(rotary_dim, base)``."""
    config = model.config
    family = getattr(config, "model_type", None)
    if family not in HF_FAMILIES:
        raise CanonicalError(f"the transformers canonical forward covers {list(HF_FAMILIES)} models; model_type "
                             f"{family!r} is not covered")
    C.check_canonical_model(config.to_dict())
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16}:
        raise CanonicalError(f"the canonical forward covers one dtype, fp32 or bf16; this model holds "
                             f"{sorted(str(d).replace('torch.', '') for d in dtypes)}")
    attention = getattr(config, "_attn_implementation", None)
    if "attention" in ops and attention not in _ATTENTION_REPLACEABLE + (CANONICAL_ATTENTION,):
        raise CanonicalError(f"the canonical attention replaces the eager / sdpa / moealign_bi attention and its mask; "
                             f"attn_implementation {attention!r} keeps its own mask and KV cache (not covered)")
    head = model.get_output_embeddings()
    escaped = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in _PASSIVE:
            continue
        if cls == "Linear" and (module is head or name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")
                                and ".self_attn." in f".{name}"):
            continue
        if cls == "Qwen3MoeAttention" and getattr(module, "sliding_window", None) is not None:
            escaped.append(f"{name} ({cls}: sliding window {module.sliding_window})")
            continue
        if cls in ("Qwen3MoeRMSNorm", "Qwen3MoeAttention", "Qwen3MoeExperts"):
            continue
        if name.endswith(".experts.act_fn") and cls == "SiLUActivation":
            continue                                 # inside the experts' forward, which c_experts replaces
        if cls == "Qwen3MoeTopKRouter":
            if getattr(module, "bias", None) is not None:
                escaped.append(f"{name} ({cls}: a router bias)")
            continue
        escaped.append(f"{name} ({cls})")
    if escaped:
        raise CanonicalError("the canonical forward does not cover these transformers modules: "
                             + ", ".join(escaped[:12])
                             + (f" (+{len(escaped) - 12} more)" if len(escaped) > 12 else ""))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise CanonicalError("the checkpoint's config names no RoPE theta (rope_parameters.rope_theta)")
    return int(head_dim), float(base)


def apply_canonical_forward(model: torch.nn.Module, ops=MODEL_OPS) -> PatchHandle:
    """Install the canonical ops ``ops`` (default every op of :data:`MODEL_OPS`) into a transformers ``qwen3_moe``
    model instance (module docstring); ``log_softmax`` (:func:`canonical_log_softmax`) and ops with no ``"hf"``
    location in :data:`~moealign.precision.canonical.SPEC` are ignored here. Returns a
    :class:`~moealign.handle.PatchHandle` (scope ``"instance"``); ``undo()`` restores the stock forward (the
    :data:`CANONICAL_ATTENTION` registry entries stay, unused, for the process)."""
    ops = tuple(ops)
    unknown = sorted(set(ops) - set(C.OPS))
    if unknown:
        raise ConfigError(f"unknown canonical ops {unknown}; known: {list(C.OPS)}")
    ops = tuple(op for op in ops if op in MODEL_OPS)          # ops of other engines' families: none to install here
    rot, base = _check_model(model, ops)
    param = next(model.parameters())
    C.check_device_backend(param.device, param.dtype)      # on CUDA: the Triton kernels' refusals, once, here
    if "rope" in ops:
        C.rope_reserve(int(model.config.max_position_embeddings), rot, base, next(model.parameters()).device)
    renormalize = bool(getattr(model.config, "norm_topk_prob", True))
    head = model.get_output_embeddings()
    handle = PatchHandle(f"transformers canonical forward ({', '.join(ops)}) on {type(model).__name__}", "instance")
    try:
        if "attention" in ops:
            name = _register_canonical_attention()
            handle.set_attr(model.config, "_attn_implementation_internal", name,
                            f"config._attn_implementation -> {name!r}")
        for name, module in model.named_modules():
            cls = type(module).__name__
            if module is head:
                if "lm_head" in ops:
                    handle.set_attr(module, "forward", _linear_forward(module), f"{name}.forward")
            elif cls == "Linear" and "linear" in ops:
                handle.set_attr(module, "forward", _linear_forward(module), f"{name}.forward")
            elif cls == "Qwen3MoeRMSNorm" and "norm" in ops:
                handle.set_attr(module, "forward", _norm_forward(module), f"{name}.forward")
            elif cls == "Qwen3MoeAttention" and {"rope", "attention"} & set(ops):
                handle.set_attr(module, "forward", _attention_forward(module, ops, rot, base), f"{name}.forward")
            elif cls == "Qwen3MoeTopKRouter" and "router" in ops:
                handle.add_hook(module.register_forward_hook(_router_hook(renormalize), with_kwargs=True,
                                                             prepend=True), f"{name} (canonical router hook)")
            elif cls == "Qwen3MoeExperts" and "experts" in ops:
                handle.set_attr(module, "forward", _experts_forward(module), f"{name}.forward")
    except BaseException:
        handle.undo()
        raise
    return handle
