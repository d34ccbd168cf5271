"""Benchmark: what the diagnosis costs on top of the mismatch test, and what its parts take.

Measured in the same run, interleaved, minimum (and median) of N:

* ``mismatch``:  ``run_mismatch`` as configured (rollout, the trainer's four runs, the report): the baseline.
* ``diagnose``:  the same with ``diagnose=True`` (every lever set scored, attribution, contracts, full-vocabulary
                 KL, plot data). The ratio ``diagnose / mismatch`` is the figure; the lever-set count and the time
                 of one rollout-side re-scoring (``rescore_decode`` of one micro-batch) against one ``generate()``
                 of the same batch are printed too (the re-scoring replays the rollout's path, so it should cost
                 about one generate).
* ``one worker``: ``diagnose`` with ``DECODE_WORKERS = 1`` (every decode in this process, one after another):
                 what the forked decode workers (:mod:`moealign.mismatch.workers`) save.
* ``floor``:     what the diagnosis would cost, decoding one micro-batch at a time, if everything but its
                 rollout-side decodes were free: the plain test plus ``decodes x micro-batches x rescore`` (the
                 report's ``levers.work``: the rollout setups that must be decoded, since a stock decode's bits come
                 only from the same kernels on the same shapes; batch-invariant setups are one forward each). No
                 exact scheme built on transformers' decode gets below it in one process; the workers divide the
                 decodes' part by up to their number.

With ``--pair default`` the default pair, vLLM -> Megatron (:mod:`moealign.mismatch.vllm_levers`): ``mismatch`` and
``diagnose`` interleaved, the ratio, the lever sets, vLLM engines and trainer passes the diagnosis ran, and the
aligned setting's measured cost (the canonical forward against the stock one, each side).

    python tools/bench_diagnosis.py                       # the embedded model, CPU, transformers on both sides
    python tools/bench_diagnosis.py --num-prompts 32 --repeats 3 --json out.json
    python tools/bench_diagnosis.py --pair default --num-prompts 32 --max-new-tokens 48 --batch-size 16
"""

from __future__ import annotations

import argparse
import sys

import torch

from _timing import interleaved, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--pair", choices=("hf", "default"), default="hf",
                    help="hf: transformers on both sides (default); default: vLLM -> Megatron")
    args = ap.parse_args(argv)
    if args.pair == "default":
        return default_pair(args)

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.mismatch import MismatchConfig, levers, run_mismatch
    from moealign.mismatch.engines import HFRolloutEngine
    from moealign.patches.hf.rollout import rescore_decode
    from moealign.record import SamplingParams

    base = dict(rollout_engine="hf", train_engine="hf", num_prompts=args.num_prompts,
                max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, device="cpu")
    counts = {}

    def diagnose():
        report = run_mismatch(MismatchConfig(**base, diagnose=True))
        counts["lever_sets"] = len(report["levers"]["runs"])
        counts["work"] = report["levers"]["work"]
        counts["workers"] = report["levers"]["decode_workers"]

    def one_worker():
        levers.DECODE_WORKERS = 1
        try:
            run_mismatch(MismatchConfig(**base, diagnose=True))
        finally:
            levers.DECODE_WORKERS = None

    times = interleaved({"mismatch": lambda: run_mismatch(MismatchConfig(**base)), "diagnose": diagnose,
                         "one_worker": one_worker}, args.repeats)

    engine = HFRolloutEngine(str(embedded_model_path()), "bf16", "cpu")
    prompts = default_prompts(None)[:args.batch_size]
    record = engine.generate(prompts, sampling=SamplingParams(top_p=0.9), max_new_tokens=args.max_new_tokens,
                             seed=0, batch_size=args.batch_size)
    pad = engine.tokenizer.pad_token_id
    parts = interleaved({
        "generate": lambda: engine.generate(prompts, sampling=SamplingParams(top_p=0.9),
                                            max_new_tokens=args.max_new_tokens, seed=0, batch_size=args.batch_size),
        "rescore": lambda: rescore_decode(engine.model, record.samples, pad_token_id=pad),
    }, args.repeats + 1)
    engine.close()

    out = {"torch_threads": torch.get_num_threads(), **vars(args), **counts,
           "mismatch_s": times["mismatch"], "diagnose_s": times["diagnose"],
           "diagnose_ratio": times["diagnose"] / times["mismatch"], "one_worker_s": times["one_worker"],
           "one_worker_ratio": times["one_worker"] / times["mismatch"], "decode_workers": counts["workers"],
           "generate_s": parts["generate"], "rescore_s": parts["rescore"],
           "rescore_ratio": parts["rescore"] / parts["generate"]}
    batches = -(-args.num_prompts // args.batch_size)
    out["floor_s"] = times["mismatch"] + counts["work"]["rollout_decodes"] * batches * parts["rescore"]
    out["floor_ratio"] = out["floor_s"] / times["mismatch"]
    print(f"mismatch test            {out['mismatch_s']:8.2f} s   (baseline)")
    print(f"with --diagnose          {out['diagnose_s']:8.2f} s   {out['diagnose_ratio']:.2f}x   "
          f"({counts.get('lever_sets', '?')} lever sets scored, {counts['workers']} decode workers)")
    print(f"  one decode worker      {out['one_worker_s']:8.2f} s   {out['one_worker_ratio']:.2f}x   "
          f"(the workers: {out['one_worker_s'] / out['diagnose_s']:.2f}x faster)")
    print(f"generate() one batch     {out['generate_s']:8.3f} s   (baseline)")
    print(f"rescore_decode same      {out['rescore_s']:8.3f} s   {out['rescore_ratio']:.2f}x")
    work = counts["work"]
    print(f"floor, one worker        {out['floor_s']:8.2f} s   {out['floor_ratio']:.2f}x   (the plain test + "
          f"{work['rollout_decodes']} decodes x {batches} micro-batches; also ran {work['rollout_forwards']} "
          f"batch-invariant forwards, {work['train_passes']} trainer passes)")
    if args.json:
        write_json(args.json, out)
    return 0


def default_pair(args) -> int:
    """``--pair default``: the diagnosis on vLLM -> Megatron against the plain test, same run, interleaved."""
    from moealign.mismatch import MismatchConfig, run_mismatch

    base = dict(rollout_engine="vllm", train_engine="megatron", num_prompts=args.num_prompts,
                max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, device="cpu")
    seen = {}

    def diagnose():
        report = run_mismatch(MismatchConfig(**base, diagnose=True))
        seen["lever_sets"] = len(report["levers"]["runs"])
        seen["work"] = report["levers"]["work"]
        seen["cost"] = report["levers"]["verdict"]["aligned"]["cost"]
        seen["attribution"] = report["attribution"]["metrics"]["mean_abs_logp_diff"]

    times = interleaved({"mismatch": lambda: run_mismatch(MismatchConfig(**base)), "diagnose": diagnose},
                        args.repeats)
    out = {"pair": "vllm -> megatron", "torch_threads": torch.get_num_threads(), **vars(args), **seen,
           "mismatch_s": times["mismatch"], "diagnose_s": times["diagnose"],
           "diagnose_ratio": times["diagnose"] / times["mismatch"]}
    work, cost = seen["work"], seen["cost"]
    print(f"mismatch test (vLLM -> Megatron)  {out['mismatch_s']:8.2f} s   (baseline)")
    print(f"with --diagnose                   {out['diagnose_s']:8.2f} s   {out['diagnose_ratio']:.2f}x   "
          f"({seen['lever_sets']} lever sets; {work['rollout_engines']} vLLM re-scorings, {work['train_engines']} "
          f"more Megatron engine(s), {work['train_passes']} trainer passes)")
    print(f"aligned cost (canonical / stock)  rollout prefill {cost.get('rollout_ratio', float('nan')):.2f}x, "
          f"trainer forward {cost.get('train_ratio', float('nan')):.2f}x")
    a = seen["attribution"]
    print("attribution of mean |dlogp| " + f"{a['gap']:.4g}: " + ", ".join(f"{k} {v:.3g}" for k, v in a["shares"].items())
          + f"; residual {a['residual']:.3g}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
