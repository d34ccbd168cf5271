"""Run by tests/test_tp_check_vllm.py in a child process: the embedded model in vLLM (fp32), 6 prompts each
generated alone and then all together in one batch; prints one JSON line with the prompt + sampled log-probs
and tokens of both. The caller sets MOEALIGN_VLLM_PATCHES (tree forward) or not.

usage: python tests/vllm_batch_probe.py
"""

from __future__ import annotations

import json

if __name__ == "__main__":
    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.patches.vllm.engine import open_llm

    llm = open_llm(str(embedded_model_path()), dtype="fp32", max_num_seqs=8, enable_prefix_caching=False)
    from vllm import SamplingParams

    prompts = default_prompts()[:6]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=0, prompt_logprobs=0)

    def rows(outputs):
        return [{"prompt_logprobs": [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])],
                 "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                 "token_ids": list(o.outputs[0].token_ids)} for o in outputs]

    alone = [rows(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    together = rows(llm.generate(prompts, params, use_tqdm=False))
    print("RESULT " + json.dumps({"alone": alone, "together": together}), flush=True)
