"""Run by tests/test_weight_manifest.py in a child process (vLLM keeps process-wide state): a vLLM engine verified
from a weight manifest written by another process (the test process), with no trainer in this one until the
negative control needs to move weights.

usage: python tests/vllm_manifest_child.py TP DTYPE MANIFEST

Prints one ``RESULT {json}`` line:

* ``ok`` / ``checked`` / ``packed`` / ``workers``: ``verify_refit(llm, WeightManifest.load(MANIFEST))`` on the
  freshly loaded engine (the manifest digests the checkpoint's weights, written by the parent);
* ``changed``: after a refit in which ``model.layers.2.self_attn.o_proj.weight`` (column-split at TP 2) and expert 3
  of ``model.layers.1.mlp.experts.down_proj`` (prepacked on the CPU build) changed, the (tensor, worker) pairs the
  manifest check names, and ``changed_why``; ``changed_control``: the manifest of the changed weights (written here)
  verifies the same engine; ``in_process_agrees``: the in-process check against the changed tensors passes too;
* ``restored``: after refitting the original weights, the parent's manifest verifies again;
* ``no_dtype``: a manifest digested at fp32 only, against a bf16 engine: what it names (the missing dtype).
"""

from __future__ import annotations

import json
import os
import sys


def main(tp: int, dtype: str, manifest_path: str) -> dict:
    import torch

    from moealign.embedded import embedded_model_path
    from moealign.mismatch.engines import VLLMRolloutEngine
    from moealign.rl import WeightManifest, refit, verify_refit, weight_manifest

    path = str(embedded_model_path())
    rollout = VLLMRolloutEngine(path, dtype, "cpu", tp=tp)
    llm = rollout.llm
    out: dict = {"tp": tp}
    manifest = WeightManifest.load(manifest_path)
    check = verify_refit(llm, manifest)
    out.update(ok=check.ok, checked=check.weights.checked, packed=check.weights.packed,
               workers=check.weights.workers, mismatches=[list(m) for m in check.weights.mismatches][:6],
               config_mismatches=check.config_mismatches, verify_seconds=check.seconds)

    # the negative control: one refit with two tensors changed (a column-split linear, one packed expert)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    changed = dict(state)
    o = "model.layers.2.self_attn.o_proj.weight"
    changed[o] = state[o].clone()
    changed[o][5, 70] += 0.5                       # a column of rank 1's half at TP 2; visible in bf16
    d = "model.layers.1.mlp.experts.down_proj"
    changed[d] = state[d].clone()
    changed[d][3, 7, 2] += 0.25
    refit(llm, changed, model.config)
    bad = verify_refit(llm, manifest)
    out["changed_ok"] = bad.ok
    out["changed"] = sorted([m[0], m[1]] for m in bad.weights.mismatches)
    out["changed_why"] = sorted({m[2] for m in bad.weights.mismatches})
    out["changed_control"] = verify_refit(llm, weight_manifest(changed, model.config)).ok
    out["in_process_agrees"] = verify_refit(llm, changed, model.config).ok
    refit(llm, state, model.config)
    out["restored"] = verify_refit(llm, manifest).ok
    if dtype != "fp32":
        only32 = verify_refit(llm, weight_manifest(state, model.config, dtypes=["float32"]))
        out["no_dtype_ok"] = only32.ok
        out["no_dtype"] = sorted({m[2] for m in only32.weights.mismatches})
    rollout.close()
    return out


if __name__ == "__main__":
    tp = int(sys.argv[1])
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in range(tp)))
    print("RESULT " + json.dumps(main(tp, sys.argv[2], sys.argv[3])), flush=True)
