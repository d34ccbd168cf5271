"""vLLM adapter, replay side: force recorded routes inside a vLLM forward (no engine offers this).

:class:`RouteForcer` (a :class:`~moealign.handle.PatchHandle`, scope ``"instance"``) replaces, in every MoE router
of a vLLM model runner (:func:`moealign.patches.vllm.rollout.moe_routers`), the router's top-k by the recorded
expert ids of the rows of the current engine step. :func:`score_with_routes` attaches one in every worker through
``LLM.collective_rpc`` (vLLM's worker processes at TP > 1; this process at TP = 1), and the ranks must agree on
what ran; :func:`force_routes` attaches one to an in-process engine directly:

* **patch point**: each router's ``_compute_routing(hidden_states, router_logits, indices_type, *, input_ids)``
  (an instance attribute over the class method; ``BaseRouter._select_experts`` calls it, then the capture hook,
  then EPLB mapping and the index cast, so the forced ids are *logical* ids and the capture hook sees the ids that
  the experts then run with);
* **the row map**: a :class:`~moealign.patches.vllm.rollout.VllmRecorder` (the recorder's own step hooks:
  ``execute_model`` / ``_model_forward``) notes per step the request ids in row order, ``query_start_loc``, the
  ``positions`` and ``input_ids`` the model is given; every row is a (request, position) pair. The request is
  identified by ``SamplingParams.extra_args["moealign_sample"]`` (the sample index), read from the runner's
  request state, so vLLM's request ids and batching play no part. The same recorder captures, through the
  routers' ``capture_fn``, the experts that actually ran (read after forcing, not what was set);
* **gate weights**: recomputed from vLLM's own router logits at the forced ids with moealign's replay math
  (:func:`moealign.routing_replay.gates.replay_gate_weights`) under the :class:`RouterScoring` that matches the
  vLLM router (:func:`vllm_router_scoring`): vLLM's CPU router (``CPURouter``, softmax, no groups / bias / custom
  function) takes ``topk`` of the *logits* and, with ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``), a
  softmax over the k chosen logits in the logits' dtype, returned as float32: ``RouterScoring("softmax_topk",
  weights_in_fp32=False)`` (bitwise vLLM's weights at the same ids); without ``renormalize`` it returns
  ``exp(logit - logsumexp)`` in the logits' dtype, which the replay math has no form for: ``RouterScoring("softmax",
  weights_in_fp32=False)`` is the same function, equal up to rounding (fp32 logits: 5e-7; bf16 logits: 3e-2, vLLM's
  bf16 logsumexp being the coarser one), not bitwise. vLLM's CUDA ``FusedTopKRouter`` (``topk_softmax``: float32
  softmax over all experts, top-k, optional division by the sum) is ``RouterScoring("softmax", renormalize)``
  (not checked against the CUDA kernel: no GPU test yet). Each is the family's scoring (Qwen3-MoE: softmax, top-k,
  renormalised) up to rounding; the vLLM form is used so that forcing the ids vLLM itself chose gives vLLM's own
  weights (bitwise on the CPU router with ``renormalize``). DeepSeek-V3's sigmoid grouped top-k on the CPU router
  (``use_grouped_topk``, a correction bias) is ``RouterScoring("sigmoid", renormalize, the router's
  routed_scaling_factor, n_group, topk_group)``: the unbiased float32 scores at the forced ids, bitwise vLLM's own at
  its ids. Any other router is refused.

**Verification** (``verify=True``, the default): each MoE layer's ``RoutedExperts.forward_modular`` (an instance
attribute that calls the class's method at each call, so a class-level patch such as the tree experts still runs)
reads the ``topk_ids`` the fused-MoE experts actually receive, after the router, the capture hook, EPLB mapping and
the index cast, into a :class:`~moealign.routing_replay.verify.ReplayVerifier` against the rows of the step plan:
:meth:`RouteForcer.verify_report` says per router whether the experts that ran are the forced ones (as sets) and the
fraction of rows that ran without a recorded route (each sample's last token, requests of no sample, padding rows);
:meth:`RouteForcer.check` and :func:`score_with_routes` raise :class:`~moealign.errors.ReplayError` when they are
not (a ``_compute_routing`` replaced after the forcer attached, a kernel path that routes on its own). EPLB (physical
expert ids at the experts) is refused with ``verify=True``; ``verify=False`` wraps nothing.

**Prefix caching** (on or off): :func:`score_with_routes` asks for prompt log-probs, so vLLM never reads the cache
for its requests (``skip_reading_prefix_cache``); the blocks its forwards write under forced routes are evicted when
it returns (:class:`~moealign.patches.vllm.rollout.CachedPrefixRoutes` with ``evict=True``), so no later request
reuses KV computed under routes the model did not choose. With :func:`force_routes` (requests the caller makes),
a request reuses a cached block only where the block's writer forced exactly what the request forces at its
positions (:class:`ForcedBlocks`, on the scheduler side at each cache lookup; otherwise the hit is clipped and the
block recomputed), and :meth:`RouteForcer.ran_routes` gives a reused position its writer's routes (tokens checked).

Rows whose position has no recorded route are left to the router (with :func:`score_with_routes`: the last
token of each sample, whose output no scored log-prob depends on, and rows the record marks missing). A row whose input token is not the record's
token at that position raises :class:`~moealign.errors.ReplayError`.

:func:`score_with_routes` is the main use: it runs each sample's prompt + response through vLLM as a prompt
(``max_tokens=1``, ``prompt_logprobs=0``) with the sample's routes forced, and returns the log-probs of the response
tokens. What they are (vLLM 0.32, ``GPUModelRunner._get_prompt_logprobs_dict``): prompt tokens skip the sampling
processors, so they are ``log_softmax(logits.float())`` of the model's logits at the previous position, i.e.
**raw log-probs at temperature 1 over the full vocabulary** (no temperature, top-k / top-p / min-p: vLLM applies
none of the record's sampling to prompt log-probs, in every ``logprobs_mode``). They are therefore comparable with
a trainer's full-vocabulary log-probs, not with the record's processed (kept-set) log-probs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...errors import EngineError, InputTypeError, ReplayError, UnsupportedEngineError
from ...families import get_family
from ...handle import PatchHandle
from ...record import RecordMeta, RolloutRecord
from ...routing_replay.gates import RouterScoring, replay_gate_weights
from ...routing_replay.routes import expand_routes
from ...routing_replay.verify import ReplayVerifier, VerifyReport, expected_ids
from .._version import require_attr
from .rollout import (
    CachedPrefixRoutes,
    InWorkers,
    VllmRecorder,
    check_llm,
    engine_scheduler,
    latest_rows,
    model_runner,
    moe_routers,
    prefix_caching_on,
    record_meta,
    with_cached_rows,
)

__all__ = ["ForcedBlocks", "RouteForcer", "force_routes", "score_with_routes", "vllm_router_scoring"]

#: ``SamplingParams.extra_args`` key naming the sample a vLLM request scores.
SAMPLE_KEY = "moealign_sample"


def vllm_router_scoring(router: Any, family_scoring: RouterScoring | None = None) -> RouterScoring:
    """The :class:`RouterScoring` whose replay weights equal what the vLLM ``router`` computes (see the module
    docstring); :class:`UnsupportedEngineError` for a router whose routing it does not reproduce, and when
    ``family_scoring`` (the model family's) disagrees with the router on renormalisation."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter

    name = type(router).__name__
    if type(router) is CPURouter and router.use_grouped_topk:
        return _grouped_sigmoid_scoring(router, family_scoring)
    if type(router) not in (CPURouter, FusedTopKRouter):
        raise UnsupportedEngineError(f"vLLM router {name}: routes can be forced through CPURouter and "
                                     f"FusedTopKRouter (plain softmax top-k) only")
    if getattr(router, "scoring_func", None) != "softmax":
        raise UnsupportedEngineError(f"vLLM router {name} scores with {router.scoring_func!r}, not softmax")
    if isinstance(router, CPURouter) and (router.use_grouped_topk or router.custom_routing_function is not None
                                          or router.e_score_correction_bias is not None):
        raise UnsupportedEngineError(f"vLLM router {name} uses grouped top-k, a correction bias or a custom routing "
                                     f"function: not plain softmax top-k")
    renormalize = bool(router.renormalize)
    if family_scoring is not None:
        if family_scoring.score != "softmax" or family_scoring.grouped or family_scoring.scaling_factor != 1.0:
            raise UnsupportedEngineError(f"the model family scores {family_scoring}, vLLM's {name} plain softmax")
        if family_scoring.renormalize != renormalize:
            raise UnsupportedEngineError(f"vLLM's {name} has renormalize={renormalize}, the model family "
                                         f"{family_scoring.renormalize}")
    if isinstance(router, CPURouter):
        if renormalize:      # softmax over the k chosen logits, in the logits' dtype
            return RouterScoring("softmax_topk", renormalize=False, weights_in_fp32=False)
        return RouterScoring("softmax", renormalize=False, weights_in_fp32=False)
    return RouterScoring("softmax", renormalize=renormalize, weights_in_fp32=True)


def _grouped_sigmoid_scoring(router: Any, family_scoring: RouterScoring | None) -> RouterScoring:
    """DeepSeek-V3 on vLLM's CPU router (``cpu_router._grouped_topk``): float32 sigmoid scores of the logits; the
    choice on the scores plus ``e_score_correction_bias`` within the best groups; weights = the unbiased scores at the
    chosen ids, divided by their sum when ``renormalize`` (no epsilon: moealign's 1e-20 leaves a float32 sum of k
    sigmoid scores unchanged), times the router's ``routed_scaling_factor`` (1.0 when vLLM scales the layer's output
    instead), float32. The replay weights at the ids vLLM chose are its own, bitwise."""
    name = type(router).__name__
    if router.scoring_func != "sigmoid" or router.custom_routing_function is not None:
        raise UnsupportedEngineError(f"vLLM router {name}: grouped top-k scored with {router.scoring_func!r}"
                                     f"{' and a custom routing function' if router.custom_routing_function else ''}: "
                                     f"routes can be forced through DeepSeek-V3's sigmoid grouped top-k only")
    scoring = RouterScoring("sigmoid", renormalize=bool(router.renormalize),
                            scaling_factor=float(router.routed_scaling_factor), n_group=int(router.num_expert_group),
                            topk_group=int(router.topk_group), weights_in_fp32=True)
    if family_scoring is not None:
        mine = (family_scoring.score, family_scoring.renormalize, family_scoring.n_group, family_scoring.topk_group)
        theirs = (scoring.score, scoring.renormalize, scoring.n_group, scoring.topk_group)
        if mine != theirs:
            raise UnsupportedEngineError(f"vLLM's {name} routes (score, renormalize, n_group, topk_group) = {theirs}, "
                                         f"the model family {mine}")
        if router.e_score_correction_bias is None:
            raise UnsupportedEngineError(f"vLLM's {name} has no e_score_correction_bias: the checkpoint's config.json "
                                         f"lacks topk_method 'noaux_tc'")
    return scoring


class RouteForcer(PatchHandle):
    """Forced routes inside one vLLM model runner (scope ``"instance"``; see the module docstring).

    ``tables[i]``: sample ``i``'s route table ``[positions, moe layers, k]`` (any integer dtype; row ``p`` forces
    position ``p``), ``tokens[i]`` its token ids (each forced row's input token is checked against them);
    ``routed[i]`` (optional, bool ``[positions]``): the rows that carry a recorded route (``Sample.routed_rows``;
    the others, rows the record marks missing, route natively). A request
    is sample ``i`` when its ``SamplingParams.extra_args[SAMPLE_KEY] == i``; requests without it route natively.
    ``force=False`` forces nothing (the router wrapper only maps requests to samples; the capture of what ran).
    ``recorder.steps`` holds what ran; :meth:`ran_routes` assembles it per sample. ``verify`` (default True): the
    ``topk_ids`` the experts receive are verified against the forced rows (module docstring; :meth:`verify_report`,
    :meth:`check`).
    """

    def __init__(self, runner, routers: Sequence[tuple[int, str, Any]], num_experts: int,
                 tables: Sequence[torch.Tensor | None], tokens: Sequence[torch.Tensor],
                 scorings: Sequence[RouterScoring], *, force: bool = True, verify: bool = True,
                 routed: Sequence[torch.Tensor | None] | None = None):
        super().__init__(f"forced routes on {type(runner).__name__} ({len(routers)} MoE routers, "
                         f"{len(tables)} samples)", "instance")
        self.runner = runner
        self.routers = list(routers)
        self.tables = [None if t is None or not force else expand_routes(t) for t in tables]
        self.tokens = [torch.as_tensor(t).to(torch.int64) for t in tokens]
        self.routed = [None if r is None or bool(r.all()) else torch.as_tensor(r).to(torch.bool)
                       for r in (routed if routed is not None else [None] * len(self.tables))]
        self.scorings = list(scorings)
        self.force = force
        self.recorder = VllmRecorder(runner, routers, num_experts, record_routes=True, record_kept_sets=False)
        self.sample_of: dict[str, int] = {}   # vLLM request id -> sample index
        self.forced_rows = 0
        self.stray_calls = 0
        self._plan_for: Any = None
        self._plan: tuple[torch.Tensor, torch.Tensor] | None = None
        self._plan_dev: tuple | None = None
        self.forced_calls = [0] * len(self.routers)     # per router: engine steps in which it forced rows
        self.verifier: ReplayVerifier | None = None
        self._experts: list[Any] = []
        if verify:
            self._experts = self._experts_modules()
            self.verifier = ReplayVerifier([layer for layer, _, _ in self.routers],
                                           source=f"the topk_ids {type(self._experts[0]).__name__}.forward_modular "
                                                  f"received")
        self._expect_for: Any = None
        self._expect: tuple | None = None
        self.cached: CachedPrefixRoutes | None = None   # prefix caching on, in-process (force_routes)

    # ---------------------------------------------------------------- the row map
    def _sample(self, req_id: str) -> int | None:
        if req_id in self.sample_of:
            return self.sample_of[req_id]
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        index = extra.get(SAMPLE_KEY)
        if index is not None and not (isinstance(index, int) and 0 <= index < len(self.tables)):
            raise ReplayError(f"vLLM request {req_id} names sample {index!r}, not one of {len(self.tables)}")
        self.sample_of[req_id] = index
        return index

    def _step_plan(self, step) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of this step to force, their ids [rows, layers, k] int64), computed once per step."""
        if self._plan_for is step:
            return self._plan
        rows, ids = [], []
        qsl = step.query_start_loc
        for j, req_id in enumerate(step.req_ids):
            i = self._sample(req_id)
            if i is None or self.tables[i] is None:
                continue
            a, b = int(qsl[j]), int(qsl[j + 1])
            pos = step.positions[a:b]
            table = self.tables[i]
            keep = (pos >= 0) & (pos < table.shape[0])
            if self.routed[i] is not None:
                keep &= self.routed[i][pos.clamp(0, table.shape[0] - 1)]
            if not bool(keep.any()):
                continue
            here = torch.arange(a, b)[keep]
            p = pos[keep]
            expected = self.tokens[i][p]
            seen = step.input_ids[here]
            if not torch.equal(seen, expected):
                k = int((seen != expected).nonzero()[0, 0])
                raise ReplayError(f"sample {i} (vLLM request {req_id}): the forward's input at position {int(p[k])} "
                                  f"is token {int(seen[k])}, the record's token is {int(expected[k])}")
            rows.append(here)
            ids.append(table[p])
        if rows:
            plan = (torch.cat(rows), torch.cat(ids))
        else:
            plan = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, 0, 0, dtype=torch.int64))
        self._plan_for, self._plan = step, plan
        self.forced_rows += int(plan[0].numel())
        return plan

    def _plan_on(self, step, device) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's plan on ``device``, copied once per step (not once per router)."""
        cached = self._plan_dev
        if cached is None or cached[0] is not step or cached[1] != device:
            rows, forced = self._step_plan(step)
            cached = self._plan_dev = (step, device, rows.to(device), forced.to(device))
        return cached[2], cached[3]

    def _compute_routing(self, index: int, original, scoring: RouterScoring):
        layer, _, router = self.routers[index]
        # under the canonical forward (moealign.patches.vllm.canonical) forced routes take its routing step too:
        # ascending expert ids and c_gates from the fp32 logits, as Megatron's canonical router gives them, so a
        # record's routes forced here and replayed there meet the same gates and the same combine order
        canonical = getattr(getattr(original, "__func__", original), "canonical", False)

        def _compute_routing(hidden_states, router_logits, indices_type, *args, **kwargs):
            weights, ids = original(hidden_states, router_logits, indices_type, *args, **kwargs)
            step = self.recorder._current
            if step is None:
                self.stray_calls += 1
                return weights, ids
            rows, forced = self._step_plan(step)
            if rows.numel() == 0:
                return weights, ids
            self.forced_calls[index] += 1
            if int(rows.max()) >= ids.shape[0]:
                raise ReplayError(f"the router of layer {layer} saw {ids.shape[0]} rows, the step has "
                                  f"{int(rows.max()) + 1}")
            if forced.shape[-1] != ids.shape[-1]:
                raise ReplayError(f"the record forces {forced.shape[-1]} experts per row, the router of layer "
                                  f"{layer} chooses {ids.shape[-1]}")
            rows_d, forced_d = self._plan_on(step, ids.device)
            chosen = forced_d[:, index].to(router_logits.device)
            if canonical:
                ascending, order = chosen.to(torch.int64).sort(dim=-1)        # c_gates takes ascending ids
                gates = canonical(router, router_logits[rows_d].to(torch.float32), ascending)   # softmax / sigmoid
                gate = torch.empty_like(gates).scatter_(1, order, gates).to(weights.dtype)   # back to slot order
            else:
                gate = replay_gate_weights(router_logits[rows_d], chosen, scoring, out_dtype=weights.dtype,
                                           validate=False)
            ids = ids.clone()
            weights = weights.clone()
            ids[rows_d] = chosen.to(ids.dtype)
            weights[rows_d] = gate
            return weights.contiguous(), ids.contiguous()
        return _compute_routing

    # ---------------------------------------------------------------- verification: what the experts received
    def _experts_modules(self) -> list:
        """Each router's ``RoutedExperts`` (the MoE runner's ``routed_experts``); EPLB refused (physical ids)."""
        out = []
        for layer, name, router in self.routers:
            if getattr(router, "eplb_state", None) is not None:
                raise UnsupportedEngineError(f"the MoE layer of layer {layer} runs EPLB: its experts receive physical "
                                             f"expert ids, which the verifier does not map back; pass verify=False")
            experts = getattr(self.runner.model.get_submodule(name), "routed_experts", None)
            if experts is None or not callable(getattr(experts, "forward_modular", None)):
                raise UnsupportedEngineError(f"the MoE layer {name!r} has no routed_experts.forward_modular whose "
                                             f"topk_ids could be verified; pass verify=False")
            out.append(experts)
        return out

    def _step_expect(self, step, rows: int, device):
        """(per router: the forced ids of this step's rows, sorted ``[rows, k]``; bool ``[rows]`` forced rows or
        None; their number), once per step (and row count / device)."""
        cached = self._expect_for
        if cached is not None and cached[0] is step and cached[1] == rows and cached[2] == device:
            return self._expect
        forced_rows, forced = self._step_plan(step)
        n = int(forced_rows.numel())
        if n and int(forced_rows.max()) >= rows:
            raise ReplayError(f"the experts received {rows} rows, the step forces row {int(forced_rows.max())}")
        k = forced.shape[-1] if n else 1
        full = torch.zeros(rows, len(self.routers), k, dtype=torch.int64)
        mask = torch.zeros(rows, dtype=torch.bool)
        if n:
            full[forced_rows] = forced
            mask[forced_rows] = True
        full = full.to(device)
        expected = [expected_ids(full[:, i], self.recorder.num_experts) for i in range(len(self.routers))]
        self._expect_for, self._expect = (step, rows, device), (expected, mask.to(device), n)
        return self._expect

    def _forward_modular(self, index: int, experts):
        own = vars(experts).get("forward_modular")
        cls = type(experts)

        def forward_modular(x, topk_weights, topk_ids, *args, **kwargs):
            step = self.recorder._current
            if step is not None:
                expected, mask, n = self._step_expect(step, int(topk_ids.shape[0]), topk_ids.device)
                # (nothing forced in this step: every row ran without a recorded route, nothing is compared)
                self.verifier.observe(index, topk_ids, expected[index] if n else topk_ids, mask, replayed_rows=n,
                                      expected_sorted=True)
            if own is not None:
                return own(x, topk_weights, topk_ids, *args, **kwargs)
            return cls.forward_modular(experts, x, topk_weights, topk_ids, *args, **kwargs)

        return forward_modular

    def verify_report(self) -> VerifyReport | None:
        """Per router: the experts that ran (what ``forward_modular`` received) against the forced rows, and the
        fraction of rows that ran without a recorded route (None with ``verify=False``)."""
        return None if self.verifier is None else self.verifier.report()

    def check(self, calls: int | None = None) -> None:
        """Raise :class:`~moealign.errors.ReplayError` when (with ``verify``) the experts that ran differ from the
        forced routes on any forced row, or a router forced rows in steps whose experts were not observed; with
        ``calls``, unless every router forced rows in exactly ``calls`` engine steps."""
        if self.verifier is not None:
            self.verifier.check(self.forced_calls)
        if calls is not None:
            bad = [(layer, c) for (layer, _, _), c in zip(self.routers, self.forced_calls) if c != calls]
            if bad:
                raise ReplayError(f"forced routes unbalanced (expected {calls} forcing steps per MoE layer): "
                                  + ", ".join(f"layer {layer}: {c}" for layer, c in bad))

    def reset_counters(self) -> None:
        self.forced_calls = [0] * len(self.routers)
        if self.verifier is not None:
            self.verifier.reset()

    def attach(self) -> "RouteForcer":
        try:
            self.add_handle(self.recorder.attach(), "row map and route capture")
            # installed with force=False too (every table None: nothing forced, requests still mapped to samples)
            for index, ((layer, _, router), scoring) in enumerate(zip(self.routers, self.scorings)):
                self.set_attr(router, "_compute_routing",
                              self._compute_routing(index, router._compute_routing, scoring),
                              f"router of layer {layer}._compute_routing")
            for index, experts in enumerate(self._experts):
                self.set_attr(experts, "forward_modular", self._forward_modular(index, experts),
                              f"routed experts of layer {self.routers[index][0]}.forward_modular (verify)")
            self.add_callback(self._drop_step_cache)
        except BaseException:
            self.undo()
            raise
        return self

    def _drop_step_cache(self) -> None:
        self._expect_for = self._expect = None
        self._plan_dev = None

    # ---------------------------------------------------------------- what ran
    def _check_restored(self, names, req, pos, tok) -> None:
        """The input tokens of the positions restored from the prefix cache against the samples' tokens."""
        for name, index in names.items():
            i = self.sample_of.get(name)
            if i is None:
                continue
            mine = req == index
            if not bool(mine.any()):
                continue
            p, t = pos[mine], tok[mine]
            if int(p.max()) >= self.tokens[i].numel() or not torch.equal(self.tokens[i][p], t):
                raise ReplayError(f"sample {i} (vLLM request {name}) reused cached KV blocks whose tokens are not the "
                                  f"record's")

    def ran_routes(self, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Per sample, the experts that ran at positions ``0 .. lengths[i] - 1`` (int64 ``[n, layers, k]``, the
        latest forward of each position), read from the routers' capture hook."""
        names, rows, _ = self.recorder._flat()
        if self.cached is not None:           # positions reused from the prefix cache: their writer's rows
            forwarded = rows[0].numel()
            rows = with_cached_rows(names, rows, self.cached.hits, self.cached.block_size)
            self._check_restored(names, *(r[forwarded:] for r in rows[:3]))
        row_req, row_pos, _, routes = rows
        by_sample = {self.sample_of.get(name): r for name, r in names.items()}
        out = []
        for i, n in enumerate(lengths):
            if i not in by_sample:
                raise ReplayError(f"no engine step of sample {i} was seen")
            mine = (row_req == by_sample[i]).nonzero().flatten()
            last = latest_rows(row_pos[mine], torch.arange(n))
            if bool((last < 0).any()):
                raise ReplayError(f"sample {i}: no route ran for position {int((last < 0).nonzero()[0, 0])}")
            out.append(routes[mine[last]].to(torch.int64))
        return out


def _check_engine(llm) -> None:
    check_llm(llm)


class ForcedBlocks:
    """The scheduler-side agreement check of forced routes under prefix caching: a request may reuse a cached KV
    block only when the block's writer forced, at the block's positions, exactly what the request forces there
    (the same ids on the same rows, the same rows left to the router); otherwise the hit is clipped there and the
    request recomputes the block under its own routes. ``sample(request)`` names a request's sample (or None)."""

    def __init__(self, tables, routed, block_size: int, sample):
        self.tables, self.routed, self.block_size, self.sample = tables, routed, block_size, sample
        self.sample_of: dict[str, int | None] = {}

    def _forced(self, i: int | None, start: int, stop: int) -> tuple:
        table = None if i is None else self.tables[i]
        if table is None:
            return None, None
        rows = table[start:stop]
        mask = None if self.routed[i] is None else self.routed[i][start:stop]
        return rows, mask

    def __call__(self, request, writers) -> int:
        mine = self.sample(request)
        self.sample_of[request.request_id] = mine
        for j, (wid, wj) in enumerate(writers):
            start, stop = j * self.block_size, (j + 1) * self.block_size
            if wid not in self.sample_of:
                return j
            a, b = self._forced(mine, start, stop), self._forced(self.sample_of[wid], start, stop)
            if not _same_forcing(a, b, stop - start):
                return j
        return len(writers)


def _same_forcing(a: tuple, b: tuple, rows: int) -> bool:
    (ta, ma), (tb, mb) = a, b
    if ta is None or tb is None:
        return ta is None and tb is None
    if ta.shape != tb.shape or ta.shape[0] != rows:
        return False
    ma = torch.ones(rows, dtype=torch.bool) if ma is None else ma
    mb = torch.ones(rows, dtype=torch.bool) if mb is None else mb
    return torch.equal(ma, mb) and torch.equal(ta[ma], tb[mb])


def _cached_blocks(llm, tables, routed, sample) -> CachedPrefixRoutes | None:
    """With prefix caching on: the scheduler-side block map (forced-route agreement on every hit; the blocks written
    under forced routes evicted on undo), attached; None with caching off."""
    if not prefix_caching_on(llm):
        return None
    scheduler = engine_scheduler(llm)
    cached = CachedPrefixRoutes(scheduler, evict=True)
    cached.admit = ForcedBlocks(tables, routed, cached.block_size, sample)
    return cached.attach()


def force_routes(llm: Any, record: RolloutRecord, *, force: bool = True, verify: bool = True) -> RouteForcer:
    """Attach a :class:`RouteForcer` for ``record`` (sample ``i`` = requests with ``extra_args[SAMPLE_KEY] == i``)
    after checking the record against the engine: the record's meta must match :func:`record_meta` (``llm``)
    (:class:`~moealign.errors.RecordMismatchError`), every sample must carry routes
    (:class:`~moealign.errors.ReplayError`). With prefix caching on, a request reuses a cached block only where
    the block's writer forced what it forces there (:class:`ForcedBlocks`), the reused positions' ran routes are the
    writer's, and the blocks written under forced routes leave the cache on undo. ``verify``
    (default True): the experts' ``topk_ids`` are verified (:meth:`RouteForcer.verify_report`, :meth:`RouteForcer.check`)."""
    runner = model_runner(llm)
    meta = _checked_record(llm, record, force)
    forcer = _attach_forcer(runner, meta.num_experts, [s.routes if force else None for s in record.samples],
                            [s.token_ids for s in record.samples], force, verify, _routed(record))
    try:
        cached = _cached_blocks(llm, forcer.tables, forcer.routed, _request_sample)
        if cached is not None:
            forcer.cached = forcer.add_handle(cached, "prefix-cache route map (forced blocks evicted)")
    except BaseException:
        forcer.undo()
        raise
    return forcer


def _request_sample(request) -> int | None:
    """The sample a scheduler-side vLLM request names (``extra_args[SAMPLE_KEY]``), or None."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    index = extra.get(SAMPLE_KEY)
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def _checked_record(llm: Any, record: RolloutRecord, force: bool) -> RecordMeta:
    """The engine's record meta, after checking ``record`` against it (meta, routes present and shaped)."""
    if not isinstance(record, RolloutRecord):
        raise InputTypeError(f"record must be a moealign RolloutRecord, got {type(record).__name__}")
    _check_engine(llm)
    meta = record_meta(llm)
    record.meta.check_matches(meta, what="vLLM engine")
    if force:
        missing = [i for i, s in enumerate(record.samples) if s.routes is None]
        if missing:
            raise ReplayError(f"samples {missing[:8]} of the record carry no routes: nothing to force")
        for i, s in enumerate(record.samples):
            if tuple(s.routes.shape) != (s.length - 1, len(meta.moe_layers), meta.top_k):
                raise ReplayError(f"sample {i}: routes {tuple(s.routes.shape)}, expected "
                                  f"{(s.length - 1, len(meta.moe_layers), meta.top_k)}")
    return meta


def _routed(record: RolloutRecord) -> list[torch.Tensor | None]:
    """Per sample, the route rows that carry a recorded route (None: all; rows marked missing are not forced)."""
    return [None if s.routes is None or getattr(s, "route_missing", None) is None else s.routed_rows
            for s in record.samples]


def _attach_forcer(runner, num_experts: int, tables, tokens, force: bool, verify: bool = True,
                   routed=None) -> RouteForcer:
    """(In each worker, through :class:`~moealign.patches.vllm.rollout.InWorkers`) a :class:`RouteForcer` on the
    worker's model runner, its routers scored as the model family says."""
    hf_config = require_attr(runner.model_config, "hf_config", "vLLM's model config")
    family_scoring = get_family(getattr(hf_config, "model_type", None)).scoring(hf_config)
    routers = moe_routers(runner.model)
    scorings = [vllm_router_scoring(router, family_scoring) for _, _, router in routers]
    return RouteForcer(runner, routers, num_experts, tables, tokens, scorings, force=force, verify=verify,
                       routed=routed).attach()


def _read_forcer(forcer: RouteForcer, lengths) -> tuple:
    return forcer.forced_rows, forcer.ran_routes(lengths), forcer.verify_report(), list(forcer.forced_calls)


def score_with_routes(llm: Any, record: RolloutRecord, *, force: bool = True, return_routes: bool = False,
                      verify: bool = True, return_verify: bool = False):
    """Per sample of ``record``, vLLM's log-probs of its response tokens (float32 ``[response_len]``) with the
    record's routes forced (``force=False``: vLLM's own routing, the same call otherwise).

    Each sample's full token ids run as one prompt (``max_tokens=1``, ``prompt_logprobs=0``); the result is the
    prompt log-probs at the response positions: raw log-probs at temperature 1 over the full vocabulary
    (vLLM applies no sampling processor to prompt log-probs; see the module docstring). Positions ``0 .. L-2`` are
    forced (but rows the record marks missing, ``Sample.route_missing``), the last token (whose output none of these
    log-probs depends on) routes natively; after the run the
    experts that ran (the routers' capture hook) are checked to be exactly the forced ones, slot for slot
    (:class:`~moealign.errors.ReplayError` otherwise). The patches are undone when the call returns or raises.
    ``return_routes=True`` also returns, per sample, the experts that ran at positions ``0 .. L-2`` (int64
    ``[L-1, layers, k]``, read from the routers' capture hook). ``verify`` (default True): the ``topk_ids`` the
    experts received are verified against the forced routes in every worker (:class:`RouteForcer`; a mismatch raises
    :class:`~moealign.errors.ReplayError`); ``return_verify=True`` also returns that
    :class:`~moealign.routing_replay.verify.VerifyReport` (None with ``verify=False``), last in the returned tuple.
    """
    from vllm import SamplingParams as VllmSamplingParams

    meta = _checked_record(llm, record, force)
    tables = [s.routes if force else None for s in record.samples]
    lengths = [s.length - 1 for s in record.samples]
    forcing = InWorkers(llm, _attach_forcer, (meta.num_experts, tables, [s.token_ids for s in record.samples], force,
                                              verify, _routed(record)),
                        _read_forcer, (lengths,), agree="forced or ran other routes")
    # prefix caching on: prompt log-probs never read the cache (vLLM skips the lookup, asked here explicitly), and
    # the blocks these forwards write under forced routes leave the cache when the call returns
    caching = prefix_caching_on(llm)
    skip = {"skip_reading_prefix_cache": True} if caching else {}
    cached = _cached_blocks(llm, tables, [None] * len(tables), _request_sample) if caching else None
    try:
        with forcing:
            inputs = [{"prompt_token_ids": s.token_ids.tolist()} for s in record.samples]
            params = [VllmSamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, logprobs=0,
                                         detokenize=False, extra_args={SAMPLE_KEY: i}, **skip)
                      for i in range(len(inputs))]
            outputs = llm.generate(inputs, params, use_tqdm=False)
    finally:
        if cached is not None:
            cached.undo()
    if cached is not None and any(cached.hits.values()):
        raise EngineError("vLLM reused prefix-cached blocks for requests that score prompt log-probs")
    if len(outputs) != len(inputs):
        raise EngineError(f"vLLM returned {len(outputs)} outputs for {len(inputs)} samples")
    forced_rows, ran, report, forced_calls = forcing.result
    if force and forced_rows == 0:
        raise ReplayError("no row was forced (the engine steps were not seen)")
    if report is not None:
        report.check(forced_calls)
    result = []
    for i, (s, out) in enumerate(zip(record.samples, outputs)):
        plp = out.prompt_logprobs
        if plp is None or len(plp) != s.length:
            raise EngineError(f"sample {i}: vLLM returned {None if plp is None else len(plp)} prompt log-probs for "
                              f"{s.length} tokens")
        tokens = s.token_ids.tolist()
        values = []
        for p in range(s.prompt_len, s.length):
            entry = plp[p]
            if entry is None or tokens[p] not in entry:
                raise EngineError(f"sample {i}: no prompt log-prob for token {tokens[p]} at position {p}")
            values.append(entry[tokens[p]].logprob)
        result.append(torch.tensor(values, dtype=torch.float32))
    if force:
        for i, (s, r) in enumerate(zip(record.samples, ran)):
            expected = s.routes.to(torch.int64)
            differ = (r != expected).any(-1).any(-1) & s.routed_rows     # rows marked missing route natively
            if bool(differ.any()):
                p = int(differ.nonzero()[0, 0])
                raise ReplayError(f"sample {i}: the experts that ran at position {p} are {r[p].tolist()}, the forced "
                                  f"ones {expected[p].tolist()}")
    out = (result,) + ((ran,) if return_routes else ()) + ((report,) if return_verify else ())
    return out if len(out) > 1 else result
