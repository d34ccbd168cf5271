"""Run by tests/test_certify_refit.py in a child process (vLLM keeps process-wide state): ``certify_refit`` on the
embedded model (fp32, TP = 1) with a fault planted in each place one check stands for.

usage: python tests/vllm_certify_child.py

Phase A (moealign's rollout engine: prefix caching on; a Megatron trainer, a calibrated probe with a decode: the
default 2 decoded tokens):
* ``both_step0``: certify_refit's one-call probes (``Probe.both_gaps``) on the calibration's weights: the gaps the
  separate calls calibrated;
* ``clean``: after moealign's refit every check passes;
* ``decode_fault``: the CPU attention's output halved on decode steps only (``max_query_len == 1``): the prefill
  probe passes, the decode probe fails (and ``verify_refit``'s decode gap too); undone: passes again;
* ``rope_fault``: one RoPE cos/sin cache nudged in place: the digests pass, ``derived_buffers`` fails;
* ``base_restored``: the trainer updated and refit, then the engine given the base checkpoint back (what a wake
  after a level-2 sleep did in TRL #5312): ``tensor_digests`` fails naming the tensors;
* ``probe_cache_stale``: then back to the trainer's weights with the cache reset disabled: the digests and both
  probes pass, the default prefix check (the probe's first sequence, one sampled token) fails;
* ``sleep``: ``llm.sleep(1|2)`` then every moealign call refused by name; ``wake_up()``: certified again; vLLM's own
  refusal of ``enable_sleep_mode=True`` on the CPU build;
* ``refused``: a probe longer than the context, a probe with a weight manifest (no teacher-forced side).

Phase B (a plain ``vllm.LLM`` with prefix caching on, snapshots as the trainer):
* ``cache_ok``: primed, refit to other weights by moealign (cache reset): ``prefix_cache`` passes;
* ``cache_stale``: ``LLM.reset_prefix_cache`` disabled, refit back: ``prefix_cache`` fails with cached tokens, the
  digests pass; the stale blocks stay until a reset; after one, a genuine hit (same weights) equals a cold run.
"""

from __future__ import annotations

import json


def statuses(cert) -> dict:
    return {c["name"]: c["status"] for c in cert.checks}


def main() -> dict:
    import torch

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.errors import ConfigError, EngineError, MoealignError
    from moealign.mismatch.engines import MegatronTrainEngine, VLLMRolloutEngine
    from moealign.rl import Probe, certify_refit, prime_prefix_cache, refit, trainer_tensors, verify_refit
    from moealign.rl import weight_manifest

    out: dict = {}
    path = str(embedded_model_path())
    rollout = VLLMRolloutEngine(path, "fp32", "cpu")
    llm = rollout.llm
    trainer = MegatronTrainEngine(path, "fp32", "cpu")
    tok = llm.get_tokenizer()
    seqs = [torch.tensor(tok(p)["input_ids"][:32]) for p in default_prompts()[:2]]
    base = {n: t.detach().clone() for n, t in trainer_tensors(trainer)}
    refit(llm, trainer)
    probe = Probe(seqs, score_last=24)          # decode_tokens: the default (2)
    probe.calibrate(llm, trainer)
    out["step0"] = {"prefill": probe.step0_gap, "decode": probe.decode_step0_gap}
    (gap, _), (dgap, _) = probe.both_gaps(llm, trainer)          # certify_refit's one-call probes, the same weights
    out["both_step0"] = {"prefill": gap, "decode": dgap}
    cert = certify_refit(llm, trainer, probe=probe)
    out["clean"] = {"ok": cert.ok, "statuses": statuses(cert), "json": json.loads(json.dumps(cert.to_dict()))}

    # 1. a decode-only fault: the attention output halved on decode steps (one query token per request)
    from vllm.v1.attention.backends import cpu_attn

    impl = cpu_attn.CPUAttentionBackendImpl
    original = impl.forward

    def faulty(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is not None and int(attn_metadata.max_query_len) == 1:
            result.mul_(0.5)
        return result

    impl.forward = faulty
    try:
        cert = certify_refit(llm, trainer, probe=probe)
        check = verify_refit(llm, trainer, probe=probe)
        out["decode_fault"] = {"ok": cert.ok, "first_failed": cert.first_failed, "statuses": statuses(cert),
                               "detail": next(c["detail"] for c in cert.checks if c["name"] == "decode_probe"),
                               "verify_probe_ok": check.probe_ok, "verify_decode_ok": check.decode_ok,
                               "verify_ok": check.ok}
    finally:
        impl.forward = original
    out["decode_fault_undone_ok"] = certify_refit(llm, trainer, probe=probe).ok

    # 2. a derived buffer nudged in place (the digests read parameters only)
    from moealign.patches.vllm.rollout import model_runner

    rope = next(m for _, m in model_runner(llm).model.named_modules() if hasattr(m, "cos_sin_cache"))
    saved = rope.cos_sin_cache.clone()
    rope.cos_sin_cache[5:, :4].mul_(1.001)
    try:
        cert = certify_refit(llm, trainer, probe=probe)
        out["rope_fault"] = {"first_failed": cert.first_failed, "statuses": statuses(cert),
                             "detail": next(c["detail"] for c in cert.checks if c["name"] == "derived_buffers")}
    finally:
        rope.cos_sin_cache.copy_(saved)

    # 3. the trainer moves, the engine follows, then the base checkpoint comes back (a wake restoring base weights)
    with torch.no_grad():
        for name, p in list(trainer.model.named_parameters()):
            if "linear_qkv" in name or "linear_proj" in name:
                p.mul_(1.05)
    refit(llm, trainer)
    updated = certify_refit(llm, trainer, probe=probe)
    refit(llm, base)
    cert = certify_refit(llm, trainer, probe=probe)
    out["base_restored"] = {"updated_ok": updated.ok, "updated_statuses": statuses(updated),
                            "first_failed": cert.first_failed, "statuses": statuses(cert),
                            "named": sorted({m[0] for m in cert.refit_check.weights.mismatches})[:4]}
    # the certificate above primed the probe's first sequence under the base weights; back to the trainer's with the
    # cache reset disabled: the digests and both probes pass (the probes' requests never read the prefix cache), the
    # default prefix check (the probe's first sequence) names the stale cache
    import vllm

    reset = vllm.LLM.reset_prefix_cache
    vllm.LLM.reset_prefix_cache = lambda self, *a, **k: True
    try:
        refit(llm, trainer)
        cert = certify_refit(llm, trainer, probe=probe)
    finally:
        vllm.LLM.reset_prefix_cache = reset
    out["probe_cache_stale"] = {"first_failed": cert.first_failed, "statuses": statuses(cert),
                                "prefix": next(c for c in cert.checks if c["name"] == "prefix_cache")}
    llm.reset_prefix_cache()

    # 4. sleep / wake: vLLM's CPU build has no sleep mode; a sleeping engine is refused by name
    sleep = {}
    for level in (1, 2):
        llm.sleep(level=level)
        refused = []
        for what, call in (("certify", lambda: certify_refit(llm, trainer, probe=probe)),
                           ("verify", lambda: verify_refit(llm, trainer)), ("refit", lambda: refit(llm, trainer))):
            try:
                call()
                refused.append([what, None])
            except EngineError as exc:
                refused.append([what, str(exc)])
        llm.wake_up()
        after = certify_refit(llm, trainer, probe=probe)
        sleep[str(level)] = {"refused": refused, "woken_ok": after.ok,
                             "sleep_mode": after.config["sleep_mode"]}
    out["sleep"] = sleep
    from moealign.patches.vllm.engine import open_llm

    try:
        open_llm(path, dtype="fp32", enable_sleep_mode=True)
        out["vllm_sleep_mode"] = None
    except Exception as exc:                                # vLLM's own (pydantic) refusal
        out["vllm_sleep_mode"] = f"{type(exc).__name__}: {exc}"

    # 5. probes that cannot run: refused at construction, before any work
    refused = {}
    long = Probe([torch.arange(300) % 2000], score_last=24)
    for what, call in (("too_long", lambda: certify_refit(llm, trainer, probe=long)),
                       ("manifest", lambda: certify_refit(llm, weight_manifest(trainer), probe=probe)),
                       ("snapshot", lambda: certify_refit(llm, base, probe=probe))):
        try:
            call()
            refused[what] = None
        except ConfigError as exc:
            refused[what] = str(exc)
        except MoealignError as exc:
            refused[what] = f"other {type(exc).__name__}: {exc}"
    cert = certify_refit(llm, weight_manifest(trainer), cache_prompts=seqs)
    refused["manifest_without_probe"] = statuses(cert)
    out["refused"] = refused
    rollout.close()

    # Phase B: prefix caching on, plain llm.generate
    cached = open_llm(path, dtype="fp32", enable_prefix_caching=True)
    moved = dict(base)
    for k in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"):
        moved[k] = base[k] * 1.5
    out["primed"] = prime_prefix_cache(cached, seqs)
    refit(cached, moved)
    cert = certify_refit(cached, moved, cache_prompts=seqs)
    out["cache_ok"] = {"ok": cert.ok, "statuses": statuses(cert),
                       "prefix": next(c for c in cert.checks if c["name"] == "prefix_cache")}
    vllm.LLM.reset_prefix_cache = lambda self, *a, **k: True          # a refit whose cache reset is disabled
    try:
        refit(cached, base)
        cert = certify_refit(cached, base, cache_prompts=seqs)
    finally:
        vllm.LLM.reset_prefix_cache = reset
    out["cache_stale"] = {"ok": cert.ok, "first_failed": cert.first_failed, "statuses": statuses(cert),
                          "prefix": next(c for c in cert.checks if c["name"] == "prefix_cache")}
    still = certify_refit(cached, base, cache_prompts=seqs)      # the stale blocks stay until a reset
    cached.reset_prefix_cache()
    cold = certify_refit(cached, base, cache_prompts=seqs)       # after a reset: no hit; the check primes the cache
    hit = certify_refit(cached, base, cache_prompts=seqs)        # a genuine hit (same weights) equals a cold run
    out["cache_after"] = {"still_stale": still.first_failed,
                          **{k: [c.ok, next(x["cached_tokens"] for x in c.checks if x["name"] == "prefix_cache")]
                             for k, c in (("reset", cold), ("genuine_hit", hit))}}
    trainer.close()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
