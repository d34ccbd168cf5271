"""Refit: new weights pushed into a running ``vllm.LLM`` in place, in every worker, and the proof that the engine
now holds exactly them.

**The path.** vLLM's own in-place reload (``vllm/model_executor/model_loader/reload/``, the layerwise reload its
``GPUModelRunner.reload_weights`` and RL weight-transfer entry points run): every layer is put back on the meta
device, the streamed checkpoint tensors go through the model's own ``load_weights`` (its name mapping, its TP
sharding), and when a layer has all its tensors vLLM re-runs the layer's ``process_weights_after_loading`` and
copies the result into the tensors the kernels already hold. :func:`refit_weights` drives it in three phases
(begin / load chunks / finish, one ``collective_rpc`` each), so the tensors are streamed in bounded chunks to every
worker (TP > 1 included) and the engine is never restarted; the prefix / KV cache is reset afterwards.

**The trap (vLLM 0.32, CPU build).** That reload silently corrupts every MoE layer: on a reload
``UnquantizedFusedMoEMethod._setup_kernel`` sees a built kernel (``moe_kernel is not None``), treats the call as a
CUDA-graph-safe "weight update" and skips ``fused_experts.process_weights_after_loading``; on CPU that is
``CPUUnquantizedExperts.process_weights_after_loading``, which pads and **prepacks** ``w13`` / ``w2`` into the
grouped-GEMM layout. The unpacked checkpoint layout is then copied into the packed kernel storage: identical
weights give log-probs off by several nats. :class:`CPUExpertsPrepack` (applied only for the duration of a refit,
undone after) runs the skipped step on a weight update, exactly as the first load ran it, so an identical-weights
refit leaves every packed byte as it was (bitwise; tested). On a build whose MoE kernels are not the CPU ones the
patch does nothing.

**Before any work.** The manifest (every name and shape that will be streamed) must be exactly the checkpoint the
engine loaded (its safetensors headers): a tensor missing, an extra one, a shape of another architecture or
vocabulary is refused by name with nothing sent; so is every value that is not a finite tensor the engine's dtype
can hold (:func:`check_values`: the stream is read once and checked before the first byte moves when it can be
read twice; a one-shot stream is checked chunk by chunk and a late failure says how much had moved), a second
refit of the same engine while one is under way (:func:`engine_busy`), and a shut-down engine (:func:`as_llm`,
one round trip to every worker). Checkpoints that store experts one by one
(``experts.{e}.gate_proj.weight``) get the trainer's fused expert tensors split to match (:func:`checkpoint_named`).

**The proof.** :func:`held_tensors` reads, in every worker, what the kernels hold, in transformers names and this
rank's shard, where the forward reads them: plain parameters as they are; linear layers and the LM head whose
forward goes through the CPU build's ``cpu_linear`` (a oneDNN / packed copy of the weight; the linears' parameter
left empty, the LM head's kept beside it: the logits come from the copy) are read back *through the kernel*
(``cpu_linear`` applied to the identity matrix: exact, every output is one product with 1.0); where the LM head's
parameter and kernel copy differ both are named; prepacked MoE experts as packed bytes, per expert.
:func:`verify_weights` fingerprints (:func:`moealign.contract.tensor_fingerprint`) the expected tensors the same way (sliced for the rank, cast to the held dtype, packed
with the worker's own prepack op where the worker packs) and names every (tensor, worker) that differs.
Un-fusing is written for the qwen3_moe layout (``qkv_proj``, ``gate_up_proj``, ``w13`` / ``w2``); another family is
refused by name.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch

from ...contract import tensor_fingerprint
from ...errors import (ConfigError, EngineError, InputTypeError, MoealignError, RefitError, UnsupportedEngineError,
                       UnsupportedModelError)
from ...handle import PatchHandle
from .._version import check_engine_version, require_attr
from .engine import vllm_version

__all__ = ["SUPPORTED_VLLM_REFIT", "RefitResult", "WeightCheck", "CPUExpertsPrepack", "apply_cpu_experts_prepack",
           "checkpoint_layout", "checkpoint_named", "check_manifest", "check_values", "as_llm", "engine_model_path",
           "engine_dtype", "engine_busy", "refit_weights", "held_tensors", "verify_weights"]

#: vLLM versions whose reload path (layerwise reload, ``UnquantizedFusedMoEMethod._setup_kernel``) moealign drives.
SUPPORTED_VLLM_REFIT = ">=0.32,<0.34"
#: Bytes of tensors per ``collective_rpc`` while streaming (each chunk is pickled to the worker processes at TP > 1).
CHUNK_BYTES = 64 << 20
_VERIFIED_FAMILIES = ("qwen3_moe",)
_FUSED_EXPERTS = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_WORKER_STATE: dict[str, dict] = {}
_LAYOUTS: dict[tuple, dict[str, tuple[int, ...]]] = {}


@dataclass
class RefitResult:
    """What one :func:`refit_weights` moved: tensors and bytes streamed, chunks, workers, seconds."""

    tensors: int
    bytes: int
    chunks: int
    workers: int
    seconds: float


@dataclass
class WeightCheck:
    """:func:`verify_weights`' verdict: ``mismatches`` lists ``(tensor, worker rank, why)``; ``checked`` counts the
    (tensor, worker) pairs compared; ``packed`` the tensors read back through a kernel or compared packed."""

    checked: int = 0
    packed: int = 0
    workers: int = 0
    mismatches: list[tuple[str, int, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not self.mismatches

    def describe(self) -> str:
        if self.ok:
            return f"{self.checked} tensor shards in {self.workers} worker(s) equal the trainer's ({self.packed} read " \
                   f"through vLLM's packing)"
        head = "; ".join(f"{name} (worker {rank}): {why}" for name, rank, why in self.mismatches[:6])
        more = f" and {len(self.mismatches) - 6} more" if len(self.mismatches) > 6 else ""
        return f"{len(self.mismatches)} of {self.checked} tensor shards differ from the trainer's: {head}{more}"

    def check(self) -> "WeightCheck":
        """Raise :class:`~moealign.errors.RefitError` naming each differing (tensor, worker)."""
        if not self.ok:
            raise RefitError("refit verification failed: " + self.describe())
        return self

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checked": self.checked, "packed": self.packed, "workers": self.workers,
                "mismatches": [list(m) for m in self.mismatches], "seconds": round(self.seconds, 6)}


# --------------------------------------------------------------------------------------------------
# the checkpoint the engine loaded: the reference layout of a refit
# --------------------------------------------------------------------------------------------------


def checkpoint_layout(path: str | Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the safetensors checkpoint at ``path`` (headers only, no tensor data read)."""
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise UnsupportedModelError(f"{path}: no local safetensors files, so the engine's checkpoint layout (what a "
                                    f"refit must match) cannot be read")
    # read once per engine run, not per refit: keyed by every file's identity, size and modification time
    key = tuple((str(f), st.st_ino, st.st_size, st.st_mtime_ns) for f in files for st in (f.stat(),))
    if key not in _LAYOUTS:
        layout: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    layout[name] = tuple(f.get_slice(name).get_shape())
        _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return dict(_LAYOUTS[key])


def checkpoint_named(named: Iterable[tuple[str, torch.Tensor]], layout: Mapping[str, tuple[int, ...]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (transformers names, experts fused ``[E, 2I, H]`` / ``[E, H, I]`` as transformers 5 holds them) in
    the checkpoint's own naming: fused expert tensors the checkpoint stores per expert are split
    (``experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``, views, nothing copied)."""
    for name, tensor in named:
        match = _FUSED_EXPERTS.match(name)
        if match is None or name in layout:
            yield name, tensor
            continue
        base = match["base"]
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            raise RefitError(f"refit stream: {name!r} must be the fused experts tensor [experts, rows, columns], got "
                             f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}")
        if match["kind"] == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                yield f"{base}.{e}.gate_proj.weight", gate[e]
                yield f"{base}.{e}.up_proj.weight", up[e]
        else:
            for e in range(tensor.shape[0]):
                yield f"{base}.{e}.down_proj.weight", tensor[e]


def check_manifest(manifest: Mapping[str, tuple[int, ...]], layout: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a refit whose tensors are not exactly the engine's checkpoint (names and shapes):
    :class:`~moealign.errors.RefitError` naming what is missing, extra or shaped otherwise."""
    missing = sorted(set(layout) - set(manifest))
    extra = sorted(set(manifest) - set(layout))
    shapes = sorted(n for n in set(manifest) & set(layout) if tuple(manifest[n]) != tuple(layout[n]))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors of the engine's checkpoint not in the refit: {missing[:4]}")
    if extra:
        problems.append(f"{len(extra)} tensors the engine's checkpoint does not have: {extra[:4]}")
    if shapes:
        problems.append("shapes differ: " + ", ".join(f"{n} {tuple(manifest[n])} vs the engine's {tuple(layout[n])}"
                                                      for n in shapes[:4]))
    if problems:
        raise RefitError("refit refused before any weight moved (another architecture, vocabulary or a partial "
                         "stream): " + "; ".join(problems))


# --------------------------------------------------------------------------------------------------
# the engine: what it is, whether it still runs, and one refit at a time
# --------------------------------------------------------------------------------------------------


def as_llm(llm: Any) -> Any:
    """``llm`` itself when it is a live ``vllm.LLM`` (moealign's ``VLLMRolloutEngine``: its ``.llm``); else a
    named error: :class:`~moealign.errors.InputTypeError` for another object,
    :class:`~moealign.errors.EngineError` for an engine that was shut down or deleted (no ``llm_engine``, a closed
    rollout engine, an executor that failed or is shutting down)."""
    from vllm import LLM

    if not isinstance(llm, LLM) and hasattr(llm, "llm") and not isinstance(llm, torch.nn.Module):
        inner = getattr(llm, "llm")
        if inner is None:
            raise EngineError(f"the {type(llm).__name__} was closed (its vLLM engine is gone): open a new one")
        llm = inner
    if not isinstance(llm, LLM):
        raise InputTypeError(f"llm must be a vllm.LLM, got {type(llm).__module__}.{type(llm).__name__}")
    engine = getattr(llm, "llm_engine", None)
    if engine is None:
        raise EngineError("this vllm.LLM has no engine (its llm_engine was deleted or shut down): open a new LLM")
    executor = getattr(engine, "model_executor", None)
    if getattr(executor, "is_failed", False) or getattr(executor, "shutting_down", False):
        raise EngineError("this vllm.LLM's executor has failed or is shutting down: open a new LLM")
    return llm


def engine_model_path(llm: Any) -> str:
    """The checkpoint directory the engine loaded (the reference layout of a refit)."""
    return str(as_llm(llm).llm_engine.model_config.model)


def engine_dtype(llm: Any) -> torch.dtype:
    """The dtype the engine holds its weights in (``model_config.dtype``): what a refit's values must fit."""
    dtype = getattr(as_llm(llm).llm_engine.model_config, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedEngineError(f"the vLLM engine states no torch dtype for its weights (got {dtype!r})")
    return dtype


def _rpc_ready(worker) -> str | None:
    """(In a worker) why this worker cannot take a refit or be read (``None``: it can)."""
    from vllm.distributed import parallel_state

    runner = getattr(worker, "model_runner", None)
    if runner is None or getattr(runner, "model", None) is None:
        return "the worker holds no model (shut down)"
    if not parallel_state.model_parallel_is_initialized():
        return "the worker's parallel groups are destroyed (the engine was shut down)"
    if _WORKER_STATE:
        return f"a refit ({', '.join(sorted(_WORKER_STATE))}) is still under way in this worker"
    return None


def _check_workers(llm: Any, what: str = "take a refit") -> int:
    """One round trip to every worker before any work: a shut-down engine, a worker in the middle of another
    refit, are refused by name (:class:`~moealign.errors.EngineError`); returns the number of workers."""
    try:
        answers = llm.collective_rpc(_rpc_ready)
    except MoealignError:
        raise
    except Exception as exc:
        raise EngineError(f"the vLLM engine's workers do not answer ({type(exc).__name__}: {exc}): it was shut down "
                          f"or has failed; open a new LLM") from exc
    bad = [(rank, why) for rank, why in enumerate(answers) if why]
    if bad:
        raise EngineError(f"the vLLM engine cannot {what}: " + "; ".join(f"worker {r}: {w}" for r, w in bad))
    return len(answers)


@dataclass
class _EngineState:
    refit: str | None = None        # the refit under way (who, since when)
    readers: int = 0                # verifications under way
    broken: str | None = None       # a refit whose finish phase failed: the engine's weights are undefined


_ENGINES: "weakref.WeakKeyDictionary[Any, _EngineState]" = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


@contextlib.contextmanager
def engine_busy(llm: Any, what: str, *, exclusive: bool = True):
    """Mark ``llm`` busy for the duration (one refit at a time per engine, no verification during a refit):
    a second refit, or a read during a refit, is refused by name (:class:`~moealign.errors.RefitError`) before any
    work. ``exclusive=False``: a read (several may run at once). An engine whose last refit failed in vLLM's
    finish phase is refused until reopened."""
    with _ENGINES_LOCK:
        state = _ENGINES.get(llm)
        if state is None:
            state = _ENGINES[llm] = _EngineState()
        if state.broken is not None and exclusive:
            raise RefitError(f"{what} refused: the last refit of this engine failed while vLLM finished the reload "
                             f"({state.broken}); its weights are undefined: open a new LLM")
        if state.refit is not None:
            raise RefitError(f"{what} refused: {state.refit} is under way on this engine (refits of one engine "
                             f"cannot overlap, nor can a verification run during one); wait for it to return")
        if exclusive and state.readers:
            raise RefitError(f"{what} refused: {state.readers} refit verification(s) are reading this engine's "
                             f"weights; wait for them to return")
        if exclusive:
            state.refit = f"a refit (thread {threading.current_thread().name!r}, started {time.strftime('%H:%M:%S')})"
        else:
            state.readers += 1
    try:
        yield state
    finally:
        with _ENGINES_LOCK:
            if exclusive:
                state.refit = None
            else:
                state.readers -= 1


# --------------------------------------------------------------------------------------------------
# the values: every tensor checked before the first byte moves
# --------------------------------------------------------------------------------------------------


def _check_tensor(name: Any, tensor: Any, what: str = "refit stream") -> None:
    if not isinstance(name, str):
        raise InputTypeError(f"{what}: tensor names must be strings, got {type(name).__name__} {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise InputTypeError(f"{what}: {name!r} is a {type(tensor).__name__}, not a tensor")
    if tensor.is_meta:
        raise RefitError(f"{what}: {name!r} is on the meta device (a shape without data)")
    if tensor.is_complex():
        raise RefitError(f"{what}: {name!r} is complex ({tensor.dtype}); the engine holds real weights")


def _overflow_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to Inf when cast to ``dtype`` (round to nearest even: the largest finite
    value plus half its ulp; fp16: 65520)."""
    info = torch.finfo(dtype)
    return (2.0 - info.eps / 2) * 2.0 ** (math.frexp(info.max)[1] - 1)


def _value_flags(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """0-d bool on the tensor's device: every value finite and held finite by ``dtype`` (one min / max pass, NaN
    propagating through it; no host read)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    if tensor.dtype == torch.float64 and dtype.is_floating_point and dtype != torch.float64:
        return torch.isfinite(tensor.detach().to(dtype)).all()      # fp64 casts round twice: the cast decides
    low, high = torch.aminmax(tensor.detach())
    limit = _overflow_threshold(dtype) if dtype.is_floating_point else math.inf
    return (high < limit) & (low > -limit)


def _value_problem(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> str:
    t = tensor.detach()
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        return f"{name!r} holds {bad} NaN or Inf value(s)"
    big = float(t.abs().max())
    return (f"{name!r} overflows the engine's {str(dtype).replace('torch.', '')} (largest |value| {big:.6g}; "
            f"{torch.finfo(dtype).max:.6g} is the largest it holds: it would be held as Inf)")


def check_values(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 manifest: Mapping[str, tuple[int, ...]] | None = None, *,
                 what: str = "refit refused before any weight moved") -> dict[str, tuple[int, ...]]:
    """Check a whole refit stream before any of it moves; returns ``{name: shape}``. Refused by name
    (:class:`~moealign.errors.RefitError` / :class:`~moealign.errors.InputTypeError`): a value that is not a tensor,
    a meta tensor, NaN / Inf, a value that overflows the engine's ``dtype`` (an fp16 engine would hold Inf), and,
    with ``manifest``, a name or shape it did not announce, a name twice, an announced name missing (``what``
    heads the message). One host read per device at the end (the bad tensor is found again only when one is bad)."""
    seen: dict[str, tuple[int, ...]] = {}
    flags: dict[torch.device, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, tensor in named:
        _check_tensor(name, tensor, what)
        shape = tuple(tensor.shape)
        if name in seen:
            raise RefitError(f"{what}: {name!r} comes twice in the stream")
        if manifest is not None and (name not in manifest or tuple(manifest[name]) != shape):
            raise RefitError(f"{what}: {name!r} {shape} is not what the manifest "
                             f"announced ({manifest.get(name, 'absent')})")
        seen[name] = shape
        flag = _value_flags(tensor, dtype)
        if flag is not None:
            flags.setdefault(flag.device, []).append((name, tensor, flag))
    for device, entries in flags.items():
        if not bool(torch.stack([f for _, _, f in entries]).all()):
            problems = [_value_problem(n, t, dtype) for n, t, f in entries if not bool(f)]
            raise RefitError(f"{what} ({len(problems)} tensor(s)): "
                             + "; ".join(problems[:4]) + (" and more" if len(problems) > 4 else ""))
    if manifest is not None and len(seen) != len(manifest):
        missing = sorted(set(manifest) - set(seen))
        raise RefitError(f"{what}: the stream lacks {len(missing)} announced "
                         f"tensor(s): {missing[:4]}")
    return seen


def _check_refit_version() -> None:
    check_engine_version("vllm (in-place refit)", vllm_version(), SUPPORTED_VLLM_REFIT)


# --------------------------------------------------------------------------------------------------
# the CPU build's skipped prepack
# --------------------------------------------------------------------------------------------------


class CPUExpertsPrepack(PatchHandle):
    """While active, a weight update of an unquantized fused-MoE layer also runs the experts' own
    ``process_weights_after_loading`` when those experts are vLLM's CPU grouped-GEMM ones (which pad and prepack
    ``w13`` / ``w2``, the step vLLM 0.32 skips on a weight update). Class scope (``UnquantizedFusedMoEMethod``)."""


def _cpu_experts_class():
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    return CPUUnquantizedExperts


def apply_cpu_experts_prepack() -> CPUExpertsPrepack:
    """Patch ``UnquantizedFusedMoEMethod._setup_kernel`` (see :class:`CPUExpertsPrepack`); undo with ``undo()``."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = require_attr(UnquantizedFusedMoEMethod, "_setup_kernel", "vLLM's UnquantizedFusedMoEMethod")
    cpu_experts = _cpu_experts_class()
    handle = CPUExpertsPrepack("UnquantizedFusedMoEMethod._setup_kernel (CPU experts prepacked on a weight update)",
                               "class")

    def _setup_kernel(self, layer, w13, w2):
        update = getattr(self, "moe_kernel", None) is not None
        original(self, layer, w13, w2)
        experts = getattr(getattr(self, "moe_kernel", None), "fused_experts", None)
        if update and cpu_experts is not None and isinstance(experts, cpu_experts):
            experts.process_weights_after_loading(layer)

    handle.set_attr(UnquantizedFusedMoEMethod, "_setup_kernel", _setup_kernel)
    return handle


# --------------------------------------------------------------------------------------------------
# the refit: three phases in every worker
# --------------------------------------------------------------------------------------------------


def _runner(worker):
    from .rollout import worker_runner

    return worker_runner(worker)


def _rpc_begin(worker, key: str) -> bool:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    if _WORKER_STATE:
        raise RefitError(f"refit {key!r} refused: a refit ({', '.join(sorted(_WORKER_STATE))}) is already under way "
                         f"in this worker")
    runner = _runner(worker)
    handle = apply_cpu_experts_prepack()
    try:
        initialize_layerwise_reload(runner.model)
    except BaseException:
        handle.undo()
        raise
    _WORKER_STATE[key] = {"handle": handle, "loaded": set()}
    return True


def _rpc_load(worker, key: str, chunk: list) -> int:
    state = _WORKER_STATE.get(key)
    if state is None:
        raise RefitError(f"refit {key!r}: no begun refit in this worker")
    loaded = _runner(worker).model.load_weights(iter(chunk))
    if loaded:
        state["loaded"].update(loaded)
    return len(chunk)


def _rpc_finish(worker, key: str) -> list[str] | None:
    """Process the layers, put the kernels' tensors back, undo the patch, reset caches; the parameters not loaded
    (``None``: no refit ``key`` was under way in this worker, e.g. its begin failed)."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    state = _WORKER_STATE.pop(key, None)
    if state is None:
        return None
    runner = _runner(worker)
    try:
        finalize_layerwise_reload(runner.model, runner.model_config)
    finally:
        state["handle"].undo()
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        fn = getattr(runner, reset, None)
        if callable(fn):
            fn()
    names = {n for n, _ in runner.model.named_parameters()}
    return sorted(names - state["loaded"])


def _chunks(named: Iterable[tuple[str, torch.Tensor]], limit: int, dtype: torch.dtype | None) -> Iterator[list]:
    """Bounded chunks of ``named``; with ``dtype``, each chunk's values checked (one host read per chunk) before it
    is sent (``None``: the whole stream was checked before the first chunk)."""
    chunk, size = [], 0

    def checked(chunk):
        if dtype is not None:
            check_values(chunk, dtype, what="refit stream")
        return chunk

    for name, tensor in named:
        chunk.append((name, tensor.detach().contiguous()))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield checked(chunk)
            chunk, size = [], 0
    if chunk:
        yield checked(chunk)


def _source(named) -> tuple[Any, bool]:
    """``(a function returning a fresh stream, whether the stream can be read twice)``."""
    if isinstance(named, Mapping):
        return (lambda: iter(named.items())), True
    if isinstance(named, (list, tuple)):
        return (lambda: iter(named)), True
    if callable(named) and not hasattr(named, "__next__"):
        return named, True
    if isinstance(named, Iterable):
        return (lambda: named), False
    raise InputTypeError(f"named must be a mapping, a sequence or an iterable of (name, tensor), or a function "
                         f"returning one; got {type(named).__name__}")


def refit_weights(llm: Any, named, manifest: Mapping[str, tuple[int, ...]], *,
                  chunk_bytes: int = CHUNK_BYTES) -> RefitResult:
    """Push ``named`` (``(checkpoint name, full unsharded tensor)``) into every worker of ``llm`` in place (see the
    module docstring). ``named`` is a mapping, a list / tuple, a function returning a fresh iterable (read twice:
    the check, then the stream; what :func:`moealign.rl.refit` passes), or a one-shot iterable.

    Before any tensor moves: ``manifest`` (``{name: shape}`` of exactly what ``named`` yields) against the engine's
    checkpoint (:func:`check_manifest`); the engine alive and not in another refit (:func:`engine_busy`: refused
    by name); and, when ``named`` can be read twice, every value (:func:`check_values`: a tensor, not meta, finite,
    within the engine's dtype, exactly the manifest; the second read, the stream, is then checked for names and
    shapes only). A one-shot iterable is checked chunk by chunk as it streams:
    a bad value found late raises :class:`~moealign.errors.RefitError` saying how many tensors had already been
    replaced (the engine then serves a mix of old and new weights until the next full refit)."""
    _check_refit_version()
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
    llm = as_llm(llm)
    if not isinstance(manifest, Mapping):
        raise InputTypeError(f"manifest must be a mapping of name -> shape, got {type(manifest).__name__}")
    layout = checkpoint_layout(engine_model_path(llm))
    check_manifest(manifest, layout)
    dtype = engine_dtype(llm)
    source, twice = _source(named)
    with engine_busy(llm, "refit") as engine:
        _check_workers(llm)
        if twice:
            check_values(source(), dtype, manifest)
        return _stream(llm, engine, source(), manifest, chunk_bytes, dtype, twice)


def _stream(llm, engine: _EngineState, named, manifest, chunk_bytes: int, dtype: torch.dtype,
            prechecked: bool) -> RefitResult:
    key = uuid.uuid4().hex
    t0 = time.perf_counter()
    tensors = nbytes = chunks = sent = 0
    seen: set[str] = set()

    def checked():
        nonlocal tensors, nbytes
        for name, tensor in named:
            _check_tensor(name, tensor)
            if name not in manifest or tuple(tensor.shape) != tuple(manifest[name]) or name in seen:
                raise RefitError(f"refit stream: {name!r} {tuple(tensor.shape)} is not what the manifest announced "
                                 f"({manifest.get(name, 'absent')}{', twice' if name in seen else ''})")
            seen.add(name)
            tensors += 1
            nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def mixed(what: str) -> str:
        if not sent:
            return f"{what}; no weight had moved (the engine still holds its previous weights)"
        again = " (the stream differed from the one checked before the send)" if prechecked else ""
        return (f"{what}{again}; {sent} of {len(manifest)} tensors had already been replaced: the engine now "
                f"serves a MIX of old and new weights until a full refit succeeds")

    try:
        workers = len(llm.collective_rpc(_rpc_begin, args=(key,)))
    except BaseException as exc:
        _finish(llm, engine, key, quiet=True)          # the workers whose begin ran put their layers back
        if isinstance(exc, MoealignError):
            raise
        raise RefitError(f"refit could not begin in every vLLM worker ({type(exc).__name__}: {exc}); no weight "
                         f"moved") from exc
    failure: BaseException | None = None
    try:
        for chunk in _chunks(checked(), chunk_bytes, None if prechecked else dtype):
            llm.collective_rpc(_rpc_load, args=(key, chunk))
            sent += len(chunk)
            chunks += 1
    except BaseException as exc:
        failure = exc
    unloaded = _finish(llm, engine, key, quiet=failure is not None)
    if failure is not None:
        if isinstance(failure, Exception):
            raise RefitError(mixed(f"refit failed: {failure}" if isinstance(failure, MoealignError) else
                                   f"refit failed ({type(failure).__name__}: {failure})")) from failure
        raise failure                                     # KeyboardInterrupt and the like: as they are
    missing = sorted(set(manifest) - seen)
    if missing:
        raise RefitError(mixed(f"refit stream ended without {len(missing)} announced tensors: {missing[:4]}"))
    for rank, names in enumerate(unloaded or []):
        if names is None:
            raise RefitError(mixed(f"vLLM worker {rank} had no refit {key!r} under way when it was finished"))
        if names:
            raise RefitError(mixed(f"refit left {len(names)} parameters of vLLM worker {rank} unloaded: "
                                   f"{names[:4]}"))
    reset = getattr(llm, "reset_prefix_cache", None)
    if callable(reset):
        reset()
    return RefitResult(tensors=tensors, bytes=nbytes, chunks=chunks, workers=workers,
                       seconds=time.perf_counter() - t0)


def _finish(llm, engine: _EngineState, key: str, *, quiet: bool) -> list | None:
    """The finish phase in every worker; a failure there marks the engine broken (every later refit refused)."""
    try:
        return llm.collective_rpc(_rpc_finish, args=(key,))
    except BaseException as exc:
        engine.broken = f"{type(exc).__name__}: {exc}"
        if quiet:
            return None
        raise RefitError(f"refit failed while vLLM finished the reload ({engine.broken}): the engine's weights are "
                         f"undefined; open a new LLM") from exc


# --------------------------------------------------------------------------------------------------
# reading back what the workers hold
# --------------------------------------------------------------------------------------------------


def _read_linear(module, param: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, bool]:
    """A linear layer's (or the LM head's) weight where its forward reads it (``[out, in]`` of this rank): where
    the CPU build routes the forward through ``cpu_linear`` (a packed / oneDNN / sgl copy of the weight, the
    parameter emptied or, for the LM head, kept beside it), ``cpu_linear(I)^T`` (exact: every output is one product
    with 1.0); the parameter where the forward reads the parameter (no kernel, or moealign's tree forward)."""
    kernel = getattr(module, "cpu_linear", None)
    if getattr(module, "_moealign_tree", False) or not callable(kernel):
        return param.detach(), False
    if k is None:
        k = param.shape[1] if param.dim() == 2 and param.numel() > 0 else (
            getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None))
    if not isinstance(k, int) or k < 1:
        raise UnsupportedEngineError(f"{type(module).__name__}: its weight is read through a CPU kernel and its input "
                                     f"size is not stated; it cannot be read back")
    eye = torch.eye(k, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        return kernel(eye, param, None).t().contiguous(), True


def _rpc_held(worker) -> dict:
    """(In a worker) this rank's held tensors in transformers names: ``{name: (digest, shape, dtype, shard, packed)}``
    plus ``_isa`` (the prepack ISA where the experts are packed) (``shard`` tells the driver how to cut the trainer's full tensor)."""
    runner = _runner(worker)
    model = runner.model
    hf_config = runner.model_config.hf_config
    family = getattr(hf_config, "model_type", None)
    if family not in _VERIFIED_FAMILIES:
        raise UnsupportedModelError(f"refit verification reads vLLM's fused tensors back for {_VERIFIED_FAMILIES}, "
                                    f"not {family!r}")
    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    isa = None
    cpu_experts = _cpu_experts_class()

    def put(name, tensor, shard, packed=False):
        out[name] = (tensor_fingerprint(tensor), tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                     shard, packed)

    for pname, param in model.named_parameters():
        mname, _, leaf = pname.rpartition(".")
        module = modules.get(mname)
        tp_rank = int(getattr(module, "tp_rank", 0) or 0)
        tp_size = int(getattr(module, "tp_size", 1) or 1)
        if mname.endswith("self_attn.qkv_proj"):
            t, packed = _read_linear(module, param) if leaf == "weight" else (param.detach(), False)
            hd = int(module.head_size)
            q, k, v = torch.split(t, [module.num_heads * hd, module.num_kv_heads * hd, module.num_kv_heads * hd])
            base = mname[:-len("qkv_proj")]
            replicas = int(getattr(module, "num_kv_head_replicas", 1) or 1)
            put(f"{base}q_proj.{leaf}", q, ("chunk", 0, tp_rank, tp_size), packed)
            put(f"{base}k_proj.{leaf}", k, ("chunk", 0, tp_rank // replicas, tp_size // replicas), packed)
            put(f"{base}v_proj.{leaf}", v, ("chunk", 0, tp_rank // replicas, tp_size // replicas), packed)
        elif mname.endswith("mlp.gate_up_proj"):
            t, packed = _read_linear(module, param)
            gate, up = t.chunk(2, dim=0)
            base = mname[:-len("gate_up_proj")]
            put(f"{base}gate_proj.{leaf}", gate, ("chunk", 0, tp_rank, tp_size), packed)
            put(f"{base}up_proj.{leaf}", up, ("chunk", 0, tp_rank, tp_size), packed)
        elif leaf in ("w13_weight", "w2_weight"):
            base = mname[:mname.index(".mlp.experts") + len(".mlp.experts")]
            hf = f"{base}.gate_up_proj" if leaf == "w13_weight" else f"{base}.down_proj"
            kernel = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            packed = cpu_experts is not None and isinstance(kernel, cpu_experts) and not getattr(
                kernel, "_use_zentorch", False)
            tree = getattr(module, "_moealign_tree_weights", None)
            if tree is not None:            # the tree / canonical forward reads its own unpacked copy: verify that
                param, packed = tree[0] if leaf == "w13_weight" else tree[1], False
            if packed:
                isa = kernel.isa
            moe = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
            if int(getattr(moe, "ep_size", 1) or 1) != 1:
                raise UnsupportedEngineError(f"{mname}: expert parallelism (each worker holds other experts); refit "
                                             f"verification reads tensor-parallel expert shards only")
            tp_rank, tp_size = int(getattr(moe, "tp_rank", 0) or 0), int(getattr(moe, "tp_size", 1) or 1)
            shard = ("glu", 1, tp_rank, tp_size) if leaf == "w13_weight" else ("chunk", 2, tp_rank, tp_size)
            # one fingerprint per expert (one vectorised pass): a mangled expert is named
            for e, fp in enumerate(tensor_fingerprint(param, rows=True)):
                out[f"{hf}[{e}]"] = (fp, tuple(param.shape[1:]), str(param.dtype).replace("torch.", ""),
                                     ("expert", e, shard), packed)
        elif mname.endswith(("o_proj", "mlp.down_proj")):
            t, packed = _read_linear(module, param) if leaf == "weight" else (param.detach(), False)
            put(pname, t, ("chunk", 1, tp_rank, tp_size), packed)
        elif mname.endswith(("embed_tokens", "lm_head")):
            idx = module.shard_indices
            rows = int(idx.org_vocab_end_index - idx.org_vocab_start_index)
            shard = ("rows", int(idx.org_vocab_start_index), int(idx.org_vocab_end_index))
            if mname.endswith("lm_head") and leaf == "weight":
                # the logits come from the LM head's kernel copy (cpu_linear), not from the parameter it keeps
                t, packed = _read_linear(module, param, int(getattr(module, "embedding_dim", 0) or 0) or None)
                put(pname, t[:rows], shard, packed)
                if packed and param.numel() > 0 and not torch.equal(param.detach()[:rows], t[:rows]):
                    put(f"{pname}[parameter]", param.detach()[:rows], shard)    # the two copies differ: name both
            else:                   # the embedding reads its parameter (F.embedding)
                put(pname, param.detach()[:rows], shard)
        elif mname.endswith("mlp.gate"):
            t, packed = _read_linear(module, param)
            put(pname, t, ("full",), packed)
        elif param.numel() == 0:
            raise UnsupportedEngineError(f"{pname}: vLLM holds it packed in a way moealign cannot read back")
        else:
            put(pname, param.detach(), ("full",))
    out["_isa"] = isa
    return out


def held_tensors(llm: Any) -> list[dict]:
    """Per worker (rank order), what it holds: ``{transformers name: (digest, shape, dtype, shard, packed)}``;
    refused by name during a refit of the same engine and on a shut-down one."""
    _check_refit_version()
    llm = as_llm(llm)
    with engine_busy(llm, "reading the engine's weights", exclusive=False):
        _check_workers(llm, "have its weights read")
        return llm.collective_rpc(_rpc_held)


def _expected(full: torch.Tensor, shard: tuple) -> torch.Tensor:
    kind = shard[0]
    if kind == "full":
        return full
    if kind == "rows":
        return full[shard[1]:shard[2]]
    if kind == "expert":
        return _expected(full[shard[1]:shard[1] + 1], shard[2])[0]
    dim, rank, world = shard[1], shard[2], shard[3]
    if world == 1:
        return full
    if kind == "glu":
        return torch.cat([half.chunk(world, dim=dim)[rank] for half in full.chunk(2, dim=dim)], dim=dim)
    return full.chunk(world, dim=dim)[rank]


def _prepack_all(tensor: torch.Tensor, isa: str) -> torch.Tensor:
    """vLLM's CPU grouped-GEMM prepack of stacked expert weights (each expert packed on its own)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    return cpu_prepack_moe_weight(tensor.contiguous(), isa)


def verify_weights(llm: Any, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> WeightCheck:
    """Compare what every worker of ``llm`` holds against ``named`` (the trainer's full tensors, transformers names;
    experts fused ``[E, 2I, H]`` / ``[E, H, I]``): per (tensor shard, worker) the fingerprint of the held bytes
    (:func:`moealign.contract.tensor_fingerprint`, a 128-bit keyed checksum computed on the tensor's device) vs the
    expected ones (sliced for the rank, cast to the held dtype, prepacked where the worker packs). Returns a
    :class:`WeightCheck` (``.check()`` raises naming each mismatch); never raises for a mismatch itself."""
    t0 = time.perf_counter()
    state = dict(named.items() if isinstance(named, Mapping) else named)
    for name, tensor in state.items():
        _check_tensor(name, tensor, "refit verification")
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]      # tied embeddings
    per_rank = held_tensors(llm)
    result = WeightCheck(workers=len(per_rank))
    expert_cache: dict = {}
    for rank, held in enumerate(per_rank):
        isa = held.get("_isa")
        for name, value in held.items():
            if name.startswith("_"):
                continue
            digest, shape, dtype, shard, packed = value
            base = name.split("[", 1)[0]
            result.checked += 1
            result.packed += int(bool(packed))
            full = state.get(base)
            if full is None:
                result.mismatches.append((name, rank, "the trainer has no such tensor"))
                continue
            if shard[0] == "expert":
                # every expert of this shard at once: sliced, cast, prepacked where the worker packs, fingerprinted
                key = (base, shard[2], dtype, bool(packed))
                if key not in expert_cache:
                    want = _expected(full.detach(), shard[2]).to(getattr(torch, dtype))
                    if packed:
                        want = _prepack_all(want, isa)
                    expert_cache[key] = (tuple(want.shape[1:]), tensor_fingerprint(want, rows=True))
                want_shape, prints = expert_cache[key]
                if want_shape != tuple(shape):
                    result.mismatches.append((name, rank, f"held shape {tuple(shape)}, the trainer's {want_shape}"))
                elif prints[shard[1]] != digest:
                    result.mismatches.append((name, rank, "held bytes differ"))
                continue
            want = _expected(full.detach(), shard).to(getattr(torch, dtype))
            if tuple(want.shape) != tuple(shape):
                result.mismatches.append((name, rank, f"held shape {tuple(shape)}, the trainer's "
                                                      f"{tuple(want.shape)}"))
            elif tensor_fingerprint(want) != digest:
                where = ("the kernel's copy the forward reads" if packed else
                         "the parameter (its kernel copy differs from it)" if name.endswith("[parameter]") else
                         "the parameter")
                result.mismatches.append((name, rank, f"held bytes differ ({where})"))
    result.seconds = time.perf_counter() - t0
    return result
