"""vLLM adapter, rollout side: :func:`generate_with_record` runs a real ``vllm.LLM`` and returns the
:class:`~moealign.record.RolloutRecord` the transformers adapter (:func:`moealign.patches.hf.generate_with_record`)
produces: token ids (prompt + response), prompt lengths, vLLM's processed log-probs of the sampled tokens,
routes, kept sets and sampling parameters, with ``meta.engine == "vllm"``.

Everything is read where the model runs, on the V1 model runner (vLLM 0.32's CPU build): a recorder is attached
in every worker through vLLM's ``LLM.collective_rpc`` (in this process when the engine core runs here, as
:func:`moealign.patches.vllm.engine.open_llm` arranges at TP = 1; in vLLM's worker processes at TP > 1), collected
and undone after ``generate``; every TP rank routes and samples the same rows, so their captures must agree
(:class:`~moealign.errors.ReplayError` otherwise) and rank 0's is the record:

* **routes**: every MoE layer's router (``MoERunner.router``, a ``BaseRouter``) gets a capture callback
  (``capture_fn``, vLLM's own hook: called once per layer per engine step with the logical expert ids of every
  token row of the step, before any EPLB mapping);
* **the row map**: the runner's ``_model_forward`` is wrapped to note, per step, the request ids in row order
  (``input_batch.req_ids``), ``query_start_loc`` and the ``positions`` / ``input_ids`` the model is given, so
  every row is a (request, position) pair whatever continuous batching, chunked prefill or preemption did;
* **kept sets**: the sampler's ``topk_topp_sampler.forward`` is wrapped; its processed log-probs (-inf outside
  the kept set after temperature, min-p, top-k and top-p) are compacted on the spot into CSR rows (int64
  counts + int32 ids; no full-vocabulary tensor is kept). Each sampler row is keyed by the position of the
  token it samples, so the rows vLLM discards (partial prefill chunks) never match a response position.

At the end every route row and kept set is checked against the tokens vLLM returned: the input token the
forward saw at each (request, position), the sampled token of each kept-set row and its log-prob; a mapping
slip raises :class:`~moealign.errors.ReplayError` instead of recording another token's experts. Every patch is
a :class:`~moealign.handle.PatchHandle` (scope ``"instance"``) undone when the call returns or raises.

**Prefix caching** (vLLM's default): a position whose KV block is reused from the prefix cache is never forwarded, so
its routes are those of the forward that wrote the block. :class:`CachedPrefixRoutes` (scheduler side, per engine
step, in the engine core's process: no hook inside a forward) notes, per KV block that vLLM makes reusable
(``BlockPool.cache_full_blocks``), the request and block index whose forward wrote it and the block's hash (vLLM's
own key); drops the note when vLLM evicts the block or resets the cache (``_remove_cached_block_hashes``,
``reset_prefix_cache``); and on each cache lookup (``KVCacheManager.get_computed_blocks``) keeps the hit only as far
as every block has a writer noted in this call (a block cached before the call, or written outside the recorder, is
recomputed instead: the hit is clipped). After ``generate`` the hit positions get their writer's rows
(:func:`with_cached_rows`: the writer's input tokens, checked against the sample's like any forwarded row, and its
routes). Refused by name: several KV cache groups, partial-block cache entries, a KV connector. Under the tree /
canonical forward a record made with caching on equals one made with it off, bitwise (tests/test_vllm_prefix_cache.py);
under the stock forward a hit changes the batch a step runs (fewer rows), which may change the bits of what the
forward computes after it: the record is still exact about what ran (the restored rows are the writer's).

Speculative decoding, async scheduling, monolithic MoE kernels and a temperature below vLLM's greedy threshold
(1e-5: vLLM then samples greedily and never truncates) are refused. The record's metadata (:func:`record_meta`): the
fingerprint of the checkpoint's config.json as written (not of the config vLLM loaded, which vLLM edits), the MoE
layers, experts and top-k of its live routers, and the router signature of the checkpoint's router weights, read
from its safetensors files (vLLM's CPU build repacks the live gate weights into a oneDNN kernel and leaves the
parameter empty); so it matches
:func:`moealign.patches.hf.record_meta` of the same checkpoint.

Sample ``i`` draws from its own seed (``seed + i``). vLLM 0.32's CPU build cannot rewind such a per-request
generator after a sample it discards (a partial prefill chunk: ``gen.set_offset`` raises "CPU Generator does not
use offset"); while recording, the sampler wrapper restores that generator's state itself and hides it from the
failing rewind until the next step, so seeded sampling works under chunked prefill and a sample does not depend
on how the batch was chunked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..._validate import check_positive_int
from ...errors import (
    ConfigError,
    EngineError,
    InputError,
    InputTypeError,
    ReplayError,
    UnsupportedEngineError,
    UnsupportedModelError,
)
from ...families import get_family
from ...handle import PatchHandle
from ...record import (
    MIN_TEMPERATURE,
    RecordMeta,
    RolloutRecord,
    Sample,
    SamplingParams,
    router_samples,
    router_signature,
)
from ...model_config import checkpoint_fingerprint
from ...routing_replay.routes import compact_routes, route_dtype
from .._version import require_attr
from .engine import vllm_version

__all__ = ["CachedPrefixRoutes", "VllmRecorder", "generate_with_record", "engine_scheduler", "prefix_caching_on",
           "with_cached_rows", "model_runner", "moe_routers", "record_meta", "cached_record_meta",
           "worker_runner"]

#: vLLM samples greedily below this temperature (``vllm.v1.sample.sampler._SAMPLING_EPS``): no kept set exists.
VLLM_GREEDY_TEMPERATURE = MIN_TEMPERATURE   # vLLM's _SAMPLING_EPS: below it vLLM samples greedily


# --------------------------------------------------------------------------------------------------
# reaching the engine
# --------------------------------------------------------------------------------------------------


def model_runner(llm: Any):
    """The in-process V1 model runner of ``llm`` (``llm.llm_engine.model_executor.driver_worker.worker
    .model_runner``); :class:`~moealign.errors.EngineError` when the engine core runs in another process."""
    engine = getattr(llm, "llm_engine", None)
    if engine is None:
        raise InputTypeError(f"llm must be a vllm.LLM, got {type(llm).__name__}")
    executor = getattr(engine, "model_executor", None)
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise EngineError("the vLLM engine core does not run in this process (no in-process driver worker): open "
                          "the LLM with moealign.patches.vllm.open_llm, or set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                          "before vLLM is imported, so that routes can be forced")
    return _checked_runner(runner)


def _checked_runner(runner):
    where = f"vLLM's {type(runner).__name__}"
    for name in ("_model_forward", "execute_model", "input_batch", "query_start_loc", "sampler", "model"):
        require_attr(runner, name, where)
    require_attr(runner.sampler, "topk_topp_sampler", f"{where}.sampler")
    return runner


def moe_routers(model: torch.nn.Module) -> list[tuple[int, str, Any]]:
    """``(decoder layer, module name, router)`` of every MoE layer of a live vLLM model, ascending by layer."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    found = []
    for name, module in model.named_modules():
        if not isinstance(module, MoERunner):
            continue
        if module.is_monolithic:
            raise UnsupportedEngineError(f"the MoE layer {name!r} runs a monolithic kernel, whose routing is not "
                                         f"exposed to the router's capture hook; routes cannot be recorded")
        router = getattr(module, "router", None)
        if not isinstance(router, BaseRouter):
            raise UnsupportedEngineError(f"the MoE layer {name!r} has router {type(router).__name__}, not a vLLM "
                                         f"BaseRouter with a capture hook; routes cannot be recorded")
        found.append((int(module.layer_id), name, router))
    if not found:
        raise UnsupportedModelError(f"no MoE layer (vLLM MoERunner) in {type(model).__name__}")
    found.sort(key=lambda item: item[0])
    layers = [layer for layer, _, _ in found]
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(f"several vLLM MoE layers share a decoder layer number: {layers}")
    return found


_GATE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")


def _checkpoint_router_weights(path: str, layers: Sequence[int], num_experts: int) -> list[torch.Tensor]:
    """The router (gate) weights of decoder ``layers`` read from the checkpoint's safetensors files (vLLM's CPU
    build repacks its live gate weights into a oneDNN kernel and leaves the parameter empty, so the files are
    the one place both engines' router weights can be read from)."""
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise UnsupportedModelError(f"{path}: no local safetensors files to read the router weights from (the "
                                    f"record's router signature)")
    found: dict[int, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                match = _GATE_RE.search(key)
                if match and int(match.group(1)) in layers:
                    found[int(match.group(1))] = f.get_tensor(key)
    missing = [layer for layer in layers if layer not in found]
    if missing:
        raise UnsupportedModelError(f"{path}: no router weight 'layers.<i>.mlp.gate.weight' for MoE layers {missing}")
    weights = [found[layer] for layer in layers]
    bad = [layer for layer, w in zip(layers, weights) if w.dim() != 2 or w.shape[0] != num_experts]
    if bad:
        raise UnsupportedModelError(f"{path}: the router weights of layers {bad} are not [num_experts={num_experts}, "
                                    f"hidden]")
    return weights


def _rpc_routers(worker) -> list[tuple[int, str, int, int]]:
    """(In each worker) ``(layer, name, top_k, experts)`` of every MoE router of the worker's live model."""
    runner = worker_runner(worker)
    return [(layer, name, int(r.top_k), int(r.global_num_experts)) for layer, name, r in moe_routers(runner.model)]


def _engine_routers(llm: Any) -> list[tuple[int, str, int, int]]:
    """The MoE routers of the model ``llm`` runs, read in its workers (every rank must see the same)."""
    if getattr(llm, "llm_engine", None) is None:
        raise InputTypeError(f"llm must be a vllm.LLM, got {type(llm).__name__}")
    return _agreed(llm.collective_rpc(_rpc_routers), "holds other MoE routers", UnsupportedEngineError)


def cached_record_meta(llm: Any) -> RecordMeta:
    """:func:`record_meta` once per engine (it describes the checkpoint vLLM loaded and its routers, which a
    rollout does not change; reading the checkpoint's router weights costs milliseconds per call)."""
    model = str(llm.llm_engine.model_config.model)
    cached = getattr(llm, "_moealign_record_meta", None)
    if cached is None or cached[0] != model:
        cached = (model, record_meta(llm))
        llm._moealign_record_meta = cached
    return cached[1]


_cached_meta = cached_record_meta


def record_meta(llm: Any) -> RecordMeta:
    """The :class:`RecordMeta` of the model ``llm`` runs: the fingerprint of the checkpoint's config.json as written
    (:func:`~moealign.model_config.checkpoint_fingerprint`; vLLM edits the config it loaded),
    the MoE layers, experts and top-k of its live routers (read in the workers, any TP size) and the router
    signature of the checkpoint's router weights (so it matches :func:`moealign.patches.hf.record_meta` of the
    same checkpoint in any dtype)."""
    version = str(vllm_version())
    model_config = llm.llm_engine.model_config
    hf_config = model_config.hf_config
    family = get_family(getattr(hf_config, "model_type", None))
    routers = _engine_routers(llm)
    top_k = {k for _, _, k, _ in routers}
    experts = {e for _, _, _, e in routers}
    if len(top_k) != 1 or len(experts) != 1:
        raise UnsupportedModelError(f"vLLM's routers disagree on top_k {sorted(top_k)} or the number of experts "
                                    f"{sorted(experts)}")
    num_experts = int(family.num_experts(hf_config))
    if experts != {num_experts}:
        raise UnsupportedModelError(f"vLLM's routers have {experts.pop()} experts, the checkpoint config "
                                    f"{num_experts}")
    moe_layers = tuple(layer for layer, _, _, _ in routers)
    weights = _checkpoint_router_weights(str(model_config.model), moe_layers, num_experts)
    return RecordMeta(
        engine="vllm",
        engine_version=version,
        model_fingerprint=checkpoint_fingerprint(str(model_config.model)),   # the file, not vLLM's edited config
        num_layers=int(hf_config.num_hidden_layers),
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=top_k.pop(),
        vocab_size=int(hf_config.vocab_size),
        dtype=str(model_config.dtype).replace("torch.", ""),
        router_signature=router_signature(weights),
        router_samples=router_samples(weights),
        model_name=str(getattr(hf_config, "_name_or_path", "") or model_config.model or ""),
    )


# --------------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------------


@dataclass
class _Step:
    """One engine step: the rows the model was given and what the routers / sampler did with them."""

    req_ids: list[str]
    query_start_loc: torch.Tensor              # int64 [num_reqs + 1]
    positions: torch.Tensor                    # int64 [tokens]
    input_ids: torch.Tensor                    # int64 [tokens]
    routes: list[torch.Tensor | None]          # per MoE layer: [tokens, k] (storage dtype)
    kept: tuple[torch.Tensor, ...] | None = None   # (counts int64 [R], ids int32, sampled int64 [R], logp f32 [R])


class VllmRecorder(PatchHandle):
    """Route and kept-set capture inside an in-process vLLM engine (scope ``"instance"``).

    :meth:`attach` wraps the runner's ``execute_model`` and ``_model_forward`` (the row map), sets each MoE
    router's ``capture_fn`` (chaining one already set) and wraps the sampler's ``topk_topp_sampler.forward``;
    ``undo()`` restores all of them. What was captured stays readable in :attr:`steps`.
    """

    def __init__(self, runner, routers: Sequence[tuple[int, str, Any]], num_experts: int, *,
                 record_routes: bool = True, record_kept_sets: bool = True):
        super().__init__(f"route / kept-set capture on {type(runner).__name__} ({len(routers)} MoE routers)",
                         "instance")
        self.runner = runner
        self.routers = list(routers)
        self.num_experts = num_experts
        self.record_routes = record_routes
        self.record_kept_sets = record_kept_sets
        self.steps: list[_Step] = []
        self.stray_calls = 0          # router / sampler calls outside a recorded step (e.g. a dummy run)
        self._in_execute = False
        self._current: _Step | None = None
        self._hidden: dict[int, Any] = {}   # batch row -> generator hidden from vLLM's CPU-incompatible rewind
        route_dtype(num_experts)   # refuses a model whose expert ids no route table holds

    # ---------------------------------------------------------------- hooks
    def _execute_model(self, original):
        def execute_model(*args, **kwargs):
            self._restore_generators()
            self._in_execute = True
            try:
                return original(*args, **kwargs)
            finally:
                self._in_execute = False
        return execute_model

    def _discarded_generators(self, runner) -> dict:
        """The CPU generators of this step's rows whose sample vLLM will discard (partial prefill chunks)."""
        batch = runner.input_batch
        mask = getattr(runner, "discard_request_mask", None)
        generators = getattr(batch, "generators", None)
        if mask is None or not generators:
            return {}
        rows = [int(i) for i in mask.np[:int(batch.num_reqs)].nonzero()[0]]
        return {i: generators[i] for i in rows if i in generators and generators[i].device.type == "cpu"}

    def _restore_generators(self) -> None:
        """Put back the generators hidden from vLLM's offset rewind (before the batch may move rows)."""
        hidden, self._hidden = self._hidden, {}
        for i, gen in hidden.items():
            self.runner.input_batch.generators[i] = gen

    def _model_forward(self, original):
        runner = self.runner

        def _model_forward(*args, **kwargs):
            if self._in_execute:
                self._begin_step(runner, kwargs)
            else:
                self._current = None
            return original(*args, **kwargs)
        return _model_forward

    def _begin_step(self, runner, kwargs) -> None:
        input_ids, positions = kwargs.get("input_ids"), kwargs.get("positions")
        if not isinstance(input_ids, torch.Tensor) or not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            raise UnsupportedEngineError("vLLM's model forward got no 1-D input_ids / positions (prompt embeddings or "
                                         "M-RoPE): rows cannot be mapped to tokens")
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        qsl = torch.as_tensor(runner.query_start_loc.np[:num_reqs + 1]).to(torch.int64).clone()
        tokens = int(qsl[-1])
        if tokens > positions.shape[0] or tokens > input_ids.shape[0]:
            raise ReplayError(f"vLLM step schedules {tokens} tokens but the model forward got "
                              f"{positions.shape[0]} positions")
        self._current = _Step(list(batch.req_ids[:num_reqs]), qsl, positions[:tokens].to("cpu", torch.int64).clone(),
                              input_ids[:tokens].to("cpu", torch.int64).clone(), [None] * len(self.routers))
        self.steps.append(self._current)

    def _capture(self, index: int, chained):
        def capture_fn(topk_ids: torch.Tensor) -> None:
            if chained is not None:
                chained(topk_ids)
            step = self._current
            if step is None:
                self.stray_calls += 1
                return
            if step.routes[index] is not None:
                raise ReplayError(f"the router of layer {self.routers[index][0]} was called twice in one vLLM step")
            tokens = step.positions.shape[0]
            if topk_ids.shape[0] < tokens:
                raise ReplayError(f"the router of layer {self.routers[index][0]} saw {topk_ids.shape[0]} rows for "
                                  f"{tokens} scheduled tokens")
            step.routes[index] = topk_ids[:tokens].to("cpu", torch.int16).clone()   # compacted per sample
        return capture_fn

    def _sampler(self, original):
        runner = self.runner

        def forward(logits, *args, **kwargs):
            rewind = self._discarded_generators(runner) if self._current is not None else {}
            saved = {i: gen.get_state() for i, gen in rewind.items()}
            sampled, processed = original(logits, *args, **kwargs)
            for i, gen in rewind.items():
                # vLLM rewinds a discarded row's generator with set_offset, which CPU generators do not have
                # ("CPU Generator does not use offset"): restore its state here and hide it from that rewind
                gen.set_state(saved[i])
                runner.input_batch.generators.pop(i)
                self._hidden[i] = gen
            step = self._current
            if step is None or step.kept is not None:
                self.stray_calls += 1
                return sampled, processed
            if processed is None:
                raise EngineError("vLLM's sampler returned no processed log-probs: open the LLM with "
                                  "logprobs_mode='processed_logprobs' (open_llm does)")
            rows = len(step.req_ids)
            if processed.shape[0] != rows or sampled.shape[0] != rows:
                raise ReplayError(f"vLLM's sampler saw {processed.shape[0]} rows for {rows} requests in the step "
                                  f"(speculative decoding?)")
            tok = sampled.reshape(-1).to(torch.int64)
            logp = processed.gather(-1, tok.unsqueeze(-1)).squeeze(-1).to("cpu", torch.float32)
            if self.record_kept_sets:
                kept = processed > float("-inf")
                counts = kept.sum(-1).to("cpu", torch.int64)
                ids = kept.nonzero()[:, 1].to("cpu", torch.int32)
            else:
                counts, ids = torch.zeros(rows, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
            step.kept = (counts, ids, tok.cpu(), logp)
            return sampled, processed
        return forward

    def attach(self) -> "VllmRecorder":
        runner = self.runner
        try:
            self.set_attr(runner, "execute_model", self._execute_model(runner.execute_model),
                          f"{type(runner).__name__}.execute_model")
            self.set_attr(runner, "_model_forward", self._model_forward(runner._model_forward),
                          f"{type(runner).__name__}._model_forward")
            if self.record_routes:
                for index, (layer, _, router) in enumerate(self.routers):
                    self.set_attr(router, "capture_fn", self._capture(index, router.capture_fn),
                                  f"router of layer {layer}.capture_fn")
            tts = runner.sampler.topk_topp_sampler
            self.set_attr(tts, "forward", self._sampler(tts.forward), f"{type(tts).__name__}.forward")
            self.add_callback(self._restore_generators, "per-request generators of discarded rows")
        except BaseException:
            self.undo()
            raise
        return self

    # ---------------------------------------------------------------- assembly
    def _flat(self):
        """All captured rows: request index, position, input token, routes; and the sampler rows."""
        names: dict[str, int] = {}
        rr, rp, rt, routes = [], [], [], []
        kr, kp, kc, ki, ks, kl = [], [], [], [], [], []
        for step in self.steps:
            index = torch.tensor([names.setdefault(r, len(names)) for r in step.req_ids], dtype=torch.int64)
            per_row = step.query_start_loc.diff()
            rr.append(torch.repeat_interleave(index, per_row))
            rp.append(step.positions)
            rt.append(step.input_ids)
            if self.record_routes:
                missing = [self.routers[i][0] for i, r in enumerate(step.routes) if r is None]
                if missing:
                    raise ReplayError(f"a vLLM step ran without a router call in layers {missing}")
                routes.append(torch.stack(step.routes, dim=1))          # [tokens, layers, k]
            if step.kept is not None:
                counts, ids, tok, logp = step.kept
                kr.append(index)
                kp.append(step.positions[step.query_start_loc[1:] - 1] + 1)   # the position each row samples
                kc.append(counts)
                ki.append(ids)
                ks.append(tok)
                kl.append(logp)
        cat = (lambda xs, dtype: torch.cat(xs) if xs else torch.zeros(0, dtype=dtype))
        rows = (cat(rr, torch.int64), cat(rp, torch.int64), cat(rt, torch.int64),
                torch.cat(routes) if routes else None)
        counts = cat(kc, torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        sampler = (cat(kr, torch.int64), cat(kp, torch.int64), offsets, cat(ki, torch.int32), cat(ks, torch.int64),
                   cat(kl, torch.float32))
        return names, rows, sampler


# --------------------------------------------------------------------------------------------------
# patches in the workers (any TP size; in-process too): vLLM's collective_rpc runs these in each worker
# --------------------------------------------------------------------------------------------------

_WORKER_HANDLES: dict[str, PatchHandle] = {}   # in each worker process: the handles attached there, by key


def worker_runner(worker):
    """(In a worker) its checked V1 model runner (for moealign's ``collective_rpc`` functions)."""
    return _checked_runner(require_attr(worker, "model_runner", f"vLLM's {type(worker).__name__}"))




def _rpc_attach(worker, key: str, build, args: tuple) -> bool:
    if key in _WORKER_HANDLES:
        raise EngineError(f"a moealign patch {key!r} is already attached in this worker")
    _WORKER_HANDLES[key] = build(worker_runner(worker), *args)
    return True


def _rpc_detach(worker, key: str, read, args: tuple, keep: bool):
    """Undo this worker's handle; return ``read(handle, *args)`` first (``keep=False``: only undo)."""
    handle = _WORKER_HANDLES.pop(key, None)
    if handle is None:
        return None
    try:
        return read(handle, *args) if keep else None
    finally:
        handle.undo()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _agreed(per_rank: list, what: str, error_cls=None):
    """Rank 0's result, after checking every rank returned the same (``error_cls``: :class:`ReplayError`)."""
    for rank, other in enumerate(per_rank[1:], start=1):
        if not _same(other, per_rank[0]):
            raise (error_cls or ReplayError)(f"vLLM TP rank {rank} {what} than rank 0")
    return per_rank[0]


class InWorkers:
    """A patch built in every worker of ``llm`` (``build(runner, *build_args)`` returns an attached
    :class:`~moealign.handle.PatchHandle`; the model may live in vLLM's worker processes at TP > 1, or in this
    process), read on exit (``read(handle, *read_args)``) and undone there, also on an exception. ``per_rank``
    holds each worker's reading; with ``agree`` (a phrase naming what must match), ``result`` is rank 0's after
    checking every rank read the same. ``build`` and ``read`` are module-level functions (they are sent to the
    workers)."""

    def __init__(self, llm, build, build_args: tuple, read, read_args: tuple = (), *, agree: str | None = None):
        import uuid

        self.llm, self.key = llm, uuid.uuid4().hex
        self.build, self.build_args, self.read, self.read_args, self.agree = build, build_args, read, read_args, agree
        self.per_rank: list | None = None
        self.result = None

    def _detach(self, keep: bool) -> list:
        return self.llm.collective_rpc(_rpc_detach, args=(self.key, self.read, self.read_args, keep))

    def __enter__(self) -> "InWorkers":
        try:
            self.llm.collective_rpc(_rpc_attach, args=(self.key, self.build, self.build_args))
        except BaseException:
            self._detach(False)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        per_rank = self._detach(exc_type is None)
        if exc_type is not None:
            return
        if any(r is None for r in per_rank):
            raise EngineError(f"a vLLM worker lost its moealign patch (per rank: {[r is not None for r in per_rank]})")
        self.per_rank = per_rank
        if self.agree is not None:
            self.result = _agreed(per_rank, self.agree)


# --------------------------------------------------------------------------------------------------
# prefix caching: the routes of cached positions (scheduler side, this process)
# --------------------------------------------------------------------------------------------------


def prefix_caching_on(llm: Any) -> bool:
    """Whether ``llm`` reuses KV blocks across requests (vLLM's ``enable_prefix_caching``, on by default)."""
    return bool(getattr(llm.llm_engine.vllm_config.cache_config, "enable_prefix_caching", False))


def engine_scheduler(llm: Any):
    """The V1 scheduler of ``llm``'s engine core, which runs in this process (:func:`~.engine.open_llm`; any TP
    size); :class:`~moealign.errors.EngineError` when the engine core runs in another process."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    scheduler = getattr(getattr(client, "engine_core", None), "scheduler", None)
    if scheduler is None:
        raise EngineError("the vLLM engine core does not run in this process (no in-process scheduler): open the "
                          "LLM with moealign.patches.vllm.open_llm, or set VLLM_ENABLE_V1_MULTIPROCESSING=0 before "
                          "vLLM is imported, so that the routes of prefix-cached positions can be restored")
    return scheduler


class CachedPrefixRoutes(PatchHandle):
    """Which forward wrote each reusable KV block, and which blocks each request reused (scope ``"instance"``).

    Hooks, all on the scheduler side (once per block cached, evicted or looked up; never inside a forward):
    ``BlockPool.cache_full_blocks`` notes ``writer[block id] = (request id, block index, block hash)`` for the
    blocks a request's forward fills; ``BlockPool._remove_cached_block_hashes`` (eviction, vLLM's only way a hash
    leaves a block) and ``reset_prefix_cache`` drop the notes; ``KVCacheManager.get_computed_blocks`` keeps a cache
    hit only over the leading blocks that have a note whose hash and block index are the block's own (and, with
    ``admit(request, writers) -> blocks kept``, only as far as ``admit`` allows: the forcer's agreement check);
    the rest is recomputed. Where vLLM picks a block cached under a hash before the call (it returns the first block
    cached under a hash) and a later block under the same hash has a note, the noted block is reused instead. :attr:`hits` holds per request the writers ``(request id, block index)`` of the blocks
    its latest lookup reused; :attr:`clipped` counts the blocks vLLM found that were recomputed instead.
    ``evict=True``: on undo, the blocks written while attached leave the prefix cache (forced routes: KV computed
    under routes the model did not choose must not serve a later request).
    """

    def __init__(self, scheduler, *, admit=None, evict: bool = False):
        manager = require_attr(scheduler, "kv_cache_manager", "vLLM's scheduler")
        super().__init__(f"prefix-cache route map on {type(manager).__name__}", "instance")
        self.manager = manager
        self.pool = require_attr(manager, "block_pool", f"vLLM's {type(manager).__name__}")
        for name in ("get_computed_blocks", "create_kv_cache_blocks"):
            require_attr(manager, name, f"vLLM's {type(manager).__name__}")
        for name in ("cache_full_blocks", "_remove_cached_block_hashes", "reset_prefix_cache"):
            require_attr(self.pool, name, f"vLLM's {type(self.pool).__name__}")
        groups = manager.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise UnsupportedEngineError(f"the KV cache has {len(groups)} groups (a hybrid or sliding-window model): "
                                         f"routes of prefix-cached positions are restored for one full-attention "
                                         f"group only; open the LLM with enable_prefix_caching=False")
        single = manager.coordinator.single_type_managers[0]
        if type(single).__name__ != "FullAttentionManager":
            raise UnsupportedEngineError(f"the KV cache is managed by {type(single).__name__}, not full attention: "
                                         f"routes of prefix-cached positions cannot be restored; open the LLM with "
                                         f"enable_prefix_caching=False")
        self.block_size = int(single.block_size)
        if int(self.pool.hash_block_size) != self.block_size:
            raise UnsupportedEngineError(f"vLLM hashes {self.pool.hash_block_size}-token units of "
                                         f"{self.block_size}-token blocks (partial-block cache entries): routes of "
                                         f"prefix-cached positions cannot be restored; open the LLM with "
                                         f"enable_prefix_caching=False")
        if getattr(scheduler, "connector", None) is not None:
            raise UnsupportedEngineError("a KV connector is configured: KV loaded from outside carries no routes; "
                                         "open the LLM without it or with enable_prefix_caching=False")
        self.admit = admit
        self.evict = evict
        self.written: set[int] = set()          # every block id noted while attached (evict=True)
        self.writer: dict[int, tuple[str, int, Any]] = {}
        self.noted: dict[Any, int] = {}         # block hash -> the block id last noted under it
        self.hits: dict[str, list[tuple[str, int]]] = {}
        self.clipped = 0
        self.evicted = 0

    # ---------------------------------------------------------------- hooks
    def _cache_full_blocks(self, original):
        def cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs):
            out = original(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
            for i in range(num_cached_blocks, num_full_blocks):
                block = blocks[i]
                if not block.is_null and block.block_hash is not None:
                    self.writer[block.block_id] = (request.request_id, i, block.block_hash)
                    self.noted[block.block_hash] = block.block_id
                    if self.evict:
                        self.written.add(block.block_id)
            return out
        return cache_full_blocks

    def _remove_hashes(self, original):
        def _remove_cached_block_hashes(block):
            note = self.writer.pop(block.block_id, None)
            if note is not None:
                self.evicted += 1
                if self.noted.get(note[2]) == block.block_id:
                    del self.noted[note[2]]
            return original(block)
        return _remove_cached_block_hashes

    def _reset(self, original):
        def reset_prefix_cache(*args, **kwargs):
            done = original(*args, **kwargs)
            if done:
                self.evicted += len(self.writer)
                self.writer.clear()
                self.noted.clear()
            return done
        return reset_prefix_cache

    def _lookup(self, original):
        manager, size = self.manager, self.block_size

        def get_computed_blocks(request):
            blocks, num_tokens, *rest = original(request)
            found = num_tokens // size if num_tokens > 0 else 0
            writers: list[tuple[str, int]] = []
            group = list(blocks.blocks[0]) if found else []
            swapped = False
            for j in range(found):
                block = group[j]
                note = self.writer.get(block.block_id)
                if note is None or note[2] != block.block_hash:
                    # vLLM picks the first block cached under a hash; a later copy under the same hash may be the
                    # one written while recording: reuse that one instead (the same tokens, a known writer)
                    other = self.noted.get(block.block_hash)
                    if other is None:
                        break
                    block, note = self.pool.blocks[other], self.writer[other]
                    group[j], swapped = block, True
                if note[1] != j or note[2] != block.block_hash:
                    break
                writers.append((note[0], j))
            if self.admit is not None:        # called on every lookup (it may note the request)
                writers = writers[:max(0, min(len(writers), int(self.admit(request, writers))))]
            self.hits[request.request_id] = writers
            if swapped or len(writers) < found or num_tokens != found * size:
                self.clipped += found - len(writers)
                keep = len(writers)
                blocks = manager.create_kv_cache_blocks((group[:keep],))
                num_tokens = keep * size
                rest = [0 for _ in rest]          # the shared-prefix boundary of sparse groups (none here)
            return (blocks, num_tokens, *rest)
        return get_computed_blocks

    def attach(self) -> "CachedPrefixRoutes":
        pool, manager = self.pool, self.manager
        try:
            self.set_attr(pool, "cache_full_blocks", self._cache_full_blocks(pool.cache_full_blocks),
                          f"{type(pool).__name__}.cache_full_blocks")
            self.set_attr(pool, "_remove_cached_block_hashes", self._remove_hashes(pool._remove_cached_block_hashes),
                          f"{type(pool).__name__}._remove_cached_block_hashes")
            self.set_attr(pool, "reset_prefix_cache", self._reset(pool.reset_prefix_cache),
                          f"{type(pool).__name__}.reset_prefix_cache")
            self.set_attr(manager, "get_computed_blocks", self._lookup(manager.get_computed_blocks),
                          f"{type(manager).__name__}.get_computed_blocks")
            if self.evict:
                self.add_callback(self._evict_written, "the blocks written while attached evicted from the cache")
        except BaseException:
            self.undo()
            raise
        return self

    def _evict_written(self) -> None:
        written, self.written = sorted(self.written), set()
        self.pool.evict_blocks(set(written))

    def cached_tokens(self) -> dict[str, int]:
        """Per request id, the prompt tokens its latest cache lookup reused."""
        return {rid: len(w) * self.block_size for rid, w in self.hits.items()}


def with_cached_rows(names: dict[str, int], rows: tuple, hits: dict[str, list[tuple[str, int]]],
                     block_size: int) -> tuple:
    """The recorder's rows ``(request index, position, input token, routes)`` plus one row per position a request
    reused from the prefix cache (``hits``: :attr:`CachedPrefixRoutes.hits`): the row its block's writer forwarded
    at that position (input token and routes), under the reusing request. The restored rows come last, so they are
    the latest rows of their positions (a request never forwards a position it reused)."""
    row_req, row_pos, row_tok, routes = rows
    dst_req, dst_block, src_req, src_block = [], [], [], []
    for rid, writers in hits.items():
        if not writers or rid not in names:
            continue
        for j, (wid, wj) in enumerate(writers):
            if wid not in names:
                raise ReplayError(f"vLLM request {rid} reused KV block {j} written by request {wid}, whose forward "
                                  f"the recorder did not see")
            dst_req.append(names[rid])
            dst_block.append(j)
            src_req.append(names[wid])
            src_block.append(wj)
    if not dst_req:
        return rows
    offsets = torch.arange(block_size)

    def expand(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).repeat_interleave(block_size)

    d_req, s_req = expand(dst_req), expand(src_req)
    d_pos = expand(dst_block) * block_size + offsets.repeat(len(dst_req))
    s_pos = expand(src_block) * block_size + offsets.repeat(len(src_req))
    stride = int(max(int(row_pos.max()) if row_pos.numel() else 0, int(s_pos.max()), int(d_pos.max()))) + 1
    source = latest_rows(row_req * stride + row_pos, s_req * stride + s_pos)
    if bool((source < 0).any()):
        k = int((source < 0).nonzero()[0, 0])
        name = {v: n for n, v in names.items()}
        raise ReplayError(f"vLLM request {name[int(d_req[k])]} reused position {int(d_pos[k])} from request "
                          f"{name[int(s_req[k])]}, which never forwarded position {int(s_pos[k])}")
    return (torch.cat([row_req, d_req]), torch.cat([row_pos, d_pos]), torch.cat([row_tok, row_tok[source]]),
            None if routes is None else torch.cat([routes, routes[source]]))


def _attach_recorder(runner, num_experts: int, record_routes: bool, record_kept_sets: bool) -> VllmRecorder:
    if getattr(runner, "use_async_scheduling", False):
        raise UnsupportedEngineError("async scheduling is on: recording reads the row map of each step as it runs "
                                     "(open the LLM with async_scheduling=False)")
    return VllmRecorder(runner, moe_routers(runner.model), num_experts, record_routes=record_routes,
                        record_kept_sets=record_kept_sets).attach()


def _read_recorder(recorder: VllmRecorder):
    return recorder._flat()


def latest_rows(keys: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """Per entry of ``wanted`` (positions), the index of the last row of ``keys`` equal to it (-1 if none)."""
    size = int(max(int(wanted.max()) if wanted.numel() else 0, int(keys.max()) if keys.numel() else 0)) + 1
    last = torch.full((size,), -1, dtype=torch.int64)
    if keys.numel():
        last.scatter_reduce_(0, keys, torch.arange(keys.numel()), "amax")
    return last[wanted]


def check_llm(llm) -> None:
    if getattr(llm, "llm_engine", None) is None:
        raise InputTypeError(f"llm must be a vllm.LLM, got {type(llm).__name__}")
    config = llm.llm_engine.vllm_config
    if getattr(config, "speculative_config", None) is not None:
        raise UnsupportedEngineError("speculative decoding is on: recording supports one sampled token per step")
    if getattr(config.scheduler_config, "async_scheduling", False):
        raise UnsupportedEngineError("async scheduling is on: recording reads the row map of each step as it runs "
                                     "(open the LLM with async_scheduling=False)")
    mode = getattr(llm.llm_engine.model_config, "logprobs_mode", None)
    if mode != "processed_logprobs":
        raise ConfigError(f"the LLM returns {mode!r} log-probs; a record states the processed log-probs (open it "
                          f"with logprobs_mode='processed_logprobs', as open_llm does)")


def _prompt_inputs(prompts, tokenizer, vocab_size: int) -> list:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise InputTypeError(f"prompts must be a non-empty list of strings or of token-id lists, got "
                             f"{type(prompts).__name__}")
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            for i, p in enumerate(prompts):
                if not p:
                    raise InputError(f"prompts[{i}] is empty")
            return list(prompts)
        prompts = [list(tokenizer(p)["input_ids"]) for p in prompts]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise InputTypeError(f"prompts[{i}] must be a token-id list (prompts are all strings or all token "
                                 f"lists), got {type(p).__name__}")
        if not p:
            raise InputError(f"prompts[{i}] is empty")
        for j, t in enumerate(p):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise InputError(f"prompts[{i}][{j}] = {t!r} is not a token id in [0, {vocab_size})")
        out.append({"prompt_token_ids": list(p)})
    return out


def generate_with_record(
    llm: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    sampling: SamplingParams,
    max_new_tokens: int,
    seed: int = 0,
    tokenizer: Any = None,
    record_routes: bool = True,
    record_kept_sets: bool = True,
    validate: bool = False,
    prompt_logprobs: bool = False,
) -> RolloutRecord:
    """Sample one response per prompt with the in-process ``vllm.LLM`` ``llm`` and return its
    :class:`~moealign.record.RolloutRecord` (the transformers adapter's format, ``meta.engine == "vllm"``).

    ``prompts``: strings (tokenized by vLLM, or by ``tokenizer`` when given: ``tokenizer(text)["input_ids"]``) or
    token-id lists. ``sampling``: the record's temperature / top-k / top-p / min-p, applied exactly (every other
    vLLM sampling option neutral; the checkpoint's generation config is not applied). Sample ``i`` is drawn with
    the per-request seed ``seed + i``, so a sample does not depend on its batch mates or on ``max_num_seqs``.
    A response ends at the model's EOS (included, as in the transformers record) or after ``max_new_tokens``.

    Per sample: ``logprobs`` are vLLM's processed log-probs of the sampled tokens; ``routes`` row ``i`` is the
    experts each MoE layer chose for input token ``i`` (prompt + response minus the last token); kept sets are
    the finite entries of the sampler's processed log-probs. Every capture is checked against the returned
    tokens (:class:`~moealign.errors.ReplayError` on a mismatch) and undone on return or on an exception.
    ``validate=True`` also runs the record's full validation (as the transformers adapter, off by default: it
    costs about 3% of a small CPU rollout; records read from files are always validated).
    ``prompt_logprobs=True``: vLLM also scores each prompt in its prefill (raw log-probs at temperature 1, vLLM's
    ``prompt_logprobs``; such requests never read the prefix cache) and ``(record, [float32 [prompt_len - 1]])`` is
    returned: per prompt, the log-prob of prompt token ``p`` for ``p = 1 ..`` (the refit certificate's probes: one
    call for the prefill and the decode probe).
    """
    if not isinstance(sampling, SamplingParams):
        raise InputTypeError(f"sampling must be a moealign.record.SamplingParams, got {type(sampling).__name__}")
    if sampling.temperature < VLLM_GREEDY_TEMPERATURE:
        raise ConfigError(f"sampling temperature {sampling.temperature} is below vLLM's greedy threshold "
                          f"{VLLM_GREEDY_TEMPERATURE}: vLLM would sample greedily, which the record cannot state")
    check_positive_int(max_new_tokens, "max_new_tokens", ConfigError)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63 - len(prompts or ()):
        raise ConfigError(f"seed must be an int in [0, 2**63 - len(prompts)), got {seed!r}")
    check_llm(llm)
    meta = _cached_meta(llm)
    inputs = _prompt_inputs(prompts, tokenizer, meta.vocab_size)

    from vllm import SamplingParams as VllmSamplingParams

    params = [VllmSamplingParams(n=1, temperature=float(sampling.temperature), top_k=int(sampling.top_k),
                                 top_p=float(sampling.top_p), min_p=float(sampling.min_p), max_tokens=max_new_tokens,
                                 seed=seed + i, logprobs=0, detokenize=False,
                                 **({"prompt_logprobs": 0} if prompt_logprobs else {}))
              for i in range(len(inputs))]
    cached = CachedPrefixRoutes(engine_scheduler(llm)).attach() if prefix_caching_on(llm) else None
    try:
        with InWorkers(llm, _attach_recorder, (meta.num_experts, record_routes, record_kept_sets), _read_recorder,
                       agree="recorded other rows / routes / kept sets") as recording:
            outputs = llm.generate(inputs, params, use_tqdm=False)
    finally:
        if cached is not None:
            cached.undo()
    if len(outputs) != len(inputs):
        raise EngineError(f"vLLM returned {len(outputs)} outputs for {len(inputs)} prompts")

    captured = recording.result
    if cached is not None:
        names, rows, sampler = captured
        captured = (names, with_cached_rows(names, rows, cached.hits, cached.block_size), sampler)
    samples = _assemble(outputs, captured, sampling, record_kept_sets)
    _check_and_compact(samples, meta)
    record = RolloutRecord(meta, samples, validate=validate)
    return (record, [_prompt_logprobs(out, b) for b, out in enumerate(outputs)]) if prompt_logprobs else record


def _prompt_logprobs(out, b: int) -> torch.Tensor:
    """vLLM's prompt log-probs of output ``out`` (prompt ``b``) as float32 ``[prompt_len - 1]`` (tokens 1 ..)."""
    tokens, plp = list(out.prompt_token_ids or []), out.prompt_logprobs
    if plp is None or len(plp) != len(tokens):
        raise EngineError(f"prompt {b}: vLLM returned {None if plp is None else len(plp)} prompt log-probs for "
                          f"{len(tokens)} tokens")
    values = []
    for p in range(1, len(tokens)):
        entry = plp[p]
        if entry is None or tokens[p] not in entry:
            raise EngineError(f"prompt {b}: no prompt log-prob for token {tokens[p]} at position {p}")
        values.append(entry[tokens[p]].logprob)
    return torch.tensor(values, dtype=torch.float32)


def _exclusive_cumsum(sizes: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]])


def _ranges(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, sizes)])`` without a Python loop."""
    total = int(sizes.sum())
    return torch.repeat_interleave(starts - _exclusive_cumsum(sizes), sizes) + torch.arange(total)


def _assemble(outputs, captured, sampling: SamplingParams, record_kept_sets: bool) -> list[Sample]:
    """The record's samples from vLLM's outputs and the recorder's rows: every sample's route rows and sampler rows
    found and checked against its tokens in a few whole-batch tensor operations (one Python pass over the outputs
    for their fields)."""
    names, (row_req, row_pos, row_tok, routes), (k_req, k_pos, k_off, k_ids, k_tok, k_lp) = captured
    internal: dict[str, str] = {}
    for name in names:
        internal.setdefault(name.rsplit("-", 1)[0], name)
    tokens, logprobs, reqs, labels, prompt_lens = [], [], [], [], []
    for b, out in enumerate(outputs):
        if len(out.outputs) != 1:
            raise EngineError(f"vLLM returned {len(out.outputs)} completions for prompt {b}")
        completion = out.outputs[0]
        prompt = list(out.prompt_token_ids or [])
        response = list(completion.token_ids)
        if not prompt or not response:
            raise EngineError(f"vLLM returned an empty prompt or response for prompt {b} "
                              f"({len(prompt)} prompt, {len(response)} response tokens)")
        if completion.logprobs is None or len(completion.logprobs) != len(response):
            raise EngineError(f"vLLM returned no log-prob per sampled token for prompt {b}")
        name = internal.get(str(out.request_id))
        if name is None:
            raise ReplayError(f"no engine step of request {out.request_id!r} (prompt {b}) was recorded")
        tokens.append(torch.tensor(prompt + response, dtype=torch.int64))
        logprobs.append(torch.tensor([step[t].logprob for step, t in zip(completion.logprobs, response)],
                                     dtype=torch.float32))
        reqs.append(names[name])
        labels.append(f"prompt {b} (vLLM request {name})")
        prompt_lens.append(len(prompt))
    n = len(tokens)
    if n == 0:
        return []
    Ls = torch.tensor([t.numel() for t in tokens], dtype=torch.int64)
    Ps = torch.tensor(prompt_lens, dtype=torch.int64)
    Rs = torch.tensor(reqs, dtype=torch.int64)
    all_lp = torch.cat(logprobs)
    finite = torch.isfinite(all_lp)
    if not bool(finite.all()):
        b = int(torch.searchsorted((Ls - Ps).cumsum(0), int((~finite).nonzero()[0, 0]), right=True))
        raise EngineError(f"vLLM returned a non-finite log-prob for a sampled token of prompt {b}: "
                          f"{logprobs[b].tolist()}")
    stride = int(Ls.max()) + 1
    length_of = torch.full((len(names),), -1, dtype=torch.int64)
    length_of[Rs] = Ls
    sample_of = torch.full((len(names),), -1, dtype=torch.int64)
    sample_of[Rs] = torch.arange(n)

    def sample_at(flat_index: int, sizes: torch.Tensor) -> tuple[int, int]:
        b = int(torch.searchsorted(sizes.cumsum(0), flat_index, right=True))
        return b, flat_index - int(sizes[:b].sum())

    sample_routes: list = [None] * n
    if routes is not None:
        mine = (length_of[row_req] >= 0).nonzero().flatten()          # rows of the returned requests
        req, pos = row_req[mine], row_pos[mine]
        bad = (pos >= length_of[req] - 1) | (pos < 0)
        if bool(bad.any()):
            b = int(sample_of[req[int(bad.nonzero()[0, 0])]])
            raise ReplayError(f"{labels[b]}: the forward saw position {int(pos[req == Rs[b]].max())} of a sample of "
                              f"{int(Ls[b])} tokens (the last sampled token is never forwarded)")
        sizes = Ls - 1
        wanted = torch.repeat_interleave(Rs * stride, sizes) + _ranges(torch.zeros(n, dtype=torch.int64), sizes)
        last = latest_rows(req * stride + pos, wanted)
        if bool((last < 0).any()):
            b, gap = sample_at(int((last < 0).nonzero()[0, 0]), sizes)
            raise ReplayError(f"{labels[b]}: no route was recorded for position {gap} (a prefix-cache hit whose rows "
                              f"were not restored, or a step the recorder did not see)")
        rows = mine[last]
        seen, expected = row_tok[rows], torch.cat([t[:-1] for t in tokens])
        if not torch.equal(seen, expected):
            k = int((seen != expected).nonzero()[0, 0])
            b, p = sample_at(k, sizes)
            raise ReplayError(f"{labels[b]}: the forward's input at position {p} was token {int(seen[k])}, the "
                              f"record's token is {int(expected[k])}: the row map is wrong")
        sample_routes = list(routes[rows].split(sizes.tolist()))   # validated and compacted below

    sizes = Ls - Ps
    mine = (length_of[k_req] >= 0).nonzero().flatten()
    wanted = torch.repeat_interleave(Rs * stride, sizes) + _ranges(Ps, sizes)
    last = latest_rows(k_req[mine] * stride + k_pos[mine], wanted)
    if bool((last < 0).any()):
        b, gap = sample_at(int((last < 0).nonzero()[0, 0]), sizes)
        raise ReplayError(f"{labels[b]}: no sampler row was recorded for response position {gap}")
    rows = mine[last]
    responses = torch.cat([t[p:] for t, p in zip(tokens, prompt_lens)])
    if not torch.equal(k_tok[rows], responses):
        k = int((k_tok[rows] != responses).nonzero()[0, 0])
        b, j = sample_at(k, sizes)
        raise ReplayError(f"{labels[b]}: the sampler row of response position {j} sampled token "
                          f"{int(k_tok[rows][k])}, vLLM returned {int(responses[k])}: the row map is wrong")
    gaps = (k_lp[rows] - all_lp).abs()
    if not bool((gaps <= 1e-6).all()):
        b, _ = sample_at(int((~(gaps <= 1e-6)).nonzero()[0, 0]), sizes)
        worst = float(gaps[int(_exclusive_cumsum(sizes)[b]):int(sizes[:b + 1].sum())].max())
        raise ReplayError(f"{labels[b]}: vLLM's returned log-probs differ from the sampler's by up to {worst}")
    kept = [(None, None)] * n
    if record_kept_sets:
        counts = k_off[rows + 1] - k_off[rows]
        ids = k_ids[_ranges(k_off[rows], counts)]
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])[sizes.cumsum(0)]
        totals = bounds.diff(prepend=torch.zeros(1, dtype=torch.int64)).tolist()
        kept = [(torch.cat([torch.zeros(1, dtype=torch.int64), c.cumsum(0)]), i)
                for c, i in zip(counts.split(sizes.tolist()), ids.split(totals))]
    return [Sample(token_ids=t, prompt_len=p, logprobs=lp, routes=r, kept_offsets=ko, kept_ids=ki, sampling=sampling)
            for t, p, lp, r, (ko, ki) in zip(tokens, prompt_lens, logprobs, sample_routes, kept)]


def _check_and_compact(samples: list[Sample], meta: RecordMeta) -> None:
    """One pass over every sample (not one per sample): route ids in range and distinct, compacted to the
    record's route dtype. Kept sets need no second check here: each is the finite entries of the sampler's
    processed log-probs, and :func:`_assemble` checked that the sampler drew the returned token with a finite
    log-prob equal to vLLM's, so the token lies in its kept set by construction (``validate=True`` re-checks)."""
    if samples and samples[0].routes is not None:
        sizes = [s.routes.shape[0] for s in samples]
        for s, r in zip(samples, compact_routes(torch.cat([s.routes for s in samples]), meta.num_experts).split(sizes)):
            s.routes = r
