"""The Megatron implementation of the replay protocol: a driver for Megatron's own ``RouterReplay``."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch

from ...errors import ConfigError, ReplayConfigError, ReplayError
from ...routing_replay.layouts import local_route_rows, packed_source_rows
from ...routing_replay.routes import RouteError, validate_routes
from .._version import UnsupportedEngineError
from .audit import _AUX_MODES, audit_replay_config
from .version import megatron_version

# --------------------------------------------------------------------------------------------------
# routers and the driver
# --------------------------------------------------------------------------------------------------


def moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, TopKRouter)`` of ``model``'s MoE layers, ascending; MTP routers excluded.

    Megatron's ``layer_number`` is 1-based; the returned index is 0-based like the record's ``moe_layers``.
    """
    megatron_version()
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter) and ".mtp." not in f".{name}." and not name.startswith("mtp"):
            if module.layer_number is None:
                raise UnsupportedEngineError(f"router {name!r} has no layer_number (set_layer_number not called)")
            if getattr(module, "router_replay", None) is None:
                raise ReplayConfigError(f"router {name!r} has no RouterReplay: build the model with "
                                        f"moe_enable_routing_replay=True")
            out.append((int(module.layer_number) - 1, module))
    if not out:
        raise UnsupportedEngineError("no TopKRouter in this model")
    out.sort(key=lambda item: item[0])
    layers = [layer for layer, _ in out]
    if len(set(layers)) != len(layers):
        raise UnsupportedEngineError(f"several routers share a layer_number: {layers}")
    return out


def _parallel_layout(config) -> dict:
    """cp/sp sizes and ranks of this process from megatron's parallel_state (1/0 when not initialised)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dict(cp_size=1, cp_rank=0, sp_size=1, sp_rank=0)
    sp = bool(getattr(config, "sequence_parallel", False))
    tp_size = ps.get_tensor_model_parallel_world_size()
    return dict(cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                sp_size=tp_size if sp else 1, sp_rank=ps.get_tensor_model_parallel_rank() if sp else 0)


@dataclass
class _Counter:
    calls: int = 0
    rows: int = 0


class RouterReplayDriver:
    """Drive Megatron's RouterReplay for one model.

    ``set_routes(routes, moe_layers, batch_shape=(B, T))`` takes a record's routes ``[B*T, n_layers, k]``
    (padded batch order, row = b*T + t, as :meth:`RolloutRecord.routes_int64` gives) or ``[N, n_layers, k]``
    (packed, ``batch_shape=None``) and hands each router its int64 ``[local_tokens, k]`` targets in
    Megatron's sequence-first order (row = t*B + b). ``forward()`` / ``backward()`` set REPLAY_FORWARD /
    REPLAY_BACKWARD (activation recompute) around the model call; ``check()`` verifies the counters;
    ``clear()`` empties targets and FIFOs between phases. Rows without a recorded route must be given
    *distinct* padding experts (Megatron's dispatcher assumes k distinct experts per token).

    ``aux_loss``: Megatron computes the load-balancing aux loss from the router's *own* top-k. ``"warn"``
    (default) measures how often that differs from the replayed experts (``aux_disagreement``) and warns
    once; ``"replayed"`` makes the aux loss count the replayed experts (the ones that ran); ``"own"``
    leaves Megatron as it is.
    """

    def __init__(self, model: torch.nn.Module, *, audit: bool = True, aux_loss: str = "warn"):
        if aux_loss not in _AUX_MODES:
            raise ConfigError(f"aux_loss must be one of {_AUX_MODES}, got {aux_loss!r}")
        self.model = model
        self.aux_loss = aux_loss
        self.aux_disagreement: list[float] = []   # per aux-loss computation under replay: rows whose own top-k differs
        self._last_replayed: torch.Tensor | None = None
        self._warned = False
        config = getattr(model, "config", None)
        if audit and config is not None:
            audit_replay_config(config, aux_loss="ignore")
        self.routers = moe_routers(model)
        from megatron.core.transformer.moe.router_replay import RouterReplay

        registry = RouterReplay.global_router_replay_instances
        stale = [layer for layer, r in self.routers if not any(inst is r.router_replay for inst in registry)]
        if stale:
            raise ReplayConfigError(f"routers of layers {stale} are not in RouterReplay's global list (a stale "
                                    f"model, or clear_global_router_replay_instances() was called after build)")
        self.counters = [_Counter() for _ in self.routers]
        self._originals = []
        self._rows = None
        for index, (_, router) in enumerate(self.routers):
            self._wrap(index, router.router_replay)
        self._aux_patch = self._patch_aux_scores() if aux_loss != "own" else None

    def _patch_aux_scores(self):
        """Wrap megatron's ``compute_routing_scores_for_aux_loss`` (router module global): right after a
        replayed top-k of one of this model's routers, measure how often the router's own top-k differs
        from the replayed one and, with ``aux_loss="replayed"``, hand back the replayed routing map so the
        load-balancing loss counts the experts that actually ran."""
        import megatron.core.transformer.moe.router as router_mod

        original = router_mod.compute_routing_scores_for_aux_loss
        driver = self

        def compute_routing_scores_for_aux_loss(logits, topk, score_function, *args, **kwargs):
            routing_map, scores = original(logits, topk, score_function, *args, **kwargs)
            last, driver._last_replayed = driver._last_replayed, None
            if not wrapper.active or last is None or last.shape[0] != routing_map.shape[0]:
                return routing_map, scores
            replayed = torch.zeros_like(routing_map).scatter(1, last.to(routing_map.device), True)
            rate = float((replayed != routing_map).any(-1).float().mean())
            driver.aux_disagreement.append(rate)
            if driver.aux_loss == "replayed":
                return replayed, scores
            if rate > 0 and not driver._warned:
                driver._warned = True
                warnings.warn(f"Megatron computes the MoE aux loss from the router's own top-k, which differs from "
                              f"the replayed experts on {rate:.1%} of tokens; RouterReplayDriver(aux_loss='replayed') "
                              f"counts the replayed experts instead", stacklevel=2)
            return routing_map, scores

        wrapper = compute_routing_scores_for_aux_loss
        wrapper.active = True
        router_mod.compute_routing_scores_for_aux_loss = wrapper
        return router_mod, original, wrapper

    def _wrap(self, index: int, replay) -> None:
        original = replay.get_replay_topk

        def get_replay_topk(scores, topk, *args, **kwargs):
            if replay.router_replay_action is not None and replay.router_replay_action.value != "record":
                self.counters[index].calls += 1
                self.counters[index].rows += scores.shape[0]
                want = self._rows
                if want is not None and scores.shape[0] != want:
                    layer = self.routers[index][0]
                    raise ReplayError(f"layer {layer}: the router saw {scores.shape[0]} tokens, the replay "
                                             f"targets have {want} rows")
            probs, top_indices = original(scores, topk, *args, **kwargs)
            replaying = replay.router_replay_action is not None and replay.router_replay_action.value != "record"
            self._last_replayed = top_indices if replaying else None
            return probs, top_indices

        replay.get_replay_topk = get_replay_topk
        self._originals.append(replay)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.routers)

    def set_routes(self, routes: torch.Tensor, moe_layers, *, batch_shape: tuple[int, int] | None = None,
                   route_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                   cu_seqlens_padded: torch.Tensor | None = None, num_experts: int | None = None,
                   parallel: dict | None = None) -> None:
        """Hand each router its targets for the next micro-batch.

        ``routes`` ``[rows, n_layers, k]`` (any integer dtype) with ``moe_layers`` naming the decoder layer
        of each route column (all layers or MoE layers only: the model's MoE layers are picked out).
        Layout: a padded batch (``batch_shape=(B, T)``, row = ``b*T + t``) or a packed row (no
        ``batch_shape``; ``cu_seqlens`` per sample, and ``cu_seqlens_padded`` for THD with padding, whose
        padding slots get filler routes). Context parallelism and sequence parallelism are read from
        megatron's ``parallel_state`` and the model config, or given as ``parallel=dict(cp_size=,
        cp_rank=, sp_size=, sp_rank=)``; see :func:`local_route_rows`.

        ``route_mask`` ``[rows]`` marks rows with a recorded route; the others (padding, each sample's
        last token) get distinct filler experts ``(row + arange(k)) % E``: Megatron's dispatcher counts
        ``k`` distinct experts per token, so a duplicate id is an error here, never silently deduplicated.
        """
        if routes.dim() != 3:
            raise RouteError(f"routes must be [rows, layers, k], got shape {tuple(routes.shape)}")
        moe_layers = tuple(int(x) for x in moe_layers)
        if len(moe_layers) != routes.shape[1]:
            raise RouteError(f"routes have {routes.shape[1]} layers but moe_layers lists {len(moe_layers)}")
        missing = [layer for layer in self.moe_layers if layer not in moe_layers]
        if missing:
            raise RouteError(f"the record has no routes for this model's MoE layers {missing} "
                             f"(record layers {list(moe_layers)}, model layers {list(self.moe_layers)})")
        k = int(self.routers[0][1].topk)
        if routes.shape[2] != k:
            raise RouteError(f"routes have k={routes.shape[2]}, the model routes top-{k}")
        E = num_experts or int(self.routers[0][1].config.num_moe_experts)
        ids = routes.to(torch.int64)
        rows = ids.shape[0]
        mask = torch.ones(rows, dtype=torch.bool) if route_mask is None else route_mask.bool().cpu()
        if mask.shape != (rows,):
            raise RouteError(f"route_mask has shape {tuple(mask.shape)}, expected ({rows},)")
        if batch_shape is not None and (cu_seqlens is not None or cu_seqlens_padded is not None):
            raise RouteError("give batch_shape (padded) or cu_seqlens (packed), not both")
        if batch_shape is not None and rows != batch_shape[0] * batch_shape[1]:
            raise RouteError(f"routes have {rows} rows, batch_shape {tuple(batch_shape)} implies "
                             f"{batch_shape[0] * batch_shape[1]}")
        if cu_seqlens is not None and int(cu_seqlens[-1]) != rows:
            raise RouteError(f"routes have {rows} rows, cu_seqlens ends at {int(cu_seqlens[-1])}")
        if cu_seqlens_padded is not None:
            if cu_seqlens is None:
                raise RouteError("cu_seqlens_padded needs cu_seqlens (the unpadded packing of the routes)")
            source = packed_source_rows(cu_seqlens, cu_seqlens_padded)
            ids, mask = ids[source.clamp(min=0)], mask[source.clamp(min=0)] & (source >= 0)
        filler = (torch.arange(ids.shape[0])[:, None] + torch.arange(k)) % E
        ids = torch.where(mask[:, None, None].to(ids.device), ids, filler[:, None, :].to(ids.device))
        validate_routes(ids, E, name="replay routes")
        layout = parallel if parallel is not None else _parallel_layout(getattr(self.model, "config", None))
        if batch_shape is not None:
            local = local_route_rows(batch_shape=batch_shape, **layout)
        else:
            cu = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
            if cu is None:
                if layout.get("cp_size", 1) > 1:
                    raise RouteError("context parallelism with packed routes needs cu_seqlens")
                cu = torch.tensor([0, ids.shape[0]])
            local = local_route_rows(cu_seqlens_padded=cu, **layout)
        ids = ids[local.to(ids.device)]
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_indices()
        for layer, router in self.routers:
            router.router_replay.set_target_indices(ids[:, moe_layers.index(layer)].contiguous())
        self._rows = ids.shape[0]

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        with self._action(RouterReplayAction.REPLAY_FORWARD):
            yield

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        with self._action(RouterReplayAction.REPLAY_BACKWARD):
            yield

    @contextlib.contextmanager
    def _action(self, action) -> Iterator[None]:
        for _, router in self.routers:
            router.router_replay.set_router_replay_action(action)
        try:
            yield
        finally:
            for _, router in self.routers:
                router.router_replay.clear_router_replay_action()

    def check(self, calls: int = 1) -> None:
        bad = [(layer, c) for (layer, _), c in zip(self.routers, self.counters)
               if c.calls != calls or (self._rows is not None and c.rows != calls * self._rows)]
        if bad:
            detail = ", ".join(f"layer {layer}: {c.calls} calls, {c.rows} rows" for layer, c in bad)
            raise ReplayError(f"replay counters unbalanced (expected {calls} calls of {self._rows} rows per "
                                     f"MoE layer): {detail}")

    def reset_counters(self) -> None:
        self.counters = [_Counter() for _ in self.routers]

    def clear(self) -> None:
        """Empty targets and backward FIFOs (between phases: forward-only passes leave FIFO entries)."""
        for _, router in self.routers:
            router.router_replay.clear_indices()
        self._rows = None

    def undo(self) -> None:
        self.clear()
        for replay in self._originals:
            replay.__dict__.pop("get_replay_topk", None)
        self._originals.clear()
        if self._aux_patch is not None:
            module, original, wrapper = self._aux_patch
            wrapper.active = False            # a pass-through if another driver wrapped it after us
            if module.compute_routing_scores_for_aux_loss is wrapper:
                module.compute_routing_scores_for_aux_loss = original
            self._aux_patch = None

    def __enter__(self) -> "RouterReplayDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()
