"""Sweep the batch-invariant Triton matmul's tile configurations on a GPU (the data behind ``matmul_config``).

    python tools/sweep_bi_matmul.py --json sweep.json                  # on a machine with one GPU
    TRITON_INTERPRET=1 python tools/sweep_bi_matmul.py --device cpu --quick   # dry run (Triton's interpreter)

For each configuration ``(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)`` and each loop form (the persistent loop
flattened or not) it compiles a copy of :mod:`moealign.precision.batch_invariant_triton`'s kernel, checks it
(every row of an ``m``-row product equals, ``torch.equal``, the same row of the largest product: the invariance a
configuration must keep; the error against an fp32 reference), and times the kernel alone
(``triton.testing.do_bench``, CUDA events) against ``torch.matmul`` measured in the same run. A configuration
must serve every ``M`` (it may depend on ``N``, ``K`` and the dtype only), so the table ranks configurations by
their worst ratio over the batch sizes.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _timing import write_json  # noqa: E402
from moealign.precision import batch_invariant_triton as tbi  # noqa: E402

CONFIGS = [
    (128, 64, 64, 5, 4), (128, 64, 64, 4, 4), (128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4),
    (128, 256, 64, 3, 8), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (128, 128, 128, 3, 8), (64, 256, 64, 3, 8),
    (128, 128, 32, 4, 4), (256, 128, 64, 3, 8), (64, 128, 128, 3, 4), (128, 64, 128, 3, 4),
]


def _variant(flatten: bool):
    """The module with the persistent loop's ``flatten`` set (a copy compiled from a temporary file)."""
    src = inspect.getsource(tbi).replace("NUM_PROGRAMS):", f"NUM_PROGRAMS, flatten={flatten}):")
    assert f"flatten={flatten}" in src, "the kernel's persistent loop changed: update the sweep"
    src = src.replace("from ..errors import InputError", "from moealign.errors import InputError")
    path = os.path.join(tempfile.mkdtemp(prefix="sweep-bi-"), f"tbi_flatten_{int(flatten)}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"tbi_flatten_{int(flatten)}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and two configurations (the dry run)")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--m", default="1,64,1024,4096")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    ms = [int(x) for x in args.m.split(",")]
    configs = CONFIGS
    if args.quick:
        args.k, args.n, ms = 64, 64, [1, 8]
        configs = [(16, 16, 16, 1, 1), (16, 32, 16, 1, 1)]
        dtype = torch.float16 if dtype == torch.bfloat16 else dtype
    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(0)
    a_full = torch.randn(max(ms), args.k, device=dev, generator=gen).to(dtype)
    b = torch.randn(args.k, args.n, device=dev, generator=gen).to(dtype)
    ref = a_full.float() @ b.float()

    def bench(fn):
        if dev.startswith("cuda"):
            import triton.testing
            return triton.testing.do_bench(fn, warmup=10, rep=40)
        import time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    stock = {m: bench(lambda m=m: torch.matmul(a_full[:m], b)) for m in ms}
    print(f"device {torch.cuda.get_device_name(0) if dev.startswith('cuda') else dev}, {args.dtype}, "
          f"K={args.k} N={args.n}; torch.matmul ms: " + ", ".join(f"m={m}: {stock[m]:.4f}" for m in ms), flush=True)
    from moealign.precision.batch_invariant import bi_matmul
    wrapped = {m: bench(lambda m=m: bi_matmul(a_full[:m], b)) for m in ms}
    kernel = {m: bench(lambda m=m: tbi.matmul(a_full[:m], b)) for m in ms}
    print("the shipped path: bi_matmul ms " + ", ".join(f"m={m}: {wrapped[m]:.4f}" for m in ms)
          + "; its kernel call alone ms " + ", ".join(f"m={m}: {kernel[m]:.4f}" for m in ms), flush=True)
    rows = []
    for flatten in (True, False):
        mod = _variant(flatten)
        for cfg in configs:
            row = {"config": list(cfg), "flatten": flatten}
            try:
                full = mod.matmul(a_full, b, config=cfg)
                row["invariant"] = all(torch.equal(mod.matmul(a_full[:m], b, config=cfg), full[:m]) for m in ms)
                row["max_rel_err"] = float(((full.float() - ref).abs().max() / ref.abs().max()).item())
                row["ms"] = {m: bench(lambda m=m: mod.matmul(a_full[:m], b, config=cfg)) for m in ms}
                row["ratio"] = {m: row["ms"][m] / stock[m] for m in ms}
                row["worst"] = max(row["ratio"].values())
            except Exception as e:      # noqa: BLE001 - a config that does not compile (shared memory) is listed
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            rows.append(row)
            if "error" in row:
                print(f"flatten={flatten!s:5} {cfg}: {row['error']}", flush=True)
            else:
                print(f"flatten={flatten!s:5} {cfg}: invariant {row['invariant']}, err {row['max_rel_err']:.2e}, "
                      + ", ".join(f"m={m}: {row['ms'][m]:.4f} ms {row['ratio'][m]:.2f}x" for m in ms), flush=True)
    ok = sorted((r for r in rows if r.get("invariant")), key=lambda r: r["worst"])
    print("best by worst ratio:")
    for r in ok[:5]:
        print(f"  flatten={r['flatten']!s:5} {tuple(r['config'])}: worst {r['worst']:.2f}x")
    if args.json:
        write_json(args.json, {"dtype": args.dtype, "k": args.k, "n": args.n, "stock_ms": stock,
                               "bi_matmul_ms": wrapped, "kernel_ms": kernel, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
