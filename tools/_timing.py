"""What the benchmark scripts share: the interleaved timing loop (minimum and median per variant) and the
atomic JSON write of their results."""

from __future__ import annotations

import json
import pathlib
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
    out["_rounds"] = times            # every round's seconds per variant (paired comparisons: paired_median)
    return out


def paired_median(result: dict, name: str, baseline: str) -> float:
    """Median over the rounds of ``name`` minus ``baseline`` timed in the same round (the two ran back to back, so
    load that lasts longer than a round cancels): a sturdier estimate of a small cost than a difference of minima."""
    rounds = result["_rounds"]
    return statistics.median(a - b for a, b in zip(rounds[name], rounds[baseline]))


def write_json(path: str, result) -> None:
    """Write ``result`` as indented JSON at ``path``, atomically (``moealign._files.atomic_write``)."""
    from moealign._files import atomic_write

    text = json.dumps(result, indent=2)
    atomic_write(path, lambda tmp: pathlib.Path(tmp).write_text(text), flag="--json")
