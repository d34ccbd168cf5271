"""Run by tests/test_vllm_rollout.py in a child process (vLLM keeps process-wide state): record a rollout of the
embedded model with moealign.patches.vllm.generate_with_record, save it, and print one JSON line with timings.

usage: python tests/vllm_record.py OUT.safetensors [DTYPE]
"""

from __future__ import annotations

import json
import sys
import time

if __name__ == "__main__":
    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.record import SamplingParams
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.rollout import generate_with_record, model_runner

    out, dtype = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "fp32")
    # 6 prompts of different lengths, 3 sequences at a time, a 40-token prefill budget: continuous batching
    # interleaves prefill chunks and decode steps, and requests finish at different steps (EOS or max tokens)
    llm = open_llm(str(embedded_model_path()), dtype=dtype, max_num_seqs=3, max_num_batched_tokens=40,
                   max_model_len=256, enable_prefix_caching=False)
    prompts = [p[:n] for p, n in zip(default_prompts()[:6], (40, 90, 25, 120, 60, 33))]
    sampling = SamplingParams(temperature=0.9, top_p=0.9, top_k=50)
    runner = model_runner(llm)
    originals = (runner.execute_model, runner._model_forward, runner.sampler.topk_topp_sampler.forward)
    t0 = time.perf_counter()
    record = generate_with_record(llm, prompts, sampling=sampling, max_new_tokens=12, seed=3)
    t_record = time.perf_counter() - t0
    restored = (vars(runner).get("execute_model") is None and vars(runner).get("_model_forward") is None
                and runner.sampler.topk_topp_sampler.forward == originals[2])
    from vllm import SamplingParams as VSP

    # unseeded: vLLM 0.32's CPU build cannot rewind a per-request generator after a discarded partial-prefill
    # sample ("CPU Generator does not use offset"); the recorder works around it, plain generate() does not
    params = [VSP(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, logprobs=0, detokenize=False)
              for _ in prompts]
    t0 = time.perf_counter()
    plain = llm.generate(prompts, params, use_tqdm=False)
    t_plain = time.perf_counter() - t0
    same_prompts = [list(o.prompt_token_ids) == s.token_ids[:s.prompt_len].tolist()
                    for o, s in zip(plain, record.samples)]
    record.save(out)
    print("RESULT " + json.dumps({"record_s": t_record, "plain_s": t_plain, "same_prompts": same_prompts,
                                  "restored": restored, "max_num_seqs": 3}), flush=True)
