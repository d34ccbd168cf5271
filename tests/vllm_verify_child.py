"""Run by tests/test_replay_verifier.py in a child process (vLLM keeps process-wide state): the replay verifier of
moealign.patches.vllm.replay.RouteForcer on the embedded model in vLLM's CPU build (fp32, chunked prefill: 3 slots,
a 16-token step budget). A rollout is recorded, then its routes shifted by one expert (``(e + 1) % E``: never the
router's own choice) and some rows marked missing are forced; the verifier reads the ``topk_ids`` the fused-MoE
experts receive (``RoutedExperts.forward_modular``). Prints one JSON line (RESULT ...): the clean report of a correct
replay (through force_routes in this process and through score_with_routes), the unrouted fraction counted here from
the record's packed replay batch ``route_mask``, the report and error of a replay whose router ``_compute_routing``
was put back to the class's after the forcer attached, and the state with ``verify=False``.

usage: python tests/vllm_verify_child.py
"""

from __future__ import annotations

import dataclasses
import json
import time

if __name__ == "__main__":
    import torch

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.errors import ReplayError
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.replay import SAMPLE_KEY, force_routes, score_with_routes
    from moealign.patches.vllm.rollout import generate_with_record, model_runner, moe_routers
    from moealign.record import RolloutRecord, SamplingParams

    t_start = time.perf_counter()
    llm = open_llm(str(embedded_model_path()), dtype="fp32", max_num_seqs=3, max_num_batched_tokens=16,
                   max_model_len=256, enable_prefix_caching=False)
    runner = model_runner(llm)
    found = moe_routers(runner.model)
    routers = [r for _, _, r in found]
    experts = [runner.model.get_submodule(name).routed_experts for _, name, _ in found]

    def state():
        return ([vars(r).get("_compute_routing") for r in routers], [vars(e).get("forward_modular") for e in experts],
                vars(runner).get("_model_forward"))

    before = state()
    prompts = [p[:n] for p, n in zip(default_prompts()[:4], (30, 70, 20, 50))]
    record = generate_with_record(llm, prompts, sampling=SamplingParams(temperature=0.9, top_p=0.9, top_k=50),
                                  max_new_tokens=6, seed=5)
    meta = record.meta
    E = meta.num_experts

    # the routes forced: the record's own shifted by one expert; sample 1 has three rows marked missing (held 0)
    samples = []
    for i, s in enumerate(record.samples):
        r = (s.routes.to(torch.int64) + 1) % E
        missing = None
        if i == 1:
            missing = torch.zeros(s.length - 1, dtype=torch.bool)
            missing[[1, 5, s.length - 3]] = True
            r[missing] = 0
        samples.append(dataclasses.replace(s, routes=r.to(s.routes.dtype), route_missing=missing))
    shifted = RolloutRecord(meta, samples)
    own_sets = torch.cat([s.routes.to(torch.int64) for s in record.samples]).sort(-1).values
    new_sets = torch.cat([s.routes.to(torch.int64) for s in shifted.samples]).sort(-1).values
    routed = torch.cat([s.routed_rows for s in shifted.samples])
    result: dict = {"samples": len(record), "tokens": sum(s.length for s in record.samples),
                    "differs_everywhere": bool((own_sets != new_sets).any(-1)[routed].all()),
                    "missing_rows": int((~routed).sum())}
    # the unrouted fraction counted from the batch: the packed replay batch's route_mask (each sample's last
    # token and the rows marked missing are False)
    mask = shifted.replay_batch("packed").route_mask
    result["mask_rows"] = int(mask.numel())
    result["mask_unrouted"] = int((~mask).sum())

    def summary(report):
        return {"rows": report.rows, "replayed": report.replayed_rows, "mismatched": report.mismatched_rows,
                "unrouted": report.unrouted_rows, "unrouted_fraction": report.unrouted_fraction,
                "layers": [[x.layer, x.calls, x.rows, x.replayed_rows, x.mismatched_rows, x.unrouted_rows]
                           for x in report.layers]}

    from vllm import SamplingParams as VllmSamplingParams

    def run(rec):
        inputs = [{"prompt_token_ids": s.token_ids.tolist()} for s in rec.samples]
        params = [VllmSamplingParams(n=1, temperature=1.0, max_tokens=1, detokenize=False,
                                     extra_args={SAMPLE_KEY: i}) for i in range(len(inputs))]
        llm.generate(inputs, params, use_tqdm=False)

    # (1) a correct replay: force_routes in this process, then score_with_routes (through the workers' RPC)
    with force_routes(llm, shifted) as forcer:
        run(shifted)
        report = forcer.verify_report()
        forcer.check()
        result["forced"] = summary(report)
        result["forced_calls"] = list(forcer.forced_calls)
    result["undone_after_forced"] = state() == before
    _, report = score_with_routes(llm, shifted, return_verify=True)
    result["scored"] = summary(report)
    result["undone_after_scored"] = state() == before

    # (2) bypassed: the first MoE layer's router gets its class _compute_routing back after the forcer attached
    layer0 = found[0][0]
    with force_routes(llm, shifted) as forcer:
        routers[0]._compute_routing = type(routers[0])._compute_routing.__get__(routers[0])
        run(shifted)
        result["bypassed"] = summary(forcer.verify_report())
        try:
            forcer.check()
            result["bypass_error"] = None
        except ReplayError as exc:
            result["bypass_error"] = str(exc)
    result["bypass_layer"] = layer0
    result["undone_after_bypass"] = state() == before

    # (3) verify=False wraps nothing
    with force_routes(llm, shifted, verify=False) as forcer:
        result["noverify_wrapped"] = [vars(e).get("forward_modular") is not None for e in experts]
        result["noverify_report"] = forcer.verify_report() is None
        run(shifted)
        forcer.check()
    lp, report = score_with_routes(llm, shifted, verify=False, return_verify=True)
    result["noverify_scored_report"] = report is None
    result["undone_at_end"] = state() == before
    result["seconds"] = time.perf_counter() - t_start
    print("RESULT " + json.dumps(result), flush=True)
