"""What the canonical forward (``--aligned``) costs against each engine's stock forward, measured in the same run.

* **vLLM** (rollout; two child processes, stock and ``MOEALIGN_VLLM_PATCHES=canonical``): ``generate_with_record``
  of ``--prompts`` x ``--new-tokens`` on the embedded model, after a warm-up generation;
* **Megatron-core** (training engine, in this process): the forward and the forward + backward of a padded batch,
  stock and under :func:`moealign.patches.megatron.canonical.apply_canonical_forward_from_hf`, on the embedded
  model and on a random Qwen3-MoE of realistic width (``--wide``: hidden 1024, 32 experts top-4, 2 layers).

    python tools/bench_aligned.py                 # embedded: vLLM + Megatron
    python tools/bench_aligned.py --wide          # + the wide MoE (Megatron)
    python tools/bench_aligned.py --no-vllm --json out.json

Each figure is the minimum over ``--repeats`` interleaved rounds (``_timing.interleaved``); ratios are aligned /
stock. The canonical ops are elementwise-product trees (no GEMM): their cost grows with the products, so the wide
model shows what a real checkpoint pays on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

_VLLM_CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
from moealign.embedded import default_prompts, embedded_model_path
from moealign.patches.vllm.engine import open_llm
from moealign.patches.vllm.rollout import generate_with_record
from moealign.record import SamplingParams

def main():
    prompts, tokens, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    llm = open_llm(str(embedded_model_path()), dtype="bf16", enable_prefix_caching=False, max_num_seqs=prompts)
    run = lambda seed: generate_with_record(llm, default_prompts()[:prompts], sampling=SamplingParams(),
                                            max_new_tokens=tokens, seed=seed)
    run(0)
    times = []
    for i in range(repeats):
        t = time.perf_counter(); run(i + 1); times.append(time.perf_counter() - t)
    print("RESULT " + json.dumps({"seconds": min(times)}))

if __name__ == "__main__":
    main()
"""


def _vllm(prompts: int, tokens: int, repeats: int) -> dict:
    out = {}
    for name, spec in (("stock", ""), ("aligned", "canonical")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "MOEALIGN_VLLM_PATCHES"}
        if spec:
            env["MOEALIGN_VLLM_PATCHES"] = spec
        env["VLLM_LOGGING_LEVEL"] = "ERROR"
        proc = subprocess.run([sys.executable, "-c", _VLLM_CHILD, str(prompts), str(tokens), str(repeats)],
                              capture_output=True, text=True, env=env, timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            from moealign.exits import child_failure

            raise SystemExit(child_failure(f"vLLM child ({name})", proc.returncode, proc.stderr) + "\n"
                             + proc.stderr[-2000:])
        out[name] = json.loads(lines[-1][7:])["seconds"]
    out["ratio"] = out["aligned"] / out["stock"]
    return out


def _megatron(model_path: str, precision: str, batch: int, seq: int, repeats: int, device: str = "cpu") -> dict:
    import torch

    from _timing import interleaved

    from moealign.mismatch.engines import MegatronTrainEngine
    from moealign.patches.megatron.canonical import apply_canonical_forward_from_hf

    engine = MegatronTrainEngine(model_path, precision, device)
    model = engine.model
    vocab = engine._hf_config.vocab_size
    ids = torch.randint(2, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    pos = torch.arange(seq, device=device)[None].expand(batch, -1)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]

    def forward():
        with torch.no_grad():
            model(ids, pos, mask)

    def train():
        model.zero_grad(set_to_none=True)
        model(ids, pos, mask).float().logsumexp(-1).mean().backward()

    try:
        stock = interleaved({"forward": forward, "train": train}, repeats, device)
        handle = apply_canonical_forward_from_hf(model, engine._hf_config)
        aligned = interleaved({"forward": forward, "train": train}, repeats, device)
        handle.undo()
    finally:
        engine.close()
    return {"tokens": batch * seq, "forward_stock_s": stock["forward"], "forward_aligned_s": aligned["forward"],
            "forward_ratio": aligned["forward"] / stock["forward"], "train_stock_s": stock["train"],
            "train_aligned_s": aligned["train"], "train_ratio": aligned["train"] / stock["train"]}


def _wide_model(directory: str) -> str:
    from gpu_check import RANDOM_MOE

    path = os.path.join(directory, "wide-moe")
    proc = subprocess.run([sys.executable, "-c", RANDOM_MOE, path, "1024", "2", "32", "4"], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"building the wide MoE failed:\n{proc.stderr[-2000:]}")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="vLLM: prompts per generation (default 16)")
    ap.add_argument("--new-tokens", type=int, default=32, help="vLLM: new tokens per prompt (default 32)")
    ap.add_argument("--batch", type=int, default=16, help="Megatron: sequences per batch (default 16)")
    ap.add_argument("--seq", type=int, default=48, help="Megatron: tokens per sequence (default 48)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--wide", action="store_true", help="also the wide random MoE (hidden 1024, 32 experts top-4)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM side")
    ap.add_argument("--device", default="cpu", help="the Megatron side's device (cuda: the canonical ops' torch path "
                    "on a GPU; vLLM's side is CPU-only under --aligned)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore")
    from _timing import write_json

    from moealign.embedded import embedded_model_path

    result = {"precision": args.precision}
    if not args.no_vllm:
        result["vllm_embedded"] = _vllm(args.prompts, args.new_tokens, args.repeats)
        v = result["vllm_embedded"]
        print(f"vLLM rollout, embedded, {args.prompts} x {args.new_tokens} tokens: stock {v['stock']:.2f} s, "
              f"aligned {v['aligned']:.2f} s: {v['ratio']:.2f}x")
    result["device"] = args.device
    result["megatron_embedded"] = _megatron(str(embedded_model_path()), args.precision, args.batch, args.seq,
                                            args.repeats, args.device)
    runs = [("embedded", result["megatron_embedded"])]
    if args.wide:
        with tempfile.TemporaryDirectory() as tmp:
            result["megatron_wide"] = _megatron(_wide_model(tmp), args.precision, 4, 64, args.repeats, args.device)
        runs.append(("wide (hidden 1024, 32 experts top-4, 2 layers)", result["megatron_wide"]))
    for name, m in runs:
        print(f"Megatron, {name}, {m['tokens']} tokens: forward stock {m['forward_stock_s'] * 1e3:.0f} ms, aligned "
              f"{m['forward_aligned_s'] * 1e3:.0f} ms: {m['forward_ratio']:.2f}x; forward + backward stock "
              f"{m['train_stock_s'] * 1e3:.0f} ms, aligned {m['train_aligned_s'] * 1e3:.0f} ms: {m['train_ratio']:.2f}x")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
