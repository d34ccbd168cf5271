"""Can this machine run a precision policy? GPU compute capability through torch.cuda or NVML.

Native kernels need: float16 tensor cores 7.0 (Volta), bfloat16 8.0 (Ampere), FP8 8.9 (Ada / Hopper).
:func:`supports` answers ``(ok, reason)`` and never raises for a missing GPU, driver or ``pynvml``: the
reason says what is missing. On CPU every policy runs (FP8 as the simulation of
:mod:`moealign.precision.fp8`).

GPUs are found through ``torch.cuda`` when torch was built with CUDA and sees a device, else through
NVML (``moealign.info.nvml_gpus``, the same probe ``moealign info`` prints), which works with a CPU-only
torch on a GPU machine.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass

import torch

from .policy import PrecisionPolicy, get_policy

__all__ = ["GpuCapability", "MIN_CAPABILITY", "amx_tiles_permitted", "gpu_capabilities", "request_amx_tiles",
           "required_capability", "supports"]

MIN_CAPABILITY = {"fp16": (7, 0), "bf16": (8, 0), "fp8": (8, 9)}


@dataclass(frozen=True)
class GpuCapability:
    index: int
    name: str
    major: int
    minor: int
    source: str          # "torch.cuda" or "nvml"

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)


def gpu_capabilities() -> tuple[list[GpuCapability], str]:
    """``(gpus, note)``: the visible GPUs and their compute capability, and where they came from (or
    why there are none). Never raises."""
    try:
        if torch.cuda.is_available():
            gpus = []
            for i in range(torch.cuda.device_count()):
                major, minor = torch.cuda.get_device_capability(i)
                gpus.append(GpuCapability(i, torch.cuda.get_device_name(i), major, minor, "torch.cuda"))
            return gpus, "torch.cuda"
    except Exception as exc:  # noqa: BLE001 - a broken CUDA runtime means "no usable GPU here"
        torch_note = f"torch.cuda failed: {type(exc).__name__}: {exc}"
    else:
        torch_note = "torch.cuda sees no device" if torch.version.cuda else "torch is a CPU build"
    from ..info import (
        nvml_gpus,  # stdlib + pynvml (optional); shared with `moealign info`
    )

    nvml = nvml_gpus()
    if "error" in nvml:
        return [], f"no GPU: {torch_note}; {nvml['error']}"
    gpus = []
    for g in nvml["gpus"]:
        cc = g.get("compute_capability")
        if not cc:
            continue
        major, minor = (int(x) for x in str(cc).split(".")[:2])
        gpus.append(GpuCapability(int(g["index"]), str(g["name"]), major, minor, "nvml"))
    if not gpus:
        return [], f"no GPU: {torch_note}; NVML lists {len(nvml['gpus'])} device(s) without a compute capability"
    return gpus, f"nvml ({torch_note})"


def required_capability(policy: str | PrecisionPolicy) -> tuple[int, int] | None:
    """The compute capability ``policy``'s native kernels need (``None`` for fp32)."""
    policy = get_policy(policy)
    needs = []
    dtypes = {policy.dtype, policy.module_dtype("router"), policy.module_dtype("lm_head")}
    if torch.float16 in dtypes:
        needs.append(MIN_CAPABILITY["fp16"])
    if torch.bfloat16 in dtypes:
        needs.append(MIN_CAPABILITY["bf16"])
    if policy.fp8 is not None:
        needs.append(MIN_CAPABILITY["fp8"])
    return max(needs) if needs else None


def supports(policy: str | PrecisionPolicy, device: str | torch.device = "cuda", *,
             gpus: list[GpuCapability] | None = None) -> tuple[bool, str]:
    """``(ok, reason)``: can ``policy`` run natively on ``device``?

    ``device``: ``"cpu"``, ``"cuda"`` (every visible GPU must qualify) or ``"cuda:<i>"``. ``gpus`` replaces
    the probe (tests, or a description of another machine).
    """
    policy = get_policy(policy)
    device = torch.device(device)
    if device.type == "cpu":
        if policy.fp8 is not None:
            return True, (f"{policy.name} on CPU: FP8 is simulated (moealign.precision.fp8 fake quantisation, "
                          f"compute in {str(policy.dtype).replace('torch.', '')})")
        return True, f"{policy.name} on CPU"
    if device.type != "cuda":
        return False, f"device type {device.type!r} is not checked (cpu and cuda are)"
    note = "given"
    if gpus is None:
        gpus, note = gpu_capabilities()
    if not gpus:
        return False, f"{policy.name} needs a CUDA GPU here; {note}"
    if device.index is not None:
        chosen = [g for g in gpus if g.index == device.index]
        if not chosen:
            return False, f"no GPU with index {device.index} (visible: {[g.index for g in gpus]})"
        gpus = chosen
    need = required_capability(policy)
    if need is None:
        return True, f"{policy.name}: any GPU ({len(gpus)} visible, via {note})"
    weak = [g for g in gpus if g.capability < need]
    if weak:
        listing = ", ".join(f"[{g.index}] {g.name} sm {g.major}.{g.minor}" for g in weak)
        hint = " (simulate it with moealign.precision.fp8.fake_quant_fp8_)" if policy.fp8 is not None else ""
        return False, f"{policy.name} needs compute capability {need[0]}.{need[1]}; {listing} below it{hint}"
    return True, f"{policy.name}: compute capability >= {need[0]}.{need[1]} on {len(gpus)} GPU(s) (via {note})"


# --------------------------------------------------------------------------------------------------
# AMX tiles on x86 CPUs (Linux)
# --------------------------------------------------------------------------------------------------

_SYS_ARCH_PRCTL = 158                  # x86_64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _arch_prctl(code: int, arg) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(code), arg)


def _linux_x86_64() -> bool:
    return os.name == "posix" and platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def amx_tiles_permitted() -> bool:
    """Whether this process may execute AMX tile instructions (Linux x86_64: ``ARCH_GET_XCOMP_PERM`` has
    ``XFEATURE_XTILEDATA``). False on a CPU without AMX and on every other platform."""
    if not _linux_x86_64():
        return False
    mask = ctypes.c_uint64(0)
    if _arch_prctl(_ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def request_amx_tiles() -> bool:
    """Ask Linux for this process's permission to use AMX tiles; return whether it now has it.

    Linux (5.16+) lets a process execute AMX tile instructions only after it asked for them
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); the first tile instruction of a process that did not
    ask dies by SIGILL. oneDNN asks before its own AMX GEMMs run, and vLLM's CPU kernels (its ``amx`` attention ISA,
    its prepacked ``amx`` MoE experts) rely on that having happened; a forward in which moealign replaced those GEMMs
    (the tree forward, the canonical ops with stock attention) never asks, so vLLM's next kernel kills the process.
    moealign therefore asks in every vLLM process it patches (:mod:`moealign.patches.vllm`). The request is made at
    run time on the CPU the process runs on (never decided at install or test time), is idempotent, and is a no-op
    returning False on a CPU without AMX or off Linux x86_64."""
    if not _linux_x86_64():
        return False
    if amx_tiles_permitted():
        return True
    _arch_prctl(_ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(_XFEATURE_XTILEDATA))
    return amx_tiles_permitted()
