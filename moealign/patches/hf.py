"""transformers adapter: record routes and kept sets during ``generate()``, replay routes in training.

Patches touch one given model *instance*, never classes, and are reversible (context managers that
restore the instance on exit; ``undo()`` for manual use)::

    from moealign.patches import hf

    record = hf.generate_with_record(model, input_ids, attention_mask, sampling=SamplingParams(top_p=0.9),
                                     max_new_tokens=64)           # routes + kept sets + log-probs
    batch = record.to_padded("right")
    with hf.replay_routing(model) as replay:
        replay.set_targets(*record.routes_int64("padded"))
        out = model(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        replay.check(forwards=1)                                  # every MoE layer consumed its rows

Supported families (a small registry, :func:`register_family` adds more): Qwen2-MoE, Qwen3-MoE,
Mixtral, OLMoE (transformers 5.x, where each sparse block's ``.gate`` is a ``*TopKRouter`` module
returning ``(router_logits, router_scores, router_indices)``).

Replay recomputes the gate weights from the trainer's own router logits for the forced ids, exactly as
the family's router does (:func:`moealign.routing_replay.replay_gate_weights`), so the router keeps its
gradient; the auxiliary load-balancing loss is recomputed from the replayed choices.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from ..record import (RecordMeta, RolloutRecord, Sample, SamplingParams, config_fingerprint, router_samples,
                      router_signature)
from ..routing_replay.gates import (
    RouterScoring,
    load_balancing_loss,
    replay_gate_weights,
    replay_recorded_gate_weights,
    select_topk,
)
from ..routing_replay.routes import RouteError, compact_routes, validate_routes
from ._version import UnsupportedEngineError, check_engine_version, engine_version

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

SUPPORTED_TRANSFORMERS = ">=5.0,<6"


class UnsupportedModelError(UnsupportedEngineError):
    """The model is not a transformers MoE family this adapter knows (or its routers are not where expected)."""


class ReplayError(RuntimeError):
    """Replay would not apply as asked: rows missing or extra, a layer not consuming its targets."""


# --------------------------------------------------------------------------------------------------
# family registry
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEFamily:
    """How one transformers MoE family routes.

    ``router_class``: class name of the router module (``.gate`` of each sparse block).
    ``scoring(config)``: the :class:`RouterScoring` of its router.
    ``scores_in_fp32``: the router returns its gate weights in float32 (Mixtral) instead of the logits dtype.
    ``num_experts(config)``: number of routed experts.
    """

    model_type: str
    router_class: str
    scoring: Callable[[object], RouterScoring]
    num_experts: Callable[[object], int]
    scores_in_fp32: bool = False


FAMILIES: dict[str, MoEFamily] = {}


def register_family(family: MoEFamily, *, overwrite: bool = False) -> None:
    if family.model_type in FAMILIES and not overwrite:
        raise ValueError(f"MoE family {family.model_type!r} is already registered (pass overwrite=True)")
    FAMILIES[family.model_type] = family


def _norm_topk(config) -> RouterScoring:
    return RouterScoring(score="softmax", renormalize=bool(getattr(config, "norm_topk_prob", False)))


register_family(MoEFamily("qwen2_moe", "Qwen2MoeTopKRouter", _norm_topk, lambda c: c.num_experts))
register_family(MoEFamily("qwen3_moe", "Qwen3MoeTopKRouter", _norm_topk, lambda c: c.num_experts))
register_family(MoEFamily("olmoe", "OlmoeTopKRouter", _norm_topk, lambda c: c.num_experts))
register_family(MoEFamily("mixtral", "MixtralTopKRouter", lambda c: RouterScoring(score="softmax", renormalize=True),
                          lambda c: c.num_local_experts, scores_in_fp32=True))


# --------------------------------------------------------------------------------------------------
# model description
# --------------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class MoEModelInfo:
    family: MoEFamily
    routers: tuple[tuple[int, torch.nn.Module], ...]   # (decoder layer number, router module), ascending
    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    scoring: RouterScoring
    transformers_version: str

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.routers)


def _transformers_version() -> str:
    _, version = engine_version("transformers", "moealign.patches.hf needs transformers")
    check_engine_version("transformers", version, SUPPORTED_TRANSFORMERS)
    return str(version)


def describe_model(model: torch.nn.Module) -> MoEModelInfo:
    """Find the family and the live routers of ``model`` (by decoder layer number); raise if unknown."""
    version = _transformers_version()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not a MoE family moealign.patches.hf knows "
                                    f"(known: {sorted(FAMILIES)}); register one with register_family()")
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__ != family.router_class:
            continue
        match = _LAYER_RE.search(name + ".")
        if match is None:
            raise UnsupportedModelError(f"router {name!r} is not under a 'layers.<n>.' module; cannot tell its layer")
        for attr in ("weight", "top_k", "hidden_dim"):
            if not hasattr(module, attr):
                raise UnsupportedModelError(f"{family.router_class} at {name!r} has no {attr!r}: this transformers "
                                            f"version's router differs from the one the adapter targets")
        routers.append((int(match.group(1)), module))
    if not routers:
        raise UnsupportedModelError(f"no {family.router_class} modules found in this {model_type} model")
    routers.sort(key=lambda item: item[0])
    layers = [layer for layer, _ in routers]
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(f"several routers share a decoder layer number: {layers}")
    top_k = {int(m.top_k) for _, m in routers}
    if len(top_k) != 1:
        raise UnsupportedModelError(f"routers disagree on top_k: {sorted(top_k)}")
    return MoEModelInfo(
        family=family,
        routers=tuple(routers),
        num_layers=int(config.num_hidden_layers),
        num_experts=int(family.num_experts(config)),
        top_k=top_k.pop(),
        vocab_size=int(config.vocab_size),
        scoring=family.scoring(config),
        transformers_version=version,
    )


def record_meta(model: torch.nn.Module, *, engine: str = "transformers", info: MoEModelInfo | None = None) -> RecordMeta:
    """The :class:`RecordMeta` of ``model`` (fingerprint from its config and router weights)."""
    info = info or describe_model(model)
    config = model.config.to_dict()
    dtype = next(model.parameters()).dtype
    return RecordMeta(
        engine=engine,
        engine_version=info.transformers_version,
        model_fingerprint=config_fingerprint(config),
        num_layers=info.num_layers,
        moe_layers=info.moe_layers,
        num_experts=info.num_experts,
        top_k=info.top_k,
        vocab_size=info.vocab_size,
        dtype=str(dtype).replace("torch.", ""),
        router_signature=router_signature(m.weight for _, m in info.routers),
        router_samples=router_samples(m.weight for _, m in info.routers),
        model_name=str(getattr(model.config, "_name_or_path", "") or ""),
    )


# --------------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------------


class RouteCapture:
    """Router decisions seen through forward hooks: ``calls[i]`` is the list of ``[rows, k]`` int64 ids
    of MoE layer ``i`` (index into ``info.moe_layers``), one entry per router call."""

    def __init__(self, info: MoEModelInfo, keep_logits: bool = False):
        self.info = info
        self.keep_logits = keep_logits
        self.calls: list[list[torch.Tensor]] = [[] for _ in info.routers]
        self.logits: list[list[torch.Tensor]] = [[] for _ in info.routers]
        self._handles = []

    def _hook(self, index: int):
        def hook(module, args, output):
            self.calls[index].append(output[2].detach())
            if self.keep_logits:
                self.logits[index].append(output[0].detach())
        return hook

    def attach(self) -> "RouteCapture":
        for index, (_, module) in enumerate(self.info.routers):
            self._handles.append(module.register_forward_hook(self._hook(index)))
        return self

    def undo(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def clear(self) -> None:
        for lst in self.calls + self.logits:
            lst.clear()

    @property
    def num_calls(self) -> list[int]:
        return [len(c) for c in self.calls]

    def last_forward(self) -> torch.Tensor:
        """Routes of the most recent forward as ``[rows, n_layers, k]`` int64."""
        if not all(self.calls):
            raise ReplayError(f"no router call recorded in some layers (calls per layer: {self.num_calls})")
        rows = {c[-1].shape[0] for c in self.calls}
        if len(rows) != 1:
            raise ReplayError(f"MoE layers saw different row counts in the last forward: {sorted(rows)}")
        return torch.stack([c[-1] for c in self.calls], dim=1)


@contextlib.contextmanager
def capture_routes(model: torch.nn.Module, *, keep_logits: bool = False,
                   info: MoEModelInfo | None = None) -> Iterator[RouteCapture]:
    """Record every router decision of ``model`` while the block runs (hooks removed on exit)."""
    capture = RouteCapture(info or describe_model(model), keep_logits).attach()
    try:
        yield capture
    finally:
        capture.undo()


# kept-set masks buffered before one nonzero() turns them into ids (bounded memory for large vocabularies)
KEPT_SET_FLUSH_BYTES = 64 << 20


class _KeptSetCapture:
    """The last logits processor of ``generate()``: sees the processed scores sampling uses.

    It keeps each step's processed scores (a reference: transformers does not modify them after the
    processors) and, in chunks bounded by ``flush_bytes``, turns them into the kept sets (finite entries)
    and the sampled tokens' log-probs (``log_softmax(scores)[token]``), once the tokens are known. Per
    step the capture costs one list append; the work is a few large vector ops per chunk.
    """

    def __init__(self, prompt_width: int, flush_bytes: int = 64 << 20):
        self.prompt_width = prompt_width
        self.flush_bytes = flush_bytes
        self.steps = 0
        self.logprobs: list[torch.Tensor] = []             # per chunk [B, S_c]
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []   # (counts [B, S_c], ids int32 b-major)
        self._pending: list[torch.Tensor] = []             # per step float32 [B, V], not yet flushed
        self._flushed = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        if step != self.steps:
            raise ReplayError(f"kept-set capture saw step {step} after {self.steps} steps: generate() "
                              f"did not call the logits processors once per token")
        if self._pending and len(self._pending) * self._pending[0].numel() * 4 >= self.flush_bytes:
            self._flush(input_ids)   # the tokens of every pending step are in input_ids now
        self._pending.append(scores.to(torch.float32))
        self.steps += 1
        return scores

    def _flush(self, tokens: torch.Tensor) -> None:
        if not self._pending:
            return
        scores = torch.stack(self._pending, dim=1)                        # [B, S_c, V]
        lo = self.prompt_width + self._flushed
        sampled = tokens[:, lo:lo + scores.shape[1]].to(scores.device)    # [B, S_c]
        # log_softmax over the whole (processed) vocabulary row: the reduction length is V whatever the
        # kept set's size, so a trainer computing the same log_softmax on its own logits (kept set
        # applied as -inf) gets the same bits from the same logits (a fixed tree under batch_invariant_mode)
        logp = torch.log_softmax(scores, dim=-1)
        self.logprobs.append(logp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1))
        kept = scores > float("-inf")
        self.chunks.append((kept.sum(dim=-1), kept.nonzero()[:, 2].to(torch.int32)))
        self._flushed += scores.shape[1]
        self._pending = []

    def finish(self, sequences: torch.Tensor) -> None:
        self._flush(sequences)

    def kept_sets(self, resp_lens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample, the CSR kept sets of its first ``resp_lens[b]`` steps."""
        chunks = [(c.cpu(), ids.cpu()) for c, ids in self.chunks]
        starts = [torch.cat([torch.zeros(1, dtype=torch.int64), c.sum(1).cumsum(0)]) for c, _ in chunks]
        out = []
        for b, R in enumerate(resp_lens):
            counts, ids, step0 = [], [], 0
            for (c, chunk_ids), start in zip(chunks, starts):
                n = max(0, min(c.shape[1], R - step0))
                if n:
                    counts.append(c[b, :n])
                    lo = int(start[b])
                    ids.append(chunk_ids[lo:lo + int(c[b, :n].sum())])
                step0 += c.shape[1]
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(counts).cumsum(0)])
            out.append((offsets, torch.cat(ids)))
        return out


@contextlib.contextmanager
def _append_logits_processor(model, processor) -> Iterator[None]:
    """Make ``processor`` the last logits processor of ``model.generate`` (instance-level, undone on exit)."""
    original = type(model)._get_logits_processor

    def _get_logits_processor(*args, **kwargs):
        processors = original(model, *args, **kwargs)
        processors.append(processor)
        return processors

    model._get_logits_processor = _get_logits_processor
    try:
        yield
    finally:
        del model._get_logits_processor


def _response_lengths(generated: torch.Tensor, eos_ids: Sequence[int]) -> list[int]:
    if not eos_ids:
        return [generated.shape[1]] * generated.shape[0]
    is_eos = torch.isin(generated, torch.tensor(list(eos_ids), device=generated.device))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], generated.shape[1], dtype=torch.long))
    return [int(x) for x in first]


def generate_with_record(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 64,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    record_routes: bool = True,
    record_kept_sets: bool = True,
    seed: int | None = None,
    engine: str = "transformers",
    validate: bool = False,
) -> RolloutRecord:
    """Sample with ``model.generate()`` and return a :class:`RolloutRecord`.

    ``input_ids`` / ``attention_mask`` are a left-padded prompt batch (pad positions are dropped from
    the record). Log-probs and kept sets come from the processed scores sampling used (after
    temperature, top-k, top-p, min-p and any other processor of the generation config); routes from
    the prefill and every decode step.
    """
    info = describe_model(model)
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         f"must both be [batch, prompt_len]")
    am = attention_mask.to(torch.int64)
    if bool((am.sum(1) == 0).any()):
        raise ValueError(f"prompt rows {(am.sum(1) == 0).nonzero().flatten().tolist()} are empty")
    if not bool((am[:, 1:] >= am[:, :-1]).all()):
        raise ValueError("prompts must be left-padded (attention_mask zeros then ones in every row); "
                         "set tokenizer.padding_side = 'left'")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    gen_cfg = model.generation_config
    if eos_token_id is None:
        eos_token_id = gen_cfg.eos_token_id
    eos_ids = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if pad_token_id is None:
        pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)

    S0 = input_ids.shape[1]
    kept = _KeptSetCapture(S0, KEPT_SET_FLUSH_BYTES)
    if seed is not None:
        torch.manual_seed(seed)
    with contextlib.ExitStack() as stack:
        capture = stack.enter_context(capture_routes(model, info=info)) if record_routes else None
        stack.enter_context(_append_logits_processor(model, kept))
        with torch.no_grad():
            sequences = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                min_p=sampling.min_p if sampling.min_p > 0 else None, max_new_tokens=max_new_tokens,
                eos_token_id=eos_ids or None, pad_token_id=pad_token_id, use_cache=True,
                return_dict_in_generate=False)
    kept.finish(sequences)
    generated = sequences[:, S0:]
    steps = generated.shape[1]
    if kept.steps != steps or sum(lp.shape[1] for lp in kept.logprobs) != steps:
        raise ReplayError(f"kept-set capture saw {kept.steps} steps for {steps} generated tokens")
    resp_lens = _response_lengths(generated, eos_ids)

    routes_bt = None
    if capture is not None:
        if any(n != steps for n in capture.num_calls):
            raise ReplayError(f"expected {steps} router calls per MoE layer (prefill + {steps - 1} decode steps), "
                              f"saw {capture.num_calls}")
        B = input_ids.shape[0]
        per_layer = []
        for calls in capture.calls:
            prefill = calls[0].reshape(B, S0, -1)
            decode = [c.reshape(B, 1, -1) for c in calls[1:]]
            per_layer.append(torch.cat([prefill] + decode, dim=1))   # [B, S0 + steps - 1, k]
        routes_bt = compact_routes(torch.stack(per_layer, dim=2), info.num_experts).cpu()  # [B, S0+steps-1, n, k]

    logprobs = torch.cat(kept.logprobs, dim=1).cpu()                  # [B, steps]
    kept_sets = kept.kept_sets(resp_lens) if record_kept_sets else None

    meta = record_meta(model, engine=engine, info=info)
    samples = []
    am_cpu, seq_cpu = am.cpu(), sequences.cpu()
    for b in range(input_ids.shape[0]):
        R = resp_lens[b]
        prompt = seq_cpu[b, :S0][am_cpu[b].bool()]
        token_ids = torch.cat([prompt, seq_cpu[b, S0:S0 + R]])
        routes = None
        if routes_bt is not None:
            valid = torch.cat([am_cpu[b].bool(), torch.ones(R - 1, dtype=torch.bool)])
            routes = routes_bt[b, :S0 + R - 1][valid]   # validated and compacted once above
        kept_offsets, kept_ids = kept_sets[b] if kept_sets is not None else (None, None)
        samples.append(Sample(token_ids=token_ids, prompt_len=int(prompt.numel()), logprobs=logprobs[b, :R].clone(),
                              routes=routes, kept_offsets=kept_offsets, kept_ids=kept_ids, sampling=sampling))
    # built by construction from what generate() did; RolloutRecord.validate() (also run by save/load
    # round trips and by the tests) checks the same invariants at a cost of ~1% of a generate() call
    return RolloutRecord(meta, samples, validate=validate)


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
