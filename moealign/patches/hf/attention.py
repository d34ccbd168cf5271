"""transformers: the batch-invariant attention (:func:`moealign.precision.bi_attention.bi_attention`) as an
attention implementation, ``attn_implementation="moealign_bi"``.

:func:`apply_bi_attention` adds two entries to transformers' process-wide registries: the attention
function (``AttentionInterface``) and its mask builder (``AttentionMaskInterface``, a boolean
``[B, 1, Q, K]`` mask, True = attend, never skipped), and returns a :class:`~moealign.handle.PatchHandle`
(scope ``"process"``) whose ``name`` is :data:`BI_ATTENTION`. Models loaded with
``attn_implementation=handle.name`` then call it from their unmodified attention modules, in the full
forward and in every cached decode step. ``handle.undo()`` puts both registries back as they were (models
still configured with the name fail on their next forward if no entry is left). Registering twice is harmless.

:func:`register_bi_attention` is the same registration for the process's lifetime (the engines of
:mod:`moealign.mismatch` register on demand); it returns the name only.
"""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ...handle import PatchHandle

__all__ = ["BI_ATTENTION", "BiAttentionHandle", "apply_bi_attention", "register_bi_attention",
           "is_bi_attention_registered"]

#: The name of the implementation in transformers' registries.
BI_ATTENTION = "moealign_bi"


def _transformers():
    from ..._optional import require

    return require("transformers", "the batch-invariant attention needs transformers (pip install 'moealign[hf]')")


def _attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs):
    """transformers' attention-function signature around :func:`bi_attention`; returns ``(out, None)``."""
    from ...precision.bi_attention import bi_attention

    if dropout and module.training:
        raise ConfigError(f"the {BI_ATTENTION} attention has no dropout (got dropout={dropout} in training mode)")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ConfigError(f"the {BI_ATTENTION} attention needs a bool mask from its own mask builder, got "
                         f"{attention_mask.dtype} (was the model loaded with attn_implementation={BI_ATTENTION!r}?)")
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    return bi_attention(query, key, value, attention_mask, scaling=scaling), None


def _mask(*args, **kwargs):
    """A boolean ``[B, 1, Q, K]`` mask (True = attend): transformers' SDPA mask, with its skips disabled."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    kwargs.pop("dtype", None)
    return sdpa_mask(*args, **kwargs)


class BiAttentionHandle(PatchHandle):
    """Undo handle of :func:`apply_bi_attention`; ``name`` is the ``attn_implementation`` to load models with."""

    name: str = BI_ATTENTION


def apply_bi_attention() -> BiAttentionHandle:
    """Register the batch-invariant attention with transformers' attention and mask registries.

    Returns a :class:`BiAttentionHandle` (scope ``"process"``): ``handle.name`` is :data:`BI_ATTENTION`;
    ``handle.undo()`` restores both registry entries as they were before (removed if there was none).
    """
    _transformers()
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    handle = BiAttentionHandle(f"transformers attention {BI_ATTENTION!r} (AttentionInterface, "
                               f"AttentionMaskInterface)", "process")
    handle.set_item(AttentionInterface._global_mapping, BI_ATTENTION, _attention_forward,
                    f"AttentionInterface[{BI_ATTENTION!r}]")
    handle.set_item(AttentionMaskInterface._global_mapping, BI_ATTENTION, _mask,
                    f"AttentionMaskInterface[{BI_ATTENTION!r}]")
    return handle


def register_bi_attention() -> str:
    """:func:`apply_bi_attention` for the rest of the process (no handle); returns the name, :data:`BI_ATTENTION`."""
    return apply_bi_attention().name


def is_bi_attention_registered() -> bool:
    """True when both registry entries of :func:`register_bi_attention` are present."""
    _transformers()
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return (BI_ATTENTION in AttentionInterface._global_mapping
            and BI_ATTENTION in AttentionMaskInterface._global_mapping)
