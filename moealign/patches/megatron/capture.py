"""Megatron-core adapter: the experts each MoE router actually used, through forward hooks.

::

    from moealign.patches.megatron.capture import capture_routes

    with torch.no_grad(), capture_routes(model) as capture:
        logits = model(input_ids, position_ids, attention_mask)       # input_ids [B, T]
    used = capture.last_forward()     # [B*T, n_layers, k] int64, row b*T + t, expert ids ascending per row

Each ``TopKRouter`` returns ``(probs, routing_map)``; the routing map is a bool ``[T*B, E]`` in Megatron's
sequence-first row order (row ``t*B + b``). :meth:`MegatronRouteCapture.last_forward` turns the maps of the
most recent forward into expert ids in the record's batch-major row order (row ``b*T + t``, as in
:meth:`moealign.record.RolloutRecord.to_padded`), one column per MoE layer in ascending layer order
(:func:`~moealign.patches.megatron.moe_routers`; MTP routers excluded). Works with or without routing
replay (under replay the maps hold the replayed experts). Under sequence parallelism each TP rank's routers see
only its chunk of the sequence: :meth:`MegatronRouteCapture.last_forward_rows` (``sp_size``, ``sp_rank``) gives
that rank's ids with the record rows they belong to, which the TP ranks' answers put back in order;
:meth:`~MegatronRouteCapture.last_forward` needs every row. Context-parallel slicing is refused.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ...errors import ReplayError, UnsupportedEngineError
from ...handle import PatchHandle
from ...routing_replay.layouts import local_route_rows
from .replay import moe_routers

__all__ = ["MegatronRouteCapture", "capture_routes"]


class MegatronRouteCapture(PatchHandle):
    """Routing maps of a Megatron model's MoE routers (a :class:`~moealign.handle.PatchHandle`, scope
    ``"instance"``): :meth:`attach` adds a forward pre-hook on the model (the ``[B, T]`` shape of each
    forward's ``input_ids``) and a forward hook per router; ``undo()`` removes them (what was captured
    stays readable). ``maps[i]`` is the list of ``[T*B, E]`` bool routing maps of MoE layer ``i``, one per
    router call."""

    def __init__(self, model: torch.nn.Module, routers: list[tuple[int, torch.nn.Module]] | None = None):
        self.model = model
        self.routers = moe_routers(model) if routers is None else list(routers)
        super().__init__(f"route capture on {len(self.routers)} Megatron routers "
                         f"{[layer for layer, _ in self.routers]} of {type(model).__name__}", "instance")
        self.maps: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.shapes: list[tuple[int, int]] = []        # (B, T) of each model forward

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.routers)

    @property
    def num_calls(self) -> list[int]:
        return [len(m) for m in self.maps]

    def _shape_hook(self, module, args, kwargs):
        input_ids = args[0] if args else kwargs.get("input_ids")
        if input_ids is None or input_ids.dim() != 2:
            raise ReplayError(f"route capture needs the model called with input_ids [batch, seq]; got "
                              f"{None if input_ids is None else tuple(input_ids.shape)}")
        self.shapes.append((int(input_ids.shape[0]), int(input_ids.shape[1])))

    def _router_hook(self, index: int):
        def hook(module, args, out):
            self.maps[index].append(out[1].detach())
        return hook

    def attach(self) -> "MegatronRouteCapture":
        try:
            self.add_hook(self.model.register_forward_pre_hook(self._shape_hook, with_kwargs=True),
                          f"{type(self.model).__name__} forward pre-hook (input shape)")
            for index, (layer, router) in enumerate(self.routers):
                self.add_hook(router.register_forward_hook(self._router_hook(index)), f"router of layer {layer}")
        except BaseException:
            self.undo()
            raise
        return self

    def clear(self) -> None:
        for lst in self.maps:
            lst.clear()
        self.shapes.clear()

    def last_forward(self) -> torch.Tensor:
        """Expert ids of the most recent forward: ``[B*T, n_layers, k]`` int64, row ``b*T + t`` (the
        record's row order), ids ascending within a row. The routers must have seen every row (no sequence
        parallelism: :meth:`last_forward_rows`)."""
        rows, ids = self.last_forward_rows()
        return ids.new_empty(ids.shape).index_copy_(0, rows.to(ids.device), ids)

    def last_forward_rows(self, *, sp_size: int = 1, sp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, ids)`` of the most recent forward on a rank whose routers saw the sequence-parallel chunk
        ``sp_rank`` of ``sp_size`` (Megatron's ``[s / sp_size, b, h]``; 1 / 0: every row): ``ids``
        ``[B*T / sp_size, n_layers, k]`` int64 in the routers' own row order, ids ascending within a row, and
        ``rows`` the record row ``b*T + t`` of each (:func:`~moealign.routing_replay.layouts.local_route_rows`)."""
        if not self.shapes:
            raise ReplayError("route capture saw no model forward")
        if not all(self.maps):
            raise ReplayError(f"no router call recorded in some layers (calls per layer: {self.num_calls})")
        B, T = self.shapes[-1]
        rows = local_route_rows(batch_shape=(B, T), sp_size=sp_size, sp_rank=sp_rank)
        used = []
        for (layer, router), maps in zip(self.routers, self.maps):
            m = maps[-1]
            if m.dim() != 2 or m.shape[0] != rows.numel():
                raise UnsupportedEngineError(
                    f"layer {layer}: the router saw a routing map of shape {tuple(m.shape)}, not [{rows.numel()}, E] "
                    f"for input_ids [{B}, {T}] at sequence-parallel rank {sp_rank} of {sp_size} (another "
                    f"sequence-parallel size, or context-parallel slicing, which the capture does not support)")
            k = int(router.topk)
            ids = m.nonzero()[:, 1]                         # the routers' row order: t*B + b within the chunk
            if ids.numel() != rows.numel() * k:
                raise ReplayError(f"layer {layer}: the routing map selects {ids.numel()} experts for {rows.numel()} "
                                  f"rows, not {k} per row")
            used.append(ids.reshape(rows.numel(), k))
        return rows, torch.stack(used, dim=1)


@contextlib.contextmanager
def capture_routes(model: torch.nn.Module, *,
                   routers: list[tuple[int, torch.nn.Module]] | None = None) -> Iterator[MegatronRouteCapture]:
    """Record every router decision of the Megatron ``model`` while the block runs (hooks removed on exit);
    ``capture.last_forward()`` gives the ids per layer in record row order. ``routers``: the
    ``(layer, TopKRouter)`` list when the caller has it (default :func:`~moealign.patches.megatron.moe_routers`)."""
    capture = MegatronRouteCapture(model, routers).attach()
    try:
        yield capture
    finally:
        capture.undo()
