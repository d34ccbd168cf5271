"""Rollout and training engines of the mismatch test, behind two small interfaces.

A rollout engine turns prompts into a :class:`~moealign.record.RolloutRecord` (log-probs, routes,
kept sets). A training engine recomputes, for a slice of a record, the logits that score each response
token and the routes it actually used, with or without routing replay. ``ROLLOUT_ENGINES`` /
``TRAIN_ENGINES`` map the names the CLI accepts to factories; later adapters (Megatron, vLLM) register
themselves here. ``close()`` releases an engine (its model, its process group); the harness closes both sides.

The engines hold no engine code of their own: loading, route capture and replay go through the adapters
(:func:`moealign.patches.hf.loading.load_model`, :mod:`moealign.patches.hf`,
:func:`moealign.patches.megatron.capture.capture_routes`, :mod:`moealign.patches.megatron`), and what a
precision policy becomes in each engine comes from the translators of :mod:`moealign.precision.policy`
(:func:`~moealign.precision.policy.to_transformers`, :func:`~moealign.precision.policy.to_megatron_config_fields`,
:func:`~moealign.precision.policy.megatron_gaps`).

Every factory is called as ``factory(model_path, precision, device, batch_invariant=..., attention=...)``.
``precision`` is a :mod:`moealign.precision.policy` name (``fp32``, ``bf16``, ``fp16``,
``fp16-fp32-router-head``, ``fp8-e4m3-tensor``, ``fp8-e4m3-block``, or any registered policy); the plain
dtype names ``fp32`` / ``bf16`` / ``fp16`` are themselves policies. ``batch_invariant=True`` runs the
engine's forwards under :func:`moealign.precision.batch_invariant.batch_invariant_mode`; the
transformers engines then also use the batch-invariant attention ``"bi"``
(:mod:`moealign.precision.bi_attention`, registered with transformers by
:mod:`moealign.patches.hf.attention`): each query row reduces over its own valid keys, compacted to the
front, in a fixed tree, so a left-padded one-token decode step and a right-padded full forward give the
same bits. SDPA's fused kernels bypass the overridden aten ops; eager attention is covered by them, but its
bf16 P @ V matmul still depends on where the zero (masked) probabilities sit and on the key length (a gap
that shows in bf16, not in fp32). ``attention="sdpa"`` / ``"eager"`` / ``"bi"`` forces one (the
transformers engines; ``None``: ``"bi"`` under batch-invariant ops, else transformers' default).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from ..errors import ConfigError, MoealignWarning
from ..precision.batch_invariant import batch_invariant_mode
from ..precision.policy import (
    POLICIES,
    PrecisionPolicy,
    UnknownPolicyError,
    dtype_name,
    get_policy,
    to_transformers,
)
from ..record import RecordMeta, RolloutRecord, SamplingParams

__all__ = [
    "ATTENTION",
    "DTYPES",
    "parse_dtype",
    "resolve_precision",
    "short_dtype",
    "describe_engine",
    "TrainForward",
    "RolloutEngine",
    "TrainEngine",
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "register_rollout_engine",
    "register_train_engine",
    "HFEngine",
    "HFRolloutEngine",
    "VLLMRolloutEngine",
    "HFTrainEngine",
    "MegatronTrainEngine",
    "megatron_train_engine",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_precision(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """The precision policy called ``name``; an unknown name is a ``ValueError`` listing the known ones."""
    try:
        return get_policy(name)
    except UnknownPolicyError as exc:
        raise ConfigError(f"unknown precision policy {name!r}; choose one of {sorted(POLICIES)}") from exc


def short_dtype(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (the names of :data:`DTYPES`)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    return dtype_name(dtype)


@dataclass
class TrainForward:
    """One training-engine forward over a slice of a record, in record order.

    ``logits``: ``[n_response_tokens, V]`` float32, the logits that score each response token.
    ``tokens``: ``[n_response_tokens]`` the response token ids.
    ``routes``: ``[n_route_rows, n_layers, k]`` int64, the experts the trainer used for each recorded
    route row (rows as in the record: prompt + response minus the last token, per sample).
    """

    logits: torch.Tensor
    tokens: torch.Tensor
    routes: torch.Tensor


class RolloutEngine(Protocol):
    name: str
    version: str         # the engine's version (the report names it)
    dtype: str           # the policy's compute dtype, short name ("bf16")
    precision: str       # the precision policy's name

    def generate(self, prompts: Sequence[str], *, sampling: SamplingParams, max_new_tokens: int, seed: int,
                 batch_size: int, progress: Callable[[int], None] | None = None) -> RolloutRecord: ...

    def close(self) -> None:
        """Release the engine (model, process group); calling it again does nothing."""


class TrainEngine(Protocol):
    name: str
    version: str
    dtype: str
    precision: str

    def meta(self) -> RecordMeta: ...

    def forward(self, record: RolloutRecord, indices: Sequence[int], *, replay: bool) -> TrainForward: ...

    def close(self) -> None:
        """Release the engine (model, process group); calling it again does nothing."""


def describe_engine(engine: RolloutEngine | TrainEngine) -> dict:
    """The report's description of one side: engine and its version, precision policy, compute dtype
    (+ attention)."""
    desc = {"engine": engine.name, "engine_version": str(engine.version), "precision": engine.precision,
            "dtype": engine.dtype}
    attention = getattr(engine, "attention", None)
    if attention is not None:
        desc["attention"] = attention
    return desc


ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {}
TRAIN_ENGINES: dict[str, Callable[..., TrainEngine]] = {}


def register_rollout_engine(name: str, factory: Callable[..., RolloutEngine]) -> None:
    ROLLOUT_ENGINES[name] = factory


def register_train_engine(name: str, factory: Callable[..., TrainEngine]) -> None:
    TRAIN_ENGINES[name] = factory


ATTENTION = ("sdpa", "eager", "bi")


def _attention(attention: str | None, batch_invariant: bool) -> str | None:
    """The transformers attention implementation: as asked, else the batch-invariant one (``"bi"``) under
    batch-invariant ops (SDPA's fused kernels are not covered by them, eager's key-axis reductions depend on
    padding and key length), else transformers' default (``None``)."""
    if attention is not None and attention not in ATTENTION:
        raise ConfigError(f"unknown attention {attention!r}; choose one of {list(ATTENTION)}")
    return attention if attention is not None else ("bi" if batch_invariant else None)


def _bi_context(enabled: bool):
    return batch_invariant_mode() if enabled else contextlib.nullcontext()


def _sampling_dict(sampling) -> dict | None:
    """A contract's ``sampling``: ``None``, a :class:`SamplingParams` or a dict of its fields."""
    if sampling is None or isinstance(sampling, dict):
        return sampling
    if isinstance(sampling, SamplingParams):
        return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                "min_p": sampling.min_p}
    raise ConfigError(f"sampling must be a SamplingParams, a dict or None, got {type(sampling).__name__}")


def _hf_canonical(model, aligned: bool, skip) -> tuple:
    """``--aligned`` on a transformers engine: ``(handle, ops)``, the canonical forward installed on ``model``
    (:func:`moealign.patches.hf.canonical.apply_canonical_forward`) with every op but ``skip``; ``(None, ())`` off."""
    if not aligned:
        return None, ()
    from ..patches.hf.canonical import HF_OPS, apply_canonical_forward

    ops = tuple(op for op in HF_OPS if op not in tuple(skip))
    return apply_canonical_forward(model, ops), ops


def _canonical_log_softmax(ops):
    """The rollout's recorded log-probs from the canonical log-softmax when ``ops`` holds it."""
    from ..patches.hf.canonical import canonical_log_softmax

    return canonical_log_softmax(ops)


class HFEngine:
    """What the transformers engines share: the model loaded at a precision policy on a device (batch-invariant
    ops and attention where asked), the engine's version."""

    name = "transformers"

    def _load(self, model_path: str, precision: str, device: str, batch_invariant: bool,
              attention: str | None) -> None:
        from ..patches.hf.loading import load_model
        from ..patches.hf.model import transformers_version

        policy = resolve_precision(precision)
        self.batch_invariant = bool(batch_invariant)
        self.attention = _attention(attention, self.batch_invariant)
        self.model, self.precision_handle = load_model(model_path, policy, device, self.attention)
        self.precision, self.dtype, self.device = policy.name, short_dtype(to_transformers(policy)["dtype"]), device
        self.version = transformers_version()


class HFRolloutEngine(HFEngine):
    """transformers ``generate()`` with route and kept-set recording (:mod:`moealign.patches.hf`)."""

    def __init__(self, model_path: str, precision: str = "bf16", device: str = "cpu", *,
                 batch_invariant: bool = False, attention: str | None = None, aligned: bool = False,
                 aligned_skip=()):
        from ..patches.hf.loading import load_tokenizer

        self._load(model_path, precision, device, batch_invariant, attention)
        self.tokenizer = load_tokenizer(model_path, padding_side="left")
        # --aligned: the canonical forward on the model (patches/hf/canonical.py); the recorded log-probs from the
        # canonical log-softmax
        self.aligned, self.canonical_ops = _hf_canonical(self.model, aligned, aligned_skip)

    def generate(self, prompts, *, sampling, max_new_tokens, seed, batch_size, progress=None) -> RolloutRecord:
        from ..patches import hf

        samples, meta = [], None
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            enc = self.tokenizer(chunk, return_tensors="pt", padding=True)
            with _bi_context(self.batch_invariant), _canonical_log_softmax(self.canonical_ops):
                record = hf.generate_with_record(
                    self.model, enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device),
                    sampling=sampling, max_new_tokens=max_new_tokens, seed=seed + start,
                    pad_token_id=self.tokenizer.pad_token_id)
            meta = meta or record.meta
            samples += record.samples
            if progress:
                progress(len(chunk))
        return RolloutRecord(meta, samples)

    def contract(self, sampling: SamplingParams | dict | None = None) -> dict:
        """The execution contract of the loaded model (:mod:`moealign.contract`)."""
        from ..patches.hf.contract import contract_of

        return contract_of(self.model, attention=self.attention, batch_invariant=self.batch_invariant,
                           sampling=_sampling_dict(sampling))

    def weight_digests(self, roundings=None) -> dict:
        """The contract's ``"weights"`` entry alone, at ``roundings`` only (one pass over the weights each)."""
        from ..patches.hf.contract import weights_of

        return weights_of(self.model, roundings=roundings)

    def close(self) -> None:
        if getattr(self, "aligned", None) is not None:
            self.aligned.undo()
        self.model = self.precision_handle = self.tokenizer = self.aligned = None


class VLLMRolloutEngine:
    """vLLM ``LLM.generate`` with route and kept-set recording (:mod:`moealign.patches.vllm`): the engine RL
    runs roll out with. The precision policy becomes vLLM engine arguments
    (:func:`~moealign.precision.policy.to_vllm_engine_args`); a policy vLLM cannot express
    (:func:`~moealign.precision.policy.vllm_gaps`) is refused, as are the transformers-only options."""

    name = "vllm"

    def __init__(self, model_path: str, precision: str = "bf16", device: str = "cpu", *,
                 batch_invariant: bool = False, attention: str | None = None, tp: int = 1, aligned: bool = False,
                 aligned_skip=()):
        from ..precision.policy import to_vllm_engine_args, vllm_gaps

        policy = resolve_precision(precision)
        gaps = vllm_gaps(policy)
        if gaps:
            raise ConfigError(f"precision {policy.name!r} cannot run in vLLM yet: {'; '.join(gaps)}")
        if batch_invariant:
            raise ConfigError("--batch-invariant is not available with --rollout vllm yet (vLLM's kernels are not "
                              "covered by moealign's batch-invariant mode); use --rollout hf")
        if attention is not None:
            raise ConfigError(f"--attention {attention} selects the transformers engines' attention; vLLM uses its "
                              f"own (drop --attention with --rollout vllm)")
        from ..patches.vllm.engine import open_llm, vllm_version
        from ..patches.vllm.precision import apply_precision, audit_vllm, needs_patch

        args = to_vllm_engine_args(policy)
        extra = {k: v for k, v in args.items() if k != "dtype" and v is not None}
        self.batch_invariant, self.attention = False, None
        self.precision, self.device = policy.name, device
        self.dtype = short_dtype(policy.dtype)
        # an fp32 router / LM head: built by moealign's class-level patch (this process runs the model), undone
        # on close; the live model is then audited against the policy
        self._precision = apply_precision(policy) if needs_patch(policy) else None
        self.aligned = _AlignedVllm(aligned_skip) if aligned else None
        try:
            if tp != 1:
                extra["tensor_parallel_size"] = tp      # stock reductions unless MOEALIGN_VLLM_PATCHES=tree
                if not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                    from ..tp_check import cpu_bind_spec    # vLLM's CPU build binds each rank to its own cores

                    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_spec(tp)
            with (self.aligned.environment() if self.aligned else contextlib.nullcontext()):
                # prefix caching on (vLLM's default): the routes of reused positions are restored from the block's
                # writer, bitwise the caching-off record under the tree / canonical forward (patches/vllm/rollout.py)
                self.llm = open_llm(model_path, dtype=args["dtype"], enable_prefix_caching=True, **extra)
            if self._precision is not None:
                audit_vllm(self.llm, policy)
            if self.aligned:
                self.aligned.audit(self.llm)
        except BaseException:
            self.close()
            raise
        self.version = vllm_version()

    def generate(self, prompts, *, sampling, max_new_tokens, seed, batch_size, progress=None) -> RolloutRecord:
        from ..patches.vllm.engine import naming_dead_workers
        from ..patches.vllm.rollout import generate_with_record

        with naming_dead_workers(self.llm, "the vLLM rollout"):
            record = generate_with_record(self.llm, list(prompts), sampling=sampling, max_new_tokens=max_new_tokens,
                                          seed=seed)
        if self.aligned:
            self.aligned.audit(self.llm, ran=True)
        if progress:
            progress(len(prompts))
        return record

    def contract(self, sampling: SamplingParams | dict | None = None) -> dict:
        """The execution contract of the loaded vLLM engine (:mod:`moealign.contract`)."""
        from ..patches.vllm.contract import contract_of

        canonical_router = self.aligned is not None and "router" in self.aligned.ops   # its logits stay fp32
        return contract_of(self.llm, resolve_precision(self.precision), sampling=_sampling_dict(sampling),
                           router_compute=torch.float32 if canonical_router else None)

    def close(self) -> None:
        self.llm = None
        if getattr(self, "_precision", None) is not None:
            self._precision.undo()
            self._precision = None
        if getattr(self, "aligned", None) is not None:
            self.aligned.close()


class _AlignedVllm:
    """``--aligned`` on the vLLM side: the plugin's canonical patch in every vLLM process (this one included
    when the engine runs here), the audit of every worker's model, and the undo of the in-process patch."""

    def __init__(self, skip):
        from ..precision.canonical import OPS

        self.skip = tuple(skip)
        self.ops = tuple(op for op in OPS if op not in self.skip)

    @contextlib.contextmanager
    def environment(self):
        from ..patches.vllm.plugin import ENV, load, spec_for

        saved = os.environ.get(ENV)
        os.environ[ENV] = spec_for(canonical=True, canonical_skip=self.skip)
        try:
            load()            # this process now (vLLM calls its plugins once per process); workers at their start
            yield
        finally:
            if saved is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = saved

    def audit(self, llm, *, ran: bool = False) -> None:
        """Every worker's model runs only canonical ops (``ran``: and each patched module ran its canonical path
        in the last generation); else :class:`~moealign.errors.CanonicalError` naming what escaped."""
        import functools

        from ..errors import CanonicalError
        from ..patches.vllm.canonical import audit_canonical

        escaped = sorted({name for worker in llm.apply_model(functools.partial(audit_canonical, ops=self.ops,
                                                                               ran=ran))
                          for name in worker})
        if escaped:
            raise CanonicalError(f"--aligned: these vLLM modules {'did not run' if ran else 'are not covered by'} the "
                                 f"canonical forward: {', '.join(escaped[:12])}"
                                 + (f" (+{len(escaped) - 12} more)" if len(escaped) > 12 else ""))

    def close(self) -> None:
        from ..patches.vllm.plugin import unload

        unload("canonical")


class HFTrainEngine(HFEngine):
    """transformers full-sequence forward (no KV cache), optionally with routing replay."""

    def __init__(self, model_path: str, precision: str = "fp32", device: str = "cpu", *,
                 batch_invariant: bool = False, attention: str | None = None, aligned: bool = False,
                 aligned_skip=()):
        self._load(model_path, precision, device, batch_invariant, attention)
        pad = self.model.generation_config.pad_token_id
        self.pad_token_id = int(pad) if isinstance(pad, int) else 0
        self.aligned, _ = _hf_canonical(self.model, aligned, aligned_skip)      # --aligned (the scorer: log-softmax)

    def meta(self) -> RecordMeta:
        from ..patches import hf

        return hf.record_meta(self.model)

    def set_canonical_ops(self, ops) -> None:
        """Run these canonical ops (the others stock) from now on: the ``--aligned --diagnose`` levers."""
        from ..patches.hf.canonical import apply_canonical_forward

        if self.aligned is not None:
            self.aligned.undo()
        self.aligned = apply_canonical_forward(self.model, ops)

    def forward(self, record: RolloutRecord, indices, *, replay: bool, capture: bool = True) -> TrainForward:
        """The logits at the response positions of ``record.samples[indices]`` and the experts each router used
        (``capture`` is accepted for the trainers' one signature: the routes are always read here)."""
        from ..patches import hf

        sub = RolloutRecord(record.meta, [record.samples[i] for i in indices], validate=False)
        batch = sub.to_padded("right", self.pad_token_id)
        dev = self.device
        with contextlib.ExitStack() as stack, torch.no_grad():
            stack.enter_context(_bi_context(self.batch_invariant))
            capture = stack.enter_context(hf.capture_routes(self.model))
            rp = None
            if replay:
                rp = stack.enter_context(hf.replay_routing(self.model, aux_loss="own"))
                rp.set_routes(batch.replay_batch())      # the routes travel with the tokens they were laid out for
            out = self.model(input_ids=batch.input_ids.to(dev), attention_mask=batch.attention_mask.to(dev),
                             use_cache=False)
            if rp is not None:
                rp.check(calls=1)
            used = capture.last_forward()
        route_mask = batch.route_mask.reshape(-1).to(used.device)
        # logits at position p - 1 score the token at position p
        b, p = batch.response_mask.nonzero(as_tuple=True)
        logits = out.logits[b.to(dev), (p - 1).to(dev)].float()
        return TrainForward(logits=logits, tokens=batch.input_ids[b, p].to(dev), routes=used[route_mask])

    def contract(self, sampling: SamplingParams | dict | None = None) -> dict:
        """The execution contract of the loaded model (:mod:`moealign.contract`)."""
        from ..patches.hf.contract import contract_of

        return contract_of(self.model, attention=self.attention, batch_invariant=self.batch_invariant,
                           sampling=_sampling_dict(sampling))

    def weight_digests(self, roundings=None) -> dict:
        """The contract's ``"weights"`` entry alone, at ``roundings`` only (one pass over the weights each)."""
        from ..patches.hf.contract import weights_of

        return weights_of(self.model, roundings=roundings)

    def close(self) -> None:
        if getattr(self, "aligned", None) is not None:
            self.aligned.undo()
        self.model = self.precision_handle = self.aligned = None


class MegatronTrainEngine:
    """Megatron-core ``GPTModel`` (local spec) converted from the transformers checkpoint, in a one-process
    world (CPU: gloo and :func:`~moealign.patches.megatron.enable_megatron_cpu`); routing replay through
    Megatron's own RouterReplay (:class:`~moealign.patches.megatron.RouterReplayDriver`).

    Precision: the Megatron config gets :func:`~moealign.precision.policy.to_megatron_config_fields`
    (``params_dtype`` / ``bf16`` / ``fp16``). Policies with a :func:`~moealign.precision.policy.megatron_gaps`
    entry (an fp32 router or LM head in an fp16 model) or FP8 are refused: Megatron's ``moe_router_dtype``
    computes the router in fp32 from *fp16-rounded* weights, which is not the policy's fp32 router, it has
    no fp32 output-layer option, and its FP8 needs transformer-engine layers (the engine builds the local
    spec; no CPU build). Use ``--train hf`` for those policies.
    """

    name = "megatron"

    def __init__(self, model_path: str, precision: str = "fp32", device: str = "cpu", *,
                 batch_invariant: bool = False, attention: str | None = None, aligned: bool = False,
                 aligned_skip=()):
        from ..patches import hf
        from ..patches import megatron as mg
        from ..patches.hf.loading import load_model
        from ..patches.megatron import checkpoint as mc
        from ..patches.megatron.version import megatron_version

        self.version = megatron_version()

        if attention is not None:
            raise ConfigError(f"the megatron engine has one attention (the local spec's unfused "
                             f"DotProductAttention); attention={attention!r} applies to transformers engines only")
        from ..patches.megatron.sharded import precision_fields

        # the local (transformer-engine-free) spec: no FP8 layers, whether transformer-engine is installed or not
        policy = resolve_precision(precision)
        _, fields = precision_fields(policy, engine="the megatron engine",
                                     hint="; use --train hf (FP8 there is simulated)")
        if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
            raise ConfigError(f"the megatron engine runs on cpu, or on cuda where CUDA is available, not on {device!r}")
        self.precision, self.dtype, self.device = policy.name, short_dtype(fields["params_dtype"]), device
        self.batch_invariant = bool(batch_invariant)
        # device="cpu" pins Megatron's CPU mode even where CUDA is available (--device cpu on a GPU machine)
        self._world = mg.init_single_process(device="cpu" if device == "cpu" else "cuda")
        try:
            hf_model, _ = load_model(model_path, "fp32", "cpu")
            self._meta = hf.record_meta(hf_model)
            self._hf_config = hf_model.config          # the contract's transformers names (contract())
            pad = hf_model.generation_config.pad_token_id
            self.pad_token_id = int(pad) if isinstance(pad, int) else 0
            self.model = mc.build_megatron_from_hf(hf_model, cpu=device == "cpu", **fields)
            del hf_model
            self.model.to(device).eval()
            self.aligned = None
            if aligned:
                from ..patches.megatron.canonical import apply_canonical_forward_from_hf
                from ..precision.canonical import OPS

                self.aligned = apply_canonical_forward_from_hf(
                    self.model, self._hf_config, ops=[op for op in OPS if op not in aligned_skip])
            self.driver = mg.RouterReplayDriver(self.model, aux_loss="own")
        except BaseException:
            self._world.undo()
            raise

    def meta(self) -> RecordMeta:
        return self._meta

    def set_canonical_ops(self, ops) -> None:
        """Run these canonical ops (the others stock) from now on: the ``--aligned --diagnose`` levers."""
        from ..patches.megatron.canonical import apply_canonical_forward_from_hf

        if self.aligned is not None:
            self.aligned.undo()
        self.aligned = apply_canonical_forward_from_hf(self.model, self._hf_config, ops=ops)

    def forward(self, record: RolloutRecord, indices, *, replay: bool, grad: bool = False,
                capture: bool = True) -> TrainForward:
        """The logits at the response positions of ``record.samples[indices]`` (and the experts each router used).
        ``grad=True`` keeps the autograd graph (a training step: the caller runs the backward); the default runs
        under ``no_grad``. ``capture=False`` skips reading the experts each router used (``routes`` is then an
        empty ``[0, layers, k]`` tensor: a plain training forward, the benchmarks' baseline)."""
        import contextlib

        from ..patches.megatron.capture import capture_routes

        sub = RolloutRecord(record.meta, [record.samples[i] for i in indices], validate=False)
        batch = sub.to_padded("right", self.pad_token_id)
        T = batch.input_ids.shape[1]
        dev = self.device
        # bool mask, True = masked: causal, and padded keys
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        mask = (causal[None, None] | (batch.attention_mask == 0)[:, None, None, :]).to(dev)
        try:
            with torch.set_grad_enabled(grad), _bi_context(self.batch_invariant), \
                    (capture_routes(self.model) if capture else contextlib.nullcontext()) as captured:
                if replay:
                    self.driver.set_routes(batch.replay_batch())
                    with self.driver.forward():
                        logits = self.model(batch.input_ids.to(dev), batch.position_ids.to(dev), mask)
                    self.driver.check(calls=1)
                else:
                    logits = self.model(batch.input_ids.to(dev), batch.position_ids.to(dev), mask)
        finally:
            self.driver.clear()
            self.driver.reset_counters()
        if captured is not None:
            used = captured.last_forward()              # [B*T, n_layers, k], record row order
            used = used[batch.route_mask.reshape(-1).to(used.device)].detach()
        else:
            used = torch.zeros(0, len(self._meta.moe_layers), self._meta.top_k, dtype=torch.int64)
        b, p = batch.response_mask.nonzero(as_tuple=True)
        out = logits[b.to(dev), (p - 1).to(dev)].float()
        return TrainForward(logits=out, tokens=batch.input_ids[b, p].to(dev), routes=used)

    def contract(self, sampling: SamplingParams | dict | None = None) -> dict:
        """The execution contract of the converted model (:mod:`moealign.contract`)."""
        from ..patches.megatron.contract import contract_of

        return contract_of(self.model, self._hf_config, batch_invariant=self.batch_invariant,
                           sampling=_sampling_dict(sampling))

    def weight_digests(self, roundings=None) -> dict | None:
        """The contract's ``"weights"`` entry alone (the weights converted back to transformers names), at
        ``roundings`` only; ``None`` when the model does not convert back."""
        from ..contract import weight_digests
        from ..errors import UnsupportedConversionError
        from ..patches.megatron.checkpoint import hf_state_dict_from_megatron

        try:
            state = hf_state_dict_from_megatron(self.model, self._hf_config)
        except UnsupportedConversionError:
            return None
        return weight_digests(state.items(), int(self.model.config.num_layers), roundings=roundings)

    def close(self) -> None:
        if getattr(self, "driver", None) is not None:
            self.driver.undo()
            self.driver = None
        if getattr(self, "aligned", None) is not None:
            self.aligned.undo()
            self.aligned = None
        self.model = None
        if getattr(self, "_world", None) is not None:
            self._world.undo()
            self._world = None


def megatron_train_engine(model_path: str, precision: str = "fp32", device: str = "cpu", *, tp: int = 1, ep: int = 1,
                          pp: int = 1, dispatcher: str = "alltoall", batch_invariant: bool = False,
                          attention: str | None = None, aligned: bool = False, aligned_skip=()) -> TrainEngine:
    """The ``megatron`` training engine: one process (:class:`MegatronTrainEngine`) at TP = EP = PP = 1, else the
    sharded trainer (:class:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer`: one process per rank,
    Megatron's own parallelism, routing replay and its verifier on every rank; ``dispatcher``: its MoE token
    dispatcher; ``aligned``: the canonical forward on every rank, :mod:`moealign.patches.megatron.canonical`, TP 1's
    bits). The sharded trainer scores, and trains through its ``train_step`` (rl-check); what it does not do yet is
    refused by name (the commands refuse it earlier, with the flags: :class:`~moealign.mismatch.MismatchConfig`).
    Its ranks share this process's torch threads (at least one each)."""
    if tp == ep == pp == 1:
        return MegatronTrainEngine(model_path, precision, device, batch_invariant=batch_invariant, attention=attention,
                                   aligned=aligned, aligned_skip=aligned_skip)
    from ..patches.megatron.sharded import ShardedMegatronTrainer

    refused = [what for what, given in (("batch-invariant ops", batch_invariant), ("an attention choice", attention))
               if given]
    if refused:
        raise ConfigError(f"the sharded Megatron trainer (TP {tp} x EP {ep} x PP {pp}) does not run "
                          f"{', '.join(refused)} yet")
    world = tp * pp * max(ep, 1)
    with warnings.catch_warnings():        # the commands log the "it will be slow" line themselves, once
        warnings.filterwarnings("ignore", message=".*it will be slow", category=MoealignWarning)
        return ShardedMegatronTrainer(model_path, tp=tp, ep=ep, pp=pp, dispatcher=dispatcher, precision=precision,
                                      device="cpu" if device == "cpu" else "cuda",
                                      threads=max(1, torch.get_num_threads() // world), aligned=bool(aligned),
                                      aligned_skip=tuple(aligned_skip) if aligned else ())


register_rollout_engine("hf", HFRolloutEngine)
register_rollout_engine("vllm", VLLMRolloutEngine)
register_train_engine("hf", HFTrainEngine)
register_train_engine("megatron", megatron_train_engine)
