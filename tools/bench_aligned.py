"""What the canonical forward (``--aligned``) costs against each engine's stock forward, measured in the same run.

* **vLLM** (rollout; two child processes, stock and ``MOEALIGN_VLLM_PATCHES=canonical``): ``generate_with_record``
  of ``--prompts`` x ``--new-tokens`` on the embedded model, after a warm-up generation (CPU only: ``--aligned``
  does not run vLLM on CUDA);
* **Megatron-core** and **transformers** (``--engines``; training engines, in this process): the forward and the
  forward + backward (a training step) of a padded batch, stock and with the canonical forward
  (:func:`moealign.patches.megatron.canonical.apply_canonical_forward_from_hf`,
  :func:`moealign.patches.hf.canonical.apply_canonical_forward`), on the embedded model, on a random Qwen3-MoE of
  realistic width (``--wide``: hidden 1024, 32 experts top-4, ``--wide-layers`` layers) and on any checkpoint given
  by ``--model`` (tools/gpu_check.py passes its random MoE: hidden 1024, 8 layers, 32 experts top-4).

    python tools/bench_aligned.py                 # embedded: vLLM + Megatron (CPU)
    python tools/bench_aligned.py --wide          # + the wide MoE (Megatron)
    python tools/bench_aligned.py --no-vllm --json out.json
    python tools/bench_aligned.py --device cuda --no-vllm --engines megatron,hf --model DIR   # the Triton kernels

On ``--device cuda`` the canonical ops run their Triton kernels (``moealign/precision/canonical_triton.py``; compiled
by a warm-up call of each variant before the timed rounds) and each training step's ratio is printed against issue
40's goal (aligned / stock <= 1.25x, forward + backward). Each figure is the minimum over ``--repeats`` interleaved
rounds (``_timing.interleaved``); ratios are aligned / stock. On the CPU the canonical ops are elementwise-product
trees (no GEMM): their cost grows with the products, so the wide model shows what a real checkpoint pays there.
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


#: Issue 40's goal for a training step (forward + backward) with the canonical forward on CUDA: aligned / stock.
GOAL = 1.25


def _time_pair(forward, train, apply, repeats: int, device: str) -> dict:
    """Stock, then with the canonical forward (``apply()`` returns its handle): each variant's forward and training
    step warmed up once (the Triton kernels compile on their first call), then timed over ``repeats`` rounds."""
    from _timing import interleaved

    forward(), train()
    stock = interleaved({"forward": forward, "train": train}, repeats, device)
    handle = apply()
    try:
        forward(), train()
        aligned = interleaved({"forward": forward, "train": train}, repeats, device)
    finally:
        handle.undo()
    return {"forward_stock_s": stock["forward"], "forward_aligned_s": aligned["forward"],
            "forward_ratio": aligned["forward"] / stock["forward"], "train_stock_s": stock["train"],
            "train_aligned_s": aligned["train"], "train_ratio": aligned["train"] / stock["train"]}


def _megatron(model_path: str, precision: str, batch: int, seq: int, repeats: int, device: str = "cpu") -> dict:
    import torch

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
        out = _time_pair(forward, train, lambda: apply_canonical_forward_from_hf(model, engine._hf_config),
                         repeats, device)
    finally:
        engine.close()
    return {"tokens": batch * seq, **out}


def _hf(model_path: str, precision: str, batch: int, seq: int, repeats: int, device: str = "cpu") -> dict:
    """The transformers trainer's forward and training step (a full-sequence forward, no KV cache)."""
    import torch

    from moealign.patches.hf.canonical import apply_canonical_forward
    from moealign.patches.hf.loading import load_model

    model, _ = load_model(model_path, precision, device)
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)

    def forward():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)

    def train():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().logsumexp(-1).mean().backward()

    return {"tokens": batch * seq, **_time_pair(forward, train, lambda: apply_canonical_forward(model), repeats,
                                                device)}


def _wide_model(directory: str, layers: int) -> str:
    from gpu_check import RANDOM_MOE

    path = os.path.join(directory, "wide-moe")
    proc = subprocess.run([sys.executable, "-c", RANDOM_MOE, path, "1024", str(layers), "32", "4"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"building the wide MoE failed:\n{proc.stderr[-2000:]}")
    return path


def _engines(value: str) -> list[str]:
    names = [n for n in value.split(",") if n]
    bad = sorted(set(names) - {"megatron", "hf"})
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--engines takes megatron and / or hf, got {value!r}")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="vLLM: prompts per generation (default 16)")
    ap.add_argument("--new-tokens", type=int, default=32, help="vLLM: new tokens per prompt (default 32)")
    ap.add_argument("--batch", type=int, default=16, help="training engines: sequences per batch (default 16)")
    ap.add_argument("--seq", type=int, default=48, help="training engines: tokens per sequence (default 48)")
    ap.add_argument("--wide-batch", type=int, default=4, help="the wide / --model checkpoints: sequences (default 4)")
    ap.add_argument("--wide-seq", type=int, default=64, help="the wide / --model checkpoints: tokens each (default 64)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", type=_engines, default=["megatron"],
                    help="training engines to time, comma-separated: megatron, hf (default megatron)")
    ap.add_argument("--wide", action="store_true", help="also a wide random MoE (hidden 1024, 32 experts top-4)")
    ap.add_argument("--wide-layers", type=int, default=2, help="the wide MoE's layers (default 2)")
    ap.add_argument("--model", metavar="DIR", help="also this qwen3_moe checkpoint (e.g. gpu_check's random MoE)")
    ap.add_argument("--no-embedded", action="store_true", help="skip the embedded model")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM side")
    ap.add_argument("--device", default="cpu", help="the training engines' device (cuda: the canonical ops' Triton "
                    "kernels; vLLM's side is CPU-only under --aligned)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore")
    from _timing import write_json

    from moealign.embedded import embedded_model_path

    cuda = args.device.startswith("cuda")
    result = {"precision": args.precision, "device": args.device, "engines": args.engines}
    if cuda:
        import torch

        result["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        print(f"device: {result['gpu']}")
    if not args.no_vllm:
        result["vllm_embedded"] = _vllm(args.prompts, args.new_tokens, args.repeats)
        v = result["vllm_embedded"]
        print(f"vLLM rollout, embedded, {args.prompts} x {args.new_tokens} tokens: stock {v['stock']:.2f} s, "
              f"aligned {v['aligned']:.2f} s: {v['ratio']:.2f}x")
    timers = {"megatron": ("Megatron", _megatron), "hf": ("transformers", _hf)}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [] if args.no_embedded else [("embedded", "embedded", str(embedded_model_path()), args.batch,
                                               args.seq)]
        if args.wide:
            models.append(("wide", f"wide (hidden 1024, 32 experts top-4, {args.wide_layers} layers)",
                           _wide_model(tmp, args.wide_layers), args.wide_batch, args.wide_seq))
        if args.model:
            models.append(("model", args.model, args.model, args.wide_batch, args.wide_seq))
        for key, label, path, batch, seq in models:
            for engine in args.engines:
                name, timer = timers[engine]
                m = timer(path, args.precision, batch, seq, args.repeats, args.device)
                result[f"{engine}_{key}"] = m
                runs.append((f"{name}, {label}", m))
    for name, m in runs:
        goal = f" (goal <= {GOAL}x: {'met' if m['train_ratio'] <= GOAL else 'NOT met'})" if cuda else ""
        print(f"{name}, {m['tokens']} tokens: forward stock {m['forward_stock_s'] * 1e3:.1f} ms, aligned "
              f"{m['forward_aligned_s'] * 1e3:.1f} ms: {m['forward_ratio']:.2f}x; forward + backward stock "
              f"{m['train_stock_s'] * 1e3:.1f} ms, aligned {m['train_aligned_s'] * 1e3:.1f} ms: "
              f"{m['train_ratio']:.2f}x{goal}")
    if cuda:
        result["goal_train_ratio"] = GOAL
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
