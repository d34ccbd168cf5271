"""Run by tests/test_sharded_refit.py in a child process (vLLM keeps process-wide state): refits of one vLLM engine
(the embedded model, fp32, TP 1) from a sharded Megatron trainer (TP 2: two rank processes, each holding half of
every split tensor), streamed from the ranks, and their verification.

usage: python tests/vllm_sharded_refit_child.py CHANGED CHANGED_ONE_RANK WITH_NAN PARENT_MANIFEST OUT_DIR

CHANGED: a copy of the embedded checkpoint with every weight changed; CHANGED_ONE_RANK: CHANGED with one element of
a piece rank 1 owns changed; WITH_NAN: CHANGED with a NaN in a piece rank 1 owns; PARENT_MANIFEST: the weight
manifest of CHANGED written by the test process (from the safetensors file, no trainer). Prints one ``RESULT {json}``
line; writes the sharded trainer's manifest of CHANGED to OUT_DIR/sharded.manifest.json.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def main(changed: str, changed_one_rank: str, with_nan: str, parent_manifest: str, out_dir: str) -> dict:
    import torch

    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.errors import RefitError
    from moealign.mismatch.engines import VLLMRolloutEngine
    from moealign.model_config import ConfigView, read_model_config
    from moealign.patches.megatron import checkpoint as mc
    from moealign.patches.megatron.sharded import ShardedMegatronTrainer, process_memory
    from moealign.rl import WeightManifest, refit, verify_refit, weight_manifest

    out: dict = {}
    t0 = time.perf_counter()
    box: dict = {}

    def start_world():            # the ranks import and load while vLLM starts
        try:
            box["trainer"] = ShardedMegatronTrainer(changed, tp=2, timeout_s=180)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    starter = threading.Thread(target=start_world)
    starter.start()
    rollout = VLLMRolloutEngine(str(embedded_model_path()), "fp32", "cpu", tp=1)
    starter.join()
    if "error" in box:
        raise box["error"]
    trainer = box["trainer"]
    out["start_s"] = time.perf_counter() - t0
    llm = rollout.llm
    from vllm import SamplingParams

    prompts = default_prompts()[:2]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def logprobs() -> torch.Tensor:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return torch.cat([torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
                          for o in outs])

    try:
        before = logprobs()
        plan = trainer.hf_plan()
        out["split_tensors"] = sum(len(e.pieces) > 1 for e in plan.values())
        out["tensors"] = len(plan)
        out["owned_bytes"] = [sum(math_prod(p.shape) * 4 for e in plan.values() for p in e.pieces if p.rank == r)
                              for r in range(trainer.layout.world)]
        # the manifest, each rank digesting its own pieces, saved for the test process to compare with its own
        t = time.perf_counter()
        manifest = weight_manifest(trainer)
        out["manifest_s"] = time.perf_counter() - t
        manifest.save(os.path.join(out_dir, "sharded.manifest.json"))
        # 1. the refit from the ranks, in chunks of 1 MiB (the model: 9.2 MB), memory measured around it
        ranks0 = trainer.peak_rss(reset=True)
        own0 = process_memory(reset=True)
        result = refit(llm, trainer, chunk_bytes=1 << 20)
        ranks1 = trainer.peak_rss()
        own1 = process_memory()
        out["refit"] = dict(tensors=result.tensors, bytes=result.bytes, chunks=result.chunks, seconds=result.seconds)
        out["rank_peak_delta"] = [b["peak"] - a["rss"] for a, b in zip(ranks0, ranks1)]
        out["driver_peak_delta"] = own1["peak"] - own0["rss"]
        after = logprobs()
        out["moved"] = float((after - before).abs().max())
        check = verify_refit(llm, trainer)                       # digests from the ranks
        out["verify_trainer_ok"] = check.ok
        out["verify_trainer_checked"] = check.weights.checked
        parent = WeightManifest.load(parent_manifest)            # written by another process
        out["verify_parent_manifest_ok"] = verify_refit(llm, parent).ok
        # 2. the reference: the same weights refitted from one process (a snapshot read from the checkpoint file)
        config = ConfigView(**read_model_config(changed))
        ckpt = mc.open_hf_checkpoint(changed, config)
        try:
            snapshot = {name: ckpt.get(name) for name in plan}
        finally:
            ckpt.close()
        t = time.perf_counter()
        refit(llm, snapshot, chunk_bytes=1 << 20)
        out["snapshot_refit_s"] = time.perf_counter() - t
        reference = logprobs()
        out["bitwise_vs_single_process_refit"] = bool(torch.equal(after, reference))
        out["differs_from_before"] = not bool(torch.equal(after, before))      # negative control
        # 3. negative control: one element of a piece rank 1 owns changed after the manifest was taken
        trainer.load_checkpoint(changed_one_rank)
        refit(llm, trainer, chunk_bytes=1 << 20)
        stale = verify_refit(llm, manifest)
        out["stale_ok"] = stale.ok
        out["stale_named"] = sorted(list(m[:2]) for m in stale.weights.mismatches)
        out["fresh_ok"] = verify_refit(llm, weight_manifest(trainer)).ok
        out["one_rank_moved"] = not bool(torch.equal(logprobs(), after))
        # 4. a NaN in a piece rank 1 owns: refused by that rank before any weight moved
        held = logprobs()
        trainer.load_checkpoint(with_nan)
        try:
            refit(llm, trainer, chunk_bytes=1 << 20)
            out["nan_refused"] = None
        except RefitError as exc:
            out["nan_refused"] = str(exc)
        out["unchanged_after_refusal"] = bool(torch.equal(logprobs(), held))
    finally:
        trainer.close()
        rollout.close()
    return out


def math_prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(*sys.argv[1:6])), flush=True)
