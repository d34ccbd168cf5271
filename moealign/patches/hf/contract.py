"""The execution contract (:mod:`moealign.contract`) of a live transformers MoE model.

Region dtypes are read from the parameters as held (the routers found by
:func:`~moealign.patches.hf.model.describe_model`, each decoder layer's ``self_attn``, each MoE layer's experts
module, ``get_output_embeddings()``: :func:`~moealign.patches.hf.precision.module_roles`); the logits dtype is
measured by a two-token forward; the weight digests cover ``named_parameters()`` (transformers names already; a
tied LM head is listed under both names).
"""

from __future__ import annotations

import torch

from ...contract import check_contract, weight_digests
from ...errors import ConfigError
from ...precision.policy import ATTENTION, EXPERTS, LM_HEAD, ROLES, ROUTER

__all__ = ["contract_of", "region_dtypes", "logits_dtype", "weights_of"]


from ...contract import bulk_dtype as _bulk_dtype


def region_dtypes(model: torch.nn.Module) -> dict[str, str | None]:
    """``{router, attention, experts, lm_head}``: the dtype holding most of each region's parameters."""
    from .precision import module_roles

    roles = module_roles(model, include=ROLES)
    modules = dict(model.named_modules())
    out = {}
    for key, role in (("router", ROUTER), ("attention", ATTENTION), ("experts", EXPERTS), ("lm_head", LM_HEAD)):
        params = [p for name, r in roles.items() if r == role for p in modules[name].parameters()]
        out[key] = _bulk_dtype(params)
    return out


def logits_dtype(model: torch.nn.Module) -> str:
    """The dtype of the logits a forward returns, measured on two tokens."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[0, 1]], device=device), use_cache=False)
    return str(out.logits.dtype).replace("torch.", "")


def weights_of(model: torch.nn.Module, *, roundings=None) -> dict:
    """The contract's ``"weights"`` entry of a loaded transformers model (``roundings``: only these rounding dtypes,
    see :func:`moealign.contract.weight_digests`)."""
    from .model import describe_model

    return weight_digests(model.named_parameters(remove_duplicate=False), describe_model(model).num_layers,
                          roundings=roundings)


def contract_of(model: torch.nn.Module, *, attention: str | None = None, batch_invariant: bool = False,
                sampling: dict | None = None, tree_reductions: bool = False) -> dict:
    """The contract of a loaded transformers MoE model (see :mod:`moealign.contract` for the fields).

    ``attention`` is the implementation asked for at loading (``None``: read from the config);
    ``sampling`` the sampling parameters this side samples or scores with (``None``: not stated)."""
    from .model import describe_model

    info = describe_model(model)
    config = model.config
    dtypes = region_dtypes(model)
    dtypes["logits"] = logits_dtype(model)
    attn = getattr(config, "_attn_implementation", None) or attention
    if attention == "bi" and attn is not None:
        attn = f"bi ({attn})"
    experts = getattr(config, "_experts_implementation", None)
    weights = weights_of(model)
    if sampling is not None and not isinstance(sampling, dict):
        raise ConfigError(f"sampling must be a dict or None, got {type(sampling).__name__}")
    return check_contract({
        "engine": "transformers",
        "engine_version": info.transformers_version,
        "dtypes": dtypes,
        "kernels": {"attention": None if attn is None else str(attn),
                    "moe": str(experts) if experts is not None else "eager"},
        "parallel": {"tp": 1, "ep": 1, "sp": 1, "cp": 1},
        "switches": {"batch_invariant": bool(batch_invariant), "tree_reductions": bool(tree_reductions)},
        "sampling": None if sampling is None else dict(sampling),
        "weights": weights,
    })
