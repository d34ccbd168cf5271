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
Only imported where Megatron is (``patches/megatron`` is the only place megatron is imported).
"""

from __future__ import annotations

import dataclasses

from ...errors import UnsupportedConversionError
from .version import megatron_version

__all__ = ["local_mla_core_attention", "mla_local_block_spec"]

_CLASS = None


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


def mla_local_block_spec(config):
    """Megatron's local decoder block spec for an MLA ``config`` (``multi_latent_attention=True``), its core
    attention :class:`LocalMLACoreAttention` in every layer."""
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
        layers.append(dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                               self_attention=attention)))
    return dataclasses.replace(block, layer_specs=layers)
