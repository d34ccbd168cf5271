"""Run by tests/test_vllm_router_audit.py in a child process: open the embedded model in vLLM (bf16) under each
precision policy named on the command line, in turn (moealign's precision patch applied before the engine is
built and undone after it is released, as VLLMRolloutEngine does), run the four-stage router audit and print one
``RESULT {json}`` line: ``{policy: {"stages": {layer: {stage: dtype}}, "notes": [...], "engine": ...,
"failures_fp32": [...]}}`` (``failures_fp32``: check_router_audit against float32 at every stage).

usage: python tests/vllm_router_audit_child.py POLICY [POLICY ...]
"""

from __future__ import annotations

import gc
import json
import sys

if __name__ == "__main__":
    import torch

    from moealign.embedded import embedded_model_path
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.precision import apply_precision, audit_router_vllm, needs_patch
    from moealign.precision.policy import to_vllm_engine_args
    from moealign.precision.router_audit import check_router_audit

    out = {}
    for policy in sys.argv[1:]:
        handle = apply_precision(policy) if needs_patch(policy) else None
        try:
            args = to_vllm_engine_args(policy)
            llm = open_llm(str(embedded_model_path()), dtype="bf16", max_num_seqs=2, enable_prefix_caching=False,
                           **{k: v for k, v in args.items() if k != "dtype" and v is not None})
            audit = audit_router_vllm(llm)
            out[policy] = {"stages": {str(k): v for k, v in audit.names().items()}, "notes": audit.notes,
                           "engine": audit.engine, "summary": audit.summary(),
                           "failures_fp32": check_router_audit(audit, torch.float32)}
            del llm
            gc.collect()
        finally:
            if handle is not None:
                handle.undo()
    print("RESULT " + json.dumps(out), flush=True)
