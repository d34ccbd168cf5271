"""Run by tests/test_vllm_replay.py in a child process (vLLM keeps process-wide state): record a vLLM rollout of
the embedded model (fp32, chunked prefill: 3 slots, a 16-token step budget), then score it with
moealign.patches.vllm.replay.score_with_routes unforced, with its own routes forced, with one expert swapped on
some rows, and with the routes transformers bf16 chooses on the same tokens; print one JSON line (RESULT ...) of
what the routers actually ran (read through their capture hook), log-prob differences, refusals and undo checks.

usage: python tests/vllm_replay_child.py
"""

from __future__ import annotations

import dataclasses
import json
import time

if __name__ == "__main__":
    import torch

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.errors import RecordMismatchError, ReplayConfigError, ReplayError
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.replay import score_with_routes
    from moealign.patches.vllm.rollout import generate_with_record, model_runner, moe_routers
    from moealign.record import RolloutRecord, SamplingParams

    t_start = time.perf_counter()
    llm = open_llm(str(embedded_model_path()), dtype="fp32", max_num_seqs=3, max_num_batched_tokens=16,
                   max_model_len=256, enable_prefix_caching=False)
    runner = model_runner(llm)
    routers = [r for _, _, r in moe_routers(runner.model)]
    tts = runner.sampler.topk_topp_sampler

    def state():
        return (vars(runner).get("execute_model"), vars(runner).get("_model_forward"), vars(tts).get("forward"),
                [r.capture_fn for r in routers], [vars(r).get("_compute_routing") for r in routers])

    before = state()
    prompts = [p[:n] for p, n in zip(default_prompts()[:5], (40, 90, 25, 120, 60))]
    record = generate_with_record(llm, prompts, sampling=SamplingParams(temperature=0.9, top_p=0.9, top_k=50),
                                  max_new_tokens=10, seed=5)
    meta = record.meta
    result: dict = {"samples": len(record), "tokens": sum(s.length for s in record.samples),
                    "response_tokens": sum(s.response_len for s in record.samples)}

    def srt(r):
        return r.to(torch.int64).sort(-1).values

    def flips(ran, forced):
        """(rows x layers) whose expert set differs, over all samples."""
        return int(sum(int((srt(a) != srt(b)).any(-1).sum()) for a, b in zip(ran, forced)))

    def maxdiff(a, b):
        return float(max(float((x - y).abs().max()) for x, y in zip(a, b)))

    def meandiff(a, b):
        return float(torch.cat([(x - y).abs() for x, y in zip(a, b)]).mean())

    recorded = [s.routes for s in record.samples]
    lp_native, ran_native = score_with_routes(llm, record, force=False, return_routes=True)
    result["native_flips_vs_record"] = flips(ran_native, recorded)
    result["undone_after_native"] = state() == before

    lp_own, ran_own = score_with_routes(llm, record, return_routes=True)
    result["own_flips"] = flips(ran_own, recorded)
    result["own_exact_slots"] = all(torch.equal(a, b.to(torch.int64)) for a, b in zip(ran_own, recorded))
    result["own_max_diff"] = maxdiff(lp_own, lp_native)
    result["own_bitwise"] = all(torch.equal(a, b) for a, b in zip(lp_own, lp_native))
    result["undone_after_forced"] = state() == before

    # one expert swapped (slot 0 -> the smallest expert not in the row's set) on every third row, one layer per row
    swapped, changed = [], 0
    for s in record.samples:
        r = s.routes.clone().to(torch.int64)
        for p in range(0, r.shape[0], 3):
            layer = p % r.shape[1]
            used = set(r[p, layer].tolist())
            r[p, layer, 0] = min(e for e in range(meta.num_experts) if e not in used)
            changed += 1
        swapped.append(r)
    rec_swapped = RolloutRecord(meta, [dataclasses.replace(s, routes=r.to(s.routes.dtype))
                                       for s, r in zip(record.samples, swapped)])
    lp_swap, ran_swap = score_with_routes(llm, rec_swapped, return_routes=True)
    result["swap_rows_changed"] = changed
    result["swap_flips_vs_forced"] = flips(ran_swap, swapped)
    result["swap_flips_vs_native"] = flips(ran_swap, recorded)
    result["swap_max_diff"] = maxdiff(lp_swap, lp_native)

    # another engine: transformers bf16 on the same tokens (its routes and its full-vocabulary log-probs)
    from moealign.patches.hf.loading import load_model
    from moealign.patches.hf.model import record_meta as hf_record_meta
    from moealign.patches.hf.rollout import capture_routes

    model, _ = load_model(embedded_model_path(), "bf16")
    hf_routes, lp_hf = [], []
    with torch.no_grad(), capture_routes(model) as cap:
        for s in record.samples:
            logits = model(s.token_ids[None]).logits[0].float()
            hf_routes.append(cap.last_forward()[:s.length - 1])
            logp = logits.log_softmax(-1)
            lp_hf.append(logp[s.prompt_len - 1:s.length - 1].gather(-1, s.response_ids[:, None]).squeeze(-1))
    hf_meta = hf_record_meta(model)
    rec_hf = RolloutRecord(hf_meta, [dataclasses.replace(s, routes=r.to(s.routes.dtype))
                                     for s, r in zip(record.samples, hf_routes)])
    lp_hfr, ran_hfr = score_with_routes(llm, rec_hf, return_routes=True)
    result["hf_route_flips_vs_vllm"] = flips(hf_routes, recorded)
    result["hf_forced_flips"] = flips(ran_hfr, hf_routes)
    result["hf_max_diff_vs_native"] = maxdiff(lp_hfr, lp_native)
    result["hf_mean_abs_before"] = meandiff(lp_native, lp_hf)
    result["hf_mean_abs_after"] = meandiff(lp_hfr, lp_hf)
    result["rows_x_layers"] = sum((s.length - 1) * len(meta.moe_layers) for s in record.samples)

    # undo: a later forward routes natively again
    lp_again, ran_again = score_with_routes(llm, record, force=False, return_routes=True)
    result["undo_native_routes_equal"] = all(torch.equal(a, b) for a, b in zip(ran_again, ran_native))
    result["undo_native_logprobs_equal"] = all(torch.equal(a, b) for a, b in zip(lp_again, lp_native))
    result["undone_at_end"] = state() == before

    # refusals
    refused = {}
    no_routes = RolloutRecord(meta, [dataclasses.replace(s, routes=None) for s in record.samples], validate=False)
    for name, call, error in (
            ("no_routes", lambda: score_with_routes(llm, no_routes), ReplayError),
            ("other_model", lambda: score_with_routes(
                llm, RolloutRecord(dataclasses.replace(meta, model_fingerprint="0" * 16), record.samples,
                                   validate=False)), RecordMismatchError)):
        try:
            call()
            refused[name] = None
        except error as exc:
            refused[name] = type(exc).__name__
    cache = llm.llm_engine.vllm_config.cache_config
    cache.enable_prefix_caching = True
    try:     # forced routes with prefix caching on are supported (tests/test_vllm_prefix_cache.py): not refused
        score_with_routes(llm, record)
        refused["prefix_caching"] = None
    except ReplayConfigError as exc:
        refused["prefix_caching"] = type(exc).__name__
    finally:
        cache.enable_prefix_caching = False
    result["refused"] = refused
    result["undone_after_refusals"] = state() == before

    # the replay weights at the ids vLLM's router chose are its own weights, bitwise (the scoring that matches
    # the router), for both renormalisations; the family's scoring (softmax over all experts, renormalised) is
    # the same up to rounding
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from moealign.families import get_family
    from moealign.patches.vllm.replay import vllm_router_scoring
    from moealign.routing_replay.gates import replay_gate_weights

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(257, 8, generator=gen)
    family_scoring = get_family("qwen3_moe").scoring(llm.llm_engine.model_config.hf_config)
    weights = {}
    for renorm in (True, False):
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(257, meta.num_experts, generator=gen) * 3).to(dtype)
            router = CPURouter(top_k=meta.top_k, global_num_experts=meta.num_experts, renormalize=renorm)
            w, ids = router._compute_routing(hidden, logits, None)
            mine = replay_gate_weights(logits, ids, vllm_router_scoring(router), out_dtype=torch.float32)
            fam = replay_gate_weights(logits, ids, dataclasses.replace(family_scoring, renormalize=renorm),
                                      out_dtype=torch.float32)
            weights[f"renorm={renorm},{str(dtype)[6:]}"] = [torch.equal(mine, w), float((fam - w).abs().max())]
    result["router_weights"] = weights
    result["seconds"] = time.perf_counter() - t_start
    print("RESULT " + json.dumps(result), flush=True)
