"""transformers adapter: record routes and kept sets during ``generate()``, replay routes in training.

Patches touch one given model *instance*, never classes, and are reversible (context managers that
restore the instance on exit; ``undo()`` for manual use)::

    from moealign.patches import hf

    record = hf.generate_with_record(model, input_ids, attention_mask, sampling=SamplingParams(top_p=0.9),
                                     max_new_tokens=64)           # routes + kept sets + log-probs
    batch = record.replay_batch("padded", side="right")           # routes + the tokens they belong to
    with hf.replay_routing(model) as replay:                      # the routing-replay protocol
        replay.set_routes(batch)
        with replay.forward():
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        replay.check(calls=1)                                     # every MoE layer consumed its rows

Modules: :mod:`.model` (live routers, record metadata), :mod:`.rollout` (route capture,
``generate_with_record``), :mod:`.replay` (the replay protocol), :mod:`.precision` (precision policies on
a live model), :mod:`.attention` (the batch-invariant attention registered with transformers).

Supported families (a small registry, :func:`register_family` adds more): Qwen2-MoE, Qwen3-MoE,
Mixtral, OLMoE (transformers 5.x, where each sparse block's ``.gate`` is a ``*TopKRouter`` module
returning ``(router_logits, router_scores, router_indices)``).

Replay recomputes the gate weights from the trainer's own router logits for the forced ids, exactly as
the family's router does (:func:`moealign.routing_replay.replay_gate_weights`), so the router keeps its
gradient; the auxiliary load-balancing loss is recomputed from the replayed choices.
"""

from __future__ import annotations

from ...errors import ReplayError, UnsupportedModelError
from .model import (
    FAMILIES,
    SUPPORTED_TRANSFORMERS,
    MoEFamily,
    MoEModelInfo,
    describe_model,
    record_meta,
    register_family,
)
from .replay import RoutingReplay, replay_routing
from .rollout import RouteCapture, capture_routes, generate_with_record

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "MoEFamily",
    "FAMILIES",
    "register_family",
    "UnsupportedModelError",
    "ReplayError",
    "MoEModelInfo",
    "describe_model",
    "record_meta",
    "capture_routes",
    "RouteCapture",
    "generate_with_record",
    "replay_routing",
    "RoutingReplay",
]
