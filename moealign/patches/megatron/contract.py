"""The execution contract (:mod:`moealign.contract`) of a Megatron-core ``GPTModel`` built from a transformers
checkpoint (:func:`~moealign.patches.megatron.checkpoint.build_megatron_from_hf`).

Region dtypes: attention, experts and LM head from their parameters as held; the router from Megatron's
``moe_router_dtype`` (``"fp32"``: the router computes in float32 from weights held in ``params_dtype``, so the
contract states ``"float32"`` for the computation while the weight digests reflect the held weights); the logits
dtype measured by a two-token forward. Parallel sizes come from the model's ``TransformerConfig`` (``sp`` is the TP
size when sequence parallelism is on, else 1). Weight digests: the transformers-named tensors of
:func:`~moealign.patches.megatron.checkpoint.hf_state_dict_from_megatron` (TP = 1; at TP > 1 ``digests`` is empty
with a note).
"""

from __future__ import annotations

import torch

from ...contract import check_contract, weight_digests
from ...errors import ConfigError, UnsupportedConversionError
from .version import megatron_version

__all__ = ["contract_of"]

_ROUTER_DTYPES = {"fp32": "float32", "fp64": "float64"}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


from ...contract import bulk_dtype as _bulk


def _logits_dtype(model: torch.nn.Module) -> str:
    device = next(model.parameters()).device
    ids = torch.tensor([[0, 1]], device=device)
    pos = torch.arange(2, device=device)[None]
    mask = torch.ones(2, 2, dtype=torch.bool, device=device).triu(1)[None, None]
    with torch.no_grad():
        logits = model(ids, pos, mask)
    return _name(logits.dtype)


def contract_of(model: torch.nn.Module, hf_config, *, batch_invariant: bool = False, sampling: dict | None = None,
                tree_reductions: bool = False) -> dict:
    """The contract of a Megatron ``GPTModel`` converted from ``hf_config``'s checkpoint (see the module
    docstring). ``sampling``: the sampling parameters this side scores with (``None``: not stated)."""
    from .checkpoint import hf_state_dict_from_megatron

    version = megatron_version()
    if sampling is not None and not isinstance(sampling, dict):
        raise ConfigError(f"sampling must be a dict or None, got {type(sampling).__name__}")
    config = model.config
    params_dtype = _name(config.params_dtype)
    named = list(model.named_parameters())
    attention = _bulk(p for n, p in named if ".self_attention." in n)
    experts = _bulk(p for n, p in named if ".mlp.experts." in n)
    head = getattr(model, "output_layer", None)
    lm_head = _bulk(head.parameters()) if head is not None and any(True for _ in head.parameters()) else None
    if lm_head is None:   # tied embeddings: the output layer reads the embedding's weight
        lm_head = _bulk(p for n, p in named if n.startswith("embedding."))
    router_weights = _bulk(p for n, p in named if ".mlp.router." in n)
    router = _ROUTER_DTYPES.get(getattr(config, "moe_router_dtype", None) or "", router_weights)
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    weights: dict
    try:
        state = hf_state_dict_from_megatron(model, hf_config)
        weights = weight_digests(state.items(), int(config.num_layers))
    except UnsupportedConversionError as exc:
        weights = {"dtype": params_dtype, "algorithm": "sha256", "digests": {},
                   "note": f"no digests: {' '.join(str(exc).split())[:200]}"}
    dispatcher = getattr(config, "moe_token_dispatcher_type", None)
    moe = ("grouped_gemm" if getattr(config, "moe_grouped_gemm", False) else "sequential_mlp") + (
        f", {dispatcher} dispatcher" if dispatcher else "")
    return check_contract({
        "engine": "megatron",
        "engine_version": str(version),
        "dtypes": {"router": router, "attention": attention, "experts": experts, "lm_head": lm_head,
                   "logits": _logits_dtype(model)},
        "kernels": {"attention": "local DotProductAttention (unfused)", "moe": moe},
        "parallel": {"tp": tp, "ep": int(getattr(config, "expert_model_parallel_size", 1) or 1),
                     "sp": tp if getattr(config, "sequence_parallel", False) else 1,
                     "cp": int(getattr(config, "context_parallel_size", 1) or 1)},
        "switches": {"batch_invariant": bool(batch_invariant), "tree_reductions": bool(tree_reductions)},
        "sampling": None if sampling is None else dict(sampling),
        "weights": weights,
    })
