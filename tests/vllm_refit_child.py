"""Run by tests/test_rl_refit.py in a child process (vLLM keeps process-wide state): in-place refits of a running
vLLM engine (the embedded model, fp32) from a Megatron-core trainer, read back and checked.

usage: python tests/vllm_refit_child.py TP

Prints one ``RESULT {json}`` line:

* ``identical_bitwise``: prompt log-probs after refitting the trainer's identical weights equal the ones before
  (``torch.equal``), and the verifier passes;
* ``stock_reload_max_diff``: the negative control, vLLM's own ``reload_weights`` fed the same identical weights
  (its CPU build skips the MoE prepack on a weight update): the log-probs move by nats;
* ``mangled``: a refit with ``model.layers.1.self_attn.q_proj.weight`` transposed and expert 3 of layer 2 nudged:
  the (tensor, worker) pairs the verifier names; ``manifest_ok`` / ``manifest_mangled``: the same checks from a
  weight manifest of the trainer (saved and loaded), every worker's shards summed;
* ``interrupted``: a stream that stops before ``model.layers.2.self_attn.o_proj.weight``: the error, and what the
  verifier names afterwards;
* ``updated``: the trainer takes a real optimizer step; after the refit the verifier passes and the probe gap is
  within its step-0 bound; the log-probs moved;
* ``missing_refused`` / ``arch_refused``: a manifest without a tensor, a trainer of another vocabulary: refused before
  any weight moved (log-probs unchanged).
"""

from __future__ import annotations

import json
import os
import sys


def main(tp: int) -> dict:
    import torch

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.errors import RefitError
    from moealign.mismatch.engines import MegatronTrainEngine, VLLMRolloutEngine
    from moealign.patches.vllm import refit as vr
    from moealign.rl.refit import Probe, refit, trainer_tensors, verify_refit

    path = str(embedded_model_path())
    rollout = VLLMRolloutEngine(path, "fp32", "cpu", tp=tp)
    llm = rollout.llm
    trainer = MegatronTrainEngine(path, "fp32", "cpu")
    from vllm import SamplingParams

    prompt = default_prompts()[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def logprobs() -> torch.Tensor:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    out: dict = {"tp": tp}
    before = logprobs()
    # 1. identical weights through the real path (Megatron -> transformers names -> every worker)
    result = refit(llm, trainer)
    after = logprobs()
    check = verify_refit(llm, trainer)
    out["identical_bitwise"] = bool(torch.equal(before, after))
    out["identical_verify_ok"] = check.ok
    out["identical_checked"] = check.weights.checked
    out["identical_packed"] = check.weights.packed
    out["workers"] = result.workers
    # the same check from digests alone (a weight manifest, through its file): every worker's shards summed
    import tempfile

    from moealign.rl import WeightManifest, weight_manifest

    manifest_path = os.path.join(tempfile.mkdtemp(), "step.manifest.json")
    weight_manifest(trainer).save(manifest_path)
    manifest = WeightManifest.load(manifest_path)
    out["manifest_ok"] = verify_refit(llm, manifest).ok
    # 2. negative control: vLLM's own reload of the same tensors (TP = 1: the engine runs in this process)
    if tp == 1:
        from moealign.patches.vllm.rollout import model_runner

        state = dict(trainer_tensors(trainer))
        layout = vr.checkpoint_layout(path)
        model_runner(llm).reload_weights(weights_iterator=iter(list(vr.checkpoint_named(state.items(), layout))))
        out["stock_reload_max_diff"] = float((logprobs() - before).abs().max())
        out["stock_reload_verify"] = [list(m[:2]) for m in vr.verify_weights(llm, state).mismatches][:4]
        refit(llm, trainer)
        out["restored_bitwise"] = bool(torch.equal(logprobs(), before))
    # 3. a mangled stream: one tensor transposed, one expert nudged
    state = dict(trainer_tensors(trainer))
    bad = dict(state)
    q = "model.layers.1.self_attn.q_proj.weight"
    bad[q] = state[q].t().contiguous()
    e = "model.layers.2.mlp.experts.gate_up_proj"
    nudged = state[e].clone()
    nudged[3] += 1e-3
    bad[e] = nudged
    layout = vr.checkpoint_layout(path)
    named = list(vr.checkpoint_named(bad.items(), layout))
    vr.refit_weights(llm, iter(named), {n: tuple(t.shape) for n, t in named})
    out["mangled"] = sorted(list(m[:2]) for m in verify_refit(llm, trainer).weights.mismatches)
    out["mangled_vs_what_was_sent"] = verify_refit(llm, trainer, expected=bad).ok
    out["manifest_mangled"] = sorted(list(m[:2]) for m in verify_refit(llm, manifest).weights.mismatches)
    # 4. an interrupted stream: everything but layer 2's o_proj, announced complete
    refit(llm, trainer)
    skipped = "model.layers.2.self_attn.o_proj.weight"
    moved = dict(state)
    moved[skipped] = state[skipped] * 1.5          # what the trainer now holds for it
    named = list(vr.checkpoint_named(moved.items(), layout))
    manifest = {n: tuple(t.shape) for n, t in named}
    try:
        vr.refit_weights(llm, iter([(n, t) for n, t in named if n != skipped]), manifest)
        out["interrupted_error"] = None
    except RefitError as exc:
        out["interrupted_error"] = str(exc)
    out["interrupted_named"] = sorted(list(m[:2]) for m in vr.verify_weights(llm, moved).mismatches)
    # 5. a real update: one Adam step on a loss over the probe tokens
    refit(llm, trainer)
    tok = llm.get_tokenizer()
    probe = Probe([torch.tensor(tok(p)["input_ids"][:40]) for p in default_prompts()[:2]])
    probe.calibrate(llm, trainer)
    params_ = [p for p in trainer.model.parameters()]
    for p in params_:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params_, lr=1e-3)
    record = probe.record(__import__("moealign.patches.vllm.rollout", fromlist=["_cached_meta"])._cached_meta(llm))
    fwd = trainer.forward(record, list(range(len(record))), replay=False, grad=True)
    loss = torch.nn.functional.cross_entropy(fwd.logits, fwd.tokens)
    loss.backward()
    opt.step()
    refit(llm, trainer)
    updated = verify_refit(llm, trainer, probe=probe)
    out["updated_verify_ok"] = updated.ok
    out["updated_probe_gap"] = updated.probe_gap
    out["updated_probe_bound"] = updated.probe_bound
    now = logprobs()
    out["updated_moved"] = float((now - before).abs().max())
    # 6. refused before any weight moved
    layout_manifest = {n: tuple(t.shape) for n, t in vr.checkpoint_named(trainer_tensors(trainer, meta=True), layout)}
    partial = {n: s for n, s in layout_manifest.items() if n != "lm_head.weight"}
    try:
        vr.refit_weights(llm, iter([]), partial)
        out["missing_refused"] = None
    except RefitError as exc:
        out["missing_refused"] = str(exc)
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    config.vocab_size = 1024
    other = transformers.AutoModelForCausalLM.from_config(config)
    try:
        refit(llm, other)
        out["arch_refused"] = None
    except RefitError as exc:
        out["arch_refused"] = str(exc)
    out["unchanged_after_refusals"] = bool(torch.equal(logprobs(), now))
    trainer.close()
    rollout.close()
    return out


if __name__ == "__main__":
    tp = int(sys.argv[1])
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in range(tp)))
    print("RESULT " + json.dumps(main(tp)), flush=True)
