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

A forward pre-hook on the model compares the tokens a replayed forward runs, in each router's row order
(after context-parallel and sequence-parallel slicing), with the tokens the routes were recorded for: a
transposed layout, another padding side or another batch raises :class:`~moealign.errors.ReplayError`.

Misuse is a :class:`~moealign.errors.ReplayError` (never a raw Megatron error, never a silent misroute):
forward without routes; a recompute in ``backward()`` with no routes left, or of a forward that did not
replay; with activation recompute, ``set_routes`` before the backward of the last replayed forward (one
micro-batch in flight per driver); a second driver on the same routers; routers replaced after binding;
any use after ``undo()``. Only this driver's routers (and its aux-loss reads) are touched, so colocated
models (actor + reference) each replay their own routes.

With ``verify=True`` (the default) each MoE layer's ``token_dispatcher.dispatch_preprocess`` (an instance attribute
calling the class's method) reads the ``routing_map`` the dispatcher receives under replay into a
:class:`~moealign.routing_replay.verify.ReplayVerifier`: :meth:`RouterReplayDriver.verify_report` says per router
whether the experts the tokens were dispatched to are the recorded ones and the fraction of rows that ran without a
recorded route (filler rows, THD padding slots); :meth:`RouterReplayDriver.check` raises
:class:`~moealign.errors.ReplayError` when they are not (a router forward replaced after binding, a routing path
that bypasses ``RouterReplay``), or when a router replayed but its dispatcher was never seen. ``verify=False``
wraps nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch

from ...errors import InputTypeError, MoealignWarning, ReplayConfigError, ReplayError
from ...handle import PatchHandle
from ...routing_replay.layouts import local_route_rows, packed_source_rows
from ...routing_replay.protocol import (
    DisagreementLog,
    ReplayBatch,
    ReplayCounters,
    RowTokenCheck,
    check_aux_loss_mode,
    check_route_ids,
    model_routes,
)
from ...routing_replay.routes import RouteError, check_num_experts
from ...routing_replay.verify import ReplayVerifier, VerifyReport, expected_map
from .._version import UnsupportedEngineError
from .audit import audit_layers, audit_replay_config, check_record_layers, is_transformer_config
from .version import megatron_version

# --------------------------------------------------------------------------------------------------
# routers and the driver
# --------------------------------------------------------------------------------------------------


def moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, TopKRouter)`` of ``model``'s MoE layers, ascending; MTP routers excluded.

    Megatron's ``layer_number`` is 1-based; the returned index is 0-based like the record's ``moe_layers``.
    """
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"model must be a Megatron torch.nn.Module (a GPTModel or a module wrapping one), got "
                             f"{type(model).__name__}")
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


_PARALLEL_KEYS = ("cp_size", "cp_rank", "sp_size", "sp_rank")


def _moe_dispatchers(model: torch.nn.Module, routers) -> list:
    """The ``token_dispatcher`` of the MoE layer holding each router (same order as ``routers``)."""
    by_router = {}
    for module in model.modules():
        router, dispatcher = getattr(module, "router", None), getattr(module, "token_dispatcher", None)
        if isinstance(router, torch.nn.Module) and dispatcher is not None:
            by_router[id(router)] = dispatcher
    missing = [layer for layer, r in routers if id(r) not in by_router]
    if missing:
        raise UnsupportedEngineError(f"the routers of layers {missing} sit in no MoE layer with a token_dispatcher "
                                     f"whose input could be verified; pass verify=False to replay without it")
    for layer, r in routers:
        if not callable(getattr(by_router[id(r)], "dispatch_preprocess", None)):
            raise UnsupportedEngineError(f"layer {layer}: {type(by_router[id(r)]).__name__} has no "
                                         f"dispatch_preprocess(hidden_states, routing_map, probs); pass verify=False")
    return [by_router[id(r)] for _, r in routers]


def _check_parallel(parallel) -> dict:
    """``set_routes(parallel=...)``: a dict of ints with keys among :data:`_PARALLEL_KEYS` (others default 1 / 0)."""
    if not isinstance(parallel, dict):
        raise RouteError(f"parallel must be a dict(cp_size=, cp_rank=, sp_size=, sp_rank=), got "
                         f"{type(parallel).__name__}")
    unknown = sorted(set(parallel) - set(_PARALLEL_KEYS), key=str)
    if unknown:
        raise RouteError(f"parallel has unknown keys {unknown}; known: {list(_PARALLEL_KEYS)}")
    for key, value in parallel.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise RouteError(f"parallel {key} must be an int, got {type(value).__name__} {value!r}")
    return dict(parallel)


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

    ``verify`` (default True): the routing map each token dispatcher receives is verified against the routes set
    (module docstring); :meth:`verify_report` and :meth:`check` read it.
    """

    def __init__(self, model: torch.nn.Module, *, audit: bool = True, aux_loss: str = "warn", verify: bool = True):
        self.aux_loss = check_aux_loss_mode(aux_loss)
        self.model = model
        self._aux = DisagreementLog(self._warn_disagreement)   # per aux-loss computation under replay (device)
        self._tokens = RowTokenCheck(type(model).__name__)      # the per-forward token check (device counters)
        self._last_replayed: torch.Tensor | None = None
        config = getattr(model, "config", None)
        if audit and is_transformer_config(config):
            audit_replay_config(config, aux_loss="ignore")
        self.routers = moe_routers(model)
        if audit and not is_transformer_config(config):      # a wrapper without a config: the routers' own
            audit_replay_config(self.routers[0][1].config, aux_loss="ignore")
        # global layer numbering of every block (pipeline / virtual-pipeline offset), and the layers held dense
        self.dense_layers = audit_layers(model) if audit else ()
        self._replays = [r.router_replay for _, r in self.routers]
        self._forwarded = [False] * len(self.routers)       # per router: the routes set were replayed by a forward
        self._in_router = False                             # one of this driver's routers is running (aux wrapper)
        rc = self.routers[0][1].config                      # do the routers run again in backward (recompute)?
        self._recomputes = (getattr(rc, "recompute_granularity", None) == "full" or (
            getattr(rc, "recompute_granularity", None) == "selective"
            and "moe" in (getattr(rc, "recompute_modules", None) or ())))
        self._awaiting_backward = False                     # a replayed forward whose recompute has not run yet
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
        self.verifier: ReplayVerifier | None = None
        self._expected_maps: list[torch.Tensor] | None = None     # per router: the recorded routing map, local rows
        self._verify_mask: torch.Tensor | None = None             # local rows with a recorded route (None: all)
        self._verify_replayed = 0
        self._rows = None
        self._expected_tokens: torch.Tensor | None = None
        self._expected_mask: torch.Tensor | None = None
        self._sp: tuple[int, int] = (1, 0)
        self.add_callback(self.clear)                       # undone last: empty this driver's targets and FIFOs
        self.add_callback(self._aux.values)                 # read the aux-loss disagreement rates, warn once
        try:
            for index, (layer, router) in enumerate(self.routers):
                self._wrap(index, layer, router.router_replay)
            if aux_loss != "own":
                self._patch_aux_scores()
            if verify:
                dispatchers = _moe_dispatchers(model, self.routers)
                self.verifier = ReplayVerifier(self.moe_layers, source=f"the routing_map "
                                               f"{type(dispatchers[0]).__name__}.dispatch_preprocess received")
                for index, ((layer, _), dispatcher) in enumerate(zip(self.routers, dispatchers)):
                    self._wrap_dispatcher(index, layer, dispatcher)
            self._token_hook = self.add_hook(model.register_forward_pre_hook(self._check_tokens_hook, with_kwargs=True),
                          f"{type(model).__name__} forward pre-hook (token check)")
        except BaseException:
            self.undo()
            raise

    def _check_tokens_hook(self, module, args, kwargs):
        """Forward pre-hook: the tokens the model runs, in router row order, must be the batch's."""
        if self._expected_tokens is None or not self._replaying():
            return None                               # a forward that replays nothing may run any batch
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
        self._tokens.observe(rows, input_ids=input_ids)       # values on the device, raised by check()
        if (self._recomputes and module.training and torch.is_grad_enabled()
                and self._replays[0].router_replay_action.value == "replay_forward"):
            self._awaiting_backward = True            # (checked here: Megatron's checkpoint runs routers without grad)
        return None

    @property
    def aux_disagreement(self) -> list[float]:
        """Per aux-loss computation under replay: the fraction of tokens whose own top-k differs from the replayed
        experts (read from the device here, by :meth:`check` and on undo; a warning once with ``aux_loss="warn"``)."""
        return self._aux.values()

    def _warn_disagreement(self, rate: float) -> None:
        if self.aux_loss == "warn":
            warnings.warn(f"Megatron computes the MoE aux loss from the router's own top-k, which differs from "
                          f"the replayed experts on {rate:.1%} of tokens; RouterReplayDriver(aux_loss='replayed') "
                          f"counts the replayed experts instead", MoealignWarning, stacklevel=4)

    def _replaying(self) -> bool:
        """True while this driver's routers replay (REPLAY_FORWARD / REPLAY_BACKWARD, however it was set)."""
        action = self._replays[0].router_replay_action
        return action is not None and action.value != "record"

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
            if not driver._in_router:            # another model's router (a colocated one): not ours to read
                return routing_map, scores
            last, driver._last_replayed = driver._last_replayed, None
            if not wrapper.active or last is None or last.shape[0] != routing_map.shape[0]:
                return routing_map, scores
            replayed = torch.zeros_like(routing_map).scatter(1, last.to(routing_map.device), True)
            # on the device (read by aux_disagreement / check / undo): no host sync in the forward
            driver._aux.add((replayed != routing_map).any(-1).float().mean())
            if driver.aux_loss == "replayed":
                return replayed, scores
            return routing_map, scores

        wrapper = compute_routing_scores_for_aux_loss
        wrapper.active = True
        router_mod.compute_routing_scores_for_aux_loss = wrapper

        def restore() -> None:
            wrapper.active = False            # a pass-through if another driver wrapped it after us
            if router_mod.compute_routing_scores_for_aux_loss is wrapper:
                router_mod.compute_routing_scores_for_aux_loss = original

        self.add_callback(restore, "megatron.core.transformer.moe.router.compute_routing_scores_for_aux_loss")

        def enter(module, args):
            self._in_router, self._last_replayed = True, None

        def leave(module, args, output):
            self._in_router, self._last_replayed = False, None

        for layer, router in self.routers:
            self.add_hook(router.register_forward_pre_hook(enter), f"router forward pre-hook (layer {layer})")
            self.add_hook(router.register_forward_hook(leave, always_call=True), f"router forward hook (layer {layer})")

    def _wrap(self, index: int, layer: int, replay) -> None:
        original = replay.get_replay_topk

        def get_replay_topk(scores, topk, *args, **kwargs):
            action = replay.router_replay_action
            replaying = action is not None and action.value != "record"
            if replaying:
                if self._rows is None:
                    raise ReplayError(f"layer {layer}: replay is on but no routes are set "
                                      f"(call set_routes(batch) before forward())")
                if action.value == "replay_forward":
                    if replay.target_topk_idx is None:
                        raise ReplayError(f"layer {layer}: its replay targets were cleared outside this driver "
                                          f"(RouterReplay.clear_global_indices?); call set_routes(batch) again")
                    want = replay.target_topk_idx.shape[0]
                    self._forwarded[index] = True
                else:
                    if not replay.replay_backward_list:
                        raise ReplayError(f"layer {layer}: backward() has nothing left for activation recompute: "
                                          f"each set_routes queues the routes for one recompute and that one was "
                                          f"used (more replayed forwards than set_routes calls?); call set_routes "
                                          f"before every forward whose backward recomputes")
                    if not self._forwarded[index]:
                        raise ReplayError(f"layer {layer}: activation recompute under backward() of a forward that "
                                          f"did not replay the routes set (run the forward inside forward() after "
                                          f"set_routes), so the recompute would route differently from the forward")
                    want = replay.replay_backward_list[0].shape[0]
                self.counters.add(index, scores.shape[0])
                if scores.shape[0] != want:
                    raise ReplayError(f"layer {layer}: the router saw {scores.shape[0]} tokens, the replay "
                                      f"targets have {want} rows")
            probs, top_indices = original(scores, topk, *args, **kwargs)
            self._last_replayed = top_indices if replaying else None
            return probs, top_indices

        self.set_attr(replay, "get_replay_topk", get_replay_topk, f"RouterReplay.get_replay_topk (layer {layer})")

    def _wrap_dispatcher(self, index: int, layer: int, dispatcher) -> None:
        """``dispatcher.dispatch_preprocess`` as an instance attribute that observes the routing map it receives
        while this driver replays, then calls the method the dispatcher had (its class's, looked up at each call,
        so a class-level patch applied later still runs)."""
        own = vars(dispatcher).get("dispatch_preprocess")
        cls = type(dispatcher)

        def dispatch_preprocess(*args, **kwargs):
            expected = self._expected_maps
            if expected is not None and self._replaying():
                routing_map = args[1] if len(args) > 1 else kwargs.get("routing_map")
                if not isinstance(routing_map, torch.Tensor):
                    raise ReplayError(f"layer {layer}: the token dispatcher was called without a routing_map; the "
                                      f"replay cannot verify which experts ran")
                # queued: the forward's routers are compared in one batched pass (ReplayVerifier.defer)
                self.verifier.defer(index, routing_map, expected[index], self._verify_mask,
                                    replayed_rows=self._verify_replayed)
            if own is not None:
                return own(*args, **kwargs)
            return cls.dispatch_preprocess(dispatcher, *args, **kwargs)

        self.set_attr(dispatcher, "dispatch_preprocess", dispatch_preprocess,
                      f"{cls.__name__}.dispatch_preprocess (layer {layer}, verify)")

    def _require_bound(self) -> None:
        """Raise :class:`ReplayError` if the driver was undone or the model no longer runs the routers it bound."""
        if not self.active:
            raise ReplayError("this driver was undone; build a new one with replay_routing(model)")
        now = {layer: r for layer, r in moe_routers(self.model)}
        moved = [layer for (layer, r), rr in zip(self.routers, self._replays)
                 if now.pop(layer, None) is not r or r.router_replay is not rr]
        if moved or now:
            raise ReplayError(f"the routers of layers {sorted(moved + list(now))} were replaced after the driver was "
                              f"bound (the model runs router modules this driver does not drive); undo it and build "
                              f"a new one with replay_routing(model)")

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
        self._require_bound()
        if self._awaiting_backward:
            raise ReplayError("set_routes before the backward of the last replayed forward: this model recomputes "
                              "its routers in backward (activation recompute), and that recompute needs the routes "
                              "set_routes would replace; run loss.backward() inside driver.backward() first (one "
                              "micro-batch in flight per driver), or clear() to drop a forward that will not be "
                              "backpropagated")
        k = int(self.routers[0][1].topk)
        routes = model_routes(batch, self.moe_layers, k, dense_layers=self.dense_layers)
        check_record_layers(self.routers[0][1].config, batch.moe_layers)   # no routes for MTP layers
        model_E = int(self.routers[0][1].config.num_moe_experts)
        E = model_E if num_experts is None else check_num_experts(num_experts)
        if E > model_E:
            raise RouteError(f"num_experts={num_experts} is outside 1..{model_E} (the model's expert count)")
        # the batch was validated when it was built: its facts decide here, without reading its tensors again
        check_route_ids(batch, E)
        if isinstance(cu_seqlens_padded, torch.Tensor) and cu_seqlens_padded.device.type == "meta":
            raise RouteError("cu_seqlens_padded is on the meta device (shapes only, no values): replay needs the "
                             "recorded expert ids and tokens")
        layout = _check_parallel(parallel) if parallel is not None else _parallel_layout(
            getattr(self.model, "config", None))
        ids = routes.cpu()
        mask = batch.route_mask.cpu()
        tokens = batch.row_tokens.cpu()
        replayed_rows = batch.num_replayed_rows
        if cu_seqlens_padded is not None:
            if batch.layout != "packed":
                raise RouteError("cu_seqlens_padded applies to a packed batch; this one is padded")
            source = packed_source_rows(batch.cu_seqlens, cu_seqlens_padded)
            valid = source >= 0
            ids, mask, tokens = ids[source.clamp(min=0)], mask[source.clamp(min=0)] & valid, tokens[source.clamp(min=0)]
            replayed_rows = None
        else:
            valid = None
        if not (batch.all_routed and valid is None):
            # rows without a recorded route: distinct filler experts (the routed rows' ids were checked above)
            filler = (torch.arange(ids.shape[0])[:, None] + torch.arange(k)) % E
            ids = torch.where(mask[:, None, None], ids, filler[:, None, :])
        if valid is None:
            valid = torch.ones(ids.shape[0], dtype=torch.bool)
        if batch.layout == "padded":
            local = local_route_rows(batch_shape=(batch.batch_size, batch.seq_len), **layout)
        else:
            cu = cu_seqlens_padded if cu_seqlens_padded is not None else batch.cu_seqlens
            local = local_route_rows(cu_seqlens_padded=cu, **layout)
        ids = ids[local]
        # every router's targets in one table [routers, rows, k] (one copy), moved to the routers' device once here:
        # each router gets a contiguous slice already on its device, so RouterReplay's per-call `.to(scores.device)`
        # (forward and recompute) is a no-op instead of a host-to-device copy per router and call
        devices = [router.weight.device for _, router in self.routers]
        device = devices[0]
        table = ids.transpose(0, 1).contiguous()
        if all(d == device for d in devices):
            table = table.to(device)
        for col, (_, router) in enumerate(self.routers):
            router.router_replay.clear_indices()                 # this driver's routers only
            router.router_replay.set_target_indices(table[col].to(devices[col]))
        if self.verifier is not None:
            replayed = mask[local]
            # the recorded routing maps of every router at once: [routers, rows, E]
            self._expected_maps = expected_map(table.to(device), model_E).unbind(0)
            if replayed_rows is None or local.numel() != mask.numel():     # padded THD slots or a CP / SP slice
                replayed_rows = int(replayed.sum())
            self._verify_replayed = replayed_rows
            self._verify_mask = None if replayed_rows == replayed.numel() else replayed.to(device)
        self._rows = ids.shape[0]
        self._forwarded = [False] * len(self.routers)
        # what the pre-hook compares: the token of every local router row (padding slots of THD excluded)
        self._expected_tokens = tokens[local]
        self._expected_mask = valid[local]
        self._tokens.set(self._expected_tokens, None if bool(self._expected_mask.all()) else self._expected_mask)
        self._sp = (int(layout.get("sp_size", 1)), int(layout.get("sp_rank", 0)))

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        with self._action(RouterReplayAction.REPLAY_FORWARD):
            yield

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        try:
            with self._action(RouterReplayAction.REPLAY_BACKWARD):
                yield
        finally:
            self._awaiting_backward = False             # the backward ran: its recompute, if any, is over

    @contextlib.contextmanager
    def _action(self, action) -> Iterator[None]:
        self._require_bound()
        for _, router in self.routers:
            router.router_replay.set_router_replay_action(action)
        try:
            yield
        finally:
            for _, router in self.routers:
                router.router_replay.clear_router_replay_action()

    def check(self, calls: int = 1) -> None:
        """Raise :class:`ReplayError` unless every router ran ``calls`` replayed calls of exactly its rows and
        (with ``verify``) the tokens were dispatched to the recorded experts on every replayed row, each replayed
        router call followed by its dispatcher; and the token checks of every replayed forward since the last check
        (each router row holds the batch's token). Reads the device counters (one host sync)."""
        self._tokens.check()
        self._aux.values()
        if self.verifier is not None:
            self.verifier.check([c.calls for c in self.counters.counts])
        self.counters.check(calls, self._rows)

    def verify_report(self) -> VerifyReport | None:
        """Per router since the last :meth:`reset_counters`: the routing maps the dispatchers received under replay
        against the routes set, and the fraction of rows without a recorded route (None with ``verify=False``)."""
        return None if self.verifier is None else self.verifier.report()

    def reset_counters(self) -> None:
        self.counters.reset()
        self._tokens.reset()
        if self.verifier is not None:
            self.verifier.reset()

    def clear(self) -> None:
        """Empty targets and backward FIFOs (between phases: forward-only passes leave FIFO entries)."""
        for _, router in self.routers:
            router.router_replay.clear_indices()
        self._rows = None
        self._forwarded = [False] * len(self.routers)
        self._awaiting_backward = False
        self._expected_tokens = self._expected_mask = None
        self._tokens.clear()
        self._expected_maps = self._verify_mask = None
        self._verify_replayed = 0


def replay_routing(model: torch.nn.Module, batch: ReplayBatch | None = None, *, aux_loss: str = "warn",
                   audit: bool = True, verify: bool = True) -> RouterReplayDriver:
    """Drive Megatron's RouterReplay for ``model``: the attached :class:`RouterReplayDriver` (a context
    manager that undoes on exit). ``batch`` (optional) is passed to :meth:`RouterReplayDriver.set_routes`;
    ``verify`` (default True): the dispatchers' routing maps are verified (:meth:`RouterReplayDriver.verify_report`)."""
    driver = RouterReplayDriver(model, audit=audit, aux_loss=aux_loss, verify=verify)
    if batch is not None:
        try:
            driver.set_routes(batch)
        except BaseException:
            driver.undo()
            raise
    return driver
