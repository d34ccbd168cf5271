"""The canonical forward (:mod:`moealign.precision.canonical`) installed into a Megatron-core ``GPTModel`` (local
spec), so its logits equal vLLM's under :mod:`moealign.patches.vllm.canonical` bit for bit.

What is swapped (instance attributes on the model's modules, plus Megatron's ``apply_rotary_pos_emb`` as the
attention module sees it):

* ``ColumnParallelLinear`` / ``RowParallelLinear`` (QKV, output projection, the output layer) -> ``c_linear``;
* every ``torch.nn.RMSNorm`` (input, pre-MLP, final, q / k layernorms) -> ``c_rms_norm``;
* RoPE -> ``c_rope`` from the canonical table (positions read from Megatron's own frequencies:
  ``freqs[p, 0] = p * inv_freq[0] = p`` exactly);
* ``DotProductAttention`` -> ``c_attention`` (each query row over its unmasked keys);
* ``TopKRouter.gating`` -> fp32 ``c_linear`` logits; ``TopKRouter.routing`` keeps Megatron's selection (so
  RouterReplay still forces the recorded experts) and replaces the gates with ``c_gates``;
* ``MoELayer.forward`` -> ``c_experts`` + ``c_combine`` over the routed experts (the token dispatcher's
  ``dispatch_preprocess`` is still called, so the replay verifier sees the routing map).

Across ranks (a rank of :class:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer`; every exchange is
Megatron's or ``torch.distributed``'s over Megatron's own groups):

* **TP** (a power of two; every reduced shard whole :data:`~moealign.precision.canonical.LEAF_WIDTH`-wide leaves).
  A ``ColumnParallelLinear`` computes its output columns (each column's tree needs nothing from the other
  ranks; the output layer's vocabulary slices are all-gathered, an exact copy). A ``RowParallelLinear``'s K shard
  is a subtree of the canonical tree: its fp32 subtree roots are summed by
  :func:`~moealign.precision.tree.tree_all_reduce` over Megatron's TP group (the top of the same tree), then the
  bias and the one cast: TP 1's bits. Under sequence parallelism (what the sharded trainer builds at TP > 1) a
  column-parallel linear first all-gathers its input's sequence chunks (an exact copy; backward: Megatron's
  reduce-scatter) and a row-parallel one adds the roots with
  :func:`~moealign.precision.tree.tree_reduce_scatter` (the same tree, each rank keeping its sequence chunk).
* **EP / expert TP**: the token dispatcher (all-to-all or all-gather) moves each (token, expert) pair to its
  expert's ranks; there ``c_experts`` computes that pair's fp32 output (on an expert-TP shard of the intermediate
  axis, its subtree root, tree-all-reduced over Megatron's expert-TP group and kept on that group's first rank,
  the others sending zeros); the dispatcher's own combine exchange brings each pair back *unsummed* (all-to-all:
  the pair's row; all-gather: a ``[tokens, k * H]`` row per token, one slot per chosen expert, whose
  reduce-scatter adds only zeros to it), and ``c_combine`` adds the slots in ascending expert id on the token's
  rank: the single-rank bits.
* **PP**: each stage runs its own layers; the pipeline's send / recv moves activations unchanged.

Everything stays differentiable: a training step's backward runs through the same forward. Refused at setup,
naming it (:class:`~moealign.errors.CanonicalError`): context parallelism, sequence parallelism at TP 1, a TP or expert-TP
size that is not a power of two or whose shards are not whole tree leaves, a token dispatcher other than
all-to-all / all-gather, a gated or overlapped shared expert, a capacity factor, a latent MoE, grouped GEMM experts,
RoPE fusion or interleaving (outside MLA) or scaling (YaRN, mscale), a custom softmax scale, packed sequences at run
time, MLA at TP, expert TP or PP above 1 (EP runs: verified bitwise at EP 2), and any module of a class the canonical forward does not know.

**DeepSeek-V3** (MLA on the local spec, :mod:`moealign.patches.megatron.mla`; the sigmoid router; shared experts; the
first dense layers): MLA's projections are column / row parallel linears and its q / kv layernorms RMSNorms (covered
above); its rope (``multi_latent_attention.apply_rotary_pos_emb``, each MLA module's own ``RotaryEmbedding``) is
``c_rope_deinterleaved``; its core attention (``LocalMLACoreAttention``) is ``c_attention`` over ``[k_nope; k_pe]``
with values of their own head dim. ``TopKRouter.routing`` keeps Megatron's selection (bias, groups) and takes
``c_sigmoid_gates`` (unscaled, for the canonical MoE layer; the probs it returns carry
``moe_router_topk_scaling_factor``, as Megatron's do, for a stock MoE layer); ``MoELayer.forward`` combines, scales the
combined output by the factor in the activation dtype and adds the shared expert's output (vLLM's MoE runner's
order); ``MLP.forward`` of the dense layers and the shared expert: ``c_linear``, ``c_silu_and_mul``, ``c_linear``.

**On CUDA** (one rank, ``qwen3_moe``) the same binding runs the Triton kernels: every ``C.c_*`` call dispatches on its
input's device (:mod:`moealign.precision.canonical`, the backend); :func:`apply_canonical_forward` calls
:func:`~moealign.precision.canonical_triton.check_canonical_cuda` once for the model's device and dtype and refuses, by
name, TP / EP / expert-TP / PP above 1 and MLA there (:func:`_check_triton_world`).
"""

from __future__ import annotations


import torch

from ...errors import CanonicalError, ConfigError
from ...handle import PatchHandle
from ...precision import canonical as C

__all__ = ["MEGATRON_OPS", "TP_REDUCTIONS", "apply_canonical_forward", "apply_canonical_forward_from_hf"]

MEGATRON_OPS = C.engine_ops("megatron")
#: How the canonical forward adds partial results across tensor-parallel ranks: ``"tree"`` (the fp32 subtree roots
#: through :func:`~moealign.precision.tree.tree_all_reduce`: TP 1's bits) or ``"stock"`` (a negative control: each
#: rank's partial rounded to the activation dtype and summed by Megatron's own all-reduce / the dispatcher's
#: reduce-scatter, as Megatron's RowParallelLinear does; in bf16 not TP 1's bits).
TP_REDUCTIONS = ("tree", "stock")

_PASSIVE = {"GPTModel", "LanguageModelEmbedding", "VocabParallelEmbedding", "Dropout", "TransformerBlock",
            "ModuleList", "TransformerLayer", "SelfAttention", "IdentityOp", "IdentityFuncOp", "FusedScaleMaskSoftmax",
            "SequentialMLP", "MLP", "MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher", "RotaryEmbedding",
            "MLASelfAttention", "SharedExpertMLP"}


def _power_of_two(v) -> bool:
    return isinstance(v, int) and v >= 1 and not v & (v - 1)


def _check_config(config) -> None:
    problems = []
    for name, bad in (("tensor_model_parallel_size", lambda v: not _power_of_two(v)),
                      ("expert_tensor_parallel_size", lambda v: not _power_of_two(v)),
                      ("context_parallel_size", lambda v: v != 1),
                      ("moe_expert_capacity_factor", lambda v: v is not None),
                      ("moe_latent_size", bool), ("moe_grouped_gemm", bool), ("apply_rope_fusion", bool),
                      ("softmax_scale", lambda v: v is not None),
                      ("apply_query_key_layer_scaling", bool),
                      ("moe_shared_expert_gate", bool), ("moe_shared_expert_overlap", bool),
                      ("cache_mla_latents", bool), ("bias_activation_fusion", bool),
                      ("use_te_activation_func", bool)):
        value = getattr(config, name, None)
        if value is not None and bad(value):
            problems.append(f"{name}={value!r}")
    if getattr(config, "sequence_parallel", False) and (getattr(config, "tensor_model_parallel_size", 1) or 1) == 1:
        problems.append("sequence_parallel=True at tensor_model_parallel_size=1")
    if (getattr(config, "moe_token_dispatcher_type", "allgather") not in ("alltoall", "allgather")
            and (getattr(config, "expert_model_parallel_size", 1) or 1) * (getattr(config, "expert_tensor_parallel_size", 1) or 1) > 1):
        problems.append(f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}")
    problems += C.rope_problems(interleaved=bool(getattr(config, "rotary_interleaved", False)))
    score = getattr(config, "moe_router_score_function", "softmax")
    if score not in ("softmax", "sigmoid"):
        problems.append(f"moe_router_score_function={score!r}")
    if score == "softmax":               # the sigmoid router's extras (DeepSeek-V3) only with sigmoid scores
        for name, bad in (("moe_router_topk_scaling_factor", lambda v: v not in (None, 1)),
                          ("moe_router_num_groups", lambda v: v not in (None, 1)),
                          ("moe_router_enable_expert_bias", bool), ("moe_shared_expert_intermediate_size", bool)):
            if bad(getattr(config, name, None)):
                problems.append(f"{name}={getattr(config, name)!r} with softmax scores")
    if getattr(config, "multi_latent_attention", False):
        sizes = {name: getattr(config, name, 1) or 1 for name in (
            "tensor_model_parallel_size", "expert_tensor_parallel_size", "pipeline_model_parallel_size")}
        problems += [f"{name}={size} with MLA (verified on one rank and at EP > 1)" for name, size in sizes.items()
                     if size != 1]
        if getattr(config, "rope_type", "rope") != "rope":
            problems += C.rope_problems(rope_type=config.rope_type)
        for name in ("rotary_scaling_factor", "mscale"):
            if getattr(config, name, 1.0) not in (None, 1, 1.0):
                problems += C.rope_problems(mscale=float(getattr(config, name)))
    if getattr(config, "gated_linear_unit", True) is not True or getattr(config, "activation_func", None) not in (
            None, torch.nn.functional.silu):
        problems.append("experts other than SwiGLU")
    if problems:
        raise CanonicalError("the canonical forward does not cover this Megatron config: " + ", ".join(problems))


def _check_triton_world(config) -> None:
    """The Triton kernels (CUDA) are wired for one rank of a ``qwen3_moe`` model. TP > 1 would need each row-parallel
    shard's fp32 subtree roots (``canonical_triton.tree_linear_partial``) added by ``tree_all_reduce`` over NCCL (the
    same tree as ``linear_from_roots``), the experts' shards likewise, and EP / PP a run on several GPUs: none has run,
    so they are refused by name; so is MLA (DeepSeek-V3's rope, router and value head dim have no kernels)."""
    problems = [f"{name}={getattr(config, name)}" for name in (
        "tensor_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "pipeline_model_parallel_size") if (getattr(config, name, 1) or 1) != 1]
    if problems:
        raise CanonicalError("the canonical forward on CUDA (the Triton kernels) runs on one rank; not "
                             + ", ".join(problems) + " (TP > 1 needs the shards' tree_linear_partial roots added by "
                             "tree_all_reduce over NCCL, not run yet)")
    if getattr(config, "multi_latent_attention", False):
        raise CanonicalError("the canonical forward on CUDA (the Triton kernels) does not cover MLA (DeepSeek-V3): its "
                             "sigmoid grouped router, de-interleaved rope and value head dim have no Triton kernels")


def _group_size(group) -> int:
    return 1 if group is None else group.size()


def _check_shards(model) -> None:
    """Every tensor-parallel reduction of this rank cuts the canonical tree into whole subtrees: a power-of-two group
    and a K shard (a row-parallel linear's input, an expert's intermediate shard) of whole LEAF_WIDTH leaves."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    problems = []
    for name, module in model.named_modules():
        if not isinstance(module, RowParallelLinear):
            continue
        group = getattr(module, "tp_group", None)
        if getattr(module, "explicit_expert_comm", False):
            group = None                        # an expert's fc2: reduced in the MoE layer over the expert-TP group
            moe = name.rsplit(".experts.", 1)[0]
            disp = getattr(model.get_submodule(moe), "token_dispatcher", None) if ".experts." in name else None
            group = getattr(disp, "tp_group", None)
        size = _group_size(group)
        if size > 1 and (size & (size - 1) or module.weight.shape[1] % C.LEAF_WIDTH):
            problems.append(f"{name} (K shard {module.weight.shape[1]} over {size} ranks)")
    if problems:
        raise CanonicalError(f"the canonical trees cut into whole {C.LEAF_WIDTH}-wide leaves per rank at power-of-two "
                             f"TP sizes; not these reductions: {', '.join(problems[:6])}")


def _linear_forward(module, out_dtype=None):
    """A ColumnParallelLinear: this rank's output columns (each column's tree is whole here); the input's gradient
    all-reduced over the TP group in the backward (Megatron's copy; under sequence parallelism the input's chunks
    all-gathered first, the gradient reduce-scattered back), the output all-gathered where the layer gathers (the
    output layer of a trainer that wants the full vocabulary)."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region,
                                                        gather_from_tensor_model_parallel_region)

    group = getattr(module, "tp_group", None)
    tp = _group_size(group)
    sequence_parallel = tp > 1 and bool(getattr(module, "sequence_parallel", False))

    def forward(input_, weight=None, runtime_gather_output=None):
        w = module.weight if weight is None else weight
        bias = module.bias if (module.bias is not None and not module.skip_bias_add) else None
        if sequence_parallel:
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
        elif tp > 1:
            input_ = copy_to_tensor_model_parallel_region(input_, group=group)
        out = C.c_linear(input_, w, bias, out_dtype=out_dtype)
        gather = module.gather_output if runtime_gather_output is None else runtime_gather_output
        if tp > 1 and gather:
            out = gather_from_tensor_model_parallel_region(out, group=group)
        return out, (module.bias if module.skip_bias_add else None)
    return forward


def _row_forward(module, tp_reduce: str):
    """A RowParallelLinear: the fp32 subtree root of this rank's K shard, the top of the tree across the TP group
    (:func:`~moealign.precision.tree.tree_all_reduce`; under sequence parallelism
    :func:`~moealign.precision.tree.tree_reduce_scatter`, this rank keeping its sequence chunk), then the bias and
    the one cast (``c_linear`` at TP 1)."""
    from megatron.core.tensor_parallel.mappings import (reduce_from_tensor_model_parallel_region,
                                                        reduce_scatter_to_sequence_parallel_region)

    from ...precision.tree import tree_all_reduce, tree_linear, tree_reduce_scatter

    group = getattr(module, "tp_group", None)
    tp = _group_size(group)
    sequence_parallel = tp > 1 and bool(getattr(module, "sequence_parallel", False))

    def forward(input_):
        bias = module.bias if (module.bias is not None and not module.skip_bias_add) else None
        extra = module.bias if module.skip_bias_add else None
        if tp == 1:
            return C.c_linear(input_, module.weight, bias), extra
        root = tree_linear(input_, module.weight.to(input_.dtype), leaf_width=C.LEAF_WIDTH)
        if tp_reduce == "tree" and sequence_parallel:
            out = tree_reduce_scatter(root, group, dim=0, node_dtype=root.dtype)
        elif tp_reduce == "tree":
            out = tree_all_reduce(root, group, node_dtype=root.dtype)
        elif sequence_parallel:                # the negative control: Megatron's own reduce-scatter of rounded partials
            out = reduce_scatter_to_sequence_parallel_region(root.to(input_.dtype), group=group).to(root.dtype)
        else:                                  # the negative control: Megatron's own all-reduce of rounded partials
            out = reduce_from_tensor_model_parallel_region(root.to(input_.dtype), group=group).to(root.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.to(input_.dtype), extra
    return forward


def _norm_forward(module):
    def forward(x):
        return C.c_rms_norm(x, module.weight, module.eps)
    return forward


def _rope(original, base: float):
    def apply_rotary_pos_emb(t, freqs, config=None, cu_seqlens=None, mscale=1.0, cp_group=None):
        if cu_seqlens is not None:
            raise CanonicalError("the canonical forward does not cover packed (THD) sequences in Megatron")
        if mscale != 1.0:
            raise CanonicalError("the canonical RoPE does not cover " + ", ".join(C.rope_problems(mscale=mscale)))
        rot = freqs.shape[-1]
        positions = freqs.reshape(freqs.shape[0], -1)[:, 0]           # p * inv_freq[0] = p exactly
        cos, sin = C.rope_cos_sin(positions.round().to(torch.int64), rot, base)
        # MLA (Megatron de-interleaves the rope dims first, as transformers' rope_interleave does)
        rope = C.c_rope_deinterleaved if getattr(config, "multi_latent_attention", False) else C.c_rope
        return rope(t, cos[:, None], sin[:, None])
    return apply_rotary_pos_emb


def _megatron_attention(module):
    def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise CanonicalError("the canonical attention does not cover packed sequences or an attention bias")
        sq, b, heads, d = query.shape
        if attention_mask is None:
            raise CanonicalError("the canonical attention needs Megatron's attention mask (causal + padding)")
        group = heads // key.shape[2]
        head_map = torch.arange(heads, device=query.device) // group
        mask = attention_mask.expand(b, 1, sq, key.shape[0])
        outs = []
        for i in range(b):
            k = key[:, i][:, head_map][None]                 # [1, sk, heads, d]
            v = value[:, i][:, head_map][None]
            outs.append(C.c_attention(query[:, i], k, v, ~mask[i, 0]))
        return torch.stack(outs, dim=1).reshape(sq, b, heads * value.shape[-1])      # MLA: v head dim != qk
    return forward


def _router_gating(module):
    def gating(input):
        return C.c_linear(input, module.weight, module.bias, out_dtype=torch.float32)
    return gating


def _router_routing(module, original, renormalize: bool):
    sigmoid = getattr(module.config, "moe_router_score_function", "softmax") == "sigmoid"
    scaling = float(getattr(module.config, "moe_router_topk_scaling_factor", None) or 1.0)

    def routing(logits, padding_mask=None):
        probs, routing_map = original(logits, padding_mask=padding_mask)
        flat = logits.reshape(-1, logits.shape[-1]).to(torch.float32)
        T, E = flat.shape
        ids = C.route_ids(routing_map.reshape(T, E), module.topk)
        if sigmoid:               # DeepSeek-V3: unbiased scores, normalised; the scaling goes to the MoE output
            gates = C.c_sigmoid_gates(flat, ids, renormalize=renormalize)
        else:
            gates = C.c_gates(flat, ids, renormalize=renormalize)
        dense = torch.zeros_like(flat).scatter(1, ids, gates) + (probs - probs.detach()).to(flat.dtype) * 0
        if sigmoid and scaling != 1.0:
            # the canonical MoE layer takes the unscaled gates and scales its combined output (as vLLM's runner
            # does); the probs returned carry the scaling, as Megatron's own are, for a stock MoE layer (a lever)
            module._moealign_unscaled_gates = dense
            return dense * scaling, routing_map
        return dense, routing_map                              # (probs - probs.detach()): Megatron's aux-loss hooks
    return routing


def _moe_forward(module, tp_reduce: str = "tree"):
    experts = module.experts.local_experts
    shared = module.shared_experts if getattr(module, "use_shared_expert", False) else None
    scaling = float(getattr(module.config, "moe_router_topk_scaling_factor", None) or 1.0)
    dispatcher = module.token_dispatcher
    ep = _group_size(getattr(dispatcher, "ep_group", None))
    etp = _group_size(getattr(dispatcher, "tp_group", None))

    def forward(hidden_states, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            raise CanonicalError("the canonical MoE layer does not cover partial (CUDA-graph) MoE forwards")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        s, b, hidden = hidden_states.shape
        probs, routing_map = module.route(hidden_states, padding_mask)
        x = hidden_states.reshape(-1, hidden)
        T = x.shape[0]
        k = module.router.topk
        ids = C.route_ids(routing_map.reshape(T, -1), k)
        unscaled = getattr(module.router, "_moealign_unscaled_gates", None)     # the canonical sigmoid router's
        module.router._moealign_unscaled_gates = None
        scale = scaling if unscaled is not None else 1.0            # a stock router's probs carry the scaling
        gates = torch.gather((probs if unscaled is None else unscaled).reshape(T, -1), 1, ids)
        w13 = torch.stack([mlp.linear_fc1.weight for mlp in experts])      # autograd reaches each expert's weight
        w2 = torch.stack([mlp.linear_fc2.weight for mlp in experts])
        if ep * etp == 1:
            module.preprocess(hidden_states, probs, routing_map)      # the dispatcher sees the routes (verifier)
            partials = C.c_experts(x, ids, w13, w2)
        else:
            partials = _dispatched_experts(module, hidden_states, probs, routing_map, w13, w2, T, k, tp_reduce)
        out = C.c_combine(partials, gates, x.dtype).view(s, b, hidden)
        if scale != 1.0:
            out = out * scale                 # in the activation dtype, as vLLM's MoE runner scales its routed output
        if shared is not None:
            out = shared(hidden_states) + out
        return out, None
    return forward


def _mlp_forward(module):
    """A dense MLP (a dense layer, the shared expert): ``c_linear`` (fc1, gate rows first), ``c_silu_and_mul``,
    ``c_linear`` (fc2; its TP shards tree-reduced by the patched RowParallelLinear)."""
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    shared = isinstance(module, SharedExpertMLP)
    if shared and getattr(module, "use_shared_expert_gate", False):
        raise CanonicalError("the canonical forward does not cover a gated shared expert (moe_shared_expert_gate)")
    if not module.config.gated_linear_unit:
        raise CanonicalError("the canonical MLP covers SwiGLU (gated_linear_unit) only")

    def forward(hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise CanonicalError("the canonical MLP does not cover a per-token scale")
        inter, bias = module.linear_fc1(hidden_states)
        if bias is not None:
            inter = inter + bias
        out, out_bias = module.linear_fc2(C.c_silu_and_mul(inter))
        if shared:
            return out if out_bias is None else out + out_bias
        return out, out_bias
    return forward


class _OwnerKeeps(torch.autograd.Function):
    """Forward: ``x`` on the rank that keeps it, zeros elsewhere (the combine then adds only zeros to it). Backward:
    the identity on every rank (each rank's partial contributed to the reduced value)."""

    @staticmethod
    def forward(ctx, x, keep: bool):
        return x if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _slots(routing_map: torch.Tensor, token: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """The slot of each (token, expert) pair among its token's chosen experts in ascending id (``route_ids``)."""
    return (routing_map.to(torch.int64).cumsum(1) - 1)[token, expert]


def _dispatched_experts(module, hidden_states, probs, routing_map, w13, w2, T: int, k: int,
                        tp_reduce: str) -> torch.Tensor:
    """``[T, k, H]`` fp32: each of this rank's tokens' chosen experts' outputs, slots in ascending expert id,
    computed on the experts' ranks and brought back unsummed by Megatron's token dispatcher (module docstring)."""
    from ...precision.tree import tree_all_reduce

    dispatcher = module.token_dispatcher
    etp_group = dispatcher.tp_group
    etp = _group_size(etp_group)
    hidden = hidden_states.shape[-1]
    kind = type(dispatcher).__name__
    if kind not in ("MoEAlltoAllTokenDispatcher", "MoEAllGatherTokenDispatcher"):
        raise CanonicalError(f"the canonical MoE layer across ranks covers the all-to-all and all-gather token "
                             f"dispatchers, not {kind}")
    tokens, dprobs = module.preprocess(hidden_states, probs, routing_map)     # the verifier sees the routes here
    tokens, dprobs = module.dispatch(tokens, dprobs)
    gathered_map = dispatcher.routing_map if kind == "MoEAllGatherTokenDispatcher" else None   # [tokens of tp x ep, E]
    rows, tokens_per_expert, _ = dispatcher.dispatch_postprocess(tokens, dprobs)
    local = torch.repeat_interleave(torch.arange(len(module.experts.local_experts), device=rows.device),
                                    tokens_per_expert.to(rows.device))
    y = C.c_experts(rows, local[:, None], w13, w2)[:, 0]          # fp32: this rank's subtree root of each pair
    if etp > 1:
        if tp_reduce == "tree":
            y = _OwnerKeeps.apply(tree_all_reduce(y, etp_group, node_dtype=y.dtype), etp_group.rank() == 0)
        else:                                  # the negative control: rounded partials summed by the dispatcher
            y = y.to(hidden_states.dtype).to(y.dtype)
    if kind == "MoEAlltoAllTokenDispatcher":
        back = dispatcher.token_combine(dispatcher.combine_preprocess(y))    # this rank's pairs, permuted order
        flat_map = routing_map.reshape(T, -1)
        expert, token = flat_map.t().nonzero(as_tuple=True)             # Megatron's permute order: expert-major
        pos = token * k + _slots(flat_map, token, expert)
        return back.new_zeros(T * k, hidden).index_copy(0, pos, back).view(T, k, hidden)
    # all-gather: one [k * H] row per gathered token (a slot per chosen expert), reduce-scattered back
    offset = module.local_expert_indices[0]
    local_map = gathered_map[:, offset:offset + len(module.experts.local_experts)]
    expert, token = local_map.t().nonzero(as_tuple=True)
    pos = token * k + _slots(gathered_map, token, expert + offset)
    wide = y.new_zeros(gathered_map.shape[0] * k, hidden).index_copy(0, pos, y)
    back = dispatcher.token_combine(wide.view(gathered_map.shape[0], k * hidden))
    return back.view(T, k, hidden)


def apply_canonical_forward(model: torch.nn.Module, *, rope_base: float, max_positions: int,
                            renormalize: bool = True, ops=MEGATRON_OPS, tp_reduce: str = "tree") -> PatchHandle:
    """Install the canonical ops ``ops`` (default all of :data:`MEGATRON_OPS`) into a Megatron ``GPTModel``.

    ``rope_base`` / ``max_positions``: the checkpoint's RoPE theta and maximum position (the canonical table is
    built for them; the model's own inverse frequencies must match). ``renormalize``: the top-k gates are
    renormalised (Qwen3-MoE's ``norm_topk_prob``). ``tp_reduce``: :data:`TP_REDUCTIONS` (``"stock"`` only as a
    negative control). On a rank of a sharded world (TP / EP / expert TP / PP) the model is that rank's stage and
    shards (module docstring). Returns a :class:`~moealign.handle.PatchHandle` (scope
    ``"module"``: Megatron's ``apply_rotary_pos_emb`` is swapped where the attention module reads it).
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import attention as mg_attention
    from megatron.core.transformer import multi_latent_attention as mg_mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    ops = tuple(ops)
    unknown = sorted(set(ops) - set(MEGATRON_OPS))
    if unknown:
        raise ConfigError(f"unknown canonical ops {unknown}; known: {list(MEGATRON_OPS)}")
    if tp_reduce not in TP_REDUCTIONS:
        raise ConfigError(f"tp_reduce must be one of {list(TP_REDUCTIONS)}, got {tp_reduce!r}")
    config = model.config
    _check_config(config)
    _check_shards(model)
    param = next(model.parameters())
    if C.check_device_backend(param.device, param.dtype):   # the Triton kernels (CUDA): refusals once, here
        _check_triton_world(config)
    escaped = []
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__name__ in _PASSIVE or isinstance(module, (ColumnParallelLinear, RowParallelLinear,
                                                           DotProductAttention, MoELayer, TopKRouter,
                                                           torch.nn.RMSNorm)):
            continue
        escaped.append(f"{name} ({cls.__name__})")
    if escaped:
        raise CanonicalError("the canonical forward does not cover these Megatron modules: " + ", ".join(escaped))
    mla = bool(getattr(config, "multi_latent_attention", False))
    # the model's rotary embedding, or (MLA) each attention module's own
    rotaries = ([m.rotary_pos_emb for m in model.modules() if type(m).__name__ == "MLASelfAttention"] if mla
                else [r for r in (getattr(model, "rotary_pos_emb", None),) if r is not None])
    if "rope" in ops:
        if not rotaries:
            raise CanonicalError("the canonical RoPE needs the model's rotary embedding (position_embedding_type=rope)")
        for rotary in rotaries:
            if type(rotary).__name__ != "RotaryEmbedding":
                raise CanonicalError(f"Megatron's {type(rotary).__name__}: the canonical RoPE does not cover "
                                     + ", ".join(C.rope_problems(rope_type="yarn")))
            inv = rotary.inv_freq.detach().double().cpu()
            rot = 2 * inv.numel()
            want = torch.tensor([1.0 / (float(rope_base) ** (2 * i / rot)) for i in range(inv.numel())],
                                dtype=torch.float64)
            if float(inv[0]) != 1.0 or not torch.allclose(inv, want, rtol=1e-6, atol=0):
                raise CanonicalError(f"Megatron's rotary frequencies are not RoPE theta={rope_base} over {rot} dims: "
                                     "the canonical RoPE does not cover "
                                     + ", ".join(C.rope_problems(frequencies_match=False)))
            C.rope_reserve(max_positions, rot, rope_base, next(model.parameters()).device)

    handle = PatchHandle(f"Megatron canonical forward ({', '.join(ops)}) on {type(model).__name__}", "module")
    try:
        output_layer = getattr(model, "output_layer", None)
        for name, module in model.named_modules():
            if module is output_layer:
                if "lm_head" in ops:
                    handle.set_attr(module, "forward", _linear_forward(module), f"{name}.forward")
            elif isinstance(module, ColumnParallelLinear) and "linear" in ops:
                handle.set_attr(module, "forward", _linear_forward(module), f"{name}.forward")
            elif isinstance(module, RowParallelLinear) and "linear" in ops:
                handle.set_attr(module, "forward", _row_forward(module, tp_reduce), f"{name}.forward")
            elif isinstance(module, torch.nn.RMSNorm) and "norm" in ops:
                if module.eps is None:
                    raise CanonicalError(f"Megatron norm {name!r} has no eps (torch's default): not covered")
                handle.set_attr(module, "forward", _norm_forward(module), f"{name}.forward")
            elif isinstance(module, DotProductAttention) and "attention" in ops:
                handle.set_attr(module, "forward", _megatron_attention(module), f"{name}.forward")
            elif isinstance(module, TopKRouter) and "router" in ops:
                handle.set_attr(module, "gating", _router_gating(module), f"{name}.gating")
                handle.set_attr(module, "routing", _router_routing(module, module.routing, renormalize),
                                f"{name}.routing")
            elif isinstance(module, MoELayer) and "experts" in ops:
                handle.set_attr(module, "forward", _moe_forward(module, tp_reduce), f"{name}.forward")
            elif isinstance(module, MLP) and "experts" in ops and ".local_experts." not in f".{name}.":
                handle.set_attr(module, "forward", _mlp_forward(module), f"{name}.forward")   # dense / shared
        if "rope" in ops:
            handle.set_attr(mg_attention, "apply_rotary_pos_emb", _rope(mg_attention.apply_rotary_pos_emb,
                                                                        float(rope_base)),
                            "megatron.core.transformer.attention.apply_rotary_pos_emb")
            if mla:
                handle.set_attr(mg_mla, "apply_rotary_pos_emb", _rope(mg_mla.apply_rotary_pos_emb, float(rope_base)),
                                "megatron.core.transformer.multi_latent_attention.apply_rotary_pos_emb")
    except BaseException:
        handle.undo()
        raise
    return handle


def apply_canonical_forward_from_hf(model: torch.nn.Module, hf_config, *, ops=MEGATRON_OPS,
                                    tp_reduce: str = "tree") -> PatchHandle:
    """:func:`apply_canonical_forward` with the RoPE theta, the maximum position and the gate renormalisation
    read from the transformers config the model was converted from (``ops`` outside :data:`MEGATRON_OPS`, such as
    the scoring's ``log_softmax``, are not Megatron's and are ignored)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if base is None:
        raise CanonicalError("the checkpoint's config names no RoPE theta (rope_parameters.rope_theta)")
    return apply_canonical_forward(model, rope_base=float(base), max_positions=int(hf_config.max_position_embeddings),
                                   renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
                                   ops=[op for op in ops if op in MEGATRON_OPS], tp_reduce=tp_reduce)
