"""TP-invariant tree all-reduce swapped into vLLM's ``GroupCoordinator`` (see :mod:`moealign.precision.tree`)."""

from __future__ import annotations

import inspect

import torch

from ..._validate import check_positive_int
from ...errors import ConfigError, InputTypeError
from ...precision.capability import request_amx_tiles
from ...precision.canonical import c_combine, c_experts
from ...precision.tree import (
    TreeReducePatch,
    TreeReductionError,
    tree_all_reduce,
    tree_linear,
)
from .._version import (
    UnsupportedEngineError,
    check_engine_version,
    engine_version,
    require_attr,
)
from .engine import SUPPORTED_VLLM_ENGINE

SUPPORTED_VLLM = ">=0.8,<0.34"


# --------------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------------


def _tree_all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
    """Replacement body of ``GroupCoordinator._all_reduce_out_place``: the tree all-reduce (a new tensor)."""
    return tree_all_reduce(input_, self.device_group).clone()


def patch_vllm_all_reduce(group_coordinator=None) -> TreeReducePatch:
    """Route vLLM's all-reduce through the tree all-reduce.

    With ``group_coordinator=None`` the ``GroupCoordinator`` class is patched (every group, including TP);
    otherwise only that instance (e.g. ``vllm.distributed.get_tp_group()``). Raises
    :class:`UnsupportedEngineError` for vLLM versions outside :data:`SUPPORTED_VLLM` or when
    ``_all_reduce_out_place(self, input_)`` is missing or has another signature.
    """
    _, version = engine_version("vllm", "moealign.patches.tree_reduce.patch_vllm_all_reduce needs vLLM")
    check_engine_version("vllm", version, SUPPORTED_VLLM)
    from vllm.distributed import parallel_state

    cls = require_attr(parallel_state, "GroupCoordinator", "vllm.distributed.parallel_state")
    original = require_attr(cls, "_all_reduce_out_place", "vllm GroupCoordinator")
    params = list(inspect.signature(original).parameters)
    if params != ["self", "input_"]:
        raise UnsupportedEngineError(f"vllm GroupCoordinator._all_reduce_out_place{tuple(params)} has a signature "
                                     "this patch was not written for, nothing was patched")
    if group_coordinator is None:
        handle = TreeReducePatch("vLLM GroupCoordinator._all_reduce_out_place -> tree all-reduce (every group)",
                                 "class")
        handle.set_attr(cls, "_all_reduce_out_place", _tree_all_reduce_out_place, "GroupCoordinator (class)")
    else:
        if not isinstance(group_coordinator, cls):
            raise InputTypeError(f"expected a vllm GroupCoordinator, got {type(group_coordinator).__name__}")
        require_attr(group_coordinator, "device_group", "vllm GroupCoordinator instance")
        handle = TreeReducePatch(f"vLLM all-reduce -> tree all-reduce on GroupCoordinator "
                                 f"{getattr(group_coordinator, 'unique_name', '?')!r}", "instance")
        handle.set_attr(group_coordinator, "_all_reduce_out_place",
                    _tree_all_reduce_out_place.__get__(group_coordinator), "GroupCoordinator (instance)")
    return handle


# --------------------------------------------------------------------------------------------------
# The whole forward: every TP-size-dependent reduction of a vLLM model (class level, before loading)
# --------------------------------------------------------------------------------------------------

#: Default leaf width of the vLLM tree forward: it must divide every layer's K shard (the input width one rank
#: reduces) at the largest TP size used (the embedded model at TP = 2: expert intermediate shard 32).
VLLM_TREE_LEAF_WIDTH = 32


def _tp_group():
    from vllm.distributed import get_tp_group

    return get_tp_group().device_group


def _check_layer(label: str, widths: dict[str, int], leaf_width: int) -> None:
    for what, size in widths.items():
        if size % leaf_width:
            raise TreeReductionError(f"vLLM layer {label!r}: {what} {size} is not a multiple of the tree leaf "
                                     f"width {leaf_width} (pass a leaf_width dividing every shard)")


def _shard_leaf(label: str, what: str, shard: int, leaf_width: int, tp_size: int) -> int:
    """The leaf width a rank reduces its K shard with: ``leaf_width``, or, for a shard of a TP-split axis narrower than
    a leaf that divides it (``leaf_width / shard`` a power of two, the TP size above one), the shard itself. A leaf's
    value is the canonical tree over its products, a perfect binary tree at a power-of-two width, so the rank's
    sub-leaf sum is a subtree of it and the tree all-reduce of the ranks' roots recovers the whole leaf's bits
    (the global axis, ``shard * tp_size``, is then a power-of-two number of leaves: one perfect tree)."""
    if shard % leaf_width == 0:
        return leaf_width
    if tp_size > 1 and shard > 0 and leaf_width % shard == 0 and (leaf_width // shard) & (leaf_width // shard - 1) == 0:
        return shard
    raise TreeReductionError(f"vLLM layer {label!r}: {what} {shard} is not a multiple of the tree leaf width "
                             f"{leaf_width} (nor, on a TP-split axis, a power-of-two part of one leaf; pass a "
                             "leaf_width dividing every shard)")


def _perfect_tree(size: int, leaf_width: int) -> bool:
    """Whether ``size`` is a power-of-two number of ``leaf_width`` leaves (its tree is then the perfect binary tree
    over its products, the same at any narrower power-of-two leaf width)."""
    leaves = size // leaf_width
    return size % leaf_width == 0 and leaves & (leaves - 1) == 0


class _VllmTree:
    """The replacement methods, bound to one leaf width (installed on vLLM's classes by
    :func:`apply_tree_reductions`)."""

    def __init__(self, leaf_width: int, parts=()):
        self.leaf_width = leaf_width
        self.parts = tuple(parts)

    # Linear layers (column / merged / QKV / replicated / gate) and the LM head: weights kept unpacked
    def keep_linear_weight(self, original):
        leaf = self.leaf_width
        tree = self

        def process_weights_after_loading(method, layer) -> None:
            weight = getattr(layer, "weight", None)
            if weight is None or weight.dim() != 2 or weight.is_meta:
                return original(method, layer)
            label = getattr(layer, "prefix", None) or type(layer).__name__
            row_parallel = hasattr(layer, "input_is_parallel")
            layer._moealign_leaf = _shard_leaf(label, "K (input) shard", weight.shape[1], leaf,
                                               getattr(layer, "tp_size", 1) if row_parallel else 1)
            if getattr(layer, "reduce_results", True) is False and row_parallel and getattr(layer, "tp_size", 1) > 1:
                # A MoE layer's shared expert (DeepSeek-V3): vLLM all-reduces its partial together with the routed
                # experts' (one all-reduce of the sum). Under the tree experts, which reduce the routed partials
                # themselves (and the runner's final all-reduce is skipped), it reduces its own fp32 subtree root
                # (the TP 1 bits, cast once), and the runner adds the two full outputs as at TP 1.
                if not (label.endswith("shared_experts.down_proj") and "experts" in tree.parts):
                    raise TreeReductionError(f"vLLM RowParallelLinear {label!r} leaves its reduction to the caller "
                                             "(reduce_results=False): the tree forward cannot cut it")
                layer._moealign_reduces_for_moe = True
            layer._moealign_tree = True   # weight kept as loaded: no CPU prepacking (the tree reads it)
        return process_weights_after_loading

    def linear_apply(self, original):
        leaf = self.leaf_width

        def apply(method, layer, x, bias=None):
            if not getattr(layer, "_moealign_tree", False):
                return original(method, layer, x, bias)
            out = tree_linear(x, layer.weight, leaf_width=getattr(layer, "_moealign_leaf", leaf))
            if bias is not None:
                out = out + bias.to(out.dtype)
            return out.to(x.dtype)
        return apply

    def row_parallel_forward(self, original):
        leaf = self.leaf_width

        def forward(layer, input_):
            if not getattr(layer, "_moealign_tree", False):
                return original(layer, input_)
            if layer.input_is_parallel:
                input_parallel = input_
            else:
                input_parallel = input_.chunk(layer.tp_size, dim=-1)[layer.tp_rank].contiguous()
            local = tree_linear(input_parallel, layer.weight,                # fp32 subtree roots
                                leaf_width=getattr(layer, "_moealign_leaf", leaf))
            reduced = tree_all_reduce(local, _tp_group()) if layer.tp_size > 1 else local
            if layer.bias is not None and not layer.skip_bias_add:
                reduced = reduced + layer.bias.to(reduced.dtype)
            output = reduced.to(input_parallel.dtype)
            if not layer.return_bias:
                return output
            return output, (layer.bias if layer.skip_bias_add else None)
        return forward

    # MoE experts: per-slot fp32 subtree roots reduced across ranks before the top-k weighted sum
    def keep_expert_weights(self, original):
        leaf = self.leaf_width

        def process_weights_after_loading(method, layer) -> None:
            label = getattr(layer, "layer_name", None) or type(layer).__name__
            config = layer.moe_config
            activation = getattr(getattr(layer, "activation", None), "value", None)
            problems = []
            if activation != "silu":
                problems.append(f"activation {activation!r} (the tree experts compute SiLU-and-mul)")
            if getattr(config, "use_ep", False) or getattr(config, "ep_size", 1) != 1:
                problems.append("expert parallelism")
            if getattr(config, "is_sequence_parallel", False):
                problems.append("sequence-parallel MoE")
            if getattr(layer, "apply_router_weight_on_input", False):
                problems.append("router weights applied on the input")
            for name in ("w13_bias", "w2_bias"):
                if getattr(layer, name, None) is not None:
                    problems.append(f"expert biases ({name})")
            if any(getattr(layer, name, None) is not None for name in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
                problems.append("a clamped / scaled SwiGLU")
            if problems:
                raise TreeReductionError(f"vLLM MoE layer {label!r}: the tree experts do not apply with "
                                         + ", ".join(problems))
            w13 = layer.w13_weight.detach().clone()
            w2 = layer.w2_weight.detach().clone()
            _check_layer(label, {"hidden size (K of the gate/up projection)": w13.shape[2]}, leaf)
            expert_leaf = _shard_leaf(label, "expert intermediate shard", w2.shape[2], leaf,
                                      getattr(config, "tp_size", 1))
            if expert_leaf != leaf and not _perfect_tree(w13.shape[2], leaf):
                raise TreeReductionError(f"vLLM MoE layer {label!r}: the expert intermediate shard {w2.shape[2]} "
                                         f"cuts a tree leaf, and the hidden size {w13.shape[2]} is not a power-of-two number "
                                         f"of {leaf}-wide leaves (its tree would change at the narrower leaf)")
            if w13.shape[1] != 2 * w2.shape[2]:
                raise TreeReductionError(f"vLLM MoE layer {label!r}: w13 {tuple(w13.shape)} and w2 "
                                         f"{tuple(w2.shape)} are not a gated [2I, H] / [H, I] pair")
            original(method, layer)   # the engine's own packing: its kernel is no longer called
            layer._moealign_tree_weights = (w13, w2)
            layer._moealign_tree_leaf = expert_leaf
        return process_weights_after_loading

    def experts_forward(self, original):
        leaf = self.leaf_width

        def forward_modular(layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
            weights = getattr(layer, "_moealign_tree_weights", None)
            if weights is None:
                return original(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
            if shared_experts is not None:            # runs them only where the kernel was to overlap them (as
                from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder  # vLLM's)

                if layer.moe_config.tp_size > 1 and not _shared_reduces_itself(shared_experts):
                    raise TreeReductionError(f"vLLM MoE layer {layer.layer_name!r} has shared experts whose output "
                                             "is not reduced by the tree forward (a shared expert without a tree "
                                             "row-parallel down_proj): the tree experts cover them at TP 1")
                shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
            return _tree_experts(x, topk_weights, topk_ids, weights, getattr(layer, "_moealign_tree_leaf", leaf),
                                 layer.moe_config.tp_size)
        return forward_modular

    @staticmethod
    def runner_final_reduce(original):
        def _maybe_reduce_final_output(runner, states, trunc_size, output_is_reduced=None):
            if getattr(runner.routed_experts, "_moealign_tree_weights", None) is None:
                if runner.moe_config.tp_size > 1 and _shared_reduces_itself(runner.shared_experts):
                    raise TreeReductionError("vLLM MoE runner: its shared experts reduce their own output (tree) but "
                                             "its routed experts are not the tree experts: the final all-reduce "
                                             "would count the shared output twice")
                return original(runner, states, trunc_size, output_is_reduced)
            # already reduced across ranks inside the tree experts
            return states[..., :trunc_size] if trunc_size is not None else states
        return _maybe_reduce_final_output


def _shared_reduces_itself(shared_experts) -> bool:
    """Whether a MoE layer's shared experts (vLLM's ``SharedExperts`` wrapper) end in a tree row-parallel
    ``down_proj`` that reduces its own output (see ``keep_linear_weight``)."""
    module = getattr(shared_experts, "_layer", shared_experts)
    return bool(getattr(getattr(module, "down_proj", None), "_moealign_reduces_for_moe", False))


def _tree_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, weights, leaf_width: int,
                  tp_size: int) -> torch.Tensor:
    """The routed experts of one MoE layer with TP-invariant arithmetic, the canonical experts and combine of
    :mod:`moealign.precision.canonical`: the (token, expert) pairs taken in ascending expert id, each expert's
    gate / up projections (fp32 roots), SiLU-and-mul cast to the activation dtype, the down projection's fp32
    subtree root over this rank's intermediate shard; the ``[T, k, H]`` partials tree all-reduced across ranks,
    then the gated sum in ascending expert id in fp32, cast once."""
    w13, w2 = weights
    ids, order = topk_ids.to(torch.int64).sort(dim=1)
    gates = torch.gather(topk_weights, 1, order)
    partial = c_experts(x, ids, w13, w2, leaf_width=leaf_width)
    full = tree_all_reduce(partial, _tp_group()) if tp_size > 1 else partial
    return c_combine(full, gates, x.dtype)


TREE_PARTS = ("linear", "lm_head", "experts")


def apply_tree_reductions(*, leaf_width: int = VLLM_TREE_LEAF_WIDTH, parts=TREE_PARTS) -> TreeReducePatch:
    """Make a vLLM model's forward TP-invariant: the log-probs at TP = 2 (4, ...) equal TP = 1 bitwise.

    Class-level (scope ``"process"``), applied *before* the engine loads its model (in each worker: the
    ``vllm.general_plugins`` entry point, :mod:`moealign.patches.vllm.plugin`, does it from
    ``MOEALIGN_VLLM_PATCHES=tree``). Every reduction whose order depends on the TP size follows
    :mod:`moealign.precision.tree`'s canonical tree, and every matmul call has a shape fixed by ``leaf_width``:

    * unquantized linear layers and the LM head (``UnquantizedLinearMethod.apply``,
      ``UnquantizedEmbeddingMethod.apply``): output columns in tiles, K in leaves, fp32 nodes, cast once. Their
      weights stay as loaded (the CPU build's weight prepacking is skipped for them);
    * ``RowParallelLinear.forward``: the K shard's fp32 subtree root, tree all-reduced, bias, cast once;
    * MoE experts (``RoutedExperts.forward_modular``): per (token, slot) partials tree all-reduced before the
      top-k weighted sum (so the runner's own all-reduce of the combined output is skipped); a shared expert's
      row-parallel ``down_proj`` (``reduce_results=False``: vLLM reduces it jointly with the routed output) tree
      all-reduces its own fp32 root, so the runner scales and adds two full outputs in the TP 1 order;
    * a K shard narrower than a leaf (a power-of-two part of one, e.g. DeepSeek's 32-wide experts at TP 2) is
      reduced as that leaf's subtree (a leaf is the perfect binary tree over its products);
    * any other all-reduce (``GroupCoordinator``): the tree all-reduce (the vocab-parallel embedding's sum,
      exact anyway).

    Layers the tree cannot cut raise :class:`TreeReductionError` at load time naming the layer (a shard not a
    multiple of ``leaf_width`` nor a power-of-two part of one, a row-parallel layer other than a shared expert's
    that leaves its reduction to the caller, expert parallelism, expert biases, non-SiLU experts). The price: the tree forward is slower than the engine's
    kernels, and the MoE expert weights are held twice on CPU (the tree reads the unpacked copy).
    """
    check_positive_int(leaf_width, "leaf_width", ConfigError)
    parts = tuple(parts)
    if not parts or set(parts) - set(TREE_PARTS):
        raise ConfigError(f"tree parts must be a non-empty subset of {list(TREE_PARTS)}, got {list(parts)}")
    _, version = engine_version("vllm", "moealign.patches.vllm.apply_tree_reductions needs vLLM")
    check_engine_version("vllm", version, SUPPORTED_VLLM_ENGINE)
    request_amx_tiles()         # the patched forward may skip the oneDNN GEMM that asks for AMX (vLLM's kernels need it)
    from vllm.model_executor.layers import linear, vocab_parallel_embedding
    from vllm.model_executor.layers.fused_moe import routed_experts, unquantized_fused_moe_method
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    tree = _VllmTree(leaf_width, parts)
    linear_targets = [
        (require_attr(linear, "UnquantizedLinearMethod", "vllm linear"), "process_weights_after_loading",
         tree.keep_linear_weight, ["self", "layer"]),
        (linear.UnquantizedLinearMethod, "apply", tree.linear_apply, ["self", "layer", "x", "bias"]),
        (require_attr(linear, "RowParallelLinear", "vllm linear"), "forward", tree.row_parallel_forward,
         ["self", "input_"]),
    ]
    head_targets = [
        (require_attr(vocab_parallel_embedding, "UnquantizedEmbeddingMethod", "vllm vocab_parallel_embedding"),
         "process_weights_after_loading", tree.keep_linear_weight, ["self", "layer"]),
        (vocab_parallel_embedding.UnquantizedEmbeddingMethod, "apply", tree.linear_apply,
         ["self", "layer", "x", "bias"]),
    ]
    expert_targets = [
        (require_attr(unquantized_fused_moe_method, "UnquantizedFusedMoEMethod", "vllm fused_moe"),
         "process_weights_after_loading", tree.keep_expert_weights, ["self", "layer"]),
        (require_attr(routed_experts, "RoutedExperts", "vllm fused_moe.routed_experts"), "forward_modular",
         tree.experts_forward, ["self", "x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input"]),
        (require_attr(moe_runner, "MoERunner", "vllm fused_moe.runner.moe_runner"), "_maybe_reduce_final_output",
         tree.runner_final_reduce, ["self", "states", "trunc_size", "output_is_reduced"]),
    ]
    targets = ((linear_targets if "linear" in parts else []) + (head_targets if "lm_head" in parts else [])
               + (expert_targets if "experts" in parts else []))
    for cls, name, _, expected in targets:
        params = list(inspect.signature(require_attr(cls, name, f"vllm {cls.__name__}")).parameters)
        if params != expected:
            raise UnsupportedEngineError(f"vllm {cls.__name__}.{name}{tuple(params)} has a signature this patch "
                                         "was not written for, nothing was patched")
    handle = TreeReducePatch(f"vLLM TP-invariant tree forward ({', '.join(parts)}, all-reduce; "
                             f"leaf_width={leaf_width})", "process")
    for cls, name, make, _ in targets:
        handle.set_attr(cls, name, make(getattr(cls, name)), f"{cls.__name__}.{name}")
    handle.add_handle(patch_vllm_all_reduce(), "GroupCoordinator all-reduce")
    return handle
