"""Multi-head latent attention (MLA, DeepSeek-V2 / V3) on Megatron-core's local (transformer-engine-free) spec.

Megatron-core 0.16.1's ``MLASelfAttention`` builds its core attention with separate key and value head sizes
(``k_channels`` = nope + rope head dim, ``v_channels`` = ``v_head_dim``); the local ``DotProductAttention`` takes
neither (``GPTModel(...)`` fails with ``TypeError: DotProductAttention.__init__() got an unexpected keyword argument
'k_channels'``), only transformer-engine's does. :class:`LocalMLACoreAttention` is the local core attention with both:
the same arithmetic as ``DotProductAttention`` (``baddbmm`` scores with MLA's softmax scale, Megatron's masked
softmax in fp32, ``bmm`` with the values), its output ``heads x v_channels`` wide instead of ``heads x kv_channels``.

:func:`mla_local_block_spec` is Megatron's own local block spec (``get_gpt_decoder_block_spec(...,
use_transformer_engine=False)``) with that core attention swapped into every ``MLASelfAttention`` layer; the other
submodules (column / row parallel linears, the q / kv RMSNorms, the dense or MoE MLP) are Megatron's.

**Tensor parallelism** (TP > 1, always with sequence parallelism here): the heads split over the ranks (``q_b_proj`` /
``kv_b_proj`` rows, ``o_proj`` columns), the q down projection is Megatron's column-parallel one (its output gathered
back before ``q_a_layernorm``). The kv down projection is not: on the local spec Megatron builds it column-parallel
too, gathers its output over TP and splits off the decoupled RoPE key ``k_pe``, which every head of every rank uses;
the gather's backward keeps each rank's own columns only, so ``k_pe``'s gradient (in rank TP-1's columns) holds that
rank's heads' share alone (measured on tiny_deepseek at TP 2: ``kv_a_proj_with_mqa``'s gradient 27% off, the input
norm's 28%; the forward is right). :class:`SequenceParallelMLAAttention` (the layer's attention at TP > 1) replaces it
with :class:`SequenceParallelDuplicatedLinear`, the whole weight on every rank applied to the rank's own sequence
chunk: Megatron's own else-branch then all-gathers ``k_pe`` over the sequence, whose backward (a reduce-scatter) sums
every rank's heads (what transformer-engine's ``TELinear(parallel_mode="duplicated")`` does on the TE spec). The
weight is marked ``sequence_parallel`` (as the norms are), so its gradient is summed over the TP group after the
backward. TP > 1 without sequence parallelism is refused.
Only imported where Megatron is (``patches/megatron`` is the only place megatron is imported).
"""

from __future__ import annotations

import dataclasses

import torch

from ...errors import UnsupportedConversionError
from .version import megatron_version

__all__ = ["SequenceParallelDuplicatedLinear", "local_mla_core_attention", "mla_local_block_spec",
           "sequence_parallel_mla_attention"]

_CLASS = None
_SP_ATTENTION = None


def local_mla_core_attention():
    """The class :class:`LocalMLACoreAttention` (built on first use: it subclasses Megatron's
    ``DotProductAttention``, imported lazily)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    megatron_version()
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class LocalMLACoreAttention(DotProductAttention):
        """Megatron's local ``DotProductAttention`` with separate key / value head sizes (MLA). One query group
        per head (MLA's keys and values are per head)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            # Megatron's Attention base builds a core attention first (config.softmax_scale, no k / v sizes), then
            # MultiLatentAttention builds the one it uses (MLA's softmax scale, k_channels, v_channels)
            if config.num_query_groups != config.num_attention_heads:
                raise UnsupportedConversionError(
                    f"LocalMLACoreAttention: num_query_groups={config.num_query_groups} (MLA has one key / value per "
                    f"head: num_query_groups must equal num_attention_heads={config.num_attention_heads})")
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            world = self.pg_collection.tp.size()
            self.k_channels = int(k_channels if k_channels is not None else config.kv_channels)
            self.v_channels = int(v_channels if v_channels is not None else config.kv_channels)
            # the context is [s, b, heads_per_partition * v_channels]: the parent sizes it by kv_channels
            self.hidden_size_per_partition = divide(self.v_channels * config.num_attention_heads, world)
            self.hidden_size_per_attention_head = self.k_channels

    LocalMLACoreAttention.__qualname__ = "LocalMLACoreAttention"
    _CLASS = LocalMLACoreAttention
    return _CLASS


class SequenceParallelDuplicatedLinear(torch.nn.Module):
    """A bias-free linear held whole on every tensor-parallel rank and applied to the rank's own sequence chunk
    (``[s / TP, b, in] -> [s / TP, b, out]``), returning ``(output, None)`` as Megatron's linears do. Its ``weight``
    is marked ``sequence_parallel`` (each rank's gradient covers its own chunk: summed over the TP group after the
    backward) and is not ``tensor_model_parallel`` (the checkpoint mapping loads and reads it back whole)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        setattr(self.weight, "sequence_parallel", True)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


def sequence_parallel_mla_attention():
    """The class ``SequenceParallelMLAAttention``: Megatron's ``MLASelfAttention`` with its kv down projection a
    :class:`SequenceParallelDuplicatedLinear` (the module docstring says why). Built on first use."""
    global _SP_ATTENTION
    if _SP_ATTENTION is not None:
        return _SP_ATTENTION
    megatron_version()
    import torch.distributed as dist
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class SequenceParallelMLAAttention(MLASelfAttention):
        """``MLASelfAttention`` at TP > 1 under sequence parallelism: the column-parallel ``linear_kv_down_proj``
        Megatron built is gathered into one whole weight (the full weight Megatron initialised, from every rank's
        rows) held by a :class:`SequenceParallelDuplicatedLinear`."""

        def __init__(self, config, submodules, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            group = self.pg_collection.tp
            if group is None or group.size() == 1:
                return
            if not config.sequence_parallel:
                raise UnsupportedConversionError(
                    "multi-head latent attention at tensor parallelism needs sequence_parallel=True (without it "
                    "Megatron's column-parallel kv down projection loses the other ranks' share of the RoPE key's "
                    "gradient)")
            local = self.linear_kv_down_proj.weight.detach()
            pieces = [torch.empty_like(local) for _ in range(group.size())]
            dist.all_gather(pieces, local.contiguous(), group=group)
            self.linear_kv_down_proj = SequenceParallelDuplicatedLinear(torch.cat(pieces, dim=0))

    SequenceParallelMLAAttention.__qualname__ = "SequenceParallelMLAAttention"
    _SP_ATTENTION = SequenceParallelMLAAttention
    return _SP_ATTENTION


def mla_local_block_spec(config):
    """Megatron's local decoder block spec for an MLA ``config`` (``multi_latent_attention=True``), its core
    attention :class:`LocalMLACoreAttention` in every layer; at ``tensor_model_parallel_size > 1`` each layer's
    attention ``SequenceParallelMLAAttention`` (:func:`sequence_parallel_mla_attention`)."""
    megatron_version()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if not getattr(config, "multi_latent_attention", False):
        raise UnsupportedConversionError("mla_local_block_spec: the config is not multi_latent_attention")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    core = local_mla_core_attention()
    layers = []
    for spec in block.layer_specs:
        attention = spec.submodules.self_attention
        if attention.module is not MLASelfAttention:
            raise UnsupportedConversionError(f"mla_local_block_spec: a layer's attention is {attention.module!r}, "
                                             f"not MLASelfAttention")
        attention = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, core_attention=core))
        if int(getattr(config, "tensor_model_parallel_size", 1) or 1) > 1:
            attention = dataclasses.replace(attention, module=sequence_parallel_mla_attention())
        layers.append(dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                               self_attention=attention)))
    return dataclasses.replace(block, layer_specs=layers)
