"""Benchmark the rollout-correction pipeline against the memory-traffic floor.

The floor is cloning the three input tensors (old, rollout, mask), measured in the same run and
interleaved with the pipeline so both see the same allocator and cache state. The pipeline is the full
entry point: IS + RS + every metric it computes, with one host sync (as a training step would do).

    python tools/bench_correction.py                     # B x T = 512 x 2048 fp32, CPU, eager + fused
    python tools/bench_correction.py --device cuda       # on a GPU
    python tools/bench_correction.py --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from moealign.correction import (
    RolloutCorrectionConfig,
    compute_rollout_correction_and_rejection_mask,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved as _interleaved  # noqa: E402
from _timing import write_json  # noqa: E402

PRESETS = ("decoupled_geo_rs_seq_tis", "decoupled_token_icepop")


def warm_allocator() -> bool:
    """Keep freed large blocks in glibc's heap (no mmap/munmap per 4 MB tensor), so that neither the
    floor nor the pipeline pays page faults for fresh pages: the floor is then memory traffic alone.
    Without this, which of them page-faults depends on glibc's adaptive mmap threshold, and the ratio
    swings between runs (floor 0.5 to 3 ms here)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))
    except OSError:
        return False


def make_inputs(batch: int, tokens: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, tokens, generator=g) * 4.0
    rollout = (old + torch.randn(batch, tokens, generator=g) * 0.02).clamp(max=0.0)  # log-probs <= 0
    lengths = torch.randint(tokens // 4, tokens + 1, (batch,), generator=g)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.float32)
    return old.to(device), rollout.to(device), mask.to(device)


def interleaved(fns: dict, device: str, repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median milliseconds per function over ``repeats`` interleaved rounds, after ``warmup`` rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    t = _interleaved(fns, repeats, device)
    return {name: t[f"{name}_median"] * 1e3 for name in fns}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-fused", action="store_true", help="skip the torch.compile path")
    ap.add_argument("--json", default=None)
    ap.add_argument("--default-allocator", action="store_true",
                    help="leave glibc's malloc as it is (page faults make the floor noisy)")
    args = ap.parse_args(argv)
    warm = False if args.default_allocator else warm_allocator()

    old, rollout, mask = make_inputs(args.batch, args.tokens, args.device)
    floor = lambda: (old.clone(), rollout.clone(), mask.clone())  # noqa: E731
    fns = {"floor: clone x3": floor}
    variants = [("eager", False)] + ([] if args.no_fused else [("fused", True)])
    for preset in PRESETS:
        kw = RolloutCorrectionConfig.preset(preset).to_kwargs()
        for label, fused in variants:
            for agreement in (False, True):
                name = f"{preset} [{label}{' +agreement' if agreement else ''}]"

                def run(kw=kw, fused=fused, agreement=agreement):
                    w, m, metrics = compute_rollout_correction_and_rejection_mask(
                        old, rollout, mask, fused=fused, agreement_metrics=agreement, **kw)
                    return metrics.to_floats()

                if fused:
                    t0 = time.perf_counter()
                    run()
                    print(f"# compiled {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
                fns[name] = run
    times = interleaved(fns, args.device, args.repeats)
    base = times["floor: clone x3"]
    print(f"B x T = {args.batch} x {args.tokens} float32 on {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}, "
          f"allocator: {'warm (no page faults)' if warm else 'default'}")
    print(f"{'case':<58} {'ms':>9} {'x floor':>8}")
    rows = []
    for name, ms in times.items():
        print(f"{name:<58} {ms:9.2f} {ms / base:8.2f}")
        rows.append({"case": name, "ms": ms, "ratio_to_floor": ms / base})
    if args.json:
        write_json(args.json, {"batch": args.batch, "tokens": args.tokens, "device": args.device,
                               "warm_allocator": warm, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
