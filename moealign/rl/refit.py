"""The refit as users' own RL loops call it: the trainer's weights into a running vLLM engine, then the proof.

::

    from moealign.rl import refit, verify_refit

    refit(llm, trainer)                       # a moealign train engine, a Megatron GPTModel (+ hf_config) or a
    check = verify_refit(llm, trainer)        # transformers model; check.ok / check.check() / check.to_dict()

Both compare the trainer's config with the engine's first (:func:`architecture_differences`: every field that
changes a shape or the forward, the RoPE settings included; :func:`refit` refuses, :func:`verify_refit` fails).
:func:`refit` streams the trainer's tensors in transformers names (Megatron's ``GPTModel`` converted group by group
with :func:`~moealign.patches.megatron.checkpoint.iter_hf_tensors_from_megatron`, the inverse of the conversion the
trainer was built with) into every vLLM worker in place (:func:`moealign.patches.vllm.refit.refit_weights`: the
manifest checked against the engine's checkpoint first, then every value (finite, within the engine's dtype) before
the first byte moves; one refit per engine at a time; vLLM's CPU-build trap fixed, prefix / KV cache reset).

:func:`verify_refit` proves the engine now runs the trainer's weights: per (tensor, worker) digests of what every
worker holds, read back through vLLM's packing (:func:`~moealign.patches.vllm.refit.verify_weights`), and, with a
:class:`Probe`, a probe forward: vLLM scores the probe sequences with its own routing (captured), the trainer scores
them replaying those routes, and the mean |Δ log p| over the probe tokens must stay within the probe's bound
(``factor`` = 8 times the step-0 value on identical weights: :meth:`Probe.calibrate`). The mean, not the largest: with a
bf16 rollout against an fp32 trainer the largest per-token gap of a 16-token probe swings several-fold from step to
step with the weights' rounding (measured 0.02-0.19 nats on the embedded model), the mean far less; a wrong model
is off by nats on average (vLLM's stock reload on the CPU build: 4-7), an exact refit by the precision gap. The
probe scores prefills; calibrated with a decode (:meth:`Probe.calibrate`, wherever the engine has prefix caching
off) it also decodes ``decode_tokens`` tokens from each sequence with vLLM's own sampler and a fixed seed
(:meth:`Probe.decode_gaps`: routes recorded, the trainer teacher-forced replaying them, the same kind of bound), so a
fault on the decode path alone is caught. Tensors the engine derives from the weights at load (the family's
``derived_tensors``: DeepSeek-V3's MLA ``W_UK_T`` / ``W_UV``, which vLLM's decode path reads instead of
``kv_b_proj``) are recomputed in every worker from what it holds, as vLLM derives them, and compared bitwise
(:func:`~moealign.patches.vllm.refit.check_derived_tensors`; no round trip for a family that derives nothing).
Prefix-cache reuse and derived buffers (RoPE caches) are checked by :func:`moealign.rl.certify_refit`; what a
:class:`RefitCheck` did not check it says (``not_checked``).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..errors import ConfigError, InputTypeError, RefitError
from ..record import RolloutRecord, Sample, SamplingParams
from .trainer_state import (ARCHITECTURE_FIELDS, FORWARD_FIELDS, architecture_differences, comparable_config,
                            comparable_fields, is_sharded_trainer, trainer_config, trainer_tensors)

__all__ = ["Probe", "RefitCheck", "trainer_tensors", "trainer_config", "refit", "verify_refit",
           "check_same_architecture", "architecture_differences", "comparable_config", "comparable_fields",
           "ARCHITECTURE_FIELDS", "FORWARD_FIELDS", "NOT_CHECKED", "NOT_CHECKED_DECODE"]

#: The decode path, unchecked (no decode probe ran).
NOT_CHECKED_DECODE = "decode path (the probe scores prompts in one prefill; no token is decoded)"
#: What :func:`verify_refit` does not check (stated in every :class:`RefitCheck`; ``certify_refit`` covers the
#: decode path, the prefix cache and the RoPE buffers: :mod:`moealign.rl.certify`).
NOT_CHECKED = (NOT_CHECKED_DECODE,
               "prefix / KV cache reuse (reset by the refit; not exercised by the probe: moealign.rl.certify_refit)",
               "non-weight buffers such as the RoPE cos/sin cache (their config fields are compared instead; "
               "moealign.rl.certify_refit recomputes them)",
               "sampling (temperature, top-k / top-p, logits processors)")


def check_same_architecture(llm, hf_config) -> None:
    """Refuse (:class:`~moealign.errors.RefitError`) a trainer whose config differs from the engine's in a field that
    changes a tensor's shape or the forward (:func:`architecture_differences`), naming each field."""
    from ..patches.vllm.refit import as_llm

    differ = architecture_differences(as_llm(llm).llm_engine.model_config.hf_config, hf_config)
    if differ:
        raise RefitError("refit refused before any weight moved: the trainer's config differs from the engine's in "
                         "fields that change the forward (equal tensors would give other logits): " + "; ".join(differ))


def _snapshot(trainer: Mapping) -> dict[str, torch.Tensor]:
    snapshot = dict(trainer.items())
    if not snapshot:
        raise ConfigError("refit: the snapshot mapping is empty")
    for name, tensor in snapshot.items():
        if not isinstance(name, str):
            raise InputTypeError(f"refit snapshot: names must be strings, got {type(name).__name__} {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise InputTypeError(f"refit snapshot: {name!r} is a {type(tensor).__name__}, not a tensor")
    return snapshot


def refit(llm, trainer, hf_config=None, *, chunk_bytes: int | None = None):
    """Push the trainer's weights into every worker of ``llm`` in place; returns
    :class:`~moealign.patches.vllm.refit.RefitResult`. ``trainer`` may also be a snapshot (a mapping of transformers
    names to tensors, e.g. the weights of N steps earlier; with ``hf_config`` its config is compared too) or a
    :class:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer` (the tensors stream from its ranks, a chunk
    at a time, each rank writing its pieces into place; every rank checks its values first: :func:`_refit_sharded`).

    Refused before any tensor moves (:class:`~moealign.errors.RefitError` naming the problem): a config field that
    changes the forward differs from the engine's (:func:`check_same_architecture`), the checkpoint layout differs,
    a value is not a tensor / is a meta tensor / NaN / Inf / overflows the engine's dtype (the whole stream is read
    once and checked before the first byte moves, then streamed), another refit of the same engine is under way, the
    engine was shut down."""
    from ..patches.vllm import refit as vr

    llm = vr.as_llm(llm)
    layout = vr.checkpoint_layout(vr.engine_model_path(llm))
    config = trainer_config(trainer, hf_config)
    if config is not None:
        check_same_architecture(llm, config)
    if is_sharded_trainer(trainer):
        return _refit_sharded(llm, trainer, layout, vr.CHUNK_BYTES if chunk_bytes is None else chunk_bytes)
    if isinstance(trainer, Mapping):
        snapshot = _snapshot(trainer)
        manifest = {n: tuple(t.shape) for n, t in vr.checkpoint_named(snapshot.items(), layout)}

        def source():
            return vr.checkpoint_named(snapshot.items(), layout)
    else:
        manifest = {n: tuple(t.shape) for n, t in vr.checkpoint_named(trainer_tensors(trainer, hf_config, meta=True),
                                                                      layout)}

        def source():
            return vr.checkpoint_named(trainer_tensors(trainer, hf_config), layout)
    kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    return vr.refit_weights(llm, source, manifest, **kwargs)


def _check_piece_values(group, dtype: str) -> None:
    """Run on a sharded trainer's rank over one mapping group it owns, unconverted (``[(Megatron name, transformers
    names, tensor)]``: the conversion only moves values): every value a finite tensor the engine's ``dtype`` holds
    (:func:`moealign.patches.vllm.refit.check_values`), named by the transformers tensors it holds a piece of."""
    from ..patches.vllm.refit import check_values

    check_values(((f"{' / '.join(hf)} (a piece on this rank: Megatron {key})", t) for key, hf, t in group),
                 getattr(torch, dtype))


def _refit_sharded(llm, trainer, layout, chunk_bytes: int):
    """The refit from a sharded trainer's ranks (:func:`refit`): the names and shapes from every rank's plan checked
    against the engine's checkpoint, then every rank checks the values of the pieces it owns (nothing moved yet),
    then the tensors stream chunk by chunk from the ranks into the workers, one chunk in flight
    (:meth:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer.hf_tensors`; the stream is read once, so
    :func:`~moealign.patches.vllm.refit.refit_weights` checks each chunk again as it arrives and names what had moved
    if one fails)."""
    from ..patches.vllm import refit as vr

    manifest = {n: tuple(t.shape) for n, t in vr.checkpoint_named(trainer_tensors(trainer, meta=True,
                                                                                  chunk_bytes=chunk_bytes), layout)}
    vr.check_manifest(manifest, layout)
    dtype = str(vr.engine_dtype(llm)).replace("torch.", "")
    trainer.map_hf_shards(_check_piece_values, dtype, what="the refit's value check (no weight had moved)",
                          converted=False)
    stream = vr.checkpoint_named(trainer_tensors(trainer, chunk_bytes=chunk_bytes), layout)
    return vr.refit_weights(llm, stream, manifest, chunk_bytes=chunk_bytes)


# --------------------------------------------------------------------------------------------------
# the probe forward
# --------------------------------------------------------------------------------------------------


def _number(name: str, value, *, positive: bool = True, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"Probe.{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        raise ConfigError(f"Probe.{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r} "
                          f"(a non-finite or non-positive bound would pass or fail every refit)")


@dataclass
class Probe:
    """Probe sequences (token ids, the last ``score_last`` tokens of each scored) and the bound on the mean
    |Δ log p| between vLLM and the trainer over them (``None`` until :meth:`calibrate` measures it). Every field
    is checked when built and again when used (:meth:`validate`, :class:`~moealign.errors.ConfigError`).

    ``decode_tokens`` (default 2): tokens the decode probe samples per sequence. The first comes from the prefill's
    logits; the second from one decode step (one query token: the decode kernels, the KV the prefill wrote read
    from the cache, the step's own KV written to the cache and read back in the same attention). Two is the
    smallest count that runs a decode step; each further token is one more engine step (~3 ms on the embedded
    model) through the same path. A fault that shows only from the second decode step on (KV written by one decode
    step and read by the next, e.g. a stale decode-only buffer indexed by step) needs ``decode_tokens=3`` or more."""

    sequences: list[torch.Tensor]
    score_last: int = 24
    bound: float | None = None
    factor: float = 8.0
    floor: float = 1e-6
    step0_gap: float | None = None
    decode_tokens: int = 2
    seed: int = 0
    decode_bound: float | None = None
    decode_step0_gap: float | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> "Probe":
        if isinstance(self.score_last, bool) or not isinstance(self.score_last, int) or self.score_last < 1:
            raise ConfigError(f"Probe.score_last must be an integer >= 1, got {self.score_last!r}")
        _number("bound", self.bound, allow_none=True)
        _number("factor", self.factor)
        _number("floor", self.floor)
        _number("step0_gap", self.step0_gap, positive=False, allow_none=True)
        _number("decode_bound", self.decode_bound, allow_none=True)
        _number("decode_step0_gap", self.decode_step0_gap, positive=False, allow_none=True)
        if isinstance(self.decode_tokens, bool) or not isinstance(self.decode_tokens, int) or self.decode_tokens < 0:
            raise ConfigError(f"Probe.decode_tokens must be an integer >= 0 (0: no decode probe), got "
                              f"{self.decode_tokens!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 62:
            raise ConfigError(f"Probe.seed must be an integer in [0, 2**62), got {self.seed!r}")
        if isinstance(self.sequences, torch.Tensor) or not isinstance(self.sequences, (list, tuple)):
            raise ConfigError(f"Probe.sequences must be a list of 1-D token tensors, got "
                              f"{type(self.sequences).__name__}")
        if not self.sequences:
            raise ConfigError("a refit probe needs at least one sequence")
        for i, seq in enumerate(self.sequences):
            if not isinstance(seq, torch.Tensor) or seq.dim() != 1 or seq.numel() <= self.score_last:
                raise ConfigError(f"probe sequence {i}: a 1-D token tensor longer than score_last={self.score_last}")
            if seq.is_meta or seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
                raise ConfigError(f"probe sequence {i}: token ids must be an integer tensor with data, got "
                                  f"{seq.dtype} on {seq.device}")
            if bool((seq < 0).any()):
                raise ConfigError(f"probe sequence {i}: negative token ids")
        return self

    def record(self, meta, logprobs=None, routes=None) -> RolloutRecord:
        samples = []
        for i, seq in enumerate(self.sequences):
            lp = logprobs[i] if logprobs is not None else torch.zeros(self.score_last)
            samples.append(Sample(token_ids=seq.to(torch.int64), prompt_len=int(seq.numel()) - self.score_last,
                                  logprobs=lp.float(), routes=None if routes is None else routes[i],
                                  sampling=SamplingParams()))
        return RolloutRecord(meta, samples)

    def check_runs(self, llm, train_engine=None, *, need_trainer: bool = True) -> "Probe":
        """Refuse (:class:`~moealign.errors.ConfigError`, before any work) a probe that cannot run on ``llm``: a
        sequence (plus the decoded tokens) longer than the engine's context, token ids outside its vocabulary, and,
        with ``need_trainer``, no moealign train engine for the teacher-forced side (a weight manifest, a module, a
        snapshot)."""
        from ..patches.vllm.refit import as_llm

        self.validate()
        llm = as_llm(llm)
        context = int(llm.llm_engine.model_config.max_model_len)
        for i, seq in enumerate(self.sequences):
            if seq.numel() + self.decode_tokens > context:
                raise ConfigError(f"probe sequence {i}: {seq.numel()} tokens + {self.decode_tokens} decoded exceed the "
                                  f"engine's context (max_model_len {context}); shorten it or open the engine with a "
                                  f"longer context")
        vocab = getattr(llm.llm_engine.model_config.hf_config, "vocab_size", None)
        if vocab is not None and any(bool((s >= int(vocab)).any()) for s in self.sequences):
            raise ConfigError(f"probe sequences hold token ids >= the engine's vocabulary ({vocab})")
        if need_trainer:
            from .manifest import WeightManifest

            if train_engine is None or isinstance(train_engine, (WeightManifest, Mapping)):
                what = "nothing" if train_engine is None else type(train_engine).__name__
                raise ConfigError(f"the refit probe has no trainer for its teacher-forced side (got {what}): it needs "
                                  f"a moealign train engine whose forward replays vLLM's routes; a weight manifest or "
                                  f"a snapshot holds no forward (verify its digests without probe=)")
            _probe_forward(train_engine)
        return self

    def decodes(self, llm) -> bool:
        """Whether the decode probe runs on ``llm``: ``decode_tokens > 0`` (moealign's recorder restores the routes of
        prefix-cached positions, so caching on or off)."""
        from ..patches.vllm.refit import as_llm

        as_llm(llm)
        return self.decode_tokens > 0

    def decode_gaps(self, llm, train_engine) -> tuple[float, float]:
        """``(mean, max)`` |Δ log p| over the tokens vLLM decodes from the probe sequences (its own sampling path:
        temperature 1, per-sequence seed ``seed + i``, ``decode_tokens`` tokens, routes and log-probs recorded by
        :func:`~moealign.patches.vllm.rollout.generate_with_record`) against the trainer's teacher-forced log-probs
        of the same tokens, replaying the decode's routes. Where the prefill probe scores one forward over the whole
        sequence, this one runs vLLM's decode steps (KV cache reads, one token per step)."""
        from ..patches.vllm.refit import as_llm, engine_busy
        from ..patches.vllm.rollout import generate_with_record
        from ..routing_replay.sampling_mask import full_logprob

        self.validate()
        llm = as_llm(llm)
        if not self.decodes(llm):
            raise ConfigError("the decode probe cannot run on this engine: " + (
                "decode_tokens is 0" if self.decode_tokens == 0 else
                "prefix caching is on (moealign's recorder needs every position forwarded to give its routes)"))
        forward = _probe_forward(train_engine)
        with engine_busy(llm, "the refit decode probe", exclusive=False):
            record = generate_with_record(llm, [s.tolist() for s in self.sequences], sampling=SamplingParams(),
                                          max_new_tokens=self.decode_tokens, seed=self.seed, record_kept_sets=False)
        fwd = forward(record, list(range(len(record))))
        train_lp = full_logprob(fwd.logits, fwd.tokens, temperature=1.0).cpu()
        diff = (train_lp - torch.cat([s.logprobs for s in record.samples]).float()).abs()
        return float(diff.mean()), float(diff.max())

    def both_gaps(self, llm, train_engine) -> tuple[tuple[float, float], tuple[float, float]]:
        """The prefill probe and the decode probe in one vLLM call and one trainer forward: ``((mean, max) over the
        last ``score_last`` tokens of each sequence, (mean, max) over the ``decode_tokens`` decoded ones)``. vLLM
        decodes from the sequences as :meth:`decode_gaps` does (its own routing and sampler, seed ``seed + i``) and
        scores their prompts in the same prefill (``prompt_logprobs``); the trainer teacher-forces sequence + decoded
        tokens once, replaying every route vLLM recorded (prefill and decode steps), and both spans are read off
        that forward. The prefill span comes from vLLM's prefill alone, the decoded span from its decode steps: a
        fault on the decode path only still fails the decode span alone."""
        from ..patches.vllm.refit import as_llm, engine_busy
        from ..patches.vllm.rollout import generate_with_record
        from ..routing_replay.sampling_mask import full_logprob

        self.validate()
        llm = as_llm(llm)
        if not self.decodes(llm):
            raise ConfigError("the decode probe cannot run on this engine: decode_tokens is 0")
        forward = _probe_forward(train_engine)
        with engine_busy(llm, "the refit probes", exclusive=False):
            decoded, prompt_lps = generate_with_record(
                llm, [s.tolist() for s in self.sequences], sampling=SamplingParams(),
                max_new_tokens=self.decode_tokens, seed=self.seed, record_kept_sets=False, prompt_logprobs=True)
        samples, spans = [], []
        for s, plp in zip(decoded.samples, prompt_lps):
            start = s.prompt_len - self.score_last                  # the prefill probe's span, then the decoded one
            samples.append(Sample(token_ids=s.token_ids, prompt_len=start, routes=s.routes, sampling=SamplingParams(),
                                  logprobs=torch.cat([plp[start - 1:], s.logprobs.float()])))
            spans.append((self.score_last, s.length - s.prompt_len))
        record = RolloutRecord(decoded.meta, samples)
        fwd = forward(record, list(range(len(record))))
        diff = (full_logprob(fwd.logits, fwd.tokens, temperature=1.0).cpu()
                - torch.cat([x.logprobs for x in samples])).abs()
        parts = diff.split([n for span in spans for n in span])
        prefill, decode = torch.cat(parts[0::2]), torch.cat(parts[1::2])
        return (float(prefill.mean()), float(prefill.max())), (float(decode.mean()), float(decode.max()))

    def gaps(self, llm, train_engine) -> tuple[float, float]:
        """``(mean, max)`` |Δ log p| on the probe: vLLM with its own routing vs the trainer replaying its routes.
        ``train_engine``: a moealign train engine (``forward(record, indices, replay=True)``; Megatron's or
        transformers')."""
        from ..patches.vllm.refit import as_llm, engine_busy
        from ..patches.vllm.replay import score_with_routes
        from ..patches.vllm.rollout import cached_record_meta
        from ..routing_replay.routes import compact_routes
        from ..routing_replay.sampling_mask import full_logprob

        self.validate()
        llm = as_llm(llm)
        forward = _probe_forward(train_engine)
        meta = cached_record_meta(llm)
        vocab = int(meta.vocab_size) if getattr(meta, "vocab_size", None) is not None else None
        if vocab is not None and any(bool((s >= vocab).any()) for s in self.sequences):
            raise ConfigError(f"probe sequences hold token ids >= the engine's vocabulary ({vocab})")
        with engine_busy(llm, "the refit probe", exclusive=False):
            vllm_lp, ran = score_with_routes(llm, self.record(meta), force=False, return_routes=True)
        record = self.record(meta, vllm_lp, [compact_routes(r, meta.num_experts) for r in ran])
        fwd = forward(record, list(range(len(record))))
        train_lp = full_logprob(fwd.logits, fwd.tokens, temperature=1.0).cpu()
        diff = (train_lp - torch.cat(vllm_lp)).abs()
        return float(diff.mean()), float(diff.max())

    def calibrate(self, llm, train_engine, *, decode: bool | None = None) -> float:
        """Measure the step-0 gap (identical weights) and set ``bound = max(factor * gap, floor)``; a non-finite
        gap (the engines disagree beyond numbers) is refused (:class:`~moealign.errors.RefitError`). ``decode``
        (default: wherever :meth:`decodes`): the decode probe's step-0 gap and ``decode_bound`` likewise (then
        :func:`verify_refit` runs the decode probe too)."""
        self.check_runs(llm, train_engine)
        gap = self.gaps(llm, train_engine)[0]
        if not math.isfinite(gap):
            raise RefitError(f"probe calibration measured a non-finite gap ({gap}): the engine and the trainer do not "
                             f"compute comparable log-probs; no bound can be set")
        self.step0_gap = gap
        self.bound = max(self.factor * gap, self.floor)
        if decode is None:
            decode = self.decodes(llm)
        if decode:
            dgap = self.decode_gaps(llm, train_engine)[0]
            if not math.isfinite(dgap):
                raise RefitError(f"decode-probe calibration measured a non-finite gap ({dgap}): no bound can be set")
            self.decode_step0_gap = dgap
            self.decode_bound = max(self.factor * dgap, self.floor)
        return self.bound


def _probe_forward(train_engine):
    """The train engine's replaying forward as ``f(record, indices)``: the replay verifier inside it checks that
    the experts that ran are vLLM's, so route capture is skipped where the engine offers that (``capture=False``,
    Megatron's); transformers' engine always captures."""
    forward = getattr(train_engine, "forward", None)
    if isinstance(train_engine, torch.nn.Module) or not callable(forward):
        raise ConfigError(f"the refit probe needs a moealign train engine (its forward replays vLLM's routes), got "
                          f"{type(train_engine).__name__}")
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "replay" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise ConfigError(f"the refit probe needs a train engine whose forward takes replay=True (routing replay); "
                          f"{type(train_engine).__name__}.forward does not")
    kwargs = {"replay": True}
    if "capture" in params:
        kwargs["capture"] = False
    return lambda record, indices: forward(record, indices, **kwargs)


@dataclass
class RefitCheck:
    """:func:`verify_refit`'s verdict: the weight digests (:class:`~moealign.patches.vllm.refit.WeightCheck`), the
    config fields that differ from the engine's (each fails the check), the probe gap against its bound (``None``:
    no probe run), the tensors derived at load (``derived``: :func:`~moealign.patches.vllm.refit.check_derived_tensors`'s
    answer, ``{"checked": n, "problems": [(worker, why)], "unchecked": [...]}``; each problem fails the check), and
    what was not checked (``not_checked``: stated, never implied)."""

    weights: Any
    probe_gap: float | None = None
    probe_bound: float | None = None
    probe_max: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    config_mismatches: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=lambda: list(NOT_CHECKED))
    decode_gap: float | None = None
    decode_bound: float | None = None
    decode_max: float | None = None
    derived: dict | None = None

    @property
    def derived_ok(self) -> bool:
        return not (self.derived or {}).get("problems")

    @property
    def probe_ok(self) -> bool:
        return self.probe_gap is None or (self.probe_bound is not None and math.isfinite(self.probe_gap)
                                          and self.probe_gap <= self.probe_bound)

    @property
    def decode_ok(self) -> bool:
        return self.decode_gap is None or (self.decode_bound is not None and math.isfinite(self.decode_gap)
                                           and self.decode_gap <= self.decode_bound)

    @property
    def ok(self) -> bool:
        return bool(self.weights.ok) and self.probe_ok and self.decode_ok and self.derived_ok and \
            not self.config_mismatches

    def describe(self) -> str:
        parts = [self.weights.describe()]
        if not self.derived_ok:
            problems = self.derived["problems"]
            parts.append(f"{len(problems)} tensor(s) derived at load differ from what the engine derives from the "
                         f"weights it holds (stale: " + "; ".join(f"worker {r}: {why}" for r, why in problems[:4])
                         + ")")
        elif self.derived and self.derived.get("checked"):
            parts.append(f"{self.derived['checked']} tensor(s) derived at load equal what the engine derives from the "
                         f"weights it holds")
        if self.config_mismatches:
            parts.append("config differs from the engine's: " + ", ".join(self.config_mismatches))
        if self.probe_gap is not None:
            parts.append(f"probe mean |Δ log p| {self.probe_gap:.3g} (bound {self.probe_bound:.3g}; largest "
                         f"{self.probe_max:.3g})")
        if self.decode_gap is not None:
            parts.append(f"decode probe mean |Δ log p| {self.decode_gap:.3g} (bound {self.decode_bound:.3g}; largest "
                         f"{self.decode_max:.3g}){'' if self.decode_ok else ': the DECODE PATH differs'}")
        return "; ".join(parts + self.notes + ["not checked: " + ", ".join(self.not_checked)])

    def check(self) -> "RefitCheck":
        if not self.ok:
            raise RefitError("refit verification failed: " + self.describe())
        return self

    def to_dict(self) -> dict:
        return {"ok": self.ok, "weights": self.weights.to_dict(), "config_mismatches": list(self.config_mismatches),
                "probe_gap": self.probe_gap, "probe_bound": self.probe_bound, "probe_max": self.probe_max,
                "decode_gap": self.decode_gap, "decode_bound": self.decode_bound, "decode_max": self.decode_max,
                "seconds": round(self.seconds, 6), "notes": list(self.notes), "not_checked": list(self.not_checked),
                "derived": None if self.derived is None else {
                    "checked": self.derived["checked"], "problems": [list(p) for p in self.derived["problems"]],
                    "unchecked": list(self.derived["unchecked"])}}


def verify_refit(llm, trainer, hf_config=None, *, expected=None, probe: Probe | None = None) -> RefitCheck:
    """Prove ``llm`` runs the trainer's weights (see the module docstring). ``trainer`` may be a
    :class:`~moealign.rl.manifest.WeightManifest` instead (digests written where the trainer runs: the engine's
    tensors are compared with them, the manifest's config with the engine's; no probe). ``expected``: the tensors the engine
    should hold when they are not the trainer's current ones (a stale refit: the snapshot that was pushed); the
    probe then does not run (the engine and the trainer hold different weights by design). ``probe`` needs a
    moealign train engine (its forward replays routes). The trainer's config is compared with the engine's
    (:func:`architecture_differences`: a difference fails the check). Never raises for a failed check: read
    ``.ok`` or call ``.check()``; refused by name (before any work) for arguments it cannot use, a refit of the
    same engine under way, a shut-down engine."""
    from ..patches.vllm.refit import as_llm, check_awake, check_derived_tensors, verify_digests, verify_weights
    from .manifest import WeightManifest

    t0 = time.perf_counter()
    llm = as_llm(llm)
    check_awake(llm, "refit verification")
    if isinstance(trainer, WeightManifest):
        if expected is not None or probe is not None:
            raise ConfigError("verify_refit with a weight manifest compares digests only: expected= and probe= need "
                              "the trainer itself (its tensors, its forward); a probe has no trainer for its "
                              "teacher-forced side")
        trainer.validate("verify_refit: the weight manifest")
        config = hf_config if hf_config is not None else trainer.config
        differ = [] if config is None else architecture_differences(llm.llm_engine.model_config.hf_config, config)
        not_checked = ["the forward (a manifest holds digests: the weights were compared, the logits were not)",
                       *NOT_CHECKED]
        if config is None:
            not_checked.insert(0, "the config (the manifest states none)")
        weights = verify_digests(llm, trainer.digests())
        return RefitCheck(weights=weights, seconds=time.perf_counter() - t0, config_mismatches=differ,
                          not_checked=not_checked, derived=check_derived_tensors(llm))
    if probe is not None:
        if not isinstance(probe, Probe):
            raise InputTypeError(f"probe must be a moealign.rl.Probe, got {type(probe).__name__}")
        probe.validate()
        if expected is None:
            probe.check_runs(llm, trainer)
            if probe.bound is None:
                raise ConfigError("the refit probe has no bound: calibrate it at step 0 (Probe.calibrate)")
    if expected is not None and not isinstance(expected, Mapping):
        raise InputTypeError(f"expected must be a mapping of transformers names to tensors, got "
                             f"{type(expected).__name__}")
    notes: list[str] = []
    config = trainer_config(trainer, hf_config)
    differ = [] if config is None else architecture_differences(llm.llm_engine.model_config.hf_config, config)
    if expected is None and isinstance(trainer, Mapping):
        weights = verify_weights(llm, _snapshot(trainer))
    elif expected is None and is_sharded_trainer(trainer):    # each rank digests its own pieces: nothing gathered
        from .manifest import weight_manifest

        weights = verify_digests(llm, weight_manifest(trainer, hf_config).digests())
    else:
        weights = verify_weights(llm, expected if expected is not None else trainer_tensors(trainer, hf_config))
    derived = check_derived_tensors(llm)
    gap = bound = largest = None
    not_checked = list(NOT_CHECKED)
    if probe is None:
        not_checked.insert(0, "the forward (no probe ran: the weights were compared, the logits were not)")
    elif expected is not None:
        notes.append("probe skipped: the engine holds an earlier snapshot (staleness) by design")
        not_checked.insert(0, "the forward (probe skipped: the engine holds an earlier snapshot by design)")
    else:
        (gap, largest), bound = probe.gaps(llm, trainer), probe.bound
    dgap = dbound = dmax = None
    if probe is not None and expected is None and probe.decode_bound is not None and probe.decodes(llm):
        (dgap, dmax), dbound = probe.decode_gaps(llm, trainer), probe.decode_bound
        not_checked.remove(NOT_CHECKED_DECODE)
    elif probe is not None and expected is None:
        notes.append("decode probe not run: " + ("prefix caching is on (moealign's recorder needs it off)"
                                                 if probe.decode_bound is not None else
                                                 "not calibrated (Probe.calibrate with decode=True)"))
    return RefitCheck(weights=weights, probe_gap=gap, probe_bound=bound, probe_max=largest,
                      seconds=time.perf_counter() - t0, notes=notes, config_mismatches=differ,
                      not_checked=not_checked, decode_gap=dgap, decode_bound=dbound, decode_max=dmax,
                      derived=derived)
