"""The timing loop the benchmark scripts share: interleaved rounds, minimum and median per variant."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def interleaved(fns: dict, repeats: int, device: str = "cpu") -> dict[str, float]:
    """Seconds per call of each function: minimum over ``repeats`` interleaved rounds (on a shared
    machine the minimum is the run least disturbed by other processes), plus ``<name>_median``."""
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    out = {name: min(ts) for name, ts in times.items()}
    out.update({f"{name}_median": statistics.median(ts) for name, ts in times.items()})
    return out
