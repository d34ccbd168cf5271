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
parameter and kernel copy differ both are named; prepacked MoE experts unpacked through the packing measured with
the worker's own prepack op (:func:`_packed_layout`). Each worker sends what its shard contributes to the tensor's
**layout digest** (:func:`layout_digest`: a keyed sum over the full tensor's words, so the contributions of
disjoint shards add up to the digest of the whole: :func:`span_lanes`, :func:`shard_span`).
:func:`verify_weights` compares each (tensor, worker) with what the trainer's tensor (cast to the held dtype)
contributes over the same rows and columns and names every (tensor, worker) that differs; :func:`verify_digests`
sums the workers' shards and compares them with digests alone (a weight manifest, :mod:`moealign.rl.manifest`).
Un-fusing is written for the qwen3_moe layout (``qkv_proj``, ``gate_up_proj``, ``w13`` / ``w2``) and DeepSeek-V3's
(MLA's ``fused_qkv_a_proj`` into ``q_a_proj`` / ``kv_a_proj_with_mqa``, ``q_b_proj`` / ``kv_b_proj``, the shared
experts, the router's correction bias); another family is refused by name (``MoEFamily.verified``).

**Tensors derived at load** (a family's ``derived_tensors``: DeepSeek-V3's MLA ``W_UK_T`` / ``W_UV``, from
``kv_b_proj``). They are not streamed: vLLM's finish phase re-runs each attention layer's
``process_weights_after_loading`` after every other layer was reloaded, which recomputes them in place (unquantized,
in the engine's dtype, they are views of ``kv_b_proj``'s storage anyway). The finish phase then proves it: in every
worker they are recomputed from the held ``kv_b_proj`` with vLLM's own ``split_kv_b_proj`` and the layouts of
``MLAAttention.process_weights_after_loading`` and compared bitwise; a stale one fails the refit by name
(:func:`_derived_check`). The verifier runs the same check (:func:`check_derived_tensors`, also part of
:func:`check_derived_buffers`).
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

from ..._native import extension
from ...checkpoint_check import checkpoint_shapes
from ...families import FAMILIES, verified_families
from ...errors import (ConfigError, EngineError, InputTypeError, MoealignError, RefitError, UnsupportedEngineError,
                       UnsupportedModelError)
from ...handle import PatchHandle
from .._version import check_engine_version, require_attr
from .engine import vllm_version

__all__ = ["SUPPORTED_VLLM_REFIT", "RefitResult", "WeightCheck", "CPUExpertsPrepack", "apply_cpu_experts_prepack",
           "checkpoint_layout", "checkpoint_named", "check_manifest", "check_values", "as_llm", "engine_model_path",
           "engine_dtype", "engine_busy", "refit_weights", "DIGEST_NAME", "layout_digest", "span_lanes", "shard_span",
           "expected_lanes", "held_tensors", "verify_weights", "verify_digests", "CPU_NO_SLEEP_MODE", "sleep_mode",
           "check_awake", "check_derived_buffers", "check_derived_tensors", "decode_token_ids"]

#: vLLM versions whose reload path (layerwise reload, ``UnquantizedFusedMoEMethod._setup_kernel``) moealign drives.
SUPPORTED_VLLM_REFIT = ">=0.32,<0.34"
#: Bytes of tensors per ``collective_rpc`` while streaming (each chunk is pickled to the worker processes at TP > 1).
CHUNK_BYTES = 64 << 20
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
    """``{name: shape}`` of the safetensors checkpoint at ``path`` (headers only, no tensor data read:
    :func:`moealign.checkpoint_check.checkpoint_shapes`)."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise UnsupportedModelError(f"{path}: no local safetensors files, so the engine's checkpoint layout (what a "
                                    f"refit must match) cannot be read")
    # read once per engine run, not per refit: keyed by every file's identity, size and modification time
    key = tuple((str(f), st.st_ino, st.st_size, st.st_mtime_ns) for f in files for st in (f.stat(),))
    if key not in _LAYOUTS:
        _LAYOUTS.clear()
        _LAYOUTS[key] = checkpoint_shapes(root, "the engine's checkpoint")    # the one header reader (headers only)
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


def _run_view(first: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` elements of ``first``'s storage from ``first``'s first element on, as one flat view."""
    return first.detach().as_strided((numel,), (1,), first.storage_offset())


def _value_runs(named: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, list]]:
    """The floating tensors of ``named`` grouped into runs laid end to end in one storage (the experts of one fused
    tensor, split per expert by :func:`checkpoint_named`, are one run): ``(flat view of the run, [(name, tensor)])``.
    One value pass per run instead of one per tensor (a pass costs a parallel region even for a small tensor)."""
    run: list = []
    end = ptr = None
    for name, tensor in named:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        contiguous = tensor.is_contiguous()
        here = tensor.untyped_storage().data_ptr() if contiguous else None
        if run and contiguous and here == ptr and tensor.storage_offset() == end and \
                tensor.dtype == run[0][1].dtype and tensor.device == run[0][1].device:
            run.append((name, tensor))
            end += tensor.numel()
            continue
        if run:
            yield _run_view(run[0][1], end - run[0][1].storage_offset()) if len(run) > 1 else run[0][1], run
        run = [(name, tensor)]
        ptr, end = here, tensor.storage_offset() + tensor.numel()
        if not contiguous:
            yield tensor, run
            run, ptr, end = [], None, None
    if run:
        yield _run_view(run[0][1], end - run[0][1].storage_offset()) if len(run) > 1 else run[0][1], run


def check_values(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 manifest: Mapping[str, tuple[int, ...]] | None = None, *,
                 what: str = "refit refused before any weight moved") -> dict[str, tuple[int, ...]]:
    """Check a whole refit stream before any of it moves; returns ``{name: shape}``. Refused by name
    (:class:`~moealign.errors.RefitError` / :class:`~moealign.errors.InputTypeError`): a value that is not a tensor,
    a meta tensor, NaN / Inf, a value that overflows the engine's ``dtype`` (an fp16 engine would hold Inf), and,
    with ``manifest``, a name or shape it did not announce, a name twice, an announced name missing (``what``
    heads the message). One min / max pass per run of tensors laid end to end in memory (:func:`_value_runs`), one
    host read per device at the end (the bad tensor is found again only when one is bad)."""
    seen: dict[str, tuple[int, ...]] = {}
    entries: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        _check_tensor(name, tensor, what)
        shape = tuple(tensor.shape)
        if name in seen:
            raise RefitError(f"{what}: {name!r} comes twice in the stream")
        if manifest is not None and (name not in manifest or tuple(manifest[name]) != shape):
            raise RefitError(f"{what}: {name!r} {shape} is not what the manifest "
                             f"announced ({manifest.get(name, 'absent')})")
        seen[name] = shape
        entries.append((name, tensor))
    if manifest is not None and len(seen) != len(manifest):
        missing = sorted(set(manifest) - set(seen))
        raise RefitError(f"{what}: the stream lacks {len(missing)} announced "
                         f"tensor(s): {missing[:4]}")
    flags: dict[torch.device, list[tuple[list, torch.Tensor]]] = {}
    for view, members in _value_runs(entries):
        flag = _value_flags(view, dtype)
        if flag is not None:
            flags.setdefault(flag.device, []).append((members, flag))
    for device, runs in flags.items():
        if not bool(torch.stack([f for _, f in runs]).all()):
            problems = [_value_problem(n, t, dtype) for members, f in runs if not bool(f) for n, t in members
                        if not bool(_value_flags(t, dtype))]
            raise RefitError(f"{what} ({len(problems)} tensor(s)): "
                             + "; ".join(problems[:4]) + (" and more" if len(problems) > 4 else ""))
    return seen


def check_refit_version() -> None:
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


def _rpc_finish(worker, key: str) -> dict | None:
    """Process the layers, put the kernels' tensors back, undo the patch, reset caches; ``{"unloaded": the
    parameters neither loaded nor derived, "stale": the derived tensors (the family's ``derived_tensors``: MLA's
    ``W_UK_T`` / ``W_UV``) that differ from what vLLM derives from the reloaded tensors}`` (``None``: no refit
    ``key`` was under way in this worker, e.g. its begin failed). vLLM's finish re-runs each attention layer's
    ``process_weights_after_loading`` after every other layer was reloaded (``_finalize_attention_layer``), which
    recomputes MLA's absorbed matrices in place; the check proves it did."""
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
    leaves = _derived_leaves(runner)
    names = {n for n, _ in runner.model.named_parameters() if n.rpartition(".")[2] not in leaves}
    return {"unloaded": sorted(names - state["loaded"]), "stale": _derived_check(runner)["problems"]}


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
    check_refit_version()
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
    llm = as_llm(llm)
    if not isinstance(manifest, Mapping):
        raise InputTypeError(f"manifest must be a mapping of name -> shape, got {type(manifest).__name__}")
    layout = checkpoint_layout(engine_model_path(llm))
    check_manifest(manifest, layout)
    dtype = engine_dtype(llm)
    source, twice = _source(named)
    check_awake(llm, "refit")
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
    for rank, answer in enumerate(unloaded or []):
        if answer is None:
            raise RefitError(mixed(f"vLLM worker {rank} had no refit {key!r} under way when it was finished"))
        names, stale = answer["unloaded"], answer["stale"]
        if names:
            raise RefitError(mixed(f"refit left {len(names)} parameters of vLLM worker {rank} unloaded: "
                                   f"{names[:4]}"))
        if stale:
            raise RefitError(f"refit left {len(stale)} tensor(s) derived at load stale in vLLM worker {rank}: every "
                             f"streamed tensor was replaced, but vLLM's reload did not recompute these from the new "
                             f"weights (the engine serves them until a refit recomputes them): " + "; ".join(stale[:4])
                             + (f" and {len(stale) - 4} more" if len(stale) > 4 else ""))
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
# layout digests: one digest per tensor in transformers layout, composable over TP shards
# --------------------------------------------------------------------------------------------------

#: The name of the digest function (stated in every weight manifest; a manifest of another function is refused).
DIGEST_NAME = "moealign-rowword-splitmix64-v1"
_MASK64 = (1 << 64) - 1
_KEYS: dict[str, torch.Tensor] = {}
#: int64 words per block of the digest's elementwise pass: 128 KiB, below torch's parallel grain (32768 elements), so
#: every op of the pass runs on the calling thread: no OpenMP region per block (on a shared machine each region can
#: wait a scheduler tick for its other threads: the digest of the 432M model took 5-70 s with 64K-word blocks and two
#: threads, against 1-2 s on one). The buffer stays in cache.
_DIGEST_BLOCK = 1 << 14


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_SPLITMIX = tuple(_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)            # logical shift of int64 (torch's >> is arithmetic)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    z = z + _SPLITMIX[0]
    z = (z ^ _lsr(z, 30)) * _SPLITMIX[1]
    z = (z ^ _lsr(z, 27)) * _SPLITMIX[2]
    return z ^ _lsr(z, 31)


def _keys(kind: int, start: int, stop: int, device) -> torch.Tensor:
    """``[stop - start, 2]`` odd int64 keys (``kind`` 0: the 8-byte words of a row, 1: the rows), lane ``j`` of
    index ``i`` = ``splitmix64(i + ((2 kind + j + 1) << 48)) | 1``: a pure function of the index (any device, any
    machine, any table length gives the same keys)."""
    table = _KEYS.get(str(device))
    if table is None or table.shape[1] < stop:
        n = max(stop, 2 * (0 if table is None else table.shape[1]), 1 << 12)
        i = torch.arange(n, dtype=torch.int64)
        lanes = [_splitmix64(i + ((2 * k + j + 1) << 48)) | 1 for k in (0, 1) for j in (0, 1)]
        table = _KEYS[str(device)] = torch.stack(lanes).view(2, 2, n).transpose(1, 2).contiguous().to(device)
    return table[kind, start:stop]


def _words(t: torch.Tensor, col_start: int) -> tuple[torch.Tensor, int]:
    """``t`` ``[L, M, n]`` (columns ``col_start`` .. of rows of the full tensor) as int64 words ``[L, M, Q]`` of the
    full rows' bytes, and the index of its first word in the full row. Where the shard does not start or end on a
    word boundary its partial words are zero-filled (the other shard's bytes contribute the rest: the digest is a
    sum of products, so the two shards' partial words add up to the full word)."""
    size = t.element_size()
    off, first = (col_start * size) % 8, (col_start * size) // 8
    nbytes = t.shape[-1] * size
    if off == 0 and nbytes % 8 == 0 and nbytes > 0:
        if t.dtype == torch.int64 or t.dtype == torch.float64:
            return t.view(torch.int64) if t.dtype != torch.int64 else t, first
        try:
            return t.view(torch.int64), first                # a view when the rows are word-aligned (no copy)
        except RuntimeError:
            return t.contiguous().view(torch.int64), first
    count = (off + nbytes + 7) // 8
    if count == 0:
        return torch.zeros(*t.shape[:-1], 0, dtype=torch.int64, device=t.device), first
    buf = torch.zeros(*t.shape[:-1], count * 8, dtype=torch.uint8, device=t.device)
    if nbytes:
        buf[..., off:off + nbytes] = t.contiguous().view(torch.uint8)
    return buf.view(torch.int64), first


def _row_keys(rows: list[tuple[int, int]], device) -> torch.Tensor:
    return torch.cat([_keys(1, a, b, device) for a, b in rows]) if len(rows) != 1 else \
        _keys(1, rows[0][0], rows[0][1], device)


def _native_lanes(t: torch.Tensor, rows: list[tuple[int, int]], col_start: int) -> torch.Tensor | None:
    """:func:`span_lanes` by the native kernel (:mod:`moealign._native`), or None where it does not run (not a CPU
    tensor, the kernel switched off or not buildable)."""
    if t.device.type != "cpu" or t.element_size() not in (1, 2, 4, 8) or t.dim() not in (3, 4):
        return None
    module = extension("digest")
    if module is None:
        return None
    size, n = t.element_size(), t.shape[-1]
    off, first = (col_start * size) % 8, (col_start * size) // 8
    keys = _keys(0, first, first + (off + n * size + 7) // 8, t.device)
    return module.layout_lanes(t.unsqueeze(2) if t.dim() == 3 else t, keys, _row_keys(rows, t.device), off)


def span_lanes(t: torch.Tensor, rows: list[tuple[int, int]], col_start: int = 0) -> torch.Tensor:
    """The two int64 lanes ``[L, 2]`` that the block ``t`` (``[L, M, n]``: ``L`` tensors at once, e.g. experts; its
    ``M`` rows are the full tensor's rows ``rows`` (ranges, in order), its ``n`` columns start at ``col_start``)
    contributes to each tensor's layout digest (:func:`layout_digest`). Contributions of disjoint blocks add up
    (mod 2^64) to the digest of the whole: what lets TP shards held by different workers be checked against one
    digest of the full tensor. ``t`` may also be ``[L, Mo, Mi, n]`` (row ``mo * Mi + mi``: a strided view such as
    vLLM's prepacked experts in logical order). On a CPU the native kernel reads ``t`` through its strides, on every
    intra-op thread (:mod:`moealign._native`: the same bits; ``MOEALIGN_DIGEST_KERNEL=0`` or no compiler: this torch
    path, a copy of a view that is not row-contiguous)."""
    native = _native_lanes(t, rows, col_start)
    if native is not None:
        return native
    if t.dim() == 4:
        t = t.reshape(t.shape[0], t.shape[1] * t.shape[2], t.shape[3])
    lead, m = t.shape[0], t.shape[1]
    words, first = _words(t, col_start)
    q = words.shape[-1]
    keys = _keys(0, first, first + q, t.device)
    row_keys = _row_keys(rows, t.device)
    flat = words.reshape(lead * m, q)
    per_row = torch.empty(lead * m, 2, dtype=torch.int64, device=t.device)
    step = max(1, _DIGEST_BLOCK // max(q, 1))
    buf = torch.empty(min(step, lead * m), q, dtype=torch.int64, device=t.device)
    for r0 in range(0, lead * m, step):            # wrapping int64 products and sums: exact mod 2^64, any device
        part = flat[r0:r0 + step]
        out = buf[:part.shape[0]]
        for j in range(2):
            torch.mul(part, keys[:, j], out=out)
            per_row[r0:r0 + part.shape[0], j] = out.sum(1)
    return (per_row.view(lead, m, 2) * row_keys).sum(1)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A tensor as ``[rows, columns]``: every dimension but the last folded into rows (a 0-d / 1-d tensor: one row)."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    return t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)


def _unsigned(lanes) -> tuple[int, int]:
    return tuple(int(v) & _MASK64 for v in lanes)


def layout_digest(tensor: torch.Tensor, *, rows: bool = False):
    """The layout digest of ``tensor`` as it stands (its dtype, transformers layout): ``(lane0, lane1)``, two
    unsigned 64-bit sums over the tensor's 8-byte words (each row zero-padded to a whole word) of word x column
    key x row key (odd keys from :func:`_keys`). Any single changed word changes both lanes; a transposition or a
    shifted block changes them unless the keys collide. A bug guard, not a cryptographic digest. ``rows=True``: one
    digest per index of the first dimension (experts), in one pass. Equal, bit for bit, to the sum of
    :func:`span_lanes` over any partition of the tensor into row / column blocks (TP shards)."""
    t = tensor.detach()
    if rows:
        if t.dim() < 1 or t.shape[0] == 0:
            return []
        inner = t[0]
        r = 1 if inner.dim() <= 1 else math.prod(inner.shape[:-1])
        block = t.reshape(t.shape[0], r, -1) if inner.dim() else t.reshape(t.shape[0], 1, 1)
        return [_unsigned(v) for v in span_lanes(block, [(0, r)]).tolist()]
    block = _as_rows(t)
    return _unsigned(span_lanes(block.unsqueeze(0), [(0, block.shape[0])])[0].tolist())


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """``shape`` seen as ``[rows, columns]`` (:func:`_as_rows`)."""
    if len(shape) == 0:
        return 1, 1
    return (1 if len(shape) == 1 else math.prod(shape[:-1])), shape[-1]


def shard_span(shard: tuple, shape: tuple[int, ...]) -> tuple[list[tuple[int, int]], int, int]:
    """Where a worker's shard lies in the full tensor of ``shape`` seen as ``[rows, columns]`` (:func:`_as_rows`):
    ``(row ranges in the shard's order, first column, columns)``. ``shard``: ``("full",)``, ``("rows", start,
    end)`` (vocabulary rows), ``("chunk", dim, rank, world)`` (dim 0: rows, the last dim: columns), ``("glu", 0,
    rank, world)`` (the rank's part of each half of the rows: vLLM's merged gate / up), ``("expert", e, inner)``
    (``inner`` in the fused ``[experts, ...]`` tensor's dims, applied to expert ``e``'s matrix ``shape``)."""
    ndim = len(shape)
    n_rows, n_cols = _rows_cols(shape)
    kind = shard[0]
    if kind == "expert":
        inner = shard[2]
        if inner[0] in ("chunk", "glu"):
            inner = (inner[0], inner[1] - 1, *inner[2:])
        return shard_span(inner, shape)
    if kind == "full":
        return [(0, n_rows)], 0, n_cols
    if kind == "rows" and ndim == 2:
        return [(int(shard[1]), int(shard[2]))], 0, n_cols
    if kind in ("chunk", "glu") and len(shard) == 4:
        dim, rank, world = shard[1], shard[2], shard[3]
        if kind == "chunk" and ndim >= 1 and dim == ndim - 1:
            if n_cols % world:
                raise UnsupportedEngineError(f"a column shard of {world} does not divide {n_cols} columns")
            step = n_cols // world
            return [(0, n_rows)], rank * step, step
        if dim == 0 and ndim >= 2:
            halves = 2 if kind == "glu" else 1
            if n_rows % (halves * world):
                raise UnsupportedEngineError(f"a {kind} row shard of {world} does not divide {n_rows} rows")
            half, step = n_rows // halves, n_rows // halves // world
            return [(h * half + rank * step, h * half + (rank + 1) * step) for h in range(halves)], 0, n_cols
    raise UnsupportedEngineError(f"shard {shard!r} of a tensor of shape {tuple(shape)} is not one moealign reads")


def _block(full: torch.Tensor, rows: list[tuple[int, int]], col: int, n: int, lead: bool) -> list:
    """The views of ``full`` (``[L, R, C]`` with ``lead``, else ``[R, C]``) under a span: one per row range."""
    f = full if lead else _as_rows(full).unsqueeze(0)
    if lead:
        f = f.reshape(f.shape[0], -1, f.shape[-1]) if f.dim() > 2 else f.reshape(f.shape[0], 1, -1)
    return [(f[:, a:b, col:col + n], a, b) for a, b in rows]


def expected_lanes(full: torch.Tensor, shard: tuple, shape: tuple[int, ...], dtype: torch.dtype, *,
                   lead: bool = False) -> torch.Tensor:
    """What a worker holding ``shard`` of ``full`` (cast to ``dtype``) contributes to its layout digest: ``[L, 2]``
    int64 lanes (``lead``: ``full`` is ``[L, *shape]``, e.g. every expert at once)."""
    rows, col, n = shard_span(shard, shape)
    total = None
    for view, a, b in _block(full.detach(), rows, col, n, lead):
        part = span_lanes(view.to(dtype), [(a, b)], col)
        total = part if total is None else total + part
    return total


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


_UNPACK: dict[tuple, tuple[list[int], list[int]] | None] = {}
#: Experts unpacked per pass of the read-back (bounds its temporary memory: a few tens of MB).
_UNPACK_BYTES = 32 << 20


def _strided_inverse(inv: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """``(sizes, strides)`` of a view that lists a packed matrix in logical (row-major) order, ``inv[l]`` being the
    packed position of logical element ``l``; ``None`` where the packing is no strided permutation. Proved by
    building the view over the positions and comparing it with ``inv`` (exact)."""
    n = inv.numel()
    sizes: list[int] = []
    strides: list[int] = []
    period = 1
    while period < n:
        stride = int(inv[period] - inv[0])
        count = 1
        while period * (count + 1) <= n and int(inv[period * count] - inv[0]) == stride * count:
            count += 1
        if count == 1 or n % (period * count):
            return None
        sizes.insert(0, count)
        strides.insert(0, stride)
        period *= count
    try:
        view = torch.arange(n, dtype=torch.int64).as_strided(sizes, strides)
    except RuntimeError:
        return None
    return (sizes, strides) if torch.equal(view.reshape(-1), inv) else None


def _packed_layout(shape: tuple[int, int], dtype: torch.dtype, isa: str) -> tuple[list[int], list[int]] | None:
    """(In a worker) how vLLM's CPU prepack (``cpu_prepack_moe_weight``, this ``isa``) places one expert's
    ``[N, K]`` matrix: measured once per (shape, dtype, ISA) by packing the digits of every element's index (exact
    small integers in any float dtype) and reading where each one landed; ``None``: not a bijection or not a strided
    permutation (the caller then gathers by index). Each expert is packed on its own (one matrix's layout, offset
    by the expert)."""
    key = (tuple(shape), dtype, isa)
    if key in _UNPACK:
        return _UNPACK[key]
    from vllm._custom_ops import cpu_prepack_moe_weight

    n = shape[0] * shape[1]
    index = torch.arange(n, dtype=torch.int64)
    perm = torch.zeros(n, dtype=torch.int64)
    for d in range(max(1, ((n - 1).bit_length() + 7) // 8)):
        digit = ((index >> (8 * d)) & 255).to(dtype).reshape(1, *shape)
        perm |= cpu_prepack_moe_weight(digit, isa).reshape(-1).to(torch.int64) << (8 * d)
    if not torch.equal(torch.sort(perm).values, index):
        raise UnsupportedEngineError(f"vLLM's CPU expert prepack ({isa}, {tuple(shape)}, {dtype}) is not a "
                                     f"permutation of the weights (padding?); the packed experts cannot be read back")
    inv = torch.empty_like(perm)
    inv[perm] = index
    layout = _strided_inverse(inv)
    _UNPACK[key] = layout if layout is not None else ("index", inv)
    return _UNPACK[key]


def _unpacked_experts(param: torch.Tensor, isa: str):
    """(In a worker) the prepacked experts ``[E, N, K]`` in logical layout, a few experts at a time:
    ``(first expert, [e, N, K] tensor)``; where the native digest kernel runs and the packing splits only the rows
    (vLLM's ``vec`` packing: ``[N / 16, K, 16]``), every expert at once as an ``[E, Mo, Mi, K]`` view of the packed
    storage (no copy: :func:`span_lanes` reads it through its strides)."""
    e_all, n, k = param.shape
    layout = _packed_layout((n, k), param.dtype, isa)
    if layout[0] != "index" and param.device.type == "cpu" and extension("digest") is not None:
        sizes, strides = layout                 # rows split [Mo, Mi] at most, columns whole: read in place, no copy
        if len(sizes) == 2 and sizes[-1] == k:
            sizes, strides = [sizes[0], 1, k], [strides[0], 1, strides[1]]
        if len(sizes) == 3 and sizes[0] * sizes[1] == n and sizes[2] == k:
            yield 0, param.as_strided([e_all, *sizes], [n * k, *strides])
            return
    per = max(1, _UNPACK_BYTES // max(1, n * k * param.element_size()))
    for e0 in range(0, e_all, per):
        part = param[e0:e0 + per]
        if layout[0] == "index":
            yield e0, part.reshape(part.shape[0], -1)[:, layout[1]].reshape(part.shape)
        else:
            sizes, strides = layout
            yield e0, part.as_strided([part.shape[0], *sizes], [n * k, *strides]).reshape(part.shape)


def _expert_padding(module, leaf: str, held: tuple[int, int]):
    """(In a worker) where vLLM padded a rank's experts, ``None`` where it did not; else ``(logical per-rank shape, a
    function taking held experts [e, ...] (any layout torch reshapes) to the checkpoint's rows and columns)``. vLLM
    0.32's CPU build allocates each rank's experts wider than its slice when the slice is narrow (DeepSeek-V3's
    expert width 32 at TP 2: ``moe_config.intermediate_size_per_partition`` 16, ``w13`` ``[E, 2 x 32, H]`` with the
    gate rows in ``[0, 16)`` and the up rows in ``[32, 48)``, ``w2`` ``[E, H, 32]`` with the slice in columns
    ``[0, 16)``); the padding is never part of the result (its ``w13`` rows are zero, so its activations are zero
    whatever ``w2`` holds there), so the check reads the slice: ``w13`` gate rows ``[0, i)`` and up rows
    ``[I, I + i)``, ``w2`` columns ``[0, i)``."""
    config = getattr(module, "moe_config", None)
    i_log = int(getattr(config, "intermediate_size_per_partition_unpadded", 0) or
                getattr(config, "intermediate_size_per_partition", 0) or 0)
    i_pad = held[0] // 2 if leaf == "w13_weight" else held[1]
    if not i_log or i_log >= i_pad or (leaf == "w13_weight" and held[0] % 2):
        return None
    if leaf == "w13_weight":
        h = held[1]

        def cut(x):
            x = x.reshape(x.shape[0], 2 * i_pad, h)
            return torch.cat([x[:, :i_log], x[:, i_pad:i_pad + i_log]], dim=1)
        return (2 * i_log, h), cut
    h = held[0]
    return (h, i_log), lambda x: x.reshape(x.shape[0], h, i_pad)[:, :, :i_log].contiguous()


def _rpc_held(worker) -> dict:
    """(In a worker) this rank's held tensors in transformers names: ``{name: (lanes, local shape, dtype, shard,
    packed, full shape)}``: ``lanes`` what the held bytes contribute to the full tensor's layout digest
    (:func:`span_lanes`; read where the forward reads them: kernel copies through the kernel, prepacked experts
    unpacked), ``shard`` where they lie in the full tensor (:func:`shard_span`), ``full shape`` the transformers
    shape (one expert's matrix for ``experts.*[e]``)."""
    runner = _runner(worker)
    model = runner.model
    hf_config = runner.model_config.hf_config
    family = getattr(hf_config, "model_type", None)
    verified = verified_families("refit")
    if family not in verified:
        raise UnsupportedModelError(f"refit verification reads vLLM's fused tensors back for {verified}, "
                                    f"not {family!r}")
    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    cpu_experts = _cpu_experts_class()
    derived = _derived_leaves(runner)           # derived at load, not loaded: _derived_check reads them

    def put(name, tensor, shard, full_shape, packed=False):
        dtype = str(tensor.dtype).replace("torch.", "")
        rows, col, n = shard_span(shard, full_shape)
        local = _as_rows(tensor)
        if tuple(local.shape) != (sum(b - a for a, b in rows), n):
            out[name] = (None, tuple(tensor.shape), dtype, shard, packed, tuple(full_shape))
            return
        lanes = _unsigned(span_lanes(local.unsqueeze(0), rows, col)[0].tolist())
        out[name] = (lanes, tuple(tensor.shape), dtype, shard, packed, tuple(full_shape))

    for pname, param in model.named_parameters():
        mname, _, leaf = pname.rpartition(".")
        module = modules.get(mname)
        tp_rank = int(getattr(module, "tp_rank", 0) or 0)
        tp_size = int(getattr(module, "tp_size", 1) or 1)
        if leaf in derived:
            continue
        if mname.endswith(_MLA_COLUMN) or mname.endswith("self_attn.fused_qkv_a_proj"):
            _put_mla(put, mname, leaf, module, param, tp_rank, tp_size)
        elif mname.endswith("self_attn.qkv_proj"):
            t, packed = _read_linear(module, param) if leaf == "weight" else (param.detach(), False)
            hd = int(module.head_size)
            q, k, v = torch.split(t, [module.num_heads * hd, module.num_kv_heads * hd, module.num_kv_heads * hd])
            base = mname[:-len("qkv_proj")]
            replicas = int(getattr(module, "num_kv_head_replicas", 1) or 1)
            kv_world = tp_size // replicas
            put(f"{base}q_proj.{leaf}", q, ("chunk", 0, tp_rank, tp_size),
                (q.shape[0] * tp_size, *q.shape[1:]), packed)
            for name, part in (("k_proj", k), ("v_proj", v)):
                put(f"{base}{name}.{leaf}", part, ("chunk", 0, tp_rank // replicas, kv_world),
                    (part.shape[0] * kv_world, *part.shape[1:]), packed)
        elif mname.endswith(("mlp.gate_up_proj", "mlp.shared_experts.gate_up_proj")):
            t, packed = _read_linear(module, param) if leaf == "weight" else (param.detach(), False)
            gate, up = t.chunk(2, dim=0)
            base = mname[:-len("gate_up_proj")]
            put(f"{base}gate_proj.{leaf}", gate, ("chunk", 0, tp_rank, tp_size),
                (gate.shape[0] * tp_size, *gate.shape[1:]), packed)
            put(f"{base}up_proj.{leaf}", up, ("chunk", 0, tp_rank, tp_size),
                (up.shape[0] * tp_size, *up.shape[1:]), packed)
        elif leaf in ("w13_weight", "w2_weight"):
            base = mname[:mname.index(".mlp.experts") + len(".mlp.experts")]
            hf = f"{base}.gate_up_proj" if leaf == "w13_weight" else f"{base}.down_proj"
            kernel = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            packed = cpu_experts is not None and isinstance(kernel, cpu_experts) and not getattr(
                kernel, "_use_zentorch", False)
            tree = getattr(module, "_moealign_tree_weights", None)
            if tree is not None:            # the tree / canonical forward reads its own unpacked copy: verify that
                param, packed = tree[0] if leaf == "w13_weight" else tree[1], False
            moe = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
            if int(getattr(moe, "ep_size", 1) or 1) != 1:
                raise UnsupportedEngineError(f"{mname}: expert parallelism (each worker holds other experts); refit "
                                             f"verification reads tensor-parallel expert shards only")
            tp_rank, tp_size = int(getattr(moe, "tp_rank", 0) or 0), int(getattr(moe, "tp_size", 1) or 1)
            shard = ("glu", 1, tp_rank, tp_size) if leaf == "w13_weight" else ("chunk", 2, tp_rank, tp_size)
            held = param.detach()
            unpad = None if tree is not None else _expert_padding(module, leaf, tuple(held.shape[1:]))
            logical_shape = tuple(held.shape[1:]) if unpad is None else unpad[0]
            full = (logical_shape[0] * tp_size, logical_shape[1]) if leaf == "w13_weight" else \
                (logical_shape[0], logical_shape[1] * tp_size)
            rows, col, n = shard_span(("expert", 0, shard), full)
            dtype = str(held.dtype).replace("torch.", "")
            if logical_shape != (sum(b - a for a, b in rows), n):
                for e in range(held.shape[0]):
                    out[f"{hf}[{e}]"] = (None, tuple(held.shape[1:]), dtype, ("expert", e, shard), packed, full)
                continue
            # every expert's contribution in one vectorised pass (a few experts unpacked at a time): a mangled
            # expert is named
            parts = _unpacked_experts(held, kernel.isa) if packed else [(0, held)]
            if unpad is not None:
                parts = ((e0, unpad[1](part)) for e0, part in parts)
            for e0, logical in parts:
                for i, lanes in enumerate(span_lanes(logical, rows, col).tolist()):
                    out[f"{hf}[{e0 + i}]"] = (_unsigned(lanes), tuple(held.shape[1:]), dtype,
                                              ("expert", e0 + i, shard), packed, full)
        elif mname.endswith(("o_proj", "mlp.down_proj", "mlp.shared_experts.down_proj")):
            t, packed = _read_linear(module, param) if leaf == "weight" else (param.detach(), False)
            if leaf == "weight":
                put(pname, t, ("chunk", 1, tp_rank, tp_size), (t.shape[0], t.shape[1] * tp_size), packed)
            else:                   # a row-parallel layer's bias is added once, whole, on every rank
                put(pname, t, ("full",), tuple(t.shape), packed)
        elif mname.endswith(("embed_tokens", "lm_head")):
            idx = module.shard_indices
            start, end = int(idx.org_vocab_start_index), int(idx.org_vocab_end_index)
            shard = ("rows", start, end)
            full = (int(getattr(module, "org_vocab_size", end)), *param.shape[1:])
            if mname.endswith("lm_head") and leaf == "weight":
                # the logits come from the LM head's kernel copy (cpu_linear), not from the parameter it keeps
                t, packed = _read_linear(module, param, int(getattr(module, "embedding_dim", 0) or 0) or None)
                put(pname, t[:end - start], shard, full, packed)
                if packed and param.numel() > 0 and not torch.equal(param.detach()[:end - start], t[:end - start]):
                    put(f"{pname}[parameter]", param.detach()[:end - start], shard, full)   # they differ: name both
            else:                   # the embedding reads its parameter (F.embedding)
                put(pname, param.detach()[:end - start], shard, full)
        elif mname.endswith("mlp.gate"):
            # the router's weight through its kernel; a selection bias (e_score_correction_bias) is read as held
            t, packed = _read_linear(module, param) if leaf == "weight" else (param.detach(), False)
            put(pname, t, ("full",), tuple(t.shape), packed)
        elif param.numel() == 0:
            raise UnsupportedEngineError(f"{pname}: vLLM holds it packed in a way moealign cannot read back")
        else:
            put(pname, param.detach(), ("full",), tuple(param.shape))
    return out


#: MLA's column-parallel projections (vLLM's DeepSeek-V2/V3 attention): each rank holds its heads' rows.
_MLA_COLUMN = ("self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.q_proj")


def _put_mla(put, mname: str, leaf: str, module, param: torch.Tensor, tp_rank: int, tp_size: int) -> None:
    """(In a worker) MLA's projections in transformers names: ``fused_qkv_a_proj`` (replicated: ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` stacked by rows, vLLM's ``output_sizes``) un-fused; ``q_b_proj`` / ``kv_b_proj`` /
    ``q_proj`` (column parallel: this rank's heads' rows), each read where its forward reads it."""
    if param.numel() == 0 and (mname.endswith("kv_b_proj") or not callable(getattr(module, "cpu_linear", None))):
        raise UnsupportedEngineError(f"{mname}.{leaf}: vLLM released this weight (the AMX MLA backend keeps only "
                                     f"its own packed W_UK / W_UV); moealign cannot read it back")
    t, packed = _read_linear(module, param) if leaf == "weight" else (param.detach(), False)
    if mname.endswith("self_attn.fused_qkv_a_proj"):
        sizes = [int(n) for n in getattr(module, "output_sizes", ())]
        if len(sizes) != 2 or sum(sizes) != t.shape[0] * tp_size:
            raise UnsupportedEngineError(f"{mname}: output sizes {sizes} do not split its {t.shape[0]} rows into "
                                         f"q_a_proj and kv_a_proj_with_mqa")
        base = mname[:-len("fused_qkv_a_proj")]
        for name, part, full in zip(("q_a_proj", "kv_a_proj_with_mqa"), t.split([n // tp_size for n in sizes]),
                                    sizes):
            put(f"{base}{name}.{leaf}", part, ("chunk", 0, tp_rank, tp_size), (full, *part.shape[1:]), packed)
        return
    put(f"{mname}.{leaf}", t, ("chunk", 0, tp_rank, tp_size), (t.shape[0] * tp_size, *t.shape[1:]), packed)


def held_tensors(llm: Any) -> list[dict]:
    """Per worker (rank order), what it holds (:func:`_rpc_held`: ``{transformers name: (lanes, local shape, dtype,
    shard, packed, full shape)}``); refused by name during a refit of the same engine and on a shut-down one."""
    check_refit_version()
    llm = as_llm(llm)
    with engine_busy(llm, "reading the engine's weights", exclusive=False):
        _check_workers(llm, "have its weights read")
        return llm.collective_rpc(_rpc_held)


def _expected(full: torch.Tensor, shard: tuple) -> torch.Tensor:
    """The part of ``full`` a worker holding ``shard`` holds (a reference for tests and users: the digests use
    :func:`shard_span`, which never copies)."""
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


def _where(name: str, packed: bool) -> str:
    return ("the kernel's copy the forward reads" if packed else
            "the parameter (its kernel copy differs from it)" if name.endswith("[parameter]") else "the parameter")


def verify_weights(llm: Any, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> WeightCheck:
    """Compare what every worker of ``llm`` holds against ``named`` (the trainer's full tensors, transformers names;
    experts fused ``[E, 2I, H]`` / ``[E, H, I]``): per (tensor shard, worker) what the held bytes contribute to the
    tensor's layout digest (:func:`span_lanes`, computed in the worker on what the forward reads) vs what the
    trainer's tensor, cast to the held dtype, contributes over the same rows and columns (no copy but the cast).
    Returns a :class:`WeightCheck` (``.check()`` raises naming each mismatch); never raises for a mismatch itself."""
    t0 = time.perf_counter()
    state = dict(named.items() if isinstance(named, Mapping) else named)
    for name, tensor in state.items():
        _check_tensor(name, tensor, "refit verification")
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]      # tied embeddings
    per_rank = held_tensors(llm)
    result = WeightCheck(workers=len(per_rank))
    cache: dict = {}
    for rank, held in enumerate(per_rank):
        for name, (lanes, shape, dtype, shard, packed, full_shape) in held.items():
            base = name.split("[", 1)[0]
            result.checked += 1
            result.packed += int(bool(packed))
            full = state.get(base)
            if full is None:
                result.mismatches.append((name, rank, "the trainer has no such tensor"))
                continue
            expert = shard[0] == "expert"
            trainer_shape = tuple(full.shape[1:] if expert else full.shape)
            if lanes is None or trainer_shape != tuple(full_shape):
                result.mismatches.append((name, rank, f"held shape {tuple(shape)} (of {tuple(full_shape)}), the "
                                                      f"trainer's {trainer_shape}"))
                continue
            key = (base, shard[2] if expert else shard, dtype)
            if key not in cache:
                want = expected_lanes(full, shard, trainer_shape, getattr(torch, dtype), lead=expert) if expert else \
                    expected_lanes(full, shard, trainer_shape, getattr(torch, dtype))
                cache[key] = [_unsigned(v) for v in want.tolist()]
            want = cache[key][shard[1]] if expert else cache[key][0]
            if tuple(lanes) != want:
                result.mismatches.append((name, rank, "held bytes differ" if expert else
                                          f"held bytes differ ({_where(name, packed)})"))
    result.seconds = time.perf_counter() - t0
    return result


def _tiles(spans: list[tuple[list[tuple[int, int]], int, int]], n_rows: int, n_cols: int) -> bool:
    """Whether the row-range x column-range blocks cover ``[n_rows, n_cols]`` exactly once."""
    row_cuts, col_cuts = {0, n_rows}, {0, n_cols}
    for rows, col, n in spans:
        for a, b in rows:
            row_cuts |= {a, b}
        col_cuts |= {col, col + n}
    row_cuts, col_cuts = sorted(row_cuts), sorted(col_cuts)
    if row_cuts[0] < 0 or row_cuts[-1] > n_rows or col_cuts[0] < 0 or col_cuts[-1] > n_cols:
        return False
    for r0, r1 in zip(row_cuts, row_cuts[1:]):
        for c0, c1 in zip(col_cuts, col_cuts[1:]):
            hits = sum(1 for rows, col, n in spans if col <= c0 and c1 <= col + n
                       and any(a <= r0 and r1 <= b for a, b in rows))
            if hits != 1:
                return False
    return True


def verify_digests(llm: Any, digests: Mapping[str, tuple[tuple[int, ...], Mapping[str, tuple[int, int]]]]
                   ) -> WeightCheck:
    """Compare what every worker of ``llm`` holds against layout digests alone (a weight manifest:
    ``{transformers name (experts: "...experts.gate_up_proj[e]"): (full shape, {dtype name: (lane0, lane1)})}``,
    no tensor): per tensor, the contributions of its shards (one per distinct shard; replicas must agree) summed over
    the workers (:func:`span_lanes`; the shards must tile the tensor) against the digest at the dtype the engine
    holds. A tensor held whole by a worker is named with that worker; one split over workers is named with every
    worker holding a part (a digest cannot say which part differs). Names the manifest has and no worker holds are
    named too (worker -1)."""
    t0 = time.perf_counter()
    table = dict(digests)
    if "lm_head.weight" not in table and "model.embed_tokens.weight" in table:
        table["lm_head.weight"] = table["model.embed_tokens.weight"]      # tied embeddings
    per_rank = held_tensors(llm)
    result = WeightCheck(workers=len(per_rank))
    groups: dict[str, list] = {}
    for rank, held in enumerate(per_rank):
        for name, entry in held.items():
            result.checked += 1
            result.packed += int(bool(entry[4]))
            groups.setdefault(name, []).append((rank, *entry))
    seen: set[str] = set()
    for name, entries in groups.items():
        key = name if entries[0][4][0] == "expert" else name.split("[", 1)[0]
        seen.add(key)
        ranks = [e[0] for e in entries]
        want = table.get(key)
        if want is None:
            result.mismatches += [(name, r, "the manifest has no such tensor") for r in ranks]
            continue
        shape, by_dtype = tuple(want[0]), want[1]
        bad = False
        for rank, lanes, local, dtype, shard, packed, full_shape in entries:
            if lanes is None or tuple(full_shape) != shape:
                result.mismatches.append((name, rank, f"held shape {tuple(local)} (of {tuple(full_shape)}), the "
                                                      f"manifest's {shape}"))
                bad = True
            elif dtype not in by_dtype:
                result.mismatches.append((name, rank, f"the manifest has no digest at the engine's dtype {dtype} "
                                                      f"(it has {sorted(by_dtype)}): write it with that dtype"))
                bad = True
        if bad:
            continue
        digest = tuple(int(v) & _MASK64 for v in by_dtype[entries[0][3]])
        distinct: dict = {}
        for rank, lanes, local, dtype, shard, packed, full_shape in entries:
            span = shard_span(shard, shape)
            distinct.setdefault(repr(span), (span, []))[1].append((rank, tuple(lanes), packed))
        n_rows, n_cols = _rows_cols(shape)
        if len(distinct) == 1 and next(iter(distinct.values()))[0] == ([(0, n_rows)], 0, n_cols):
            for rank, lanes, packed in next(iter(distinct.values()))[1]:      # held whole: each worker on its own
                if lanes != digest:
                    result.mismatches.append((name, rank, f"held bytes differ from the manifest's digest "
                                                          f"({_where(name, packed)})"))
            continue
        disagree = [g for g in distinct.values() if len({lanes for _, lanes, _ in g[1]}) > 1]
        if disagree:
            for span, members in disagree:
                result.mismatches += [(name, r, f"workers {[m[0] for m in members]} hold the same shard with different "
                                                f"bytes") for r, _, _ in members]
            continue
        if not _tiles([g[0] for g in distinct.values()], n_rows, n_cols):
            result.mismatches += [(name, r, f"the shards held by workers {ranks} do not tile the tensor {shape}")
                                  for r in ranks]
            continue
        total = [sum(g[1][0][1][j] for g in distinct.values()) & _MASK64 for j in (0, 1)]
        if tuple(total) != digest:
            packed = any(p for g in distinct.values() for _, _, p in g[1])
            result.mismatches += [(name, r, f"held bytes differ from the manifest's digest (its shards on workers "
                                            f"{ranks} together; a digest cannot say which shard): "
                                            f"{_where(name, packed)}") for r in ranks]
    for name in sorted(set(digests) - seen):
        result.mismatches.append((name, -1, "the engine holds no such tensor"))
    result.seconds = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------------------------------
# the state no weight digest sees: sleep mode, derived buffers
# --------------------------------------------------------------------------------------------------

#: Why vLLM's CPU build has no sleep mode (vLLM 0.32: ``Platform.is_sleep_mode_available()`` is true for CUDA, ROCm
#: and XPU only; ``LLM(enable_sleep_mode=True)`` fails ``ModelConfig``'s check "Sleep mode is not supported on current
#: platform"; ``CPUWorker.sleep`` / ``wake_up`` log "sleep mode is not supported on CPU, ignore it" and keep
#: every tensor where it was).
CPU_NO_SLEEP_MODE = ("vLLM's CPU build has no sleep mode: its platform states is_sleep_mode_available() false (sleep "
                     "offloads or discards device memory through the CUDA / ROCm / XPU allocator), "
                     "LLM(enable_sleep_mode=True) is refused ('Sleep mode is not supported on current platform') and "
                     "CPUWorker.sleep / wake_up only log 'sleep mode is not supported on CPU, ignore it'")


def sleep_mode(llm: Any) -> dict:
    """Where ``llm`` stands with vLLM's sleep mode: ``{"available": platform supports it, "enabled": the engine was
    opened with enable_sleep_mode, "sleeping": llm.sleep() without wake_up(), "reason": why not available}``."""
    llm = as_llm(llm)
    from vllm.platforms import current_platform

    available = bool(current_platform.is_sleep_mode_available())
    enabled = bool(getattr(llm.llm_engine.model_config, "enable_sleep_mode", False))
    try:
        sleeping = bool(llm.llm_engine.is_sleeping())
    except Exception as exc:                    # an engine that cannot say: treated as unknown, named
        raise EngineError(f"the vLLM engine cannot say whether it sleeps ({type(exc).__name__}: {exc})") from exc
    reason = None if available else (CPU_NO_SLEEP_MODE if current_platform.is_cpu() else
                                     f"vLLM's {type(current_platform).__name__} states is_sleep_mode_available() false")
    return {"available": available, "enabled": enabled, "sleeping": sleeping, "reason": reason}


def check_awake(llm: Any, what: str) -> dict:
    """Refuse (:class:`~moealign.errors.EngineError`, before any work) ``what`` on an engine put to sleep
    (``llm.sleep(level)`` without ``llm.wake_up()``): its scheduler is paused (a probe would wait forever) and, where
    sleep mode exists, its weights are offloaded (level 1) or discarded (level 2). Returns :func:`sleep_mode`."""
    state = sleep_mode(llm)
    if state["sleeping"]:
        extra = "" if state["available"] else f" ({state['reason']}: the engine's scheduler is paused all the same)"
        raise EngineError(f"{what} refused: the vLLM engine is asleep (llm.sleep() was called without llm.wake_up()); "
                          f"wake it first, then refit and verify: after a level-2 sleep its weights must be pushed "
                          f"again{extra}")
    return state


def _rope_modules(model) -> list[tuple[str, Any]]:
    seen: dict[int, str] = {}
    found = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "cos_sin_cache", None), torch.Tensor) and id(module) not in seen:
            seen[id(module)] = name
            found.append((name, module))
    return found


def _derived_leaves(runner) -> dict[str, str]:
    """(In a worker) ``{engine tensor leaf name: the checkpoint tensor it is derived from}``: the family's
    ``derived_tensors`` (engine-free facts, :mod:`moealign.families`; empty for an unregistered family)."""
    family = FAMILIES.get(getattr(runner.model_config.hf_config, "model_type", None))
    return dict(family.derived_tensors) if family is not None else {}


def _mla_absorbed(module, act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """(In a worker) MLA's absorbed matrices as vLLM derives them from the ``kv_b_proj`` the module holds now:
    ``split_kv_b_proj`` (vLLM's own function) then the layouts of ``MLAAttention.process_weights_after_loading``'s
    unquantized branch (``W_UV``: ``(L, N, V) -> (N, L, V)``; ``W_UK_T``: ``(L, N, P) -> (N, P, L)``)."""
    from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj

    w_uk, w_uv = split_kv_b_proj(module.kv_b_proj, act_dtype, module.kv_lora_rank, module.num_heads,
                                 module.qk_nope_head_dim, module.v_head_dim)
    return {"W_UV": w_uv.transpose(0, 1), "W_UK_T": w_uk.permute(1, 2, 0)}


def _mla_not_derived(module) -> str | None:
    """Why this MLA layer does not hold vLLM's generic absorbed matrices (they cannot be recomputed and compared)."""
    if getattr(module, "is_amx_bmm_enabled", False):
        return ("the AMX MLA backend packs its own W_UK / W_UV and releases kv_b_proj's weight; moealign does not "
                "read them back")
    for flag in ("is_aiter_triton_fp4_bmm_enabled", "is_aiter_triton_fp8_bmm_enabled", "dcp_q_replicate"):
        if getattr(module, flag, False):
            return f"{flag}: the absorbed matrices are quantized or gathered (not vLLM's generic W_UK_T / W_UV)"
    return None


def _derived_check(runner) -> dict:
    """(In a worker) the family's derived tensors (:func:`_derived_leaves`) in every MLA attention layer:
    recomputed from the held ``kv_b_proj`` as vLLM derives them (:func:`_mla_absorbed`) and compared bitwise with
    what the layer holds (what the decode path reads). ``{"checked": names, "problems": texts, "unchecked": texts}``."""
    checked, problems, unchecked = [], [], []
    leaves = _derived_leaves(runner)
    if not leaves:
        return {"checked": checked, "problems": problems, "unchecked": unchecked}
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    act_dtype = runner.model_config.dtype
    layers = [(n, m) for n, m in runner.model.named_modules() if isinstance(m, MLAAttention)]
    if not layers:
        problems.append(f"the family derives {sorted(leaves)} at load, but the engine holds no MLA attention layer "
                        f"to read them from")
    for name, module in layers:
        why = _mla_not_derived(module)
        if why is not None:
            unchecked += [f"{name}.{leaf} ({why})" for leaf in sorted(leaves)]
            continue
        with torch.no_grad():
            fresh = _mla_absorbed(module, act_dtype)
        for leaf, source in sorted(leaves.items()):
            where = f"{name}.{leaf}"
            held, want = getattr(module, leaf, None), fresh.get(leaf)
            if want is None:
                problems.append(f"{where}: moealign does not know how vLLM derives it from {source}")
                continue
            checked.append(where)
            if not isinstance(held, torch.Tensor) or held.shape != want.shape or held.dtype != want.dtype:
                problems.append(f"{where}: held {getattr(held, 'shape', held)} "
                                f"{getattr(held, 'dtype', '')}, vLLM derives {tuple(want.shape)} {want.dtype} from "
                                f"{source}")
            elif not torch.equal(held, want):
                diff = float((held.float() - want.float()).abs().max())
                problems.append(f"{where}: differs from what vLLM derives from the held {source} (max |diff| "
                                f"{diff:.3g}): stale, the decode path reads it")
    return {"checked": checked, "problems": problems, "unchecked": unchecked}


def _rpc_derived(worker) -> dict:
    """(In a worker) every buffer of the model, checked where a check exists: RoPE ``cos_sin_cache`` recomputed from
    the module's own settings (``_compute_cos_sin_cache``, cast as vLLM casts it: bitwise) and those settings
    against the checkpoint's config (theta, rotary dimension, positions); the family's tensors derived at load (MLA's
    ``W_UK_T`` / ``W_UV``: :func:`_derived_check`); the other buffers named, unchecked."""
    runner = _runner(worker)
    model = runner.model
    config = runner.model_config.hf_config
    rope_ids = {id(m) for _, m in _rope_modules(model)}
    checked, problems, unchecked = [], [], []
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    positions = getattr(config, "max_position_embeddings", None)
    for name, module in _rope_modules(model):
        held = module.cos_sin_cache
        checked.append(f"{name}.cos_sin_cache" if name else "cos_sin_cache")
        where = checked[-1]
        fresh = module._compute_cos_sin_cache().to(device=held.device)
        if not getattr(module, "use_flashinfer", False):
            fresh = fresh.to(held.dtype)
        if fresh.shape != held.shape or not torch.equal(fresh, held):
            diff = float((fresh.float() - held.float()).abs().max()) if fresh.shape == held.shape else math.inf
            problems.append(f"{where}: differs from the values its settings give (max |diff| {diff:.3g}; shapes "
                            f"{tuple(held.shape)} vs {tuple(fresh.shape)})")
        if (params.get("rope_type", "default") or "default") == "default":
            for field_, want, have in (("rope_theta", theta, getattr(module, "base", None)),
                                       ("rotary dimension", int(head_dim * partial), getattr(module, "rotary_dim",
                                                                                               None)),
                                       ("max_position_embeddings", positions,
                                        getattr(module, "max_position_embeddings", None))):
                if want is not None and have is not None and float(want) != float(have):
                    problems.append(f"{where}: built for {field_} {have}, the checkpoint's config says {want}")
    for name, module in model.named_modules():
        for leaf, buf in module.named_buffers(recurse=False):
            if id(module) in rope_ids and leaf in ("cos_sin_cache", "cos_sin_cache_bf16"):
                continue
            if isinstance(buf, torch.Tensor):
                unchecked.append(f"{name}.{leaf}" if name else leaf)
    derived = _derived_check(runner)
    checked += derived["checked"]
    problems += derived["problems"]
    unchecked += derived["unchecked"]
    return {"checked": checked, "problems": problems, "unchecked": sorted(set(unchecked))}


def check_derived_buffers(llm: Any) -> dict:
    """The derived buffers and tensors of every worker (:func:`_rpc_derived`: RoPE caches, the family's tensors
    derived at load such as MLA's ``W_UK_T`` / ``W_UV``): ``{"checked": n, "problems": [(rank, why)],
    "unchecked": [names]}``; refused by name on a sleeping / shut-down engine."""
    llm = as_llm(llm)
    check_awake(llm, "the derived-buffer check")
    with engine_busy(llm, "the derived-buffer check", exclusive=False):
        answers = llm.collective_rpc(_rpc_derived)
    problems = [(rank, why) for rank, a in enumerate(answers) for why in a["problems"]]
    unchecked = sorted({n for a in answers for n in a["unchecked"]})
    return {"checked": sum(len(a["checked"]) for a in answers), "problems": problems, "unchecked": unchecked}


def _rpc_derived_tensors(worker) -> dict:
    return _derived_check(_runner(worker))


def check_derived_tensors(llm: Any) -> dict:
    """The family's tensors derived at load (``MoEFamily.derived_tensors``: MLA's ``W_UK_T`` / ``W_UV``) in every
    worker, recomputed from the held source as vLLM derives them and compared bitwise (:func:`_derived_check`):
    ``{"checked": n, "problems": [(rank, why)], "unchecked": [names and why]}``. A family that derives nothing
    costs no round trip (``checked`` 0). Refused by name on a sleeping / shut-down engine and during a refit."""
    llm = as_llm(llm)
    family = FAMILIES.get(getattr(llm.llm_engine.model_config.hf_config, "model_type", None))
    if family is None or not family.derived_tensors:
        return {"checked": 0, "problems": [], "unchecked": []}
    check_awake(llm, "the derived-tensor check")
    with engine_busy(llm, "the derived-tensor check", exclusive=False):
        answers = llm.collective_rpc(_rpc_derived_tensors)
    return {"checked": sum(len(a["checked"]) for a in answers),
            "problems": [(rank, why) for rank, a in enumerate(answers) for why in a["problems"]],
            "unchecked": sorted({n for a in answers for n in a["unchecked"]})}


def decode_token_ids(llm, prompts: list[list[int]], decode_tokens: int, seed: int | list[int],
                     salt: str | None | list[str | None]):
    """``[(token ids, log-probs float64, cached prompt tokens)]``: vLLM's own decode of ``decode_tokens`` tokens from
    each token-id prompt (temperature 1, seed ``seed + i``, its processed log-probs), through its prefix cache unless
    ``salt`` (a ``cache_salt``) makes the run cold: the certificate's prefix-cache check (:mod:`moealign.rl.certify`).
    ``seed`` / ``salt`` may also be lists, one per prompt (a cached and a cold run of the same prompts in one call)."""
    from vllm import SamplingParams as VllmSamplingParams

    salts = list(salt) if isinstance(salt, (list, tuple)) else [salt] * len(prompts)
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed + i for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": p, **({"cache_salt": x} if x else {})} for p, x in zip(prompts, salts)]
    params = [VllmSamplingParams(n=1, temperature=1.0, max_tokens=decode_tokens, seed=x, logprobs=0,
                                 detokenize=False) for x in seeds]
    outs = llm.generate(inputs, params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lp = torch.tensor([float(d[t].logprob) for d, t in zip(c.logprobs or [], c.token_ids)], dtype=torch.float64)
        result.append((list(c.token_ids), lp, int(o.num_cached_tokens or 0)))
    return result
