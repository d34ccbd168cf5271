"""Run by tests/test_vllm_precision.py in a child process: open the embedded model in vLLM under the policy
fp16-fp32-router-head, with moealign's precision patch (``patched``) or with vLLM's engine arguments alone
(``args-only``), audit it and print one JSON line (the audit report, or the audit's deviations).

usage: python tests/vllm_precision_child.py patched|args-only
"""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    from moealign.embedded import embedded_model_path
    from moealign.errors import PrecisionAuditError
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.precision import apply_precision, audit_vllm
    from moealign.precision.policy import to_vllm_engine_args

    policy = "fp16-fp32-router-head"
    handle = apply_precision(policy) if sys.argv[1] == "patched" else None
    args = to_vllm_engine_args(policy)
    llm = open_llm(str(embedded_model_path()), dtype="fp16", max_num_seqs=2,
                   **{k: v for k, v in args.items() if k != "dtype" and v is not None})
    try:
        result = {"report": audit_vllm(llm, policy)}
    except PrecisionAuditError as exc:
        result = {"deviations": exc.deviations}
    print("RESULT " + json.dumps(result), flush=True)
