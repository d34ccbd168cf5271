"""Benchmark: the refit from a sharded Megatron trainer (``moealign.rl.refit(llm, sharded_trainer)``): time and peak
memory per process, on a random qwen3_moe of realistic width.

The model (default: tools/bench_refit.py's 432M-parameter qwen3_moe, hidden 1024, 8 layers, 32 experts top-4, 865 MB
in bf16) is built under a temporary directory at run time. A sharded trainer (default TP 2: every split tensor
joined from two ranks' slices; bf16) and a vLLM engine (bf16, TP 1, in this process) load it. Measured, each rank's
and this process's peak resident set above its size before (Linux ``VmHWM`` after ``/proc/self/clear_refs``):

* ``stream``: ``trainer.hf_tensors(chunk_bytes=C)`` read and dropped (no engine): what streaming alone holds;
* ``gather``: ``trainer.hf_shards()`` (every rank's pieces copied here at once): the baseline a stream replaces;
* ``refit``: ``refit(llm, trainer, chunk_bytes=C)`` into the engine (this process's figure includes vLLM's own
  reload, which runs here), against ``refit(llm, hf_model)`` from one process in the same run;
* ``verify`` / ``manifest``: ``verify_refit(llm, trainer)`` (each rank digests its own pieces) and
  ``weight_manifest(trainer)``.

    OMP_NUM_THREADS=1 python tools/bench_sharded_refit.py                 # 3-4 minutes on 2 cores
    python tools/bench_sharded_refit.py --layers 2 --chunk-mib 16 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

MIB = 1 << 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--moe-width", type=int, default=512)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    import torch
    from _timing import write_json
    from bench_refit import build_model
    from transformers import AutoModelForCausalLM

    from moealign.patches.megatron.sharded import ShardedMegatronTrainer, process_memory
    from moealign.patches.vllm.engine import open_llm
    from moealign.rl import refit, verify_refit, weight_manifest

    chunk = args.chunk_mib * MIB
    out: dict = {"chunk_bytes": chunk}

    def measured(fn, trainer):
        ranks0, own0 = trainer.peak_rss(reset=True), process_memory(reset=True)
        t0 = time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - t0
        ranks1, own1 = trainer.peak_rss(), process_memory()
        return value, dict(seconds=seconds, ranks=[b["peak"] - a["rss"] for a, b in zip(ranks0, ranks1)],
                           driver=own1["peak"] - own0["rss"])

    with tempfile.TemporaryDirectory(prefix="bench_sharded_refit_") as tmp:
        params = build_model(tmp, hidden=args.hidden, layers=args.layers, experts=args.experts, top_k=4,
                             moe_width=args.moe_width, heads=8, kv_heads=4, head_dim=128)
        out["params"] = params
        trainer = ShardedMegatronTrainer(tmp, tp=args.tp, ep=args.ep, pp=args.pp, precision="bf16", timeout_s=600)
        try:
            plan = trainer.hf_plan()
            owned = [0] * trainer.layout.world
            for entry in plan.values():
                size = torch.empty((), dtype=getattr(torch, entry.dtype)).element_size()
                for piece in entry.pieces:
                    owned[piece.rank] += size * int(torch.Size(piece.shape).numel())
            out["model_bytes"], out["owned_bytes"] = sum(owned), owned
            out["largest_tensor"] = max(e.nbytes for e in plan.values())

            def touch(t) -> int:          # read every page (shared-memory pages count once mapped and read)
                float(t.reshape(-1)[::512].float().sum())
                return t.numel() * t.element_size()

            _, out["stream"] = measured(lambda: sum(touch(t) for _, t in trainer.hf_tensors(chunk_bytes=chunk)),
                                        trainer)
            _, out["gather"] = measured(lambda: sum(touch(t) for r in trainer.hf_shards() for _, t, _, _ in r),
                                        trainer)
            llm = open_llm(tmp, dtype="bf16", max_model_len=128, max_num_seqs=4, memory_fraction=0.05)
            refit(llm, trainer, chunk_bytes=chunk)                       # warm-up (and the digest kernel's build)
            verify_refit(llm, trainer)
            _, out["refit"] = measured(lambda: refit(llm, trainer, chunk_bytes=chunk), trainer)
            check, out["verify"] = measured(lambda: verify_refit(llm, trainer), trainer)
            assert check.ok, check.describe()
            _, out["manifest"] = measured(lambda: weight_manifest(trainer), trainer)
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
            refit(llm, model, chunk_bytes=chunk)
            own0 = process_memory(reset=True)
            t0 = time.perf_counter()
            refit(llm, model, chunk_bytes=chunk)
            out["single_process_refit_s"] = time.perf_counter() - t0
            out["single_process_refit_driver"] = process_memory()["peak"] - own0["rss"]
            assert verify_refit(llm, trainer).ok
        finally:
            trainer.close()

    mb = lambda n: f"{n / 1e6:.0f} MB"            # noqa: E731
    print(f"model {out['params'] / 1e6:.0f}M parameters, {mb(out['model_bytes'])} bf16; TP {args.tp} x EP {args.ep} x "
          f"PP {args.pp}; owned per rank {[mb(b) for b in out['owned_bytes']]}; chunk {mb(chunk)}, largest tensor "
          f"{mb(out['largest_tensor'])}")
    print(f"{'step':<10} {'seconds':>8} {'GB/s':>6}  peak above before: ranks / this process")
    for key in ("stream", "gather", "refit", "verify", "manifest"):
        row = out[key]
        rate = out["model_bytes"] / row["seconds"] / 1e9
        print(f"{key:<10} {row['seconds']:8.2f} {rate:6.2f}  {[mb(b) for b in row['ranks']]} / {mb(row['driver'])}")
    print(f"single-process refit from a transformers model (same engine): {out['single_process_refit_s']:.2f} s, "
          f"this process's peak {mb(out['single_process_refit_driver'])} above before (vLLM's reload included)")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
