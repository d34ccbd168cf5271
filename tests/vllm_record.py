"""Run by tests/test_vllm_rollout.py in a child process (vLLM keeps process-wide state): record a rollout of the
embedded model with moealign.patches.vllm.rollout.generate_with_record, save it, and print one JSON line with
timings and the checks that need the live engine (patches undone after the call, also on an exception;
prefix caching on: recorded).

usage: python tests/vllm_record.py OUT.safetensors [DTYPE] [chunked|whole]

``chunked`` (the default): 3 sequence slots and a 16-token step budget; ``whole``: 8 slots and a 2048-token budget
(every prompt prefilled in one step, all requests together), the same prompts, sampling and seed.
"""

from __future__ import annotations

import json
import sys
import time

if __name__ == "__main__":
    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.rollout import generate_with_record, model_runner, moe_routers
    from moealign.record import SamplingParams

    out, dtype = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "fp32")
    mode = sys.argv[3] if len(sys.argv) > 3 else "chunked"
    slots, budget = {"chunked": (3, 16), "whole": (8, 2048)}[mode]
    # 6 prompts of 8 to 32 tokens; chunked: 3 sequences at a time and a 16-token step budget, so prefills are
    # chunked (partial chunks whose samples vLLM discards), requests join as others finish, decode and prefill mix
    llm = open_llm(str(embedded_model_path()), dtype=dtype, max_num_seqs=slots, max_num_batched_tokens=budget,
                   max_model_len=256, enable_prefix_caching=False)
    prompts = [p[:n] for p, n in zip(default_prompts()[:6], (40, 90, 25, 120, 60, 33))]
    sampling = SamplingParams(temperature=0.9, top_p=0.9, top_k=50)
    runner = model_runner(llm)
    tts = runner.sampler.topk_topp_sampler
    routers = [r for _, _, r in moe_routers(runner.model)]

    def state():
        return (vars(runner).get("execute_model"), vars(runner).get("_model_forward"), vars(tts).get("forward"),
                [r.capture_fn for r in routers])

    before = state()
    from vllm import SamplingParams as VllmSamplingParams

    # unseeded: vLLM 0.32's CPU build cannot rewind a per-request generator after a discarded partial-prefill
    # sample ("CPU Generator does not use offset"); the recorder works around it, plain generate() does not
    params = [VllmSamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, logprobs=0, detokenize=False)
              for _ in prompts]
    llm.generate(prompts, params, use_tqdm=False)                       # warm-up
    # count the engine's sampler rows whose sample vLLM discards (partial prefill chunks) during the record
    sampler, discarded = runner.sampler, []
    sampler_forward = sampler.forward

    def counting_forward(*args, **kwargs):
        discarded.append(int(runner.discard_request_mask.np[:runner.input_batch.num_reqs].sum()))
        return sampler_forward(*args, **kwargs)
    sampler.forward = counting_forward
    t0 = time.perf_counter()
    record = generate_with_record(llm, prompts, sampling=sampling, max_new_tokens=12, seed=3)
    t_record = time.perf_counter() - t0
    del sampler.forward
    restored = state() == before
    t0 = time.perf_counter()
    plain = llm.generate(prompts, params, use_tqdm=False)
    t_plain = time.perf_counter() - t0
    again = generate_with_record(llm, prompts, sampling=sampling, max_new_tokens=12, seed=3)
    same_prompts = [list(o.prompt_token_ids) == s.token_ids[:s.prompt_len].tolist()
                    for o, s in zip(plain, record.samples)]
    seeded_repeat = [a.token_ids.tolist() == b.token_ids.tolist() for a, b in zip(record.samples, again.samples)]

    # an exception inside the engine call: every patch is undone all the same
    def broken(*args, **kwargs):
        raise RuntimeError("engine failed")
    llm.generate = broken
    try:
        generate_with_record(llm, prompts[:1], sampling=sampling, max_new_tokens=2)
        raised = False
    except RuntimeError:
        raised = True
    del llm.generate
    restored_on_error = raised and state() == before

    cache = llm.llm_engine.vllm_config.cache_config
    cache.enable_prefix_caching = True
    try:     # prefix caching is recorded (tests/test_vllm_prefix_cache.py); with the flag only, nothing is reused
        prefix_recorded = len(generate_with_record(llm, prompts[:1], sampling=sampling, max_new_tokens=2)) == 1
    finally:
        cache.enable_prefix_caching = False

    record.save(out)
    print("RESULT " + json.dumps({"record_s": t_record, "plain_s": t_plain, "same_prompts": same_prompts,
                                  "seeded_repeat": seeded_repeat, "restored": restored,
                                  "restored_on_error": restored_on_error, "prefix_recorded": prefix_recorded,
                                  "discarded_rows": sum(discarded), "steps": len(discarded)}), flush=True)
