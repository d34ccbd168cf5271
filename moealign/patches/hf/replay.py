"""transformers adapter, training side: routing replay on one model instance (:class:`RoutingReplay`)."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from ...errors import ReplayError
from ...routing_replay.gates import (
    load_balancing_loss,
    replay_gate_weights,
    replay_recorded_gate_weights,
    select_topk,
)
from ...routing_replay.routes import RouteError, validate_routes
from .model import MoEModelInfo, describe_model

# --------------------------------------------------------------------------------------------------
# replay
# --------------------------------------------------------------------------------------------------


_NO_FORWARD = object()


@dataclass
class ReplayCounter:
    forwards: int = 0
    rows_seen: int = 0
    rows_replayed: int = 0


@dataclass
class RoutingReplay:
    """Handle of an active replay on one model instance. See :func:`replay_routing`."""

    model: torch.nn.Module
    info: MoEModelInfo
    fix_aux_loss: bool = True
    counters: list[ReplayCounter] = field(default_factory=list)
    _targets: list[torch.Tensor] | None = None
    _mask: torch.Tensor | None = None
    _rows_replayed: int = 0
    _weights: list[torch.Tensor] | None = None
    _live: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _active: bool = False
    _saved_model_forward: object = None   # the instance-level ``forward`` the model had before attach, if any

    def __post_init__(self):
        self.counters = [ReplayCounter() for _ in self.info.routers]

    # ------------------------------------------------------------ targets
    def set_targets(self, routes: torch.Tensor, route_mask: torch.Tensor | None = None, *,
                    recorded_weights: torch.Tensor | None = None) -> None:
        """Routes ``[rows, n_layers, k]`` (any integer dtype) for the next forward(s).

        ``route_mask`` ``[rows]`` marks rows with a recorded route; other rows (padding, each sample's
        last token) keep the router's own choice. ``recorded_weights`` ``[rows, n_layers, k]`` switches
        to the verification variant: the gate weights are those constants instead of recomputed ones.
        """
        n, k, E = len(self.info.routers), self.info.top_k, self.info.num_experts
        if routes.dim() != 3:
            raise RouteError(f"replay routes must be [rows, layers, k], got shape {tuple(routes.shape)}")
        if routes.shape[1] != n:
            raise RouteError(f"replay routes have {routes.shape[1]} layers, the model has {n} MoE layers "
                             f"{list(self.info.moe_layers)}")
        if routes.shape[2] != k:
            raise RouteError(f"replay routes have k={routes.shape[2]}, the model routes top-{k}")
        rows = routes.shape[0]
        if route_mask is None:
            route_mask = torch.ones(rows, dtype=torch.bool, device=routes.device)
        if route_mask.shape != (rows,):
            raise RouteError(f"route_mask has shape {tuple(route_mask.shape)}, expected ({rows},)")
        route_mask = route_mask.to(torch.bool)
        validate_routes(routes[route_mask.to(routes.device)], E, name="replay routes")
        device = self.info.routers[0][1].weight.device
        ids = routes.to(device=device, dtype=torch.int64)
        self._targets = [ids[:, i].contiguous() for i in range(n)]
        self._mask = None if bool(route_mask.all()) else route_mask.to(device)
        self._rows_replayed = int(route_mask.sum())
        if recorded_weights is not None:
            if recorded_weights.shape != routes.shape:
                raise RouteError(f"recorded_weights shape {tuple(recorded_weights.shape)} != routes shape "
                                 f"{tuple(routes.shape)}")
            self._weights = [recorded_weights[:, i].to(device) for i in range(n)]
        else:
            self._weights = None

    def clear_targets(self) -> None:
        self._targets = self._mask = self._weights = None

    # ------------------------------------------------------------ counters
    def reset_counters(self) -> None:
        self.counters = [ReplayCounter() for _ in self.info.routers]

    def check(self, forwards: int = 1) -> None:
        """Raise :class:`ReplayError` unless every MoE layer ran ``forwards`` times, replaying its rows each time."""
        want_rows = forwards * self._rows_replayed
        bad = [(layer, c) for (layer, _), c in zip(self.info.routers, self.counters)
               if c.forwards != forwards or c.rows_replayed != want_rows]
        if bad:
            detail = ", ".join(f"layer {layer}: {c.forwards} forwards, {c.rows_replayed} rows replayed" for layer, c in bad)
            raise ReplayError(f"replay counters unbalanced (expected {forwards} forwards and {want_rows} replayed "
                              f"rows per MoE layer): {detail}")

    # ------------------------------------------------------------ the patched router forward
    def _router_forward(self, index: int, router: torch.nn.Module):
        scoring = self.info.scoring
        fp32_scores = self.info.family.scores_in_fp32

        def forward(hidden_states: torch.Tensor):
            if self._targets is None:
                raise ReplayError("routing replay is active but no targets are set (call set_targets first)")
            h = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(h, router.weight, getattr(router, "bias", None))
            target = self._targets[index]
            if target.shape[0] != h.shape[0]:
                layer = self.info.routers[index][0]
                raise ReplayError(f"layer {layer}: the router saw {h.shape[0]} rows, the replay targets have "
                                  f"{target.shape[0]} rows ({'extra' if target.shape[0] > h.shape[0] else 'missing'} "
                                  f"rows in the record for this forward)")
            if self._mask is None:
                ids = target
            else:
                native = select_topk(logits, router.top_k, scoring)[1]
                ids = torch.where(self._mask[:, None], target, native)
            out_dtype = torch.float32 if fp32_scores else logits.dtype
            if self._weights is not None:
                weights = replay_recorded_gate_weights(self._weights[index], logits).to(out_dtype)
            else:
                weights = replay_gate_weights(logits, ids, scoring, out_dtype=out_dtype, validate=False)
            counter = self.counters[index]
            counter.forwards += 1
            counter.rows_seen += h.shape[0]
            counter.rows_replayed += self._rows_replayed
            if self.fix_aux_loss:
                self._live.append((index, logits, ids))
            return logits, weights, ids

        return forward

    def _model_forward(self, original):
        signature = inspect.signature(type(self.model).forward)

        def forward(*args, **kwargs):
            self._live.clear()
            # The aux loss is fixed on the output object: where the caller asks for a tuple, get the object
            # and convert at the end, as transformers' ``can_return_tuple`` does.
            want_tuple = kwargs.get("return_dict") is False
            if want_tuple:
                kwargs["return_dict"] = True
            out = original(*args, **kwargs)
            aux = getattr(out, "aux_loss", None)
            if aux is not None and self._live:
                by_layer: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
                for index, logits, ids in self._live:   # with activation recompute the last call per layer wins
                    by_layer[index] = (logits, ids)
                ordered = [by_layer[i] for i in sorted(by_layer)]
                try:   # attention_mask may come by keyword or by position
                    attention_mask = signature.bind_partial(self.model, *args, **kwargs).arguments.get("attention_mask")
                except TypeError:
                    attention_mask = kwargs.get("attention_mask")
                new_aux = load_balancing_loss([lg for lg, _ in ordered], [ids for _, ids in ordered],
                                              self.info.num_experts, self.info.top_k,
                                              attention_mask=attention_mask)
                # the coefficient the model itself applied (an instance attribute in every supported family)
                coef = float(getattr(self.model, "router_aux_loss_coef",
                                     getattr(self.model.config, "router_aux_loss_coef", 0.0)))
                if getattr(out, "loss", None) is not None:
                    out.loss = out.loss - coef * aux.to(out.loss.device) + coef * new_aux.to(out.loss.device)
                out.aux_loss = new_aux
            self._live.clear()
            return out.to_tuple() if want_tuple and not isinstance(out, tuple) else out

        return forward

    def attach(self) -> "RoutingReplay":
        if self._active:
            raise ReplayError("this replay is already attached")
        for _, module in self.info.routers:
            if "forward" in module.__dict__:
                raise ReplayError("a router of this model already has an instance-level forward (another replay "
                                  "is active on it?)")
        for index, (_, module) in enumerate(self.info.routers):
            module.forward = self._router_forward(index, module)
        if self.fix_aux_loss:
            self._saved_model_forward = self.model.__dict__.get("forward", _NO_FORWARD)
            self.model.forward = self._model_forward(self.model.forward)
        self._active = True
        return self

    def undo(self) -> None:
        if not self._active:
            return
        for _, module in self.info.routers:
            module.__dict__.pop("forward", None)
        if self.fix_aux_loss:
            if self._saved_model_forward is _NO_FORWARD:
                self.model.__dict__.pop("forward", None)
            else:   # put back a wrapper someone else installed (accelerate, a profiler, ...)
                self.model.__dict__["forward"] = self._saved_model_forward
            self._saved_model_forward = None
        self._live.clear()
        self._active = False


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routes: torch.Tensor | None = None, route_mask: torch.Tensor | None = None,
                   *, fix_aux_loss: bool = True) -> Iterator[RoutingReplay]:
    """Force the routers of ``model`` to the given expert ids while the block runs (undone on exit).

    Gate weights are recomputed from the live router logits for the forced ids (the router keeps its
    gradient); with ``fix_aux_loss`` the model's ``aux_loss`` (and ``loss``) use the replayed choices.
    """
    replay = RoutingReplay(model, describe_model(model), fix_aux_loss=fix_aux_loss)
    if routes is not None:
        replay.set_targets(routes, route_mask)
    replay.attach()
    try:
        yield replay
    finally:
        replay.undo()
