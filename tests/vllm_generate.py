"""Run by tests/test_vllm_engine.py in a child process (vLLM keeps process-wide state): generate with the
embedded model through moealign.patches.vllm.open_llm and print one JSON line with the outputs.

usage: python tests/vllm_generate.py processed|raw
"""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    from moealign.embedded import embedded_model_path
    from moealign.patches.vllm.engine import open_llm

    llm = open_llm(str(embedded_model_path()), dtype="bf16", max_num_seqs=4,
                   processed_logprobs=sys.argv[1] == "processed")
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=7, logprobs=0)
    outputs = llm.generate(["def f(x):", "import os\n"], params, use_tqdm=False)
    result = [{"token_ids": list(o.outputs[0].token_ids),
               "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
              for o in outputs]
    print("RESULT " + json.dumps(result), flush=True)
