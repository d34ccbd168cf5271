"""Benchmark: moealign's own per-step work inside the RL loop of ``moealign rl-check``, against the loop's plain step,
in one run.

One vLLM engine and one Megatron trainer (the embedded model by default, the rl-check defaults: 32 prompts x 4
completions x 32 tokens, vLLM bf16, Megatron fp32), the same prompts, seeds and tokens. Interleaved rounds time:

* rollout: plain ``LLM.generate`` (processed log-probs of the sampled tokens, what any RL loop asks for) vs
  ``generate_with_record`` (routes and kept sets recorded and checked);
* train: a plain Megatron forward + backward vs the same with routing replay (``set_routes``, RouterReplay, the
  replay verifier's device counters and its check); the route capture rl-check adds to measure router flips is
  measurement, not alignment work, and is left out of both;
* refit: moealign's in-place refit (manifest check, the CPU build's prepack fix) vs vLLM's own ``reload_weights`` of
  the same tensors (the stock path: it corrupts the MoE layers on the CPU build, timed only as a baseline);
* refit verification: ``verify_refit`` (every worker's tensors read back and fingerprinted) at every step, and the
  standalone probe forward (``Probe.gaps``) once per run (the aligned loop's other refits are probed by the next
  rollout itself: a masked mean over tensors the step has anyway), amortized over ``--steps``.

* the refit certificate (:func:`moealign.rl.certify_refit`, issue 38): each check's own cost (the digests and the
  prefill probe above, the decode probe alone, both probes as ``certify_refit`` runs them: one vLLM call and one
  trainer forward (``Probe.both_gaps``; the probe's defaults: 2 sequences of 32 tokens, 24 scored, 2 decoded), the
  derived-buffer check, the prefix-cache check: its cached and cold runs in one vLLM call, one sampled token each,
  on the rollout engine, which caches prefixes by default) and the whole call, as if run after every refit: each
  prefix check and whole call starts from a reset prefix cache, as a refit leaves it (the reset timed with it).

Printed: minimum / median seconds of each, the plain step (medians of plain rollout + plain train + refit), moealign's
own work per step (recording and replay as the median of their per-round paired differences, which cancels load that
outlasts a round, plus the verification's median) and its share of the aligned step (target <= 3%, aim 1%), and the
certificate's share of the plain step (goal <= 2%).
``--json`` writes the figures.

    python tools/bench_rl_check.py
    python tools/bench_rl_check.py --num-prompts 32 --max-new-tokens 64 --repeats 7 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main(argv=None) -> int:
    import torch

    from _timing import interleaved, paired_median, write_json

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.mismatch.engines import MegatronTrainEngine, VLLMRolloutEngine
    from moealign.patches.vllm import refit as vr
    from moealign.patches.vllm.rollout import generate_with_record, model_runner
    from moealign.record import SamplingParams
    from moealign.rl.certify import certify_refit, prefix_cache_check
    from moealign.rl.refit import Probe, refit, trainer_tensors, verify_refit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(embedded_model_path()))
    ap.add_argument("--rollout-precision", default="bf16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="steps of the loop the standalone probe is amortized over")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    prompts = [p for p in default_prompts()[:args.num_prompts] for _ in range(args.group_size)]
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    rollout = VLLMRolloutEngine(args.model, args.rollout_precision, "cpu")
    trainer = MegatronTrainEngine(args.model, "fp32", "cpu")
    llm = rollout.llm
    for p in trainer.model.parameters():
        p.requires_grad_(True)
    from vllm import SamplingParams as VllmSampling

    plain_params = [VllmSampling(n=1, temperature=1.0, top_p=0.9, max_tokens=args.max_new_tokens, seed=i, logprobs=0)
                    for i in range(len(prompts))]
    record = generate_with_record(llm, prompts, sampling=sampling, max_new_tokens=args.max_new_tokens, seed=0)
    idx = list(range(len(record)))
    tok = llm.get_tokenizer()
    probe = Probe([torch.tensor(tok(p)["input_ids"][:32]) for p in default_prompts()[:2]])   # rl-check's
    probe.calibrate(llm, trainer)
    layout = vr.checkpoint_layout(args.model)

    def train(replay: bool, capture: bool):
        fwd = trainer.forward(record, idx, replay=replay, grad=True, capture=capture)
        torch.nn.functional.cross_entropy(fwd.logits, fwd.tokens).backward()
        trainer.model.zero_grad(set_to_none=True)

    def stock_reload():
        state = trainer_tensors(trainer)
        model_runner(llm).reload_weights(weights_iterator=vr.checkpoint_named(state, layout))

    fns = {
        "rollout_plain": lambda: llm.generate(prompts, plain_params, use_tqdm=False),
        "rollout_recorded": lambda: generate_with_record(llm, prompts, sampling=sampling,
                                                         max_new_tokens=args.max_new_tokens, seed=0),
        "train_plain": lambda: train(False, False),
        "train_replay": lambda: train(True, False),
        "refit_vllm_reload": stock_reload,
        "refit_moealign": lambda: refit(llm, trainer),
        "verify_digests": lambda: verify_refit(llm, trainer),
        "probe": lambda: probe.gaps(llm, trainer),
        "decode_probe": lambda: probe.decode_gaps(llm, trainer),
        "derived_buffers": lambda: vr.check_derived_buffers(llm),
        "probes": lambda: probe.both_gaps(llm, trainer),
        # after a refit the prefix cache is empty (moealign's refit resets it), so the prefix check's "cached" run
        # recomputes its prompts: each timed call starts from a reset cache (the reset's own cost included)
        "certify": lambda: (llm.reset_prefix_cache(), certify_refit(llm, trainer, probe=probe)),
    }
    caching = bool(getattr(llm.llm_engine.vllm_config.cache_config, "enable_prefix_caching", False))
    if caching:
        fns["prefix_cache"] = lambda: (llm.reset_prefix_cache(), prefix_cache_check(llm, probe.sequences[:1]))
    t = interleaved(fns, args.repeats)
    refit(llm, trainer)                        # leave the engine exact (the stock reload corrupted it)
    assert verify_refit(llm, trainer, probe=probe).ok
    # the aligned loop: every refit's tensors fingerprinted before the next rollout; the probe is the next rollout
    # itself (a masked mean over tensors the step has anyway) but for the last refit, which gets the standalone probe
    verification = t["verify_digests_median"] + t["probe_median"] / args.steps
    every_step = t["verify_digests_median"] + t["probe_median"]       # the standalone probe after every refit
    plain_step = t["rollout_plain_median"] + t["train_plain_median"] + t["refit_moealign_median"]
    # each cost as the median of its per-round paired difference (clamped at 0: a cost, not a speed-up)
    recording = max(0.0, paired_median(t, "rollout_recorded", "rollout_plain"))
    replay = max(0.0, paired_median(t, "train_replay", "train_plain"))
    own = recording + replay + verification
    aligned_step = plain_step + own
    # the certificate after every refit (issue 38 item 6): the whole call on this engine (digests, buffers, both
    # probes, and the prefix check where the engine caches prefixes)
    prefix = t["prefix_cache_median"] if caching else None
    certify_step = t["certify_median"]
    result = {k: round(v, 6) for k, v in t.items() if not k.startswith("_")}
    result.update({"prefix_cache_check_s": None if prefix is None else round(prefix, 6),
                   "certify_step_s": round(certify_step, 6),
                   "certify_share_of_plain_step": round(certify_step / plain_step, 4),
                   "certify_share_of_aligned_step": round(certify_step / (aligned_step + certify_step), 4),
                   "certify_without_prefix_share_of_plain_step": round((certify_step - (prefix or 0.0)) / plain_step,
                                                                      4),
                   "probes_share_of_plain_step": round(t["probes_median"] / plain_step, 4),
                   "decode_probe_share_of_plain_step": round(t["decode_probe_median"] / plain_step, 4)})
    result.update({"recording_cost_s": round(recording, 6), "replay_cost_s": round(replay, 6)})
    result.update({
        "samples": len(prompts), "response_tokens": record.num_response_tokens,
        "recording_ratio": round(t["rollout_recorded"] / t["rollout_plain"], 4),
        "replay_ratio": round(t["train_replay"] / t["train_plain"], 4),
        "refit_ratio_vs_vllm_reload": round(t["refit_moealign"] / t["refit_vllm_reload"], 4),
        "plain_step_s": round(plain_step, 6), "aligned_step_s": round(aligned_step, 6),
        "moealign_own_s": round(own, 6), "moealign_share": round(own / aligned_step, 4),
        "verification_s": round(verification, 6), "verify_share": round(verification / aligned_step, 4),
        "standalone_probe_share": round(every_step / (aligned_step - verification + every_step), 4),
    })
    print(f"{len(prompts)} samples, {record.num_response_tokens} response tokens, vLLM {args.rollout_precision}, "
          f"Megatron fp32, {args.repeats} interleaved rounds (min / median s)")
    for name in fns:
        print(f"  {name:18s} {t[name]:.4f} / {t[name + '_median']:.4f}")
    print(f"  recording {result['recording_ratio']:.3f}x of the plain rollout; replay (+ verifier) "
          f"{result['replay_ratio']:.3f}x of the plain train step; refit {result['refit_ratio_vs_vllm_reload']:.3f}x "
          f"of vLLM's own reload")
    print(f"  plain step {plain_step:.3f} s (medians); moealign's own work {own * 1e3:.1f} ms (recording "
          f"{recording * 1e3:.1f} + replay {replay * 1e3:.1f} by paired medians, verification {verification * 1e3:.1f}) "
          f"= {100 * result['moealign_share']:.2f}% of the aligned step (refit verification alone "
          f"{100 * result['verify_share']:.2f}%; with the standalone probe at every step it would be "
          f"{100 * result['standalone_probe_share']:.2f}%)")
    print(f"  refit certificate after every refit: certify_refit {certify_step * 1e3:.1f} ms = "
          f"{100 * result['certify_share_of_plain_step']:.2f}% of the plain step (goal <= 2%; without the prefix "
          f"check, an engine with caching off: {100 * result['certify_without_prefix_share_of_plain_step']:.2f}%)")
    print(f"    digests {t['verify_digests_median'] * 1e3:.1f} ms, derived buffers "
          f"{t['derived_buffers_median'] * 1e3:.2f}, both probes in one call {t['probes_median'] * 1e3:.1f} (apart: "
          f"prefill {t['probe_median'] * 1e3:.1f} + decode {t['decode_probe_median'] * 1e3:.1f}), prefix cache "
          f"{'- (caching off)' if prefix is None else f'{prefix * 1e3:.1f}'}")
    if args.json:
        write_json(args.json, result)
    trainer.close()
    rollout.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
