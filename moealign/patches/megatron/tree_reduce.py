"""TP-invariant tree reductions swapped into Megatron-core (see :mod:`moealign.precision.tree`).

* :func:`patch_megatron_row_parallel` - per instance, every ``RowParallelLinear`` of a module.
* :func:`patch_megatron_vocab_parallel_cross_entropy` - module level, ``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ...precision.tree import (
    DEFAULT_LEAF_WIDTH,
    TreeReducePatch,
    TreeReductionError,
    tree_all_reduce,
    tree_matmul,
    tree_reduce_scatter,
    vocab_parallel_logprob_tree,
)
from .._version import (
    require_attr,
)
from .version import megatron_version

# --------------------------------------------------------------------------------------------------
# Megatron-core
# --------------------------------------------------------------------------------------------------




def _row_parallel_tree_forward(layer, leaf_width: int, algorithm: str):
    """A replacement for ``RowParallelLinear.forward`` bound to one layer (same inputs and outputs)."""
    from megatron.core.tensor_parallel.mappings import (
        scatter_to_tensor_model_parallel_region,
    )

    def forward(input_):
        if layer.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=layer.tp_group)
        local = tree_matmul(input_parallel, layer.weight, leaf_width=leaf_width)  # fp32 subtree root
        if layer.sequence_parallel:
            reduced = tree_reduce_scatter(local, layer.tp_group, dim=0)
        else:
            reduced = tree_all_reduce(local, layer.tp_group, algorithm=algorithm)
        output_ = reduced.to(input_parallel.dtype)
        if not layer.skip_bias_add:
            return (output_ + layer.bias if layer.bias is not None else output_), None
        return output_, layer.bias

    return forward


def patch_megatron_row_parallel(module: torch.nn.Module, *, leaf_width: int = DEFAULT_LEAF_WIDTH,
                                algorithm: str = "auto") -> TreeReducePatch:
    """Make every ``RowParallelLinear`` inside ``module`` (or ``module`` itself) TP-invariant, per instance.

    Raises ValueError when there is none; :class:`~moealign.precision.tree.TreeReductionError` naming the layer
    when its K shard is not a whole number of leaves or its TP size is not a power of two; ValueError for
    layers whose reduction happens elsewhere (MoE experts with explicit expert communication) or that rely on
    fused weight-gradient accumulation (``gradient_accumulation_fusion``).
    """
    megatron_version()
    from megatron.core.tensor_parallel import layers as mlayers

    row_cls = require_attr(mlayers, "RowParallelLinear", "megatron.core.tensor_parallel.layers")
    targets = [(name, mod) for name, mod in module.named_modules() if isinstance(mod, row_cls)]
    if not targets:
        raise ConfigError(f"no megatron RowParallelLinear found in {type(module).__name__}")
    for name, layer in targets:
        label = name or type(layer).__name__
        for attr in ("tp_group", "input_size_per_partition", "input_is_parallel", "sequence_parallel",
                     "skip_bias_add", "weight"):
            require_attr(layer, attr, f"RowParallelLinear {label!r}")
        if getattr(layer, "explicit_expert_comm", False):
            raise ConfigError(f"RowParallelLinear {label!r} is an expert layer with explicit expert communication; "
                             "its reduction is not done by the layer, so the tree patch does not apply")
        if getattr(layer, "gradient_accumulation_fusion", False):
            raise ConfigError(f"RowParallelLinear {label!r} uses gradient_accumulation_fusion (fused main_grad "
                             "accumulation), which the tree forward does not provide; disable it")
        world = layer.tp_group.size()
        if layer.input_size_per_partition % leaf_width:
            raise TreeReductionError(f"RowParallelLinear {label!r}: K shard {layer.input_size_per_partition} is not a "
                                     f"multiple of leaf_width={leaf_width}")
        if world & (world - 1):
            raise TreeReductionError(f"RowParallelLinear {label!r}: TP size {world} is not a power of two")
    handle = TreeReducePatch(f"TP-invariant tree forward on {len(targets)} RowParallelLinear of "
                             f"{type(module).__name__} (leaf_width={leaf_width})", "instance")
    for name, layer in targets:
        handle.set_attr(layer, "forward", _row_parallel_tree_forward(layer, leaf_width, algorithm),
                    f"RowParallelLinear {name or '<root>'}")
    return handle


def patch_megatron_vocab_parallel_cross_entropy(*, leaf_width: int = DEFAULT_LEAF_WIDTH) -> TreeReducePatch:
    """Replace Megatron's ``vocab_parallel_cross_entropy`` with the tree version (loss = -log-prob of the
    target, fp32, bitwise the same for every TP size whose vocab shard is a whole number of leaves)."""
    megatron_version()
    import megatron.core.tensor_parallel as tp_pkg
    import megatron.core.tensor_parallel.cross_entropy as ce_mod
    from megatron.core import parallel_state

    require_attr(ce_mod, "vocab_parallel_cross_entropy", "megatron.core.tensor_parallel.cross_entropy")
    require_attr(tp_pkg, "vocab_parallel_cross_entropy", "megatron.core.tensor_parallel")
    get_group = require_attr(parallel_state, "get_tensor_model_parallel_group", "megatron.core.parallel_state")

    def tree_vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
        """moealign tree version of Megatron's vocab_parallel_cross_entropy (no label smoothing)."""
        if label_smoothing:
            raise ConfigError(f"the tree vocab-parallel cross-entropy has no label smoothing (got {label_smoothing})")
        return -vocab_parallel_logprob_tree(vocab_parallel_logits, target, get_group(), leaf_width=leaf_width)

    handle = TreeReducePatch(f"megatron vocab_parallel_cross_entropy -> tree version (leaf_width={leaf_width})",
                             "module")
    handle.set_attr(ce_mod, "vocab_parallel_cross_entropy", tree_vocab_parallel_cross_entropy,
                    "tensor_parallel.cross_entropy.vocab_parallel_cross_entropy")
    handle.set_attr(tp_pkg, "vocab_parallel_cross_entropy", tree_vocab_parallel_cross_entropy,
                    "tensor_parallel.vocab_parallel_cross_entropy")
    return handle
