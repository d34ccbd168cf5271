"""The canonical forward (:mod:`moealign.precision.canonical`) installed into vLLM: every op of the model runs
moealign's one implementation, so vLLM's log-probs equal Megatron's (under the same patch) bit for bit.

Class-level, applied before the engine loads its model, in every vLLM process (the ``vllm.general_plugins``
entry point does it from ``MOEALIGN_VLLM_PATCHES=canonical``; :func:`apply_canonical_forward` in-process):

* linear layers, the LM head, the row-parallel all-reduce and every other all-reduce: the tree forward of
  :func:`~moealign.patches.vllm.tree_reduce.apply_tree_reductions` at the canonical leaf width (TP-invariant);
* ``RMSNorm`` (with its fused residual add), ``RotaryEmbedding`` (NeoX style, from the canonical table);
* attention: ``CPUAttentionBackendImpl``: keys and values are also written to a shadow cache in the
  canonical layout (one row per slot, any ISA), and each query row attends its own sequence's keys
  ``0 .. position`` from it, prefill or decode alike (the paged cache's ISA-specific layout is never read);
* the router: ``GateLinear`` keeps fp32 logits; ``FusedTopKRouter._compute_routing`` takes the canonical top-k
  and gates (the recorder's capture hook still sees the chosen ids); the experts and their combine
  (``RoutedExperts.forward_modular``, through the tree forward's experts);
* the sampler's processed log-probs (``TopKTopPSampler.forward_cpu`` / ``forward_native``): the canonical
  log-softmax of the same masked logits (the sampling itself is vLLM's).

DeepSeek-V3 (MLA on the ``CPU_MLA`` backend, which ``CpuPlatform.get_attn_backend_cls`` is made to choose also on an
AMX CPU; the sigmoid grouped router, shared experts, dense first layers):

* ``MLAAttention.forward_impl``: ``CPUMLAImpl.do_kv_cache_update`` also writes a shadow cache of each slot's
  *expanded* keys ``[k_nope; k_pe]`` and values (``kv_b_proj`` of the normed latent: the tree linear, row by row) and
  every query row, decode or prefill, attends its sequence's keys ``0 .. position`` with ``c_attention`` (the
  non-absorbed math Megatron's MLA computes); vLLM's absorbed decode (``W_UK_T`` / ``W_UV``) and SDPA prefill never run;
* the interleaved rope (``is_neox_style=False``): ``c_rope_deinterleaved`` (output in the NeoX layout, as Megatron's);
* ``CPURouter._compute_routing`` with sigmoid scores: ``c_grouped_topk`` and ``c_sigmoid_gates``; the MoE runner
  scales the routed output by ``routed_scaling_factor`` and adds the shared expert's (both in the activation dtype,
  vLLM's own order, which Megatron's binding follows); ``SiluAndMul`` (the shared expert, the dense layers):
  ``c_silu_and_mul``;
* at vLLM TP 2 / 4 (the trainer on one rank): MLA's heads split over the ranks (``q_b_proj`` / ``kv_b_proj``
  column-parallel, each rank's shadow cache holds its own heads, ``o_proj`` row-parallel through the tree
  all-reduce); the shared expert's ``down_proj`` reduces its own output rather than jointly with the routed experts'
  (:mod:`~moealign.patches.vllm.tree_reduce`), so the runner scales the routed output and adds the shared one as at
  TP 1; expert shards narrower than a leaf reduce as its subtrees.

``ops`` selects a subset (the others stay stock): the negative controls and the diagnosis use it. A model with a
module the canonical forward does not cover is refused by :func:`audit_canonical` (run in every worker after
loading; the mismatch harness does), naming it.
"""

from __future__ import annotations

import inspect

import torch

from ...errors import CanonicalError, ConfigError
from ...precision.capability import request_amx_tiles
from ...handle import PatchHandle
from ...precision import canonical as C
from .._version import UnsupportedEngineError, check_engine_version, engine_version, require_attr
from .engine import SUPPORTED_VLLM_ENGINE

__all__ = ["CanonicalPatch", "apply_canonical_forward", "audit_canonical", "VLLM_OPS"]

#: The ops this patch can install (``linear`` covers every linear layer but the router and the LM head).
VLLM_OPS = C.engine_ops("vllm")


class CanonicalPatch(PatchHandle):
    """Undo handle of :func:`apply_canonical_forward` (``ops``: what it installed)."""

    ops: tuple[str, ...] = ()


def _count(module) -> None:
    module._moealign_canonical = getattr(module, "_moealign_canonical", 0) + 1


def _norm_forward(original):
    from vllm.model_executor.layers.layernorm import RMSNorm

    def forward(self, x, residual=None):
        if type(self) is not RMSNorm or self.variance_size_override is not None:
            return original(self, x, residual)
        _count(self)
        weight = self.weight if self.has_weight else None
        if residual is None:
            return C.c_rms_norm(x, weight, self.variance_epsilon)
        x = x + residual
        return C.c_rms_norm(x, weight, self.variance_epsilon), x
    return forward


def _rope_forward(original):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    def forward(self, positions, query, key=None, *args, **kwargs):
        if type(self) is not RotaryEmbedding or args or kwargs:
            return original(self, positions, query, key, *args, **kwargs)
        _count(self)
        rope = C.c_rope if self.is_neox_style else C.c_rope_deinterleaved      # DeepSeek's MLA: interleaved
        C.rope_reserve(self.max_position_embeddings, self.rotary_dim, self.base, positions.device)
        pos = positions.flatten()
        cos, sin = C.rope_cos_sin(pos, self.rotary_dim, self.base)
        n = pos.shape[0]

        def rotate(t):
            shape = t.shape
            return rope(t.reshape(n, -1, self.head_size), cos, sin).reshape(shape)
        return rotate(query), (None if key is None else rotate(key))
    return forward


def _shadow(layer, kv_cache: torch.Tensor, key: torch.Tensor):
    """The layer's shadow K / V cache ``[slots + 1, kv_heads, head]`` (the last row takes padded tokens)."""
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    slots = num_blocks * block_size
    shadow = getattr(layer, "_moealign_shadow_kv", None)
    if shadow is None or shadow[0].shape[0] != slots + 1 or shadow[0].dtype != key.dtype:
        shape = (slots + 1, kv_heads, key.shape[-1])
        shadow = (torch.zeros(shape, dtype=key.dtype, device=key.device),
                  torch.zeros(shape, dtype=key.dtype, device=key.device), block_size)
        layer._moealign_shadow_kv = shadow
    return shadow


def _kv_update(original):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        original(self, layer, key, value, kv_cache, slot_mapping)
        if not getattr(self, "_moealign_canonical_attention", True):
            return
        shadow_k, shadow_v, _ = _shadow(layer, kv_cache, key)
        n = slot_mapping.shape[0]
        slot = slot_mapping.to(torch.int64)
        slot = torch.where(slot < 0, shadow_k.shape[0] - 1, slot)
        kv_heads, head = shadow_k.shape[1:]
        shadow_k.index_copy_(0, slot, key[:n].reshape(n, kv_heads, head))
        shadow_v.index_copy_(0, slot, value[:n].reshape(n, kv_heads, head))
    return do_kv_cache_update


def _vllm_attention(original):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:
            return output
        if getattr(layer, "_moealign_shadow_kv", None) is None:
            raise CanonicalError(f"vLLM attention layer {getattr(layer, 'layer_name', '?')!r}: no canonical "
                                 "shadow KV cache was written before its forward (the KV-cache update path changed)")
        _count(layer)
        shadow_k, shadow_v, block_size = layer._moealign_shadow_kv
        n = attn_metadata.num_actual_tokens
        qsl = attn_metadata.query_start_loc.to(torch.int64)
        seq_lens = attn_metadata.seq_lens.to(torch.int64)
        tokens = torch.arange(n, device=query.device)
        req = torch.searchsorted(qsl[1:], tokens, right=True)
        q_len = qsl[1:] - qsl[:-1]
        pos = seq_lens[req] - q_len[req] + (tokens - qsl[req])          # each query's position in its sequence
        L = int(attn_metadata.max_seq_len)
        j = torch.arange(L, device=query.device)
        table = attn_metadata.block_table.to(torch.int64)
        blocks = table[req][:, (j // block_size).clamp_max(table.shape[1] - 1)]
        slots = blocks * block_size + (j % block_size)[None]
        keep = j[None] <= pos[:, None]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        head_map = torch.arange(heads, device=query.device) // (heads // kv_heads)
        k = shadow_k[slots][:, :, head_map]
        v = shadow_v[slots][:, :, head_map]
        q = query[:n].reshape(n, heads, -1)
        out = C.c_attention(q, k, v, keep, prefix=True)        # keys 0 .. position: leading by construction
        output[:n].copy_(out.reshape(output[:n].shape))
        return output
    return forward


def _mla_kv_update(original):
    """CPUMLAImpl.do_kv_cache_update: vLLM's own latent cache, and the canonical shadow cache of the *expanded* keys and
    values per slot: ``kv = kv_b_proj(kv_c_normed)`` (the tree linear, row by row: the bits Megatron's
    ``linear_kv_up_proj`` gives the same row), ``k = [k_nope; k_pe]`` per head, ``v``."""
    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        original(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        if kv_cache.numel() == 0 or not getattr(self, "_moealign_canonical_attention", True):
            return
        n = slot_mapping.shape[0]
        heads, nope, rope, v_dim = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        kv = self.kv_b_proj(kv_c_normed[:n])[0].reshape(n, heads, nope + v_dim)
        key = torch.cat([kv[..., :nope], k_pe[:n].reshape(n, 1, rope).expand(n, heads, rope)], dim=-1)
        slots = kv_cache.shape[0] * kv_cache.shape[1]
        shadow = getattr(self, "_moealign_shadow_mla", None)
        if shadow is None or shadow[0].shape[0] != slots + 1 or shadow[0].dtype != key.dtype:
            shadow = (torch.zeros((slots + 1, heads, nope + rope), dtype=key.dtype, device=key.device),
                      torch.zeros((slots + 1, heads, v_dim), dtype=key.dtype, device=key.device), kv_cache.shape[1])
            self._moealign_shadow_mla = shadow
        slot = slot_mapping.to(torch.int64)
        slot = torch.where(slot < 0, slots, slot)
        shadow[0].index_copy_(0, slot, key)
        shadow[1].index_copy_(0, slot, kv[..., nope:])
    return do_kv_cache_update


def _mla_attention(original):
    """MLAAttention.forward_impl: each query row (decode or prefill alike) over its own sequence's keys ``0 ..
    position`` from the shadow cache, :func:`~moealign.precision.canonical.c_attention` (non-absorbed MLA: the same
    math as Megatron's MLA with the canonical core attention); vLLM's absorbed decode and its SDPA prefill never run."""
    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs):
        impl = self.impl
        if attn_metadata is None or not getattr(impl, "_moealign_canonical_attention", True):
            return original(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs)
        if type(impl).__name__ != "CPUMLAImpl":
            raise CanonicalError(f"vLLM MLA layer {getattr(self, 'layer_name', '?')!r}: the canonical attention serves "
                                 f"the CPU_MLA backend, not {type(impl).__name__}")
        shadow = getattr(impl, "_moealign_shadow_mla", None)
        if shadow is None:
            raise CanonicalError(f"vLLM MLA layer {getattr(self, 'layer_name', '?')!r}: no canonical shadow cache was "
                                 "written before its forward (the MLA KV-cache update path changed)")
        _count(self)
        shadow_k, shadow_v, block_size = shadow
        n = attn_metadata.num_actual_tokens
        nd = attn_metadata.num_decode_tokens
        device = q.device
        tables, seq_lens = [], []
        if attn_metadata.decode is not None and nd > 0:
            tables.append(attn_metadata.decode.block_table)
            seq_lens.append(attn_metadata.decode.seq_lens.to(torch.int64))
        pre = attn_metadata.prefill
        if pre is not None and n > nd:
            qlen = (pre.query_start_loc[1:] - pre.query_start_loc[:-1]).to(torch.int64)
            ctx = pre.chunked_context.context_lens.to(device, torch.int64) if pre.chunked_context is not None else 0
            tables.append(pre.block_table)
            seq_lens.append(qlen + ctx)
        table = torch.cat([t.to(torch.int64) for t in tables])
        seq = torch.cat(seq_lens)
        qsl = attn_metadata.query_start_loc.to(torch.int64)
        tokens = torch.arange(n, device=device)
        req = torch.searchsorted(qsl[1:], tokens, right=True)
        q_len = qsl[1:] - qsl[:-1]
        pos = seq[req] - q_len[req] + (tokens - qsl[req])
        L = int(attn_metadata.max_seq_len)
        j = torch.arange(L, device=device)
        slots = table[req][:, (j // block_size).clamp_max(table.shape[1] - 1)] * block_size + (j % block_size)[None]
        keep = j[None] <= pos[:, None]
        heads = self.num_heads
        out = C.c_attention(q[:n].reshape(n, heads, -1), shadow_k[slots], shadow_v[slots], keep, prefix=True)
        output[:n].copy_(out.reshape(n, -1).to(output.dtype))
        return output
    return forward_impl


def _cpu_mla_backend(original):
    """``CpuPlatform.get_attn_backend_cls`` (a classmethod; ``original`` its raw ``__dict__`` entry): an MLA model gets
    the ``CPU_MLA`` backend, vLLM's own explicit choice, also on an AMX CPU (where vLLM prefers ``AMX_MLA``, whose
    forward the canonical MLA attention does not replace)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    func = original.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        if getattr(attn_selector_config, "use_mla", False) and not getattr(attn_selector_config, "use_sparse", False):
            selected_backend = AttentionBackendEnum.CPU_MLA
        return func(cls, selected_backend, attn_selector_config, *args, **kwargs)
    return classmethod(get_attn_backend_cls)


def _silu_and_mul_forward(original):
    from vllm.model_executor.layers.activation import SiluAndMul

    def forward(self, x, *args, **kwargs):
        if type(self) is not SiluAndMul or args or kwargs:
            return original(self, x, *args, **kwargs)
        return C.c_silu_and_mul(x)
    return forward


def _gate_forward(original):
    def forward(self, x):
        _count(self)
        return self._return(C.c_linear(x, self.weight, out_dtype=torch.float32))
    return forward


def router_problems(router) -> list[str]:
    """What in a vLLM router the canonical router does not cover (empty: covered): softmax top-k, or DeepSeek-V3's
    sigmoid scores with a score-correction bias and grouped top-k (the routed scaling applied to the output)."""
    problems = []
    scoring = getattr(router, "scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        problems.append(f"scoring {router.scoring_func!r}")
    if scoring == "softmax" and getattr(router, "use_grouped_topk", False):
        problems.append("grouped top-k with softmax scores")
    if scoring == "softmax" and getattr(router, "e_score_correction_bias", None) is not None:
        problems.append("a score-correction bias with softmax scores")
    if getattr(router, "custom_routing_function", None) is not None:
        problems.append("a custom routing function")
    if getattr(router, "routed_scaling_factor", 1.0) not in (None, 1.0):
        problems.append(f"routed_scaling_factor={router.routed_scaling_factor}")
    if getattr(router, "eplb_state", None) is not None:
        problems.append("EPLB")
    return problems


def _routing(original):
    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        problems = router_problems(self)
        if problems:
            raise CanonicalError(f"vLLM {type(self).__name__}: the canonical router does not cover "
                                 + ", ".join(problems))
        _count(self)
        logits = router_logits.to(torch.float32)
        if getattr(self, "scoring_func", "softmax") == "sigmoid":
            grouped = getattr(self, "use_grouped_topk", False)
            ids = C.c_grouped_topk(logits, self.top_k, bias=self.e_score_correction_bias,
                                   n_group=int(self.num_expert_group or 1) if grouped else 1,
                                   topk_group=int(self.topk_group or 1) if grouped else 1)
        else:
            ids = C.c_topk(logits, self.top_k)
        return canonical_gates(self, logits, ids), ids
    _compute_routing.canonical = canonical_gates   # read by the route forcer: forced ids get the canonical gates too
    return _compute_routing


def canonical_gates(router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The canonical gates of a vLLM router's chosen experts (``ids`` ascending, fp32 ``logits``): ``c_gates``
    (softmax) or ``c_sigmoid_gates`` (sigmoid)."""
    if getattr(router, "scoring_func", "softmax") == "sigmoid":
        return C.c_sigmoid_gates(logits, ids, renormalize=router.renormalize)
    return C.c_gates(logits, ids, renormalize=router.renormalize)


def _sampler(original):
    def forward(self, logits, generators, k, p):
        raw = logits.clone()
        sampled, processed = original(self, logits, generators, k, p)
        if processed is not None and self.logprobs_mode == "processed_logprobs":
            processed = C.c_log_softmax(raw.to(torch.float32).masked_fill(processed == float("-inf"),
                                                                         float("-inf")), -1)
        return sampled, processed
    return forward


def _check_signature(cls, name: str, expected: list[str]) -> None:
    params = list(inspect.signature(require_attr(cls, name, f"vllm {cls.__name__}")).parameters)
    if params[:len(expected)] != expected:
        raise UnsupportedEngineError(f"vllm {cls.__name__}.{name}{tuple(params)} has a signature the canonical "
                                     "forward was not written for; nothing was patched")


def apply_canonical_forward(ops=VLLM_OPS) -> CanonicalPatch:
    """Install the canonical ops ``ops`` (default: all of :data:`VLLM_OPS`) into vLLM's classes (scope
    ``"process"``; apply before the engine loads its model). ``undo()`` restores vLLM."""
    ops = tuple(ops)
    unknown = sorted(set(ops) - set(VLLM_OPS))
    if unknown:
        raise ConfigError(f"unknown canonical ops {unknown}; known: {list(VLLM_OPS)}")
    _, version = engine_version("vllm", "moealign.patches.vllm.apply_canonical_forward needs vLLM")
    check_engine_version("vllm", version, SUPPORTED_VLLM_ENGINE)
    request_amx_tiles()         # the patched forward may skip the oneDNN GEMM that asks for AMX (vLLM's kernels need it)
    from vllm.model_executor.layers import activation, layernorm
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.platforms import cpu as cpu_platform
    from vllm.v1.attention.backends.mla import cpu_mla
    from vllm.model_executor.layers.fused_moe.router import cpu_router, fused_topk_router, gate_linear
    from vllm.model_executor.layers.rotary_embedding import base as rope_base
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.sample.ops import topk_topp_sampler

    from .tree_reduce import apply_tree_reductions

    targets, raw_targets = [], []
    if "norm" in ops:
        targets.append((layernorm.RMSNorm, "forward", _norm_forward))
    if "rope" in ops:
        targets.append((rope_base.RotaryEmbedding, "forward", _rope_forward))
    if "attention" in ops:
        impl = require_attr(cpu_attn, "CPUAttentionBackendImpl", "vllm cpu_attn")
        _check_signature(impl, "forward", ["self", "layer", "query", "key", "value", "kv_cache", "attn_metadata",
                                           "output"])
        _check_signature(impl, "do_kv_cache_update", ["self", "layer", "key", "value", "kv_cache", "slot_mapping"])
        targets += [(impl, "do_kv_cache_update", _kv_update), (impl, "forward", _vllm_attention)]
        mla_impl = require_attr(cpu_mla, "CPUMLAImpl", "vllm cpu_mla")
        mla = require_attr(mla_attention, "MLAAttention", "vllm mla_attention")
        _check_signature(mla_impl, "do_kv_cache_update", ["self", "kv_c_normed", "k_pe", "kv_cache", "slot_mapping",
                                                          "kv_cache_dtype", "k_scale"])
        _check_signature(mla, "forward_impl", ["self", "q", "k_c_normed", "k_pe", "kv_cache", "attn_metadata",
                                               "output"])
        targets += [(mla_impl, "do_kv_cache_update", _mla_kv_update), (mla, "forward_impl", _mla_attention)]
        platform = require_attr(cpu_platform, "CpuPlatform", "vllm platforms.cpu")
        raw_targets = [(platform, "get_attn_backend_cls", _cpu_mla_backend)]      # a classmethod: its raw entry
    if "experts" in ops:
        targets.append((require_attr(activation, "SiluAndMul", "vllm activation"), "forward", _silu_and_mul_forward))
    if "router" in ops:
        targets += [(require_attr(gate_linear, "GateLinear", "vllm gate_linear"), "forward", _gate_forward),
                    (require_attr(fused_topk_router, "FusedTopKRouter", "vllm fused_topk_router"),
                     "_compute_routing", _routing),
                    (require_attr(cpu_router, "CPURouter", "vllm cpu_router"), "_compute_routing", _routing)]
    if "log_softmax" in ops:
        sampler = require_attr(topk_topp_sampler, "TopKTopPSampler", "vllm topk_topp_sampler")
        for name in ("forward_cpu", "forward_native"):
            _check_signature(sampler, name, ["self", "logits", "generators", "k", "p"])
            targets.append((sampler, name, _sampler))
    handle = CanonicalPatch(f"vLLM canonical forward ({', '.join(ops)})", "process")
    handle.ops = ops
    try:
        tree_parts = {"linear", "lm_head", "experts"} & set(ops)
        if tree_parts:
            handle.add_handle(apply_tree_reductions(leaf_width=C.LEAF_WIDTH, parts=tuple(sorted(tree_parts))),
                              "tree forward (linear layers, LM head, experts, all-reduce)")
        for cls, name, make in targets:
            handle.set_attr(cls, name, make(getattr(cls, name)), f"{cls.__name__}.{name}")
        for cls, name, make in raw_targets:
            handle.set_attr(cls, name, make(vars(cls)[name]), f"{cls.__name__}.{name}")
    except BaseException:
        handle.undo()
        raise
    return handle


#: vLLM module classes with no arithmetic of their own (containers, identity, the embedding lookup, which is
#: exact) or covered as part of a patched parent.
#: (The covered families' own classes come from their family files: MoEFamily.vllm_classes.)
_PASSIVE = {"ModuleList", "ModuleDict", "Sequential", "Identity", "VocabParallelEmbedding", "LogitsProcessor",
            "FusedMoE", "RoutedExperts", "MoERunner", "DefaultMoERunner", "SharedFusedMoE",
            "UnquantizedFusedMoEMethod", "FusedMoEModularKernel", "Sampler",
            "TopKTopPSampler", "CPUUnquantizedExperts", "ApplyRotaryEmb"}


#: vLLM MLAAttention's own submodules its forward_impl uses (FP8 query quantisation): under the attention op the
#: canonical forward_impl replaces it and they never run (an FP8 KV cache is refused by _mla_problems); with the
#: attention left stock (--aligned-skip attention) they are part of the op left stock on purpose.
_MLA_UNUSED = {"_DecodeConcatQuantFP8", "QuantFP8"}


def _passive() -> set[str]:
    from ...families import FAMILIES

    return _PASSIVE | {cls for name in C.covered_families() for cls in FAMILIES[name].vllm_classes}
#: covered class -> the op that covers it
_COVERED = {"RMSNorm": "norm", "RotaryEmbedding": "rope", "QKVParallelLinear": "linear",
            "MergedColumnParallelLinear": "linear", "ColumnParallelLinear": "linear", "RowParallelLinear": "linear",
            "ReplicatedLinear": "linear", "GateLinear": "router", "ParallelLMHead": "lm_head",
            "DeepSeekV2FusedQkvAProjLinear": "linear", "SiluAndMul": "experts", "MLAAttention": "attention"}


def _attention_problems(layer) -> list[str]:
    """What in a vLLM attention layer the canonical attention does not cover."""
    import math

    impl = getattr(layer, "impl", None)
    problems = []
    if type(impl).__name__ != "CPUAttentionBackendImpl":
        problems.append(f"backend {type(impl).__name__} (the canonical attention serves the CPU backend)")
        return problems
    if not math.isclose(impl.scale, 1.0 / math.sqrt(impl.head_size), rel_tol=1e-12):
        problems.append(f"scale {impl.scale} (the canonical attention scales by 1 / sqrt(head_size))")
    if impl.logits_soft_cap:
        problems.append(f"logit soft cap {impl.logits_soft_cap}")
    if impl.alibi_slopes is not None:
        problems.append("ALiBi")
    if impl.sliding_window not in (None, -1):
        problems.append(f"sliding window {impl.sliding_window}")
    if impl.sinks is not None:
        problems.append("attention sinks")
    if impl.attn_type != "decoder" or impl.kv_cache_dtype not in ("auto", None):
        problems.append(f"attention type {impl.attn_type} / KV cache {impl.kv_cache_dtype}")
    return problems


def _mla_problems(layer) -> list[str]:
    """What in a vLLM MLA attention layer the canonical (non-absorbed) MLA attention does not cover."""
    import math

    impl = getattr(layer, "impl", None)
    if type(impl).__name__ != "CPUMLAImpl":
        return [f"backend {type(impl).__name__} (the canonical MLA attention serves the CPU_MLA backend)"]
    problems = []
    qk = impl.qk_nope_head_dim + impl.qk_rope_head_dim
    if not math.isclose(impl.scale, 1.0 / math.sqrt(qk), rel_tol=1e-12):
        problems.append(f"scale {impl.scale} (the canonical attention scales by 1 / sqrt(qk head dim {qk}): "
                        "mscale / YaRN not covered)")
    if impl.kv_cache_dtype not in ("auto", None) or getattr(impl, "indexer", None) is not None:
        problems.append(f"KV cache {impl.kv_cache_dtype} / a sparse indexer")
    if getattr(impl, "dcp_world_size", 1) != 1:
        problems.append("decode context parallelism")
    return problems


def _mla_wrapper_problems(module) -> list[str]:
    problems = []
    if getattr(module, "fuse_qkv_rmsnorm", False):
        problems.append("the fused q / kv RMSNorm kernel")
    for attr, what in (("g_proj", "an output gate"), ("indexer", "a sparse indexer")):
        if getattr(module, attr, None) is not None:
            problems.append(what)
    if getattr(module, "dcp_q_replicate", False):
        problems.append("replicated queries (decode context parallelism)")
    return problems


def audit_canonical(model: torch.nn.Module, ops=VLLM_OPS, ran: bool = False) -> list[str]:
    """The modules of a loaded vLLM model the canonical forward does not cover (``"name (Class)"``), given the
    ops installed: every module must be passive (no arithmetic of its own) or of a class an installed op covers;
    a MoE layer's router must be one the canonical router covers. ``ran``: also the covered norms, rotary
    embeddings, attention layers and routers' gates that did not run their canonical path since the last audit
    (the counters are then reset). Runs in the worker that holds ``model`` (the harness sends it through
    ``collective_rpc``)."""
    escaped = []
    passive = _passive()
    counted = {"RMSNorm": "norm", "RotaryEmbedding": "rope", "Attention": "attention", "GateLinear": "router",
               "MLAAttention": "attention"}
    for name, module in model.named_modules():
        cls = type(module).__name__
        router = getattr(module, "router", None)
        if router is not None and "router" in ops and router_problems(router):
            escaped.append(f"{name}.router ({type(router).__name__}: {', '.join(router_problems(router))})")
        if cls == "MultiHeadLatentAttentionWrapper" and "attention" in ops and _mla_wrapper_problems(module):
            escaped.append(f"{name} ({cls}: {', '.join(_mla_wrapper_problems(module))})")
        if cls == "LogitsProcessor" and (getattr(module, "scale", 1.0) != 1.0 or getattr(module, "soft_cap", None)):
            escaped.append(f"{name} ({cls}: logit scale {module.scale} / soft cap {module.soft_cap})")
        op = counted.get(cls) or _COVERED.get(cls)
        if op is not None:
            if op not in ops:
                continue                                  # left stock on purpose (--aligned-skip)
            if cls == "Attention":
                escaped += [f"{name} ({cls}: {what})" for what in _attention_problems(module)]
            if cls == "MLAAttention":
                escaped += [f"{name} ({cls}: {what})" for what in _mla_problems(module)]
            if cls in counted:
                if ran and not getattr(module, "_moealign_canonical", 0):
                    escaped.append(f"{name} ({cls}, not run)")
                module._moealign_canonical = 0
            continue
        if cls in _MLA_UNUSED and ".mla_attn." in f".{name}.":
            continue      # the FP8 helpers of vLLM's MLA forward_impl: replaced (attention) or left stock on purpose
        if cls not in passive:
            escaped.append(f"{name} ({cls})")
    return escaped
