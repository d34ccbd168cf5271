"""transformers adapter: load a checkpoint with a precision policy applied, and its tokenizer.

::

    from moealign.patches.hf.loading import load_model, load_tokenizer

    model, handle = load_model(path, "fp16-fp32-router-head", "cuda", attention="bi")
    tokenizer = load_tokenizer(path, padding_side="left")

:func:`load_model` is the one loading path of moealign (the :mod:`moealign.mismatch` engines, the Megatron
converter's source model): ``from_pretrained`` in float32, then the policy applied to the live model by
:func:`moealign.patches.hf.precision.apply_precision` (dtype, fp32 router / LM head, FP8 fake
quantisation), so every policy starts from the full-precision weights.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._optional import require
from ...precision.policy import PrecisionPolicy
from .precision import PrecisionHandle, apply_precision

__all__ = ["load_model", "load_tokenizer"]


def _transformers():
    return require("transformers", "loading a transformers checkpoint needs transformers (pip install 'moealign[hf]')")


def load_model(path: Any, precision: str | PrecisionPolicy, device: str | torch.device = "cpu",
               attention: str | None = None, *, progress_bar: bool = False,
               **from_pretrained: Any) -> tuple[torch.nn.Module, PrecisionHandle]:
    """``AutoModelForCausalLM.from_pretrained(path)`` with the precision policy ``precision`` applied, on
    ``device``, in eval mode: ``(model, handle)``. The loaded float32 tensors are not kept (the model is loaded
    to be used, not given back): ``handle.undo()`` puts the loaded dtypes back, with the policy's rounding (and
    a :class:`~moealign.errors.MoealignWarning` saying so); reload for the checkpoint's values.

    The checkpoint is loaded in float32 (``dtype=`` in ``from_pretrained`` overrides that) and then cast by
    :func:`~moealign.patches.hf.precision.apply_precision`. ``attention`` is the ``attn_implementation``
    (``None``: transformers' default); ``"bi"`` registers moealign's batch-invariant attention
    (:func:`moealign.patches.hf.attention.register_bi_attention`) and loads with it. transformers'
    loading progress bar is off unless ``progress_bar=True`` (the user's setting is restored afterwards).
    Other keyword arguments go to ``from_pretrained``.
    """
    transformers = _transformers()
    if attention == "bi":
        from .attention import register_bi_attention

        attention = register_bi_attention()
    if attention is not None:
        from_pretrained["attn_implementation"] = attention
    from_pretrained.setdefault("dtype", torch.float32)
    logging = transformers.utils.logging
    was_enabled = logging.is_progress_bar_enabled()
    if not progress_bar:
        logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **from_pretrained)
    finally:
        if was_enabled:
            logging.enable_progress_bar()
    handle = apply_precision(model, precision, keep_original=False)
    model.to(device).eval()
    return model, handle


def load_tokenizer(path: Any, *, padding_side: str = "left"):
    """``AutoTokenizer.from_pretrained(path)`` with ``padding_side`` and a pad token (the EOS token when the
    tokenizer has none)."""
    tokenizer = _transformers().AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
