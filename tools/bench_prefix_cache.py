"""Benchmark: the recorded rollout (``generate_with_record``: routes, kept sets, log-probs) with vLLM's prefix caching
on vs off, at rl-check's defaults (group size 4: each prompt sampled 4 times in a row, 32 prompts, 32 new tokens,
bf16, ``open_llm``'s 32 sequence slots).

Two engines in one process, the same prompts, sampling and seed, interleaved rounds (the prefix cache reset before
each caching-on round, so every round starts cold as an rl-check step does after its refit). Each configuration
prints the minimum and median seconds of both, the ratio on / off and the prompt tokens vLLM reused
(``num_cached_tokens``). Configurations: the embedded prompts as they are (32 tokens: no KV block can be reused on the
CPU build, whose blocks are 32 tokens or more and vLLM recomputes a prompt's last token) and prompts of ``--join``
embedded prompts joined (~256 tokens), at the block size vLLM picks (128 on CPU, 16 on GPU) and at 32.

    python tools/bench_prefix_cache.py
    python tools/bench_prefix_cache.py --group-size 8 --join 8 --block-sizes 32 --json OUT.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def _measure(prompts, block_size, args) -> dict:
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.rollout import generate_with_record
    from moealign.record import SamplingParams

    from _timing import interleaved

    extra = {} if block_size is None else {"block_size": block_size}
    engines = {name: open_llm(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=512,
                              enable_prefix_caching=name == "on", **extra) for name in ("off", "on")}
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    cached = {}

    def rollout(name):
        llm = engines[name]
        if name == "on":
            llm.reset_prefix_cache()
        plain = llm.generate

        def counting(*a, **k):
            outputs = plain(*a, **k)
            cached[name] = sum(int(o.num_cached_tokens or 0) for o in outputs)
            return outputs
        llm.generate = counting
        try:
            return generate_with_record(llm, prompts, sampling=sampling, max_new_tokens=args.max_new_tokens, seed=0)
        finally:
            del llm.generate

    records = {name: rollout(name) for name in engines}             # warm-up; the same work on both sides
    same = records["on"].num_response_tokens == records["off"].num_response_tokens
    t = interleaved({name: (lambda n=name: rollout(n)) for name in ("off", "on")}, args.repeats)
    actual = int(engines["on"].llm_engine.vllm_config.cache_config.block_size)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    engines.clear()
    gc.collect()
    return {"block_size": actual, "prompt_tokens": sum(s.prompt_len for s in records["on"].samples),
            "cached_tokens": cached.get("on", 0), "off_s": t["off"], "on_s": t["on"], "ratio_min": t["on"] / t["off"],
            "ratio_median": t["on_median"] / t["off_median"], "same_response_tokens": same}


def main(argv=None) -> int:
    from moealign.embedded import default_prompts, embedded_model_path

    from _timing import write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(embedded_model_path()))
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--join", type=int, default=8, help="embedded prompts joined into one long prompt")
    ap.add_argument("--block-sizes", default="default,32", help="comma-separated; 'default': vLLM's choice")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    base = default_prompts()
    short = [base[i % len(base)] for i in range(args.num_prompts)]
    long = [" ".join(base[(i * args.join + j) % len(base)] for j in range(args.join)) for i in range(args.num_prompts)]
    sizes = [None if s == "default" else int(s) for s in args.block_sizes.split(",")]
    results = []
    for label, prompts in (("embedded prompts", short), (f"{args.join} prompts joined", long)):
        grouped = [p for p in prompts for _ in range(args.group_size)]
        for size in sizes:
            r = _measure(grouped, size, args)
            r.update({"prompts": label, "samples": len(grouped), "group_size": args.group_size})
            results.append(r)
            print(f"{label}, {args.num_prompts} x {args.group_size} samples, block {r['block_size']}: "
                  f"{r['prompt_tokens']} prompt tokens, {r['cached_tokens']} reused; caching off "
                  f"{r['off_s'] * 1e3:.0f} ms, on {r['on_s'] * 1e3:.0f} ms -> {r['ratio_min']:.3f}x (min), "
                  f"{r['ratio_median']:.3f}x (median of {args.repeats})", flush=True)
    if args.json:
        write_json(args.json, {"dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                               "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
