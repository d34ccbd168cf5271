"""Replay safety audit of a Megatron model: every setting in which routing replay would not apply.

:func:`audit_replay_config` (the ``TransformerConfig``): no RouterReplay, the fused router (its top-k returns before
the replay hook), sinkhorn / quantile-balancing routing (bypasses RouterReplay), token dropping by capacity, forced load
balancing, a CUDA graph that captures the router. Aux-loss-free routing (``moe_router_enable_expert_bias`` with
sigmoid scores) is *not* refused: Megatron 0.16 takes the top-k of ``scores + expert_bias`` through the same replay
point, and the gate weights are gathered from the unbiased scores at the replayed experts.
:func:`audit_layers` (the model): the global layer numbering of every block (pipeline / virtual-pipeline offsets) and
the layers it runs dense; :func:`check_record_layers`: routes for layers past the decoder (MTP)."""

from __future__ import annotations

import warnings

from ...errors import ConfigError, InputTypeError, MoealignWarning, ReplayConfigError
from .version import megatron_version

_SKIPPING_ROUTING_TYPES = ("sinkhorn", "quantile_balancing")
_AUX_FROM_OWN_TOPK = ("aux_loss", "seq_aux_loss", "global_aux_loss")


# --------------------------------------------------------------------------------------------------
# audit
# --------------------------------------------------------------------------------------------------


def is_transformer_config(obj) -> bool:
    """True for a megatron-core ``TransformerConfig`` (or a subclass, e.g. ``MLATransformerConfig``)."""
    megatron_version()
    from megatron.core.transformer.transformer_config import TransformerConfig

    return isinstance(obj, TransformerConfig)


def audit_replay_config(config, *, aux_loss: str = "warn") -> list[str]:
    """Raise :class:`ReplayConfigError` naming the field for every setting that breaks replay.

    ``config``: the model's megatron ``TransformerConfig`` (``model.config``). A dict of fields is refused
    (:class:`InputTypeError`): fields it lacks would be audited as their absence, not as TransformerConfig's
    defaults; build ``TransformerConfig(**fields)`` first.

    ``aux_loss``: Megatron computes its load-balancing aux loss from the router's *own* top-k, not the
    replayed one: ``"warn"`` (default) warns, ``"error"`` raises, ``"ignore"`` says nothing. Returns the
    warnings issued.
    """
    if aux_loss not in ("warn", "error", "ignore"):
        raise ConfigError(f"aux_loss must be one of ('warn', 'error', 'ignore'), got {aux_loss!r}")
    if not is_transformer_config(config):
        raise InputTypeError(f"audit_replay_config takes a megatron TransformerConfig (model.config), got "
                             f"{type(config).__name__}; for a dict of fields build TransformerConfig(**fields) first")
    problems, notes = [], []
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    if not get("moe_enable_routing_replay", False):
        problems.append("moe_enable_routing_replay=False: the routers have no RouterReplay, nothing would replay")
    if get("moe_router_fusion", False):
        problems.append("moe_router_fusion=True: the fused top-k returns before the replay hook, so replay is "
                        "silently ignored; set moe_router_fusion=False")
    lb = get("moe_router_load_balancing_type", "aux_loss")
    lb_types = lb if isinstance(lb, (list, tuple)) else [lb]
    for t in lb_types:
        if t in _SKIPPING_ROUTING_TYPES:
            problems.append(f"moe_router_load_balancing_type={t!r}: this routing type bypasses RouterReplay")
    if get("moe_expert_capacity_factor") is not None:
        problems.append(f"moe_expert_capacity_factor={get('moe_expert_capacity_factor')}: token dropping runs "
                        f"after replay and can drop replayed routes; use dropless MoE (None)")
    if get("moe_router_force_load_balancing", False):
        problems.append("moe_router_force_load_balancing=True: the gate weights of the replayed experts would come "
                        "from random logits (a benchmark switch)")
    impl = str(get("cuda_graph_impl", "none") or "none")
    if impl != "none" or get("enable_cuda_graph", False) or get("external_cuda_graph", False):
        # 0.16: cuda_graph_scope; 0.19: cuda_graph_modules (cuda_graph_scope deprecated, migrated, then None)
        field_name = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
        scope = get(field_name)
        scope = "full" if scope is None else scope
        scopes = [getattr(x, "name", str(x)).lower() for x in (scope if isinstance(scope, (list, tuple)) else [scope])]
        if not scopes or any(x in ("", "full", "full_iteration", "moe", "moe_router") for x in scopes):
            problems.append(f"cuda_graph_impl={impl!r} with {field_name}={scope!r}: a captured router graph keeps "
                            f"the target tensor it saw at capture, so later targets would not be replayed; exclude the "
                            f"router from the graph (e.g. scope 'attn') or disable CUDA graphs")
    if not get("num_moe_experts"):
        problems.append("num_moe_experts is not set: not a MoE config")
    if problems:
        raise ReplayConfigError("routing replay would not apply as asked: " + "; ".join(problems))
    coeff = get("moe_aux_loss_coeff", 0.0)
    coeff = sum(coeff) if isinstance(coeff, (list, tuple)) else coeff
    if any(t in _AUX_FROM_OWN_TOPK for t in lb_types) and coeff:
        msg = (f"moe_router_load_balancing_type={lb!r} with moe_aux_loss_coeff={coeff}: Megatron computes the "
               f"aux loss from the router's own top-k, not the replayed experts")
        if aux_loss == "error":
            raise ReplayConfigError(msg)
        if aux_loss == "warn":
            warnings.warn(msg, MoealignWarning, stacklevel=2)
        notes.append(msg)
    return notes


# --------------------------------------------------------------------------------------------------
# the model's layers: numbering, dense layers, MTP
# --------------------------------------------------------------------------------------------------


def audit_layers(model) -> tuple[int, ...]:
    """Check the decoder-layer numbering of every ``TransformerBlock`` in ``model`` (MTP blocks aside) and return the
    0-based numbers of the layers this model holds and runs dense.

    Routes are bound to routers by their ``layer_number`` (global, 1-based: the block's pipeline / virtual-pipeline
    offset plus the layer's index). A block whose layers are not numbered ``offset + 1, offset + 2, ...`` with
    Megatron's own offset for its ``vp_stage`` (a model chunk built with another ``vp_stage``, a custom spec that
    renumbers, layers re-ordered after build) would bind every route to another layer: :class:`ReplayConfigError`
    naming the block, its ``vp_stage``, the expected and the actual numbers."""
    megatron_version()
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense: list[int] = []
    for name, block in model.named_modules():
        if not isinstance(block, TransformerBlock) or ".mtp." in f".{name}." or name.startswith("mtp"):
            continue
        vp_stage = getattr(block, "vp_stage", None)
        try:
            pp = getattr(getattr(block, "pg_collection", None), "pp", None)
            pp_rank = pp.rank() if pp is not None and hasattr(pp, "rank") else None
            offset = get_transformer_layer_offset(block.config, vp_stage, pp_rank)
        except Exception as exc:  # noqa: BLE001 - Megatron asserts on an inconsistent pipeline layout
            raise ReplayConfigError(f"block {name or 'decoder'!r} (vp_stage={vp_stage}): Megatron cannot compute its "
                                    f"layer offset ({type(exc).__name__}: {exc}); replay binds routes by global layer "
                                    f"number and needs it") from None
        numbers = [int(getattr(layer, "layer_number", -1)) for layer in block.layers]
        want = list(range(offset + 1, offset + 1 + len(numbers)))
        if numbers != want:
            raise ReplayConfigError(f"block {name or 'decoder'!r} (vp_stage={vp_stage}) numbers its layers {numbers}, "
                                    f"Megatron's offset for this stage gives {want}: routes bound by layer number would "
                                    f"reach other layers (a chunk built with another vp_stage, or renumbered layers)")
        dense += [n - 1 for n, layer in zip(numbers, block.layers) if not isinstance(getattr(layer, "mlp", None),
                                                                                      MoELayer)]
    return tuple(sorted(dense))


def check_record_layers(config, moe_layers) -> None:
    """Refuse routes for layers the decoder does not have: with multi-token prediction (``mtp_num_layers``) the MTP
    layers' routers are numbered after the decoder's, and a record (rollout engines record the decoder only) that
    names them hands decoder routes to MTP routers."""
    num_layers = int(getattr(config, "num_layers", 0) or 0)
    beyond = sorted(x for x in moe_layers if x >= num_layers)
    if beyond:
        mtp = getattr(config, "mtp_num_layers", None)
        what = (f"the model's {mtp} MTP layer(s) sit there, and their routers are not the decoder's: rollout engines "
                f"record decoder layers only" if mtp else "there is no such layer")
        raise ReplayConfigError(f"the routes name layers {beyond}, beyond the decoder's {num_layers} layers: {what}")
