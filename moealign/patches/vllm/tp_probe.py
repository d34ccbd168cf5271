"""One vLLM engine run for ``moealign tp-check --engine vllm`` (a child process per TP size and path).

vLLM keeps process-wide state and the tree patch is class-level and must precede model loading, so every
(TP size, path) pair is a fresh process: ``python -m moealign.patches.vllm.tp_probe --tp 2 --out FILE``. The
caller sets ``MOEALIGN_VLLM_PATCHES`` (:mod:`.plugin`) for the tree path; the run then checks that every worker
really loaded its model under the tree patch (a silent no-op is an error, not a passing row).

The probe generates from fixed prompts (temperature 1, seeded) and keeps what the two paths are compared on: the
prompt log-probs (one prefill of every prompt token, independent of sampling), the sampled tokens and their
log-probs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..._files import atomic_write
from ...errors import ConfigError, EngineError
from .engine import open_llm

__all__ = ["probe", "tree_flags"]


def tree_flags(model) -> bool:
    """Run in each worker (``LLM.apply_model``): did every linear layer and MoE layer load under the tree patch?"""
    linear = [getattr(mod, "_moealign_tree", False) for mod in model.modules() if hasattr(mod, "quant_method")
              and hasattr(mod, "weight") and getattr(mod, "weight").dim() == 2]
    experts = [hasattr(mod, "_moealign_tree_weights") for mod in model.modules() if hasattr(mod, "w13_weight")]
    return bool(linear) and all(linear) and all(experts)


def probe(model: str, *, tp: int, dtype: str, prompts: list[str], max_tokens: int, seed: int,
          expect_tree: bool) -> dict:
    """Open vLLM at ``tensor_parallel_size=tp``, generate, and return token ids and log-probs (JSON-ready)."""
    options = {"tensor_parallel_size": tp}
    if tp > 1:
        options["distributed_executor_backend"] = "mp"
    llm = open_llm(model, dtype=dtype, seed=seed, max_num_seqs=max(1, len(prompts)), **options)
    from vllm import SamplingParams

    flags = llm.apply_model(tree_flags)
    if expect_tree and not all(flags):
        raise EngineError(f"MOEALIGN_VLLM_PATCHES asked for the tree forward but the workers' models did not load "
                          f"under it (per worker: {flags}); the vllm.general_plugins entry point of moealign did "
                          f"not run there (is moealign installed in this environment, VLLM_PLUGINS unset?)")
    if not expect_tree and any(flags):
        raise EngineError(f"the stock path's workers loaded under moealign's tree patch (per worker: {flags})")
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=0, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    rows = []
    for out in outputs:
        completion = out.outputs[0]
        prompt_ids = list(out.prompt_token_ids)
        rows.append({
            "prompt_logprobs": [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], prompt_ids[1:])],
            "token_ids": list(completion.token_ids),
            "logprobs": [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)],
        })
    from .engine import vllm_version

    return {"tp": tp, "tree": bool(expect_tree), "workers_tree": flags, "generate_s": elapsed, "rows": rows,
            "vllm_version": str(vllm_version())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moealign.patches.vllm.tp_probe")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--prompts", required=True, help="JSON list of prompt strings")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tree", action="store_true", help="expect the tree patch (MOEALIGN_VLLM_PATCHES=tree)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    prompts = json.loads(args.prompts)
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ConfigError("--prompts must be a JSON list of strings")
    result = probe(args.model, tp=args.tp, dtype=args.dtype, prompts=prompts, max_tokens=args.max_tokens,
                   seed=args.seed, expect_tree=args.tree)
    text = json.dumps(result)
    atomic_write(args.out, lambda tmp: Path(tmp).write_text(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
