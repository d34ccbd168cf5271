"""The Megatron-core implementation of the routing-replay protocol: a driver for Megatron's own ``RouterReplay``.

:func:`replay_routing` returns a :class:`RouterReplayDriver` (a
:class:`~moealign.routing_replay.protocol.RoutingReplayAdapter`)::

    batch = record.replay_batch("padded", side="right")
    with mg.replay_routing(model, aux_loss="replayed") as replay:
        replay.set_routes(batch)                 # each router's local rows, in Megatron's order
        with replay.forward():                   # REPLAY_FORWARD
            logits = model(batch.input_ids, position_ids, attention_mask)
        with replay.backward():                  # REPLAY_BACKWARD serves activation recompute
            loss.backward()
        replay.check(calls=2)

A forward pre-hook on the model compares the tokens the model runs, in each router's row order (after
context-parallel and sequence-parallel slicing), with the tokens the routes were recorded for: a
transposed layout, another padding side or another batch raises :class:`~moealign.errors.ReplayError`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

from ...errors import ReplayConfigError, ReplayError
from ...handle import PatchHandle
from ...routing_replay.layouts import local_route_rows, packed_source_rows
from ...routing_replay.protocol import (
    ReplayBatch,
    ReplayCounters,
    check_aux_loss_mode,
    check_row_tokens,
    model_routes,
)
from ...routing_replay.routes import RouteError, validate_routes
from .._version import UnsupportedEngineError
from .audit import audit_replay_config
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


class RouterReplayDriver(PatchHandle):
    """Drive Megatron's RouterReplay for one model.

    ``set_routes(batch)`` takes a :class:`~moealign.routing_replay.protocol.ReplayBatch` (padded: row =
    b*T + t; packed THD) and hands each router its int64 ``[local_tokens, k]`` targets in Megatron's
    sequence-first order (row = t*B + b), after context- and sequence-parallel slicing. ``forward()`` / ``backward()`` set REPLAY_FORWARD /
    REPLAY_BACKWARD (activation recompute) around the model call; ``check()`` verifies the counters;
    ``clear()`` empties targets and FIFOs between phases. Rows without a recorded route must be given
    *distinct* padding experts (Megatron's dispatcher assumes k distinct experts per token).

    ``aux_loss``: Megatron computes the load-balancing aux loss from the router's *own* top-k. ``"warn"``
    (default) measures how often that differs from the replayed experts (``aux_disagreement``) and warns
    once; ``"replayed"`` makes the aux loss count the replayed experts (the ones that ran); ``"own"``
    leaves Megatron as it is.
    """

    def __init__(self, model: torch.nn.Module, *, audit: bool = True, aux_loss: str = "warn"):
        self.aux_loss = check_aux_loss_mode(aux_loss)
        self.model = model
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
        nested = [layer for layer, r in self.routers if "get_replay_topk" in vars(r.router_replay)]
        if nested:
            raise ReplayError(f"routers of layers {nested} are already driven by another RouterReplayDriver; nested "
                              f"drivers on one model are refused (undo the other one first)")
        PatchHandle.__init__(self, f"Megatron RouterReplay of {len(self.routers)} routers {list(self.moe_layers)} of "
                             f"{type(model).__name__}, aux_loss={aux_loss!r}",
                             scope="instance" if aux_loss == "own" else "module")
        self.counters = ReplayCounters(self.moe_layers)
        self._rows = None
        self._expected_tokens: torch.Tensor | None = None
        self._expected_mask: torch.Tensor | None = None
        self._sp: tuple[int, int] = (1, 0)
        self.add_callback(self.clear)                       # undone last: empty this driver's targets and FIFOs
        try:
            for index, (layer, router) in enumerate(self.routers):
                self._wrap(index, layer, router.router_replay)
            if aux_loss != "own":
                self._patch_aux_scores()
            self._token_hook = self.add_hook(model.register_forward_pre_hook(self._check_tokens_hook, with_kwargs=True),
                          f"{type(model).__name__} forward pre-hook (token check)")
        except BaseException:
            self.undo()
            raise

    def _check_tokens_hook(self, module, args, kwargs):
        """Forward pre-hook: the tokens the model runs, in router row order, must be the batch's."""
        if self._expected_tokens is None:
            return None
        input_ids = args[0] if args else kwargs.get("input_ids")
        if input_ids is None:
            raise ReplayError("routing replay checks the tokens every router row holds: call the model with "
                              "input_ids")
        if input_ids.dim() != 2:
            raise ReplayError(f"Megatron models take input_ids [batch, seq]; got {tuple(input_ids.shape)}")
        rows = input_ids.t().reshape(-1)                        # sequence-first, as the routers see them
        sp_size, sp_rank = self._sp
        if rows.numel() % sp_size:
            raise ReplayError(f"{rows.numel()} token rows are not divisible by the sequence-parallel size {sp_size}")
        step = rows.numel() // sp_size
        rows = rows[sp_rank * step:(sp_rank + 1) * step]
        check_row_tokens(self._expected_tokens, rows, self._expected_mask, where=f"{type(module).__name__}")
        return None

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

        def restore() -> None:
            wrapper.active = False            # a pass-through if another driver wrapped it after us
            if router_mod.compute_routing_scores_for_aux_loss is wrapper:
                router_mod.compute_routing_scores_for_aux_loss = original

        self.add_callback(restore, "megatron.core.transformer.moe.router.compute_routing_scores_for_aux_loss")

    def _wrap(self, index: int, layer: int, replay) -> None:
        original = replay.get_replay_topk

        def get_replay_topk(scores, topk, *args, **kwargs):
            if replay.router_replay_action is not None and replay.router_replay_action.value != "record":
                if self._rows is None:
                    raise ReplayError(f"layer {self.routers[index][0]}: replay is on but no routes are set "
                                      f"(call set_routes(batch) before forward())")
                self.counters.add(index, scores.shape[0])
                want = self._rows
                if want is not None and scores.shape[0] != want:
                    layer = self.routers[index][0]
                    raise ReplayError(f"layer {layer}: the router saw {scores.shape[0]} tokens, the replay "
                                             f"targets have {want} rows")
            probs, top_indices = original(scores, topk, *args, **kwargs)
            replaying = replay.router_replay_action is not None and replay.router_replay_action.value != "record"
            self._last_replayed = top_indices if replaying else None
            return probs, top_indices

        self.set_attr(replay, "get_replay_topk", get_replay_topk, f"RouterReplay.get_replay_topk (layer {layer})")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.routers)

    def set_routes(self, batch: ReplayBatch, *, cu_seqlens_padded: torch.Tensor | None = None,
                   num_experts: int | None = None, parallel: dict | None = None) -> None:
        """Hand each router its rows of ``batch`` for the next micro-batch.

        ``batch`` (:class:`~moealign.routing_replay.protocol.ReplayBatch`): padded ``[B, T]`` or packed THD,
        with all layers or MoE layers only (the model's MoE layers are picked out by layer number).
        ``cu_seqlens_padded`` (packed only): the model runs THD with each sequence padded (Megatron needs
        multiples of ``2 * cp_size``; see :func:`~moealign.routing_replay.layouts.pad_packed_rows`); the
        padding slots get filler routes. Context parallelism and sequence parallelism are read from
        megatron's ``parallel_state`` and the model config, or given as ``parallel=dict(cp_size=, cp_rank=,
        sp_size=, sp_rank=)``; see :func:`~moealign.routing_replay.layouts.local_route_rows`.

        Rows without a recorded route (padding, each sample's last token) get distinct filler experts
        ``(row + arange(k)) % E``: Megatron's dispatcher counts ``k`` distinct experts per token, so a
        duplicate id is an error here, never silently deduplicated. Only this driver's routers are touched.
        """
        k = int(self.routers[0][1].topk)
        routes = model_routes(batch, self.moe_layers, k)
        if not self.active:
            raise ReplayError("this driver was undone; build a new one with replay_routing(model)")
        model_E = int(self.routers[0][1].config.num_moe_experts)
        E = model_E if num_experts is None else int(num_experts)
        if not 0 < E <= model_E:
            raise RouteError(f"num_experts={num_experts} is outside 1..{model_E} (the model's expert count)")
        ids = routes.cpu()
        mask = batch.route_mask.cpu()
        tokens = batch.row_tokens.cpu()
        if cu_seqlens_padded is not None:
            if batch.layout != "packed":
                raise RouteError("cu_seqlens_padded applies to a packed batch; this one is padded")
            source = packed_source_rows(batch.cu_seqlens, cu_seqlens_padded)
            valid = source >= 0
            ids, mask, tokens = ids[source.clamp(min=0)], mask[source.clamp(min=0)] & valid, tokens[source.clamp(min=0)]
        else:
            valid = torch.ones(ids.shape[0], dtype=torch.bool)
        filler = (torch.arange(ids.shape[0])[:, None] + torch.arange(k)) % E
        ids = torch.where(mask[:, None, None], ids, filler[:, None, :])
        validate_routes(ids, E, name="replay routes")
        layout = parallel if parallel is not None else _parallel_layout(getattr(self.model, "config", None))
        if batch.layout == "padded":
            local = local_route_rows(batch_shape=(batch.batch_size, batch.seq_len), **layout)
        else:
            cu = cu_seqlens_padded if cu_seqlens_padded is not None else batch.cu_seqlens
            local = local_route_rows(cu_seqlens_padded=cu, **layout)
        ids = ids[local]
        for col, (_, router) in enumerate(self.routers):
            router.router_replay.clear_indices()                 # this driver's routers only
            router.router_replay.set_target_indices(ids[:, col].contiguous())
        self._rows = ids.shape[0]
        # what the pre-hook compares: the token of every local router row (padding slots of THD excluded)
        self._expected_tokens = tokens[local]
        self._expected_mask = valid[local]
        self._sp = (int(layout.get("sp_size", 1)), int(layout.get("sp_rank", 0)))

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
        """Raise :class:`ReplayError` unless every router ran ``calls`` replayed calls of exactly its rows."""
        self.counters.check(calls, self._rows)

    def reset_counters(self) -> None:
        self.counters.reset()

    def clear(self) -> None:
        """Empty targets and backward FIFOs (between phases: forward-only passes leave FIFO entries)."""
        for _, router in self.routers:
            router.router_replay.clear_indices()
        self._rows = None
        self._expected_tokens = self._expected_mask = None


def replay_routing(model: torch.nn.Module, batch: ReplayBatch | None = None, *, aux_loss: str = "warn",
                   audit: bool = True) -> RouterReplayDriver:
    """Drive Megatron's RouterReplay for ``model``: the attached :class:`RouterReplayDriver` (a context
    manager that undoes on exit). ``batch`` (optional) is passed to :meth:`RouterReplayDriver.set_routes`."""
    driver = RouterReplayDriver(model, audit=audit, aux_loss=aux_loss)
    if batch is not None:
        try:
            driver.set_routes(batch)
        except BaseException:
            driver.undo()
            raise
    return driver
