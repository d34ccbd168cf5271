"""Benchmark: the in-place refit of a running vLLM engine (``moealign.rl.refit``) and its verification, on a random
qwen3_moe of realistic width, with where the refit's time goes.

The model (default: 432M parameters, hidden 1024, 8 layers, 32 experts top-4, MoE width 512, 8 / 4 heads of 128,
the embedded tokenizer's vocabulary; 865 MB in bf16) is built with transformers' ``from_config`` under a temporary
directory at run time (never committed) and loaded twice: by vLLM (bf16, TP 1, in this process) and by
transformers (bf16: the trainer). Interleaved rounds time:

* ``refit``: ``moealign.rl.refit(llm, model)``, split by timing hooks into
  - vLLM's reload: ``initialize_layerwise_reload``, the model's ``load_weights`` (name mapping, TP slicing, the
    copies into the rematerialised layers, the per-layer ``process_weights_after_loading``), ``finalize_layerwise_
    reload``, ``reset_prefix_cache``, less the expert prepack inside them;
  - the CPU expert prepack: ``CPUUnquantizedExperts.process_weights_after_loading`` (pad + ``cpu_prepack_moe_weight``,
    the step vLLM 0.32 skips and moealign's patch runs);
  - moealign's own work: the rest (config and layout checks, the value check of every tensor, naming, chunking,
    the phases' round trips);
* ``verify``: ``verify_refit(llm, model)`` (every worker's tensors read back and digested, against the trainer's),
  split into the engine's side (``held_tensors``: the oneDNN / packed linears read back through their kernel, then
  every held tensor digested, the prepacked experts through their strides) and the rest (the trainer's tensors
  digested, the comparison);
* ``manifest``: ``weight_manifest(model)`` (the trainer's digests, every dtype) and ``verify_refit(llm, manifest)``.

Printed: bytes/s of the refit, each share of the refit (minimum round, and the median), verification as a share of
the refit and its parts (the kernel read-backs, the engine's digests, the trainer's digests and the comparison) as
shares of the refit, with the digest kernel's throughput. ``--json`` writes the figures. A checkout without weight manifests (older moealign) skips that row.

    OMP_NUM_THREADS=1 python tools/bench_refit.py     # 1-3 minutes on 2 cores
    python tools/bench_refit.py --layers 2 --repeats 2 --json out.json

vLLM's CPU worker binds torch's threads when the engine starts and then turns ``torch.set_num_threads`` into a
no-op, so the thread count is set by ``OMP_NUM_THREADS`` before the run. On a shared 2-core machine one thread
gives stable figures; with two, every parallel region (vLLM's 1536 per-expert copies, any op above torch's grain)
can wait a scheduler tick for its second thread, and the same refit takes 0.8-7 s from round to round.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def build_model(out: str, *, hidden: int, layers: int, experts: int, top_k: int, moe_width: int, heads: int,
                kv_heads: int, head_dim: int) -> int:
    """A random qwen3_moe checkpoint (bf16) with the embedded model's tokenizer under ``out``; its parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from moealign.embedded import embedded_model_path

    src = str(embedded_model_path())
    config = AutoConfig.from_pretrained(src)
    for key, value in dict(hidden_size=hidden, num_hidden_layers=layers, num_experts=experts,
                           num_experts_per_tok=top_k, moe_intermediate_size=moe_width, intermediate_size=4 * hidden,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


class Hooks:
    """Seconds spent inside vLLM's reload functions and inside the CPU expert prepack, per refit."""

    def __init__(self, runner):
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.model_loader.reload import layerwise

        from moealign.patches.vllm import refit as vr

        self.vllm = self.prepack = self.held = self.readback = 0.0
        self._undo = []
        self._patch(vr, "held_tensors", "held")
        self._patch(vr, "_read_linear", "readback")
        self._patch(layerwise, "initialize_layerwise_reload", "vllm")
        self._patch(layerwise, "finalize_layerwise_reload", "vllm")
        self._patch(runner.model, "load_weights", "vllm")
        self._patch(CPUUnquantizedExperts, "process_weights_after_loading", "prepack")

    def _patch(self, owner, name, bucket):
        original = getattr(owner, name)
        in_class = isinstance(owner, type)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                setattr(self, bucket, getattr(self, bucket) + time.perf_counter() - t0)

        setattr(owner, name, timed)
        self._undo.append((owner, name, original, in_class))

    def reset(self):
        self.vllm = self.prepack = self.held = self.readback = 0.0

    def undo(self):
        for owner, name, original, in_class in reversed(self._undo):
            if in_class:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


@contextlib.contextmanager
def torch_digests():
    """The digests by their torch path (``MOEALIGN_DIGEST_KERNEL=0``: the prepacked experts copied into logical
    order first), for the same run's baseline."""
    old = os.environ.get("MOEALIGN_DIGEST_KERNEL")
    os.environ["MOEALIGN_DIGEST_KERNEL"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["MOEALIGN_DIGEST_KERNEL"]
        else:
            os.environ["MOEALIGN_DIGEST_KERNEL"] = old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-width", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    import torch
    from _timing import write_json
    from transformers import AutoModelForCausalLM

    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.rollout import model_runner
    from moealign.rl.refit import refit, verify_refit

    try:
        from moealign.rl import weight_manifest
    except ImportError:                       # a checkout from before weight manifests
        weight_manifest = None

    with tempfile.TemporaryDirectory(prefix="bench_refit_") as tmp:
        t0 = time.perf_counter()
        params = build_model(tmp, hidden=args.hidden, layers=args.layers, experts=args.experts, top_k=args.top_k,
                             moe_width=args.moe_width, heads=args.heads, kv_heads=args.kv_heads,
                             head_dim=args.head_dim)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm = open_llm(tmp, dtype="bf16", max_model_len=128, max_num_seqs=4, memory_fraction=0.05)
        started = time.perf_counter() - t0
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        hooks = Hooks(model_runner(llm))
        rounds: dict[str, list[float]] = {k: [] for k in ("refit", "vllm", "prepack", "moealign", "verify",
                                                          "verify_readback", "verify_engine_digests",
                                                          "verify_trainer", "verify_torch", "manifest_build",
                                                          "manifest_verify", "manifest_verify_torch")}
        refit(llm, model)                     # warm-up (first-touch allocations, oneDNN handles)
        assert verify_refit(llm, model).ok
        manifest = None
        for _ in range(args.repeats):
            hooks.reset()
            t0 = time.perf_counter()
            refit(llm, model)
            total = time.perf_counter() - t0
            rounds["refit"].append(total)
            rounds["prepack"].append(hooks.prepack)
            rounds["vllm"].append(hooks.vllm - hooks.prepack)
            rounds["moealign"].append(total - hooks.vllm)
            hooks.reset()
            t0 = time.perf_counter()
            check = verify_refit(llm, model)
            rounds["verify"].append(time.perf_counter() - t0)
            rounds["verify_readback"].append(hooks.readback)
            rounds["verify_engine_digests"].append(hooks.held - hooks.readback)
            rounds["verify_trainer"].append(rounds["verify"][-1] - hooks.held)
            with torch_digests():
                t0 = time.perf_counter()
                check = verify_refit(llm, model)
                rounds["verify_torch"].append(time.perf_counter() - t0)
                assert check.ok, check.describe()
            assert check.ok, check.describe()
            if weight_manifest is not None:
                t0 = time.perf_counter()
                manifest = weight_manifest(model)
                rounds["manifest_build"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                check = verify_refit(llm, manifest)
                rounds["manifest_verify"].append(time.perf_counter() - t0)
                assert check.ok, check.describe()
                with torch_digests():
                    t0 = time.perf_counter()
                    check = verify_refit(llm, manifest)
                    rounds["manifest_verify_torch"].append(time.perf_counter() - t0)
                    assert check.ok, check.describe()
        hooks.undo()
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()

    from moealign._native import extension

    digest_kernel = "native" if extension("digest") is not None else "torch"
    best = {k: min(v) for k, v in rounds.items() if v}
    med = {k: statistics.median(v) for k, v in rounds.items() if v}
    # shares from the round with the fastest refit (its parts were measured together)
    i = rounds["refit"].index(best["refit"])
    parts = {k: rounds[k][i] for k in ("moealign", "vllm", "prepack")}
    j = rounds["verify"].index(best["verify"])
    vparts = {k: rounds[k][j] for k in ("verify_readback", "verify_engine_digests", "verify_trainer")}
    result = {"parameters": params, "bytes": nbytes, "build_s": built, "engine_start_s": started,
              "threads": torch.get_num_threads(), "repeats": args.repeats,
              "refit_s": best["refit"], "refit_median_s": med["refit"], "refit_bytes_per_s": nbytes / best["refit"],
              **{f"{k}_s": v for k, v in parts.items()},
              **{f"{k}_share": v / best["refit"] for k, v in parts.items()},
              "verify_s": best["verify"], "verify_median_s": med["verify"],
              "verify_share": best["verify"] / best["refit"], "verify_torch_s": best["verify_torch"],
              "verify_torch_share": best["verify_torch"] / best["refit"], **{f"{k}_s": v for k, v in vparts.items()},
              **{f"{k}_share": v / best["refit"] for k, v in vparts.items()},
              "digest_kernel": digest_kernel, "rounds": rounds}
    if manifest is not None:
        result.update(manifest_build_s=best["manifest_build"], manifest_verify_s=best["manifest_verify"],
                      manifest_verify_share=best["manifest_verify"] / best["refit"],
                      manifest_verify_torch_s=best["manifest_verify_torch"], manifest_bytes=manifest.nbytes,
                      manifest_ratio=manifest.nbytes / nbytes)
    print(f"model: {params / 1e6:.0f}M parameters, {nbytes / 1e6:.0f} MB bf16 (built in {built:.1f} s); vLLM start "
          f"{started:.1f} s; torch threads {result['threads']}; {args.repeats} rounds (minimum; median)")
    print(f"refit            {best['refit']:7.2f} s ({med['refit']:.2f})   {nbytes / best['refit'] / 1e9:.3f} GB/s")
    for k, label in (("moealign", "moealign's own"), ("vllm", "vLLM's reload"), ("prepack", "CPU expert prepack")):
        print(f"  {label:18s} {parts[k]:7.2f} s   {parts[k] / best['refit']:6.1%} of the refit")
    print(f"verify_refit     {best['verify']:7.2f} s ({med['verify']:.2f})   {best['verify'] / best['refit']:6.1%} "
          f"of the refit (digest kernel: {digest_kernel})")
    for k, label in (("verify_readback", "kernel read-backs"), ("verify_engine_digests", "engine's digests"),
                     ("verify_trainer", "trainer's + compare")):
        print(f"  {label:18s} {vparts[k]:7.2f} s   {vparts[k] / best['refit']:6.1%} of the refit")
    print(f"  (torch digests    {best['verify_torch']:7.2f} s   {best['verify_torch'] / best['refit']:6.1%} of the "
          f"refit: the same run, MOEALIGN_DIGEST_KERNEL=0)")
    if manifest is not None:
        print(f"weight_manifest  {best['manifest_build']:7.2f} s   ({manifest.nbytes / 1e3:.0f} kB, "
              f"{manifest.nbytes / nbytes:.4%} of the model's bytes)")
        print(f"verify(manifest) {best['manifest_verify']:7.2f} s   {best['manifest_verify'] / best['refit']:6.1%} "
              f"of the refit (torch digests {best['manifest_verify_torch']:.2f} s, "
              f"{best['manifest_verify_torch'] / best['refit']:.1%})")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
