"""Run by tests/test_deepseek_refit.py in a child process (vLLM keeps process-wide state): in-place refits of a
running vLLM engine on ``embedded:tiny_deepseek`` (MLA: vLLM derives ``W_UK_T`` / ``W_UV`` from ``kv_b_proj`` at
load), bf16, TP = 1, from a transformers snapshot.

usage: python tests/vllm_deepseek_refit_child.py WORKDIR

Prints one ``RESULT {json}`` line:

* ``identical_*``: a refit of the checkpoint's own weights: prefill (prompt log-probs) and decode (vLLM's sampler,
  fixed seeds: tokens and log-probs) bitwise equal to before; the digests, the derived tensors (6: W_UK_T / W_UV of
  3 layers) and certify_refit pass;
* ``changed_*``: a refit of changed weights (every tensor nudged, bf16) vs a cold engine loaded from a checkpoint
  copy holding them: prefill and decode bitwise equal; the decode moved from before;
* ``suppressed_*``: negative control by construction, MLA's recompute suppressed (``MLAAttention.
  process_weights_after_loading`` a no-op) for one refit back to the original weights: the refit is refused naming
  the stale derived tensors, the digests still pass (``kv_b_proj`` is right), the derived check names W_UK_T /
  W_UV of every layer, the prefill equals before bitwise (it reads ``kv_b_proj``) while the decode differs (it reads
  the stale matrices); a refit without the suppression puts everything back, bitwise;
* ``perturbed_*``: negative control by construction, one element of layer 1's held ``W_UV`` nudged in the worker:
  ``verify_refit`` fails naming it, ``certify_refit``'s first failed check is ``derived_buffers`` naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys


def main(workdir: str) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.errors import RefitError
    from moealign.patches.vllm import refit as vr
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.rollout import model_runner
    from moealign.rl import certify_refit
    from moealign.rl.refit import refit, trainer_tensors, verify_refit

    path = str(embedded_model_path("tiny_deepseek"))
    tok_prompts = [p[:48] for p in default_prompts()[:3]]
    prefill_params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def open_engine(where: str):
        return open_llm(where, dtype="bf16", max_num_seqs=4, max_model_len=128, enable_prefix_caching=False)

    def logprobs(llm) -> dict:
        """Prefill: every prompt token's log-prob; decode: 8 tokens sampled per prompt (fixed seeds), their
        log-probs."""
        outs = llm.generate(tok_prompts, prefill_params, use_tqdm=False)
        prefill = torch.cat([torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
                             for o in outs])
        decode = vr.decode_token_ids(llm, [llm.get_tokenizer()(p)["input_ids"] for p in tok_prompts], 8, 11, None)
        return {"prefill": prefill, "tokens": [t for t, _, _ in decode], "decode": torch.cat([lp for _, lp, _ in decode])}

    def same(a: dict, b: dict) -> dict:
        return {"prefill": bool(torch.equal(a["prefill"], b["prefill"])),
                "decode": a["tokens"] == b["tokens"] and bool(torch.equal(a["decode"], b["decode"]))}

    out: dict = {}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    original = {n: t.detach().clone() for n, t in trainer_tensors(hf)}
    del hf
    gen = torch.Generator().manual_seed(5)
    changed = {n: (t.float() + 0.05 * t.float().std().nan_to_num(0.0).clamp(min=1e-3)
                   * torch.randn(t.shape, generator=gen)).to(t.dtype) if t.is_floating_point() else t
               for n, t in original.items()}

    llm = open_engine(path)
    before = logprobs(llm)
    # 1. identical weights
    refit(llm, original)
    after = logprobs(llm)
    check = verify_refit(llm, original)
    cert = certify_refit(llm, original)
    out.update(identical=same(before, after), identical_verify_ok=check.ok, identical_checked=check.weights.checked,
               identical_derived=check.derived, identical_certify_ok=cert.ok,
               identical_certify_derived=next(c for c in cert.to_dict()["checks"] if c["name"] == "derived_buffers"))
    # 2. changed weights, refit (compared with a cold engine below)
    refit(llm, changed)
    refitted = logprobs(llm)
    check = verify_refit(llm, changed)
    out.update(changed_verify_ok=check.ok, changed_derived_checked=check.derived["checked"],
               changed_decode_moved=not same(before, refitted)["decode"])
    # 3. where vLLM's recompute matters. Unquantized, in the engine's dtype, split_kv_b_proj copies nothing: W_UK_T /
    # W_UV are views of kv_b_proj's storage, and the reload's in-place copy into kv_b_proj updates them as well. Break
    # that (each held matrix rebound to a copy of itself, as a quantized or cast kv_b_proj gives): the values, and the
    # log-probs, are unchanged; now only vLLM's recompute in the finish phase keeps them current.
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    runner = model_runner(llm)
    layers = [m for m in runner.model.modules() if isinstance(m, MLAAttention)]
    out["aliased_at_load"] = [m.W_UV.untyped_storage().data_ptr() == m.kv_b_proj.weight.untyped_storage().data_ptr()
                              and m.W_UK_T.untyped_storage().data_ptr() == m.kv_b_proj.weight.untyped_storage().data_ptr()
                              for m in layers]
    for m in layers:
        m.W_UV.data = m.W_UV.data.clone()
        m.W_UK_T.data = m.W_UK_T.data.clone()
    out["unaliased_unchanged"] = same(refitted, logprobs(llm))
    refit(llm, original)                            # vLLM's recompute runs: the copies follow kv_b_proj
    out["unaliased_refit"] = same(before, logprobs(llm))
    out["unaliased_derived_ok"] = verify_refit(llm, original).ok
    # negative control: MLA's recompute suppressed (MLAAttention.process_weights_after_loading a no-op) for one
    # refit to the changed weights
    recompute = MLAAttention.process_weights_after_loading
    MLAAttention.process_weights_after_loading = lambda self, act_dtype: None
    try:
        refit(llm, changed)
        out["suppressed_refit_error"] = None
    except RefitError as exc:
        out["suppressed_refit_error"] = str(exc)
    finally:
        MLAAttention.process_weights_after_loading = recompute
    stale = logprobs(llm)
    check = verify_refit(llm, changed)
    out.update(suppressed_digests_ok=check.weights.ok, suppressed_verify_ok=check.ok,
               suppressed_named=sorted(why.split(":")[0] for _, why in vr.check_derived_buffers(llm)["problems"]),
               suppressed_vs_refitted=same(refitted, stale))
    refit(llm, changed)
    out["restored"] = same(refitted, logprobs(llm))
    out["restored_verify_ok"] = verify_refit(llm, changed).ok
    # 4. negative control: one element of layer 1's held W_UV nudged in the worker (not kv_b_proj: a copy now)
    target = "model.layers.1.self_attn.mla_attn.mla_attn"
    w_uv = dict(runner.model.named_modules())[target].W_UV
    with torch.no_grad():
        w_uv[1, 7, 3] += 0.25
    check = verify_refit(llm, changed)
    cert = certify_refit(llm, changed).to_dict()
    out.update(perturbed_verify_ok=check.ok, perturbed_digests_ok=check.weights.ok,
               perturbed_named=[why.split(":")[0] for _, why in check.derived["problems"]],
               perturbed_first_failed=cert["first_failed"],
               perturbed_certify_detail=next(c for c in cert["checks"] if c["name"] == "derived_buffers")["detail"])
    llm.llm_engine.engine_core.shutdown()
    del llm, runner, layers, w_uv
    # 5. a cold engine on a checkpoint copy holding the changed weights
    copy = os.path.join(workdir, "changed")
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    layout = vr.checkpoint_layout(path)
    save_file({n: t.contiguous().clone() for n, t in vr.checkpoint_named(changed.items(), layout)},
              os.path.join(copy, "model.safetensors"))
    cold = open_engine(copy)
    out["changed_vs_cold"] = same(refitted, logprobs(cold))
    out["cold_derived_checked"] = vr.check_derived_tensors(cold)["checked"]
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
