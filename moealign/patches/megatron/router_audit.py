"""The router-precision audit (:mod:`moealign.precision.router_audit`) on Megatron-core's ``TopKRouter``.

What Megatron does (``megatron/core/transformer/moe/router.py``, ``moe_utils.py``): the router weight is a
parameter in ``params_dtype`` like every other; ``moe_router_dtype="fp32"`` makes ``gating`` compute the logits
in fp32 (``router_gating_linear(input, weight, bias, router_dtype)``: input and the *held* weight cast up, so a
bf16 model's router multiplies bf16-rounded weights in fp32); ``routing`` then takes top-k with the score
function (``topk_routing_with_score_function``: softmax after top-k on the logits unless
``moe_router_pre_softmax``, or softmax / sigmoid first), the softmax itself computed in fp32 and cast back
``type_as(logits)``.

The stages as reported here:

* ``weight``: ``router.weight.dtype`` as held (``params_dtype``; ``moe_router_dtype`` does not change it);
* ``projection``: the logits ``routing`` receives (the output of ``gating``);
* ``scores``: the probabilities ``routing`` returns, i.e. the scores as the router carries them on (after its
  ``type_as(logits)``; the fp32 inside the softmax call is not reported);
* ``topk_input``: the tensor ``torch.topk`` receives inside the router.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...errors import UnsupportedEngineError
from ...precision.router_audit import RouterAudit, RouterStageObserver, observe_routers
from .version import megatron_version

__all__ = ["audit_router", "topk_routers"]


def topk_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """``{0-based decoder layer: TopKRouter}`` of ``model`` (MTP routers excluded; no RouterReplay needed)."""
    megatron_version()
    from megatron.core.transformer.moe.router import TopKRouter

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter) and ".mtp." not in f".{name}." and not name.startswith("mtp"):
            if module.layer_number is None:
                raise UnsupportedEngineError(f"router {name!r} has no layer_number (set_layer_number not called)")
            layer = int(module.layer_number) - 1
            if layer in out:
                raise UnsupportedEngineError(f"several routers share layer_number {layer + 1}")
            out[layer] = module
    if not out:
        raise UnsupportedEngineError("no TopKRouter in this model")
    return dict(sorted(out.items()))


def _wrap_routing(obs: RouterStageObserver, router: torch.nn.Module) -> None:
    original = router.routing            # the bound method

    def routing(logits, *args, **kwargs):
        obs.note("projection", logits)
        out = original(logits, *args, **kwargs)
        probs = out[0] if isinstance(out, tuple) else out
        obs.note("scores", probs)
        return out

    obs.set_attr(router, "routing", routing, f"layer {router.layer_number} TopKRouter.routing (instance)")


def audit_router(model: torch.nn.Module, inputs: Any = None, *,
                 forward: Callable[[torch.nn.Module, Any], Any] | None = None) -> RouterAudit:
    """The four stages of every ``TopKRouter`` of the Megatron ``model`` in one forward (no grad): ``model(*inputs)``
    (a tuple, e.g. ``(input_ids, position_ids, attention_mask)``) or ``forward(model, inputs)``. Returns a
    :class:`~moealign.precision.router_audit.RouterAudit` keyed by 0-based decoder layer."""
    routers = topk_routers(model)
    cfg = next(iter(routers.values())).config
    engine = f"megatron-core {megatron_version()}"
    with observe_routers(routers, engine=engine) as obs:
        for router in routers.values():
            _wrap_routing(obs, router)
        with torch.no_grad():
            if forward is not None:
                forward(model, inputs)
            elif isinstance(inputs, (tuple, list)):
                model(*inputs)
            else:
                model(inputs)
    obs.result.notes.insert(0, f"moe_router_dtype={cfg.moe_router_dtype!r}, params_dtype="
                               f"{str(cfg.params_dtype).replace('torch.', '')}, moe_router_pre_softmax="
                               f"{cfg.moe_router_pre_softmax}, score_function={getattr(cfg, 'moe_router_score_function', None)!r}; "
                               f"weight: as held; projection: logits into routing; scores: probs out of routing; "
                               f"topk_input: what torch.topk received")
    return obs.result
