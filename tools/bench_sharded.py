"""Benchmark: moealign's own per-rank work in a replayed step of the sharded Megatron trainer, as the world grows.

The embedded model in :class:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer` worlds of 1, 2 and 4 rank
processes (default layouts: one rank, EP 2, TP 2 x EP 2; gloo on CPU), all open at once, their replayed forwards
interleaved round by round (the same run, the same machine load). Each rank times its own replay work
(:data:`~moealign.patches.megatron.sharded.TIMERS`): ``set_routes`` (the micro-batch's ReplayBatch built and handed
to the stage's routers), ``token_check`` (every router row's token, the driver's forward pre-hook), ``verifier``
(the routing maps each dispatcher received against the routes set) and ``check`` (the counters read after the
schedule), in CPU time of the rank's thread (not the time it waited for a core: on 2 cores a world of 4 waits).
Printed per world: the busiest rank's own work per step (minimum over rounds), its share of that rank's forward
(CPU time too), and the ratio to the one-rank world, for

* ``weak`` scaling: the same samples per data-parallel rank (the global batch grows with DP): the per-rank work
  must stay constant (ratio ~1);
* ``strong`` scaling: the same global batch: the per-rank work must not grow (ratio <= 1).

The routes are random distinct experts per row (every router replays every row). On a machine with fewer cores than
ranks the ranks share the cores: wall-clock times grow with the world, CPU times do not (caches and frequency
aside), so the ratios are of CPU time.

    python tools/bench_sharded.py                          # embedded model, CPU, 8 samples x 64 tokens per DP rank
    python tools/bench_sharded.py --layouts 1,ep2,ep2pp2 --samples 4 --length 128 --rounds 7 --json out.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from _timing import write_json  # noqa: E402

OWN = ("set_routes", "token_check", "verifier", "check")


def parse_layout(text: str) -> dict:
    """``"1"`` -> one rank; ``"tp2ep2"`` / ``"ep2pp2"`` -> ``{"tp": 2, "ep": 2}``."""
    if text == "1":
        return {}
    parts = re.fullmatch(r"((?:(?:tp|ep|pp)\d+)+)", text)
    if not parts:
        raise SystemExit(f"--layouts: {text!r} is not 1 or a string such as tp2ep2 / ep2pp2")
    return {k: int(v) for k, v in re.findall(r"(tp|ep|pp)(\d+)", text)}


def make_record(meta, n: int, length: int, prompt: int, seed: int):
    """``n`` samples of ``length`` random tokens, each row's routes ``top_k`` random distinct experts (the model's
    ``meta``: :meth:`ShardedMegatronTrainer.meta`)."""
    from moealign.record import RolloutRecord, Sample

    E, K, L, V = meta.num_experts, meta.top_k, len(meta.moe_layers), meta.vocab_size
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        ids = torch.randint(2, V, (length,), generator=g)
        routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range((length - 1) * L)])
        samples.append(Sample(token_ids=ids, prompt_len=prompt, logprobs=torch.full((length - prompt,), -1.0),
                              routes=routes.reshape(length - 1, L, K).to(torch.uint8)))
    return RolloutRecord(meta, samples)


def own_work(fwd) -> tuple[float, float, dict]:
    """(the busiest rank's own replay work, that rank's forward, its timers), CPU seconds of the rank's thread."""
    per_rank = [(sum(r["timings"][k] for k in OWN), r["timings"]["forward_cpu"], r["timings"]) for r in fwd.ranks]
    return max(per_rank, key=lambda row: row[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="1,ep2,tp2ep2", help="comma-separated: 1, ep2, tp2, pp2, tp2ep2, ep2pp2, ...")
    ap.add_argument("--samples", type=int, default=8, help="samples per data-parallel rank (weak scaling)")
    ap.add_argument("--length", type=int, default=64, help="tokens per sample")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    from moealign.embedded import embedded_model_path
    from moealign.patches.megatron.sharded import ShardedMegatronTrainer

    layouts = [(name, parse_layout(name)) for name in args.layouts.split(",")]
    trainers = {}
    warnings.filterwarnings("ignore", message=".*it will be slow")      # said once below, with the core count
    try:
        t0 = time.perf_counter()
        for name, sizes in layouts:
            trainers[name] = ShardedMegatronTrainer(embedded_model_path(), dispatcher=args.dispatcher, timeout_s=600,
                                                    **sizes)
        print(f"{len(trainers)} worlds started in {time.perf_counter() - t0:.1f} s "
              f"({sum(t.layout.world for t in trainers.values())} rank processes, {os.cpu_count()} cores)",
              file=sys.stderr)
        dp_max = max(t.layout.dp for t in trainers.values())
        record = make_record(next(iter(trainers.values())).meta(), args.samples * dp_max, args.length, args.length // 4, seed=0)
        best: dict[tuple[str, str], tuple[float, float, dict]] = {}
        for name, trainer in trainers.items():            # warm-up: one replayed forward each
            trainer.forward(record, range(args.samples), replay=True)
        for _ in range(args.rounds):
            for name, trainer in trainers.items():
                for mode, n in (("weak", args.samples * trainer.layout.dp), ("strong", args.samples)):
                    fwd = trainer.forward(record, range(n), replay=True)
                    assert fwd.flips.router_flip_rate == 0.0
                    row = own_work(fwd)
                    key = (name, mode)
                    if key not in best or row[0] < best[key][0]:
                        best[key] = row
        rows = []
        base = {mode: best[(layouts[0][0], mode)][0] for mode in ("weak", "strong")}
        print(f"{'layout':<10} {'world':>5} {'mode':<7} {'samples':>7} {'own CPU ms':>11} {'fwd CPU ms':>11} "
              f"{'share':>6} {'ratio':>6}")
        for name, trainer in trainers.items():
            for mode in ("weak", "strong"):
                own, forward, timers = best[(name, mode)]
                n = args.samples * (trainer.layout.dp if mode == "weak" else 1)
                ratio = own / base[mode]
                rows.append(dict(layout=name, world=trainer.layout.world, parallel=trainer.layout.as_dict(),
                                 mode=mode, samples=n, own_s=own, rank_forward_cpu_s=forward, share=own / forward,
                                 ratio_to_world_1=ratio, timers=timers))
                print(f"{name:<10} {trainer.layout.world:>5} {mode:<7} {n:>7} {own * 1e3:>11.2f} "
                      f"{forward * 1e3:>11.1f} {own / forward:>6.1%} {ratio:>6.2f}")
        if args.json:
            write_json(args.json, {"rows": rows, "samples_per_dp_rank": args.samples, "length": args.length,
                                   "rounds": args.rounds, "dispatcher": args.dispatcher, "cores": os.cpu_count()})
    finally:
        for trainer in trainers.values():
            trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
