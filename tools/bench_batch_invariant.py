"""Batch-invariant ops against the stock ones: seconds per call and the ratio, min-of-N.

Matmul: ``bi_matmul([M, K] x [K, N])`` vs ``torch.matmul`` for several M (the batch rows). With
``--reductions``, also ``bi_log_softmax`` / ``bi_rms_norm`` vs their stock forms on ``[M, V]`` / ``[M, H]``.
With ``--attention``, ``bi_attention`` (causal, some rows left-padded, 4 query heads over 2 key/value heads of 32)
vs stock ``scaled_dot_product_attention`` with the same mask, for ``batch x length`` shapes; the row ``bi_attn@64``
is ``bi_attention`` with 64-query chunks (the CPU default before chunks were sized by ``CPU_CHUNK_BYTES``).
Each pair is timed in interleaved rounds (tools/_timing.py); the ratio is ours / stock in the same run.

    python tools/bench_batch_invariant.py                       # CPU, fp32, K = N = 1024
    python tools/bench_batch_invariant.py --dtype bf16 --reductions
    python tools/bench_batch_invariant.py --device cuda --backend triton
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from _timing import interleaved, write_json  # noqa: E402

from moealign.precision.batch_invariant import (  # noqa: E402
    DEFAULT_ROW_TILE,
    bi_log_softmax,
    bi_matmul,
    bi_rms_norm,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def bench_matmul(args, dtype) -> list[dict]:
    gen = torch.Generator(device=args.device).manual_seed(0)
    w = torch.randn(args.k, args.n, device=args.device, generator=gen).to(dtype)
    rows = []
    for m in args.m:
        x = torch.randn(m, args.k, device=args.device, generator=gen).to(dtype)
        t = interleaved({
            "stock": lambda: torch.matmul(x, w),
            "ours": lambda: bi_matmul(x, w, row_tile=args.row_tile, backend=args.backend),
        }, args.repeats, args.device)
        rows.append({"op": "matmul", "shape": f"[{m},{args.k}]x[{args.k},{args.n}]", "m": m,
                     "stock_ms": t["stock"] * 1e3, "ours_ms": t["ours"] * 1e3, "ratio": t["ours"] / t["stock"],
                     "ratio_median": t["ours_median"] / t["stock_median"]})
    return rows


def bench_reductions(args, dtype) -> list[dict]:
    gen = torch.Generator(device=args.device).manual_seed(1)
    rows = []
    weight = torch.randn(args.hidden, device=args.device, generator=gen).to(dtype)

    def stock_rms(x):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    for m in args.m:
        logits = torch.randn(m, args.vocab, device=args.device, generator=gen).to(dtype)
        hidden = torch.randn(m, args.hidden, device=args.device, generator=gen).to(dtype)
        cases = {
            ("log_softmax", f"[{m},{args.vocab}]"): (
                lambda: torch.log_softmax(logits.float(), -1),
                lambda: bi_log_softmax(logits, dtype=torch.float32, backend=args.backend)),
            ("rms_norm", f"[{m},{args.hidden}]"): (
                lambda: stock_rms(hidden), lambda: bi_rms_norm(hidden, weight, backend=args.backend)),
        }
        for (op, shape), (stock, ours) in cases.items():
            t = interleaved({"stock": stock, "ours": ours}, args.repeats, args.device)
            rows.append({"op": op, "shape": shape, "m": m, "stock_ms": t["stock"] * 1e3,
                         "ours_ms": t["ours"] * 1e3, "ratio": t["ours"] / t["stock"],
                         "ratio_median": t["ours_median"] / t["stock_median"]})
    return rows


def bench_attention(args, dtype) -> list[dict]:
    from moealign.precision.bi_attention import bi_attention

    gen = torch.Generator(device=args.device).manual_seed(2)
    H, Hkv, D = 4, 2, 32
    rows = []
    for B, L in args.attention_shapes:
        q = torch.randn(B, H, L, D, device=args.device, generator=gen).to(dtype)
        k = torch.randn(B, Hkv, L, D, device=args.device, generator=gen).to(dtype)
        v = torch.randn(B, Hkv, L, D, device=args.device, generator=gen).to(dtype)
        valid = torch.ones(B, L, dtype=torch.bool, device=args.device)
        valid[::3, : L // 8] = False                                   # left padding in every third row
        mask = (torch.ones(L, L, dtype=torch.bool, device=args.device).tril()[None] & valid[:, None, :])[:, None]
        kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        stock = lambda: torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)  # noqa: E731
        cases = {"bi_attn": lambda: bi_attention(q, k, v, mask),
                 "bi_attn@64": lambda: bi_attention(q, k, v, mask, query_chunk=64)}
        for op, ours in cases.items():
            t = interleaved({"stock": stock, "ours": ours}, args.repeats, args.device)
            rows.append({"op": op, "shape": f"{B}x{L}", "m": B * L, "stock_ms": t["stock"] * 1e3,
                         "ours_ms": t["ours"] * 1e3, "ratio": t["ours"] / t["stock"],
                         "ratio_median": t["ours_median"] / t["stock_median"]})
    return rows


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        out = []
    if not out or any(len(t) != 2 or min(t) < 1 for t in out):
        raise argparse.ArgumentTypeError(f"expected BxL,BxL,..., got {text!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--m", type=_ints, default=[1, 8, 64, 256, 1024, 2048], help="batch rows, comma-separated")
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--row-tile", type=int, default=DEFAULT_ROW_TILE, help="torch path: rows per GEMM call")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--reductions", action="store_true", help="also time log_softmax and RMSNorm")
    ap.add_argument("--attention", action="store_true", help="also time bi_attention against stock SDPA")
    ap.add_argument("--attention-shapes", type=_shapes, default=[(8, 64), (16, 96), (8, 300)],
                    help="batch x length pairs for --attention (default 8x64,16x96,8x300)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    ap.add_argument("--json", help="write the rows as JSON")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]

    rows = bench_matmul(args, dtype)
    if args.reductions:
        rows += bench_reductions(args, dtype)
    if args.attention:
        rows += bench_attention(args, dtype)

    print(f"device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} row_tile={args.row_tile} "
          f"backend={args.backend} repeats={args.repeats} (min of N; ratio = ours / stock)")
    print(f"{'op':<12} {'shape':<24} {'stock ms':>10} {'ours ms':>10} {'ratio':>7} {'(median)':>9}")
    for r in rows:
        print(f"{r['op']:<12} {r['shape']:<24} {r['stock_ms']:>10.3f} {r['ours_ms']:>10.3f} "
              f"{r['ratio']:>6.2f}x {r['ratio_median']:>8.2f}x")
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, {"args": meta, "threads": torch.get_num_threads(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
