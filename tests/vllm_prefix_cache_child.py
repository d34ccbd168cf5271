"""Run by tests/test_vllm_prefix_cache.py in a child process: records and forced routes with vLLM's prefix caching on
against the same with it off, on the embedded model (fp32), and the negative controls. Prints one ``RESULT {json}``.

usage: python tests/vllm_prefix_cache_child.py OUT_DIR          (MOEALIGN_VLLM_PATCHES=tree for the tree forward)

Prompts: 3 groups of 4 samples (rl-check's default group size), each group one prompt of 3 embedded prompts joined
(~96 tokens: two 32-token KV blocks reusable; vLLM's CPU attention takes multiples of 32 only), one seed per sample.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BLOCK = 32
NEW_TOKENS = 6


def _open(caching: bool):
    from moealign.embedded import embedded_model_path
    from moealign.patches.vllm.engine import open_llm

    return open_llm(str(embedded_model_path()), dtype="fp32", max_num_seqs=16, max_model_len=256,
                    enable_prefix_caching=caching, block_size=BLOCK)


def _counting(llm):
    """Wrap llm.generate to keep each output's num_cached_tokens (vLLM's per-request hit count)."""
    plain, seen = llm.generate, {}

    def generate(*args, **kwargs):
        outputs = plain(*args, **kwargs)
        seen["cached"] = [int(o.num_cached_tokens or 0) for o in outputs]
        return outputs
    llm.generate = generate
    return seen


def _same_records(a, b) -> dict:
    out = {}
    for name in ("token_ids", "logprobs", "routes", "kept_offsets", "kept_ids"):
        out[name] = all(torch.equal(getattr(x, name), getattr(y, name)) for x, y in zip(a.samples, b.samples))
    out["prompt_len"] = [s.prompt_len for s in a.samples] == [s.prompt_len for s in b.samples]
    return out


def _error(call) -> str | None:
    try:
        call()
    except Exception as exc:       # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def _forced_generate(llm, record, sampling_key):
    from vllm import SamplingParams as VllmSamplingParams

    inputs = [{"prompt_token_ids": s.token_ids.tolist()} for s in record.samples]
    params = [VllmSamplingParams(n=1, temperature=1.0, max_tokens=1, detokenize=False,
                                 extra_args={sampling_key: i}) for i in range(len(inputs))]
    return llm.generate(inputs, params, use_tqdm=False)


def main(out_dir: Path) -> None:
    from moealign.embedded import default_prompts
    from moealign.patches.vllm import rollout as R
    from moealign.patches.vllm.replay import SAMPLE_KEY, force_routes, score_with_routes
    from moealign.record import RolloutRecord, SamplingParams

    P = default_prompts()
    prompts = [" ".join(P[3 * g:3 * g + 3]) for g in range(3) for _ in range(4)]
    sampling = SamplingParams(temperature=0.9, top_p=0.9, top_k=50)
    def record(llm):
        return R.generate_with_record(llm, prompts, sampling=sampling, max_new_tokens=NEW_TOKENS, seed=11,
                                      validate=True)

    result: dict = {}

    # ---------------------------------------------------------------- caching on
    llm = _open(True)
    seen = _counting(llm)
    on = record(llm)
    result["cached_first"] = seen["cached"]
    again = record(llm)                  # the prompts' blocks are cached from the first call: noted copies reused
    result["cached_again"] = seen["cached"]
    result["again_equal"] = _same_records(on, again)
    # stock or tree: the reused positions' routes are the writer's (each group's first sample), bitwise
    result["restored_are_writers"] = all(
        torch.equal(on.samples[4 * g + k].routes[:c], on.samples[4 * g].routes[:c])
        for g in range(3) for k in range(1, 4) for c in [result["cached_first"][4 * g + k]])
    on.save(out_dir / "on.safetensors")
    scheduler = R.engine_scheduler(llm)
    pool = scheduler.kv_cache_manager.block_pool

    # negative controls: the restore disabled (missing rows), the restore off by one block (wrong rows)
    real = R.with_cached_rows
    R.with_cached_rows = lambda names, rows, hits, size: rows
    result["no_restore"] = _error(lambda: record(llm))
    R.with_cached_rows = lambda names, rows, hits, size: real(
        names, rows, {r: [(w, j + 1) for w, j in ws] for r, ws in hits.items()}, size)
    result["wrong_restore"] = _error(lambda: record(llm))
    R.with_cached_rows = real
    # a block vLLM holds that the recorder did not see written: the hit is clipped, never restored from nowhere
    llm.reset_prefix_cache()
    plain = _counting(llm)
    from vllm import SamplingParams as VllmSamplingParams

    llm.generate(prompts[:1], VllmSamplingParams(max_tokens=1), use_tqdm=False)     # unrecorded: the prompt cached
    seen = _counting(llm)
    clipped = {}
    attach = R.CachedPrefixRoutes.attach

    def counting_attach(self):
        clipped["handle"] = self
        return attach(self)
    R.CachedPrefixRoutes.attach = counting_attach
    only = R.generate_with_record(llm, prompts[:1], sampling=sampling, max_new_tokens=NEW_TOKENS, seed=11)
    R.CachedPrefixRoutes.attach = attach
    result["unseen_block_clipped"] = clipped["handle"].clipped
    result["unseen_cached"] = seen["cached"]
    result["unseen_equal"] = all(torch.equal(getattr(only.samples[0], n), getattr(on.samples[0], n))
                                 for n in ("token_ids", "logprobs", "routes"))
    del plain

    # forced routes, caching on: score_with_routes (prompt log-probs: no cache read; forced blocks evicted after)
    lp_on, ran_on = score_with_routes(llm, on, return_routes=True)
    # forced routes with cache hits: force_routes + a plain generate of the samples' tokens (groups share blocks)
    before = len(pool.cached_block_hash_to_block)
    forcer = force_routes(llm, on)
    outs = _forced_generate(llm, on, SAMPLE_KEY)
    result["forced_cached"] = [int(o.num_cached_tokens or 0) for o in outs]
    ran = forcer.ran_routes([s.length - 1 for s in on.samples])
    forcer.check()
    result["forced_ran_equal"] = all(torch.equal(r, s.routes.to(torch.int64)) for r, s in zip(ran, on.samples))
    written = set(forcer.cached.written)
    forcer.undo()
    result["forced_blocks_evicted"] = bool(written) and all(pool.blocks[b].block_hash is None for b in written)
    result["forced_cache_size_restored"] = len(pool.cached_block_hash_to_block) == before
    # a sample whose forced routes differ in a reused block: its hit clipped (recomputed under its own routes)
    other = RolloutRecord.load(out_dir / "on.safetensors")
    row = other.samples[1].routes[0, 0].to(torch.int64)
    other.samples[1].routes[0, 0] = ((row + 1) % other.meta.num_experts).to(other.samples[1].routes.dtype)
    forcer = force_routes(llm, other)
    outs = _forced_generate(llm, other, SAMPLE_KEY)
    result["perturbed_cached"] = [int(o.num_cached_tokens or 0) for o in outs]
    ran = forcer.ran_routes([s.length - 1 for s in other.samples])
    forcer.undo()
    result["perturbed_ran_equal"] = all(torch.equal(r, s.routes.to(torch.int64)) for r, s in zip(ran, other.samples))
    # control: the agreement check off, the hit is taken and the sample ran its writer's routes, not its own
    forcer = force_routes(llm, other)
    forcer.cached.admit = None
    outs = _forced_generate(llm, other, SAMPLE_KEY)
    result["unchecked_cached"] = [int(o.num_cached_tokens or 0) for o in outs]
    ran = forcer.ran_routes([s.length - 1 for s in other.samples])
    forcer.undo()
    result["unchecked_sample1_ran_forced"] = torch.equal(ran[1], other.samples[1].routes.to(torch.int64))
    result["unchecked_sample1_ran_writer"] = torch.equal(ran[1][0], on.samples[0].routes[0].to(torch.int64))
    del llm

    # ---------------------------------------------------------------- caching off
    llm = _open(False)
    seen = _counting(llm)
    off = record(llm)
    result["cached_off"] = seen["cached"]
    lp_off, ran_off = score_with_routes(llm, off, return_routes=True)
    result["on_off_equal"] = _same_records(on, off)
    result["forced_lp_equal"] = all(torch.equal(a, b) for a, b in zip(lp_on, lp_off))
    result["forced_ran_on_off_equal"] = all(torch.equal(a, b) for a, b in zip(ran_on, ran_off))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
