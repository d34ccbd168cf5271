"""transformers adapter, training side: the routing-replay protocol on one model instance.

:func:`replay_routing` returns a :class:`RoutingReplay` that implements
:class:`moealign.routing_replay.protocol.RoutingReplayAdapter`::

    batch = record.replay_batch("padded", side="right")
    with hf.replay_routing(model) as replay:
        replay.set_routes(batch)
        with replay.forward():
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        replay.check(calls=1)

The routers' ``forward`` (instance attributes, never the class) take the batch's expert ids and recompute the gate
weights from the live router logits (:func:`~moealign.routing_replay.gates.replay_topk`: the family's scores once, one
gather at the forced ids and the family's normalisation), so the router keeps its gradient. ``set_routes`` builds
every router's targets (and the verifier's expected sets) for a forward in one batched pass: one
``[routers, rows, k]`` table moved to the device once, each router reading its slice. The model's ``forward`` is
wrapped too: it checks that the tokens the model runs are the batch's (a padding-side or layout slip raises
:class:`~moealign.errors.ReplayError`), that they are token ids of the model's vocabulary and that its attention mask
is 0/1 and leaves every routed row attended. Shapes are checked at once; values on the device
(:class:`~moealign.routing_replay.protocol.RowTokenCheck`: no host sync in the forward), read and raised by
:meth:`RoutingReplay.check`. This is where the row order is checked: the routers only see hidden states already
flattened to ``[rows, hidden]`` (batch-major, ``row = b * seq + t`` in every supported family, the batch's order), so
each router call checks its row count, and the model's forward checks every routed row's token. With
``aux_loss="replayed"`` (the default here) the wrapper also recomputes the load-balancing loss from the
replayed choices. ``forward()`` / ``backward()`` only mark phases in this adapter (transformers re-runs
the patched routers during activation recompute with the same targets); they exist so that code
written for one adapter runs on all.

With ``verify=True`` (the default) a forward pre-hook on each MoE block's experts module reads the ``top_k_index``
the experts actually receive and feeds a :class:`~moealign.routing_replay.verify.ReplayVerifier` (device counters,
no host sync in the forward): :meth:`RoutingReplay.verify_report` says per router whether the experts that ran are
the recorded ones (as sets) and the fraction of rows that ran without a recorded route; :meth:`RoutingReplay.check`
raises :class:`~moealign.errors.ReplayError` when they are not, e.g. when a router's ``forward`` was replaced after
the replay was attached. ``verify=False`` installs no hook.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
import torch.nn.functional as F

from ..._validate import check_token_ids
from ...errors import InputError, ReplayError, RouteError, UnsupportedModelError
from ...handle import PatchHandle
from ...routing_replay.gates import (
    load_balancing_loss,
    replay_recorded_gate_weights,
    replay_topk,
    select_topk,
)
from ...routing_replay.protocol import (
    ReplayBatch,
    DisagreementLog,
    ReplayCounters,
    RowTokenCheck,
    check_aux_loss_mode,
    check_route_ids,
    model_routes,
)
from ...routing_replay.verify import ReplayVerifier, VerifyReport, expected_ids
from .model import MoEModelInfo, describe_model

__all__ = ["RoutingReplay", "replay_routing"]

class RoutingReplay(PatchHandle):
    """An active routing replay on one transformers model instance (see the module docstring).

    ``aux_loss``: ``"replayed"`` (default) - the model's ``aux_loss`` (and ``loss``) count the replayed
    experts; ``"warn"`` - transformers' own aux loss is kept and ``aux_disagreement`` records, per router
    call, the fraction of replayed rows whose own top-k differs from the replayed one (a warning once);
    ``"own"`` - left alone.

    ``verify`` (default True): verify what the experts receive against the routes set (module docstring);
    :meth:`verify_report` and :meth:`check` read it.
    """

    def __init__(self, model: torch.nn.Module, info: MoEModelInfo | None = None, *, aux_loss: str = "replayed",
                 verify: bool = True):
        self.model = model
        self.info = info or describe_model(model)
        self.aux_loss = check_aux_loss_mode(aux_loss)
        PatchHandle.__init__(self, f"routing replay on {len(self.info.routers)} {self.info.family.model_type} routers "
                                   f"{list(self.info.moe_layers)} of {type(model).__name__}, aux_loss={aux_loss!r}",
                             "instance")
        self.counters = ReplayCounters(self.moe_layers)
        self.verifier: ReplayVerifier | None = None
        self._experts: list[torch.nn.Module] = []
        if verify:
            self._experts = self._experts_modules()
            self.verifier = ReplayVerifier(self.moe_layers, source=f"the top_k_index {type(self._experts[0]).__name__} received")
        self._expected: tuple[torch.Tensor, ...] | None = None
        self._aux = DisagreementLog(self._warn_disagreement)
        self._tokens = RowTokenCheck(type(model).__name__, self.info.vocab_size)
        self._batch: ReplayBatch | None = None
        self._targets: tuple[torch.Tensor, ...] | None = None
        self._mask: torch.Tensor | None = None
        self._rows_replayed = 0
        self._weights: list[torch.Tensor] | None = None
        self._verified = False
        self._check_tokens = True
        self._live: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    @property
    def aux_disagreement(self) -> list[float]:
        """``aux_loss="warn"``: per replayed router call, the fraction of replayed rows whose own top-k differs from
        the replayed experts (read from the device here, by :meth:`check` and on undo)."""
        return self._aux.values()

    def _warn_disagreement(self, rate: float) -> None:
        warnings.warn(f"transformers computes the MoE aux loss from the router's own top-k, which differs from "
                      f"the replayed experts on {rate:.1%} of replayed rows; replay_routing(model, "
                      f"aux_loss='replayed') counts the replayed experts instead", stacklevel=4)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.info.moe_layers

    # ------------------------------------------------------------ the protocol
    def set_routes(self, batch: ReplayBatch, *, recorded_weights: torch.Tensor | None = None,
                   check_tokens: bool = True) -> None:
        """Hand every router its rows of ``batch`` for the next forward(s) (and their recompute).

        ``recorded_weights`` ``[rows, n_layers, k]`` (batch rows, the batch's layer columns) switches to the
        verification variant: the gate weights are those constants instead of recomputed ones.
        ``check_tokens=False`` lets routers be called directly (unit tests of a router module): the model's
        forward then does not have to run, and nothing checks that the rows belong to the batch's tokens.
        """
        k, E = self.info.top_k, self.info.num_experts
        routes = model_routes(batch, self.moe_layers, k, dense_layers=self.info.dense_layers)
        if not self.active:
            raise ReplayError("this replay was undone; start a new one with replay_routing(model)")
        # the batch was validated when it was built: its facts decide here, without reading its tensors again
        lo, hi = batch.token_range
        if lo < 0 or hi >= self.info.vocab_size:
            check_token_ids(batch.input_ids, "batch.input_ids", self.info.vocab_size, RouteError)
        check_route_ids(batch, E)
        self.info.scoring.check(E, k)          # the group limit fits (checked here once, not per router call)
        cols = batch.layer_columns(self.moe_layers)
        device = self.info.routers[0][1].weight.device
        # one table [routers, rows, k] for the forward (one copy, one transfer); each router reads a contiguous slice
        table = routes.to(device=device, dtype=torch.int64).transpose(0, 1).contiguous()
        self._targets = table.unbind(0)
        self._mask = None if batch.all_routed else batch.route_mask.to(device)
        # the verifier's expected sets, every router at once ([routers, rows]; its batched pass reads them in place)
        self._expected = None if self.verifier is None else expected_ids(table, E).unbind(0)
        self._rows_replayed = batch.num_replayed_rows
        if recorded_weights is not None:
            if recorded_weights.shape != batch.routes.shape:
                raise RouteError(f"recorded_weights shape {tuple(recorded_weights.shape)} != routes shape "
                                 f"{tuple(batch.routes.shape)}")
            self._weights = [recorded_weights[:, c].to(device) for c in cols]
        else:
            self._weights = None
        self._batch = batch
        self._tokens.set(batch.row_tokens, None if batch.all_routed else batch.route_mask)
        self._check_tokens = bool(check_tokens)
        self._verified = not check_tokens

    def forward(self) -> contextlib.AbstractContextManager:
        """A forward pass that replays (a phase marker in this adapter)."""
        return contextlib.nullcontext()

    def backward(self) -> contextlib.AbstractContextManager:
        """Activation recompute during backward (a phase marker: the routers replay the same rows)."""
        return contextlib.nullcontext()

    def check(self, calls: int = 1) -> None:
        """Raise :class:`ReplayError` unless every router ran ``calls`` times, replaying its rows each time, and
        (with ``verify``) the experts that ran were the recorded ones on every replayed row, each router call
        followed by its experts; and the token checks of every forward since the last check (the tokens the model
        ran are the batch's on every routed row, in the vocabulary, its attention mask 0/1 leaving them attended:
        :class:`~moealign.errors.InputError` / :class:`ReplayError`). Reads the device counters (one host sync)."""
        self._tokens.check()
        if self.aux_loss == "warn":
            self._aux.values()
        if self.verifier is not None:
            # routers called directly (check_tokens=False) run no experts: only the rows that ran are compared
            router_calls = [c.calls for c in self.counters.counts] if self._check_tokens else None
            self.verifier.check(router_calls)
        self.counters.check(calls, self._rows_replayed)

    def verify_report(self) -> VerifyReport | None:
        """Per router since the last :meth:`reset_counters`: the experts that ran against the routes set, and the
        fraction of rows that ran without a recorded route (None with ``verify=False``)."""
        return None if self.verifier is None else self.verifier.report()

    def reset_counters(self) -> None:
        self.counters.reset()
        self._tokens.reset()
        if self.verifier is not None:
            self.verifier.reset()

    def clear(self) -> None:
        """Drop the targets (a router call without new ``set_routes`` is then an error)."""
        self._targets = self._mask = self._weights = self._batch = self._expected = None
        self._tokens.clear()
        self._rows_replayed = 0
        self._verified = False

    # ------------------------------------------------------------ the patched router forward
    def _router_forward(self, index: int, router: torch.nn.Module):
        scoring = self.info.scoring
        fp32_scores = self.info.family.scores_in_fp32
        fp32_logits = self.info.family.logits_in_fp32        # DeepSeek-V3: x.float() @ W.float().T
        bias_attr = self.info.family.bias_attr                # DeepSeek-V3: the selection bias (native rows only)

        def forward(hidden_states: torch.Tensor):
            if self._targets is None:
                raise ReplayError("routing replay is active but no routes are set (call set_routes(batch) first)")
            if not self._verified:
                raise ReplayError(f"a router ran outside a checked forward of {type(self.model).__name__}: call the "
                                  f"model itself (with input_ids) so the replay can check the batch it runs")
            h = hidden_states.reshape(-1, router.hidden_dim)
            if fp32_logits:
                logits = F.linear(h.float(), router.weight.float())
            else:
                logits = F.linear(h, router.weight, getattr(router, "bias", None))
            expert_bias = getattr(router, bias_attr) if bias_attr else None
            target = self._targets[index]
            if target.shape[0] != h.shape[0]:
                layer = self.info.routers[index][0]
                raise ReplayError(f"layer {layer}: the router saw {h.shape[0]} rows, the replay targets have "
                                  f"{target.shape[0]} rows ({'extra' if target.shape[0] > h.shape[0] else 'missing'} "
                                  f"rows in the record for this forward)")
            out_dtype = torch.float32 if fp32_scores else logits.dtype
            warn = self.aux_loss == "warn"
            if self._weights is not None:
                native = None
                if self._mask is None:
                    ids = target
                else:
                    native = select_topk(logits, router.top_k, scoring, expert_bias=expert_bias)[1]
                    ids = torch.where(self._mask[:, None], target, native)
                weights = replay_recorded_gate_weights(self._weights[index], logits).to(out_dtype)
            else:
                # the scores once: the own top-k (masked rows, aux_loss="warn") and the replayed gates share them
                weights, ids, native = replay_topk(logits, target, scoring, mask=self._mask, expert_bias=expert_bias,
                                                   out_dtype=out_dtype, native=warn)
            if warn:
                self._measure_disagreement(logits, ids, native, router.top_k, scoring, expert_bias)
            self.counters.add(index, self._rows_replayed)
            if self.aux_loss == "replayed":
                self._live.append((index, logits, ids))
            return logits, weights, ids

        return forward

    def _measure_disagreement(self, logits, ids, native, top_k, scoring, expert_bias=None) -> None:
        with torch.no_grad():
            if native is None:
                native = select_topk(logits, top_k, scoring, expert_bias=expert_bias)[1]
            # rows without a recorded route run the own top-k (ids == native there): no mask needed
            differs = (ids.sort(-1).values != native.sort(-1).values).any(-1)
            # on the device (read by aux_disagreement / check / undo): no host sync in the forward
            self._aux.add(differs.sum() / max(self._rows_replayed, 1))

    # ------------------------------------------------------------ verification: what the experts received
    def _experts_modules(self) -> list[torch.nn.Module]:
        """Each router's sibling experts module (``mlp.experts`` next to ``mlp.gate`` in every supported family)."""
        found: dict[int, torch.nn.Module] = {}
        for module in self.model.modules():
            # the children by name (a dict lookup: getattr on every module of the model was most of attach's time)
            children = dict(module.named_children())
            gate, experts = children.get("gate"), children.get("experts")
            if gate is not None and experts is not None:
                found[id(gate)] = experts
        missing = [layer for layer, router in self.info.routers if id(router) not in found]
        if missing:
            raise UnsupportedModelError(f"the routers of layers {missing} have no sibling 'experts' module whose input "
                                        f"could be verified; pass verify=False to replay without verification")
        return [found[id(router)] for _, router in self.info.routers]

    def _experts_hook(self, index: int):
        layer = self.info.routers[index][0]

        def hook(module, args, kwargs):
            expected = self._expected
            if expected is None:
                return None
            ids = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if not isinstance(ids, torch.Tensor):
                raise ReplayError(f"layer {layer}: the experts module was called without top_k_index; the replay "
                                  f"cannot verify which experts ran")
            # queued: the forward's routers are compared in one batched pass (ReplayVerifier.defer)
            self.verifier.defer(index, ids, expected[index], self._mask, replayed_rows=self._rows_replayed,
                                expected_sorted=True)
            return None

        return hook

    # ------------------------------------------------------------ the patched model forward
    def _check_batch(self, arguments: dict) -> None:
        batch = self._batch
        if batch is None or not self._check_tokens:
            return
        input_ids = arguments.get("input_ids")
        if input_ids is None:
            raise ReplayError("routing replay checks the tokens every router row holds: call the model with "
                              "input_ids (inputs_embeds hide them)")
        if not isinstance(input_ids, torch.Tensor):
            raise InputError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
        if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
            raise InputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        given = input_ids
        if batch.layout == "packed" and input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if tuple(input_ids.shape) != tuple(batch.input_ids.shape):
            raise ReplayError(f"the model runs input_ids {tuple(input_ids.shape)}, the routes were laid out for a "
                              f"{batch.layout} batch {tuple(batch.input_ids.shape)}")
        attention_mask = arguments.get("attention_mask")
        if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
            attention_mask = None
        padded = batch.layout == "padded" and attention_mask is not None
        if padded and tuple(attention_mask.shape) != tuple(batch.input_ids.shape):
            raise ReplayError(f"attention_mask {tuple(attention_mask.shape)} does not match the batch "
                              f"{tuple(batch.input_ids.shape)}")
        if attention_mask is not None and attention_mask.is_complex():
            raise InputError(f"attention_mask must hold 0/1 values, got dtype {attention_mask.dtype}")
        # values on the device (tokens, vocabulary, 0/1 mask, routed rows attended), raised by check()
        self._tokens.observe(input_ids, input_ids=given, attention_mask=attention_mask, masked_rows=padded)
        self._verified = True

    def _run(self, original, arguments, args, kwargs):
        """``original(*args, **kwargs)``; a token id outside the vocabulary (checked on the device, read by check())
        makes the CPU embedding raise IndexError first: that is reported as the InputError naming the id."""
        try:
            return original(*args, **kwargs)
        except IndexError as e:
            input_ids = arguments.get("input_ids")
            if isinstance(input_ids, torch.Tensor):
                try:
                    check_token_ids(input_ids, "input_ids", self.info.vocab_size, InputError)   # the error path only
                except InputError:
                    self._tokens.discard_last()
                    raise
            raise e

    def _model_forward(self, original):
        signature = inspect.signature(type(self.model).forward)

        def forward(*args, **kwargs):
            try:
                arguments = signature.bind_partial(self.model, *args, **kwargs).arguments
            except TypeError:
                arguments = kwargs
            extra = arguments.get("kwargs")
            if isinstance(extra, dict):
                arguments = {**extra, **arguments}
            self._check_batch(arguments)
            self._live.clear()
            if self.aux_loss != "replayed":
                return self._run(original, arguments, args, kwargs)
            # The aux loss is fixed on the output object: where the caller asks for a tuple, get the object
            # and convert at the end, as transformers' ``can_return_tuple`` does.
            want_tuple = kwargs.get("return_dict") is False
            if want_tuple:
                kwargs["return_dict"] = True
            out = self._run(original, arguments, args, kwargs)
            aux = getattr(out, "aux_loss", None)
            if aux is not None and self._live:
                by_layer: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
                for index, logits, ids in self._live:   # with activation recompute the last call per layer wins
                    by_layer[index] = (logits, ids)
                ordered = [by_layer[i] for i in sorted(by_layer)]
                new_aux = load_balancing_loss([lg for lg, _ in ordered], [ids for _, ids in ordered],
                                              self.info.num_experts, self.info.top_k,
                                              attention_mask=arguments.get("attention_mask"))
                # the coefficient the model itself applied (an instance attribute in every supported family)
                coef = float(getattr(self.model, "router_aux_loss_coef",
                                     getattr(self.model.config, "router_aux_loss_coef", 0.0)))
                if getattr(out, "loss", None) is not None:
                    out.loss = out.loss - coef * aux.to(out.loss.device) + coef * new_aux.to(out.loss.device)
                out.aux_loss = new_aux
            self._live.clear()
            return out.to_tuple() if want_tuple and not isinstance(out, tuple) else out

        return forward

    # ------------------------------------------------------------ attach / undo
    def attach(self) -> "RoutingReplay":
        """Patch the routers' and the model's ``forward`` (instance attributes); refused when this or another
        replay is already on the model."""
        if self.active:
            raise ReplayError("this replay is already attached")
        for _, module in self.info.routers:
            if "forward" in module.__dict__:
                raise ReplayError("a router of this model already has an instance-level forward (another replay "
                                  "is active on it?); nested replays on one model are refused")
        self.add_callback(self.clear)                    # undone last: drop targets and live router outputs
        self.add_callback(self._aux.values)              # aux_loss="warn": read the rates, warn once
        self.add_callback(self._live.clear)
        for index, (layer, module) in enumerate(self.info.routers):
            self.set_attr(module, "forward", self._router_forward(index, module), f"router forward (layer {layer})")
        for index, experts in enumerate(self._experts):
            self.add_hook(experts.register_forward_pre_hook(self._experts_hook(index), with_kwargs=True),
                          f"experts forward pre-hook (layer {self.info.routers[index][0]}, verify)")
        # wraps whatever forward the model has (a wrapper of accelerate or a profiler is kept and put back)
        self.set_attr(self.model, "forward", self._model_forward(self.model.forward),
                      f"{type(self.model).__name__}.forward (token check, aux loss)")
        return self


def replay_routing(model: torch.nn.Module, batch: ReplayBatch | None = None, *,
                   aux_loss: str = "replayed", verify: bool = True) -> RoutingReplay:
    """Force the routers of ``model`` to recorded expert ids; returns the attached :class:`RoutingReplay`
    (a context manager: ``with hf.replay_routing(model) as replay: ...`` undoes on exit).

    ``batch`` (optional) is passed to :meth:`RoutingReplay.set_routes`; ``verify`` (default True): the experts'
    input is verified against the routes (:meth:`RoutingReplay.verify_report`).
    """
    replay = RoutingReplay(model, describe_model(model), aux_loss=aux_loss, verify=verify).attach()
    if batch is not None:
        try:
            replay.set_routes(batch)
        except BaseException:
            replay.undo()
            raise
    return replay
