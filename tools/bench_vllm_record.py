"""Benchmark: the cost of recording routes, kept sets and processed log-probs inside vLLM.

One engine (``moealign.patches.vllm.open_llm``, prefix caching off, processed log-probs), the same prompts,
sampling and seed, interleaved rounds: plain ``LLM.generate`` (returning the sampled token's log-prob, as an
RL rollout does) vs ``moealign.patches.vllm.rollout.generate_with_record``. Prints the minimum and median
seconds of each and their ratio (target: at most 1.03x, aim 1.01x).

    python tools/bench_vllm_record.py                          # the embedded model, CPU
    python tools/bench_vllm_record.py --model PATH --dtype bf16 --num-prompts 64 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main(argv=None) -> int:
    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.rollout import generate_with_record
    from moealign.record import SamplingParams

    from _timing import interleaved, write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(embedded_model_path()))
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    prompts = default_prompts()[:args.num_prompts]
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    llm = open_llm(args.model, dtype=args.dtype, max_num_seqs=args.num_prompts, enable_prefix_caching=False)
    from vllm import SamplingParams as VLLMSampling

    # the recorder seeds sample i with seed + i and does not detokenize: the plain run does the same, so both
    # sample the same tokens
    plain_params = [VLLMSampling(temperature=1.0, top_p=0.9, max_tokens=args.max_new_tokens, seed=i, logprobs=0,
                                 detokenize=False) for i in range(len(prompts))]

    def plain():
        llm.generate(prompts, plain_params, use_tqdm=False)

    def record():
        generate_with_record(llm, prompts, sampling=sampling, max_new_tokens=args.max_new_tokens, seed=0)

    plain_tokens = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, plain_params, use_tqdm=False))
    recorded = generate_with_record(llm, prompts, sampling=sampling, max_new_tokens=args.max_new_tokens, seed=0)
    if recorded.num_response_tokens != plain_tokens:       # warm-up, and the same work on both sides
        print(f"warning: plain sampled {plain_tokens} tokens, the recorder {recorded.num_response_tokens}")
    t = interleaved({"plain": plain, "record": record}, args.repeats)
    out = {"plain_s": t["plain"], "record_s": t["record"], "ratio_min": t["record"] / t["plain"],
           "ratio_median": t["record_median"] / t["plain_median"], "prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    print(f"vLLM generate, {len(prompts)} prompts x {args.max_new_tokens} tokens ({args.dtype}): plain "
          f"{t['plain'] * 1e3:.0f} ms, with recording {t['record'] * 1e3:.0f} ms -> {out['ratio_min']:.3f}x (min), "
          f"{out['ratio_median']:.3f}x (median of {args.repeats})")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
