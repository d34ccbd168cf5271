"""Tree all-reduce vs ``torch.distributed.all_reduce`` on gloo (real processes on this machine).

For each world size, every rank holds 1M fp32 elements (its partial) and we time, per repeat the slowest
rank, then the fastest repeat (min-of-N):

* ``stock``: ``y = x.clone(); dist.all_reduce(y)`` (out of place, like vLLM's all-reduce);
* ``tree_all_gather``: all-gather of all partials, then the canonical tree on every rank;
* ``tree_reduce_scatter``: all-to-all, each rank tree-reduces its 1/world slice, then all-gather of slices;
* ``tree_auto``: what ``tree_all_reduce`` picks by default ("pair" for 2 ranks: the stock all-reduce of
  the fp32 subtree roots, exact because the tree's top is one commutative addition; else reduce-scatter).

It prints the ratios tree / stock (target: at most 1.5x) and reduce-scatter-tree / all-gather-tree, and
checks that all tree algorithms give the same bits. Run: ``python tools/bench_tree_allreduce.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from moealign.precision.tree import tree_all_reduce
from moealign.tp_check import run_gloo

VARIANTS = ("stock", "tree_all_gather", "tree_reduce_scatter", "tree_auto")


def _run(variant: str, x: torch.Tensor) -> torch.Tensor:
    if variant == "stock":
        y = x.clone()
        dist.all_reduce(y)
        return y
    return tree_all_reduce(x, algorithm=variant[len("tree_"):])


def _worker(rank: int, world: int, numel: int, repeats: int) -> dict:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    out = {}
    for variant in VARIANTS:
        result = _run(variant, x)  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            _run(variant, x)
            times.append(time.perf_counter() - start)
        out[variant] = (times, result if variant != "stock" else None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"gloo, {args.numel} fp32 elements per rank, min over {args.repeats} repeats of the slowest rank "
          f"(torch {torch.__version__}, 1 thread per rank)")
    print(f"{'world':>5}  {'stock ms':>9}  {'tree AG ms':>10}  {'tree RS+AG ms':>13}  {'tree auto ms':>12}  "
          f"{'AG/stock':>8}  {'RS+AG/stock':>11}  {'auto/stock':>10}  same bits")
    for world in (int(w) for w in args.world_sizes.split(",")):
        ranks = run_gloo(world, _worker, (args.numel, args.repeats), timeout=600)
        best = {v: 1000 * min(max(r[v][0][i] for r in ranks) for i in range(args.repeats)) for v in VARIANTS}
        ref = ranks[0]["tree_all_gather"][1]
        same = all(torch.equal(r[v][1], ref) for r in ranks for v in VARIANTS[1:])
        print(f"{world:>5}  {best['stock']:>9.2f}  {best['tree_all_gather']:>10.2f}  "
              f"{best['tree_reduce_scatter']:>13.2f}  {best['tree_auto']:>12.2f}  "
              f"{best['tree_all_gather'] / best['stock']:>8.2f}  {best['tree_reduce_scatter'] / best['stock']:>11.2f}  "
              f"{best['tree_auto'] / best['stock']:>10.2f}  {same}")


if __name__ == "__main__":
    main()
