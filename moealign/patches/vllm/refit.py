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
vocabulary is refused by name with nothing sent. Checkpoints that store experts one by one
(``experts.{e}.gate_proj.weight``) get the trainer's fused expert tensors split to match (:func:`checkpoint_named`).

**The proof.** :func:`held_tensors` reads, in every worker, what the kernels hold, in transformers names and this
rank's shard: plain parameters as they are; linear layers whose weight the CPU build moved into a oneDNN / packed
kernel (the parameter left empty) are read back *through the kernel* (``cpu_linear`` applied to the identity
matrix: exact, every output is one product with 1.0); prepacked MoE experts as packed bytes, per expert.
:func:`verify_weights` fingerprints (:func:`moealign.contract.tensor_fingerprint`) the expected tensors the same way (sliced for the rank, cast to the held dtype, packed
with the worker's own prepack op where the worker packs) and names every (tensor, worker) that differs.
Un-fusing is written for the qwen3_moe layout (``qkv_proj``, ``gate_up_proj``, ``w13`` / ``w2``); another family is
refused by name.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch

from ...contract import tensor_fingerprint
from ...errors import ConfigError, InputTypeError, RefitError, UnsupportedEngineError, UnsupportedModelError
from ...handle import PatchHandle
from .._version import check_engine_version, require_attr
from .engine import vllm_version

__all__ = ["SUPPORTED_VLLM_REFIT", "RefitResult", "WeightCheck", "CPUExpertsPrepack", "apply_cpu_experts_prepack",
           "checkpoint_layout",
           "checkpoint_named", "check_manifest", "refit_weights", "held_tensors", "verify_weights"]

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


def _engine_model_path(llm: Any) -> str:
    engine = getattr(llm, "llm_engine", None)
    if engine is None:
        raise InputTypeError(f"llm must be a vllm.LLM, got {type(llm).__name__}")
    return str(engine.model_config.model)


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
    from .rollout import _worker_runner

    return _worker_runner(worker)


def _rpc_begin(worker, key: str) -> bool:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    if key in _WORKER_STATE:
        raise RefitError(f"a refit {key!r} is already under way in this worker")
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


def _rpc_finish(worker, key: str) -> list[str]:
    """Process the layers, put the kernels' tensors back, undo the patch, reset caches; the parameters not loaded."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    state = _WORKER_STATE.pop(key, None)
    if state is None:
        return ["<no refit under way in this worker>"]
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


def _finite(chunk: list) -> list:
    """``chunk``, after one host read saying every floating tensor in it is finite (a NaN / Inf tensor is named, and
    refused before it reaches a worker)."""
    floats = [(n, t) for n, t in chunk if t.is_floating_point()]
    if floats and not bool(torch.stack([torch.isfinite(t).all() for _, t in floats]).all()):
        bad = next(n for n, t in floats if not bool(torch.isfinite(t).all()))
        raise RefitError(f"refit stream: {bad!r} holds NaN or Inf")
    return chunk


def _chunks(named: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list]:
    chunk, size = [], 0
    for name, tensor in named:
        chunk.append((name, tensor.detach().contiguous()))
        size += tensor.numel() * tensor.element_size()
        if size >= limit:
            yield _finite(chunk)
            chunk, size = [], 0
    if chunk:
        yield _finite(chunk)


def refit_weights(llm: Any, named: Iterable[tuple[str, torch.Tensor]], manifest: Mapping[str, tuple[int, ...]], *,
                  chunk_bytes: int = CHUNK_BYTES) -> RefitResult:
    """Push ``named`` (``(checkpoint name, full unsharded tensor)``, streamed lazily) into every worker of ``llm`` in
    place (see the module docstring). ``manifest`` (``{name: shape}`` of exactly what ``named`` yields) is checked
    against the engine's checkpoint before any work (:func:`check_manifest`); a stream that then yields a name or
    shape outside the manifest, or leaves a parameter of the engine unloaded, raises
    :class:`~moealign.errors.RefitError` (the engine's weights are then undefined: refit again or reopen it)."""
    _check_refit_version()
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")
    layout = checkpoint_layout(_engine_model_path(llm))
    check_manifest(manifest, layout)
    key = uuid.uuid4().hex
    t0 = time.perf_counter()
    tensors = nbytes = chunks = 0
    seen: set[str] = set()

    def checked():
        nonlocal tensors, nbytes
        for name, tensor in named:
            if not isinstance(tensor, torch.Tensor):
                raise RefitError(f"refit stream: {name!r} is a {type(tensor).__name__}, not a tensor")
            if name not in manifest or tuple(tensor.shape) != tuple(manifest[name]) or name in seen:
                raise RefitError(f"refit stream: {name!r} {tuple(tensor.shape)} is not what the manifest announced "
                                 f"({manifest.get(name, 'absent')}{', twice' if name in seen else ''})")
            seen.add(name)
            tensors += 1
            nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    workers = len(llm.collective_rpc(_rpc_begin, args=(key,)))
    unloaded: list = []
    try:
        for chunk in _chunks(checked(), chunk_bytes):
            llm.collective_rpc(_rpc_load, args=(key, chunk))
            chunks += 1
    finally:
        unloaded = llm.collective_rpc(_rpc_finish, args=(key,))
    missing = sorted(set(manifest) - seen)
    if missing:
        raise RefitError(f"refit stream ended without {len(missing)} announced tensors: {missing[:4]}")
    for rank, names in enumerate(unloaded):
        if names:
            raise RefitError(f"refit left {len(names)} parameters of vLLM worker {rank} unloaded: {names[:4]}")
    reset = getattr(llm, "reset_prefix_cache", None)
    if callable(reset):
        reset()
    return RefitResult(tensors=tensors, bytes=nbytes, chunks=chunks, workers=workers,
                       seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------
# reading back what the workers hold
# --------------------------------------------------------------------------------------------------


def _read_linear(module, param: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A linear layer's weight as its kernel computes with it (``[out, in]`` of this rank): the parameter, or
    where the CPU build moved it into a packed / oneDNN kernel (parameter left empty), ``cpu_linear(I)^T``."""
    if param.numel() > 0 or not callable(getattr(module, "cpu_linear", None)):
        return param.detach(), False
    k = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
    if not isinstance(k, int) or k < 1:
        raise UnsupportedEngineError(f"{type(module).__name__}: its weight is packed into a CPU kernel and its input "
                                     f"size is not stated; it cannot be read back")
    eye = torch.eye(k, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        return module.cpu_linear(eye, param, None).t().contiguous(), True


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
            put(pname, param.detach()[:rows], ("rows", int(idx.org_vocab_start_index), int(idx.org_vocab_end_index)))
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
    """Per worker (rank order), what it holds: ``{transformers name: (digest, shape, dtype, shard, packed)}``."""
    _check_refit_version()
    if getattr(llm, "llm_engine", None) is None:
        raise InputTypeError(f"llm must be a vllm.LLM, got {type(llm).__name__}")
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
                result.mismatches.append((name, rank, "held bytes differ"))
    result.seconds = time.perf_counter() - t0
    return result
