"""The GPU check (issue 24, item 5; issue 26): everything moealign claims on a GPU, in at most 5 minutes on a machine
with one GPU, ending with one summary table (step, status, figure, seconds).

    MOEALIGN_SYSTEM_SITE=1 python tools/gpu_check.py               # on the GPU machine (its own CUDA torch)
    python tools/gpu_check.py --device cpu --quick                  # the dry run on a CPU machine (~30 s)

Steps, each in its own process with its own time limit (a failed or timed-out step is recorded, the next runs):

  env            torch / CUDA / GPU, ``moealign info``
  megatron       megatron-core importable; if not, installed offline (``pip install --no-deps --no-index``) into
                 a scratch directory from a wheel ``megatron_core-*.whl`` found in ``.whl/`` or ``tools/`` (the
                 machine may have no network: bring the wheel, e.g. megatron_core-0.16.1-*.whl)
  gpu-tests      ``pytest -m gpu -rf`` (the gpu-marked tests)
  mismatch-*     ``moealign mismatch --device cuda`` for every engine pair available: hf->hf, hf->megatron
                 (vLLM's CUDA wheel is not brought to such machines); figure: baseline router flip rate ->
                 with replay, max |d log p| with replay
  aligned-*      ``--batch-invariant`` with fp32 and bf16 on both sides (figure: max |d log p|, 0 expected)
  random-moe     a random Qwen3-MoE of realistic width (hidden 1024, 8 layers, 32 experts top-4, the embedded
                 tokenizer) written to a scratch directory
  bench-replay   tools/bench_replay.py on it (replayed / plain training forward, verifier ratio)
  bench-megatron tools/bench_megatron_replay.py (Megatron replay + verifier overhead)
  bench-bi       tools/bench_batch_invariant.py --dtype bf16, K = N = 4096 (ratio to cuBLAS per m)
  canonical-triton  tests/canonical_triton_child.py --device cuda: the canonical forward's Triton kernels
                 (moealign/precision/canonical_triton.py) in fp32, fp16 and bf16: accuracy, bitwise invariances, gradients
                 and their negative controls, as under the interpreter on the CPU (skipped in the CPU dry run)
  canonical-fp32, canonical-bf16  ``moealign mismatch --aligned --rollout hf --train megatron --device cuda``
                 in fp32 and bf16: the canonical forward on the Triton kernels in both engines (issue 40); figure:
                 the bitwise verdict (``torch.equal`` of every response token's log-prob), the step fails on any
                 difference (``--fail-above max_abs_logp_diff=0``); in the CPU dry run the CPU definition runs
  bench-canonical  tools/bench_aligned.py --engines megatron,hf on the embedded model and the random MoE: aligned /
                 stock forward and forward + backward per engine, against issue 40's goal of 1.25x a training step
  diagnose       ``moealign mismatch --diagnose`` (the number of lever sets run)
  suite          optional, last, with the time left (``--suite-budget``): the whole test suite serially with
                 failure names (``pytest -q -rf``); its counts, and the failed tests' names below the table

Python: ``MOEALIGN_SYSTEM_SITE=1`` (or no ``.venv``) runs every step with this interpreter (the machine's CUDA
torch); otherwise ``.venv/bin/python``. The repository is put on ``PYTHONPATH`` (no install needed).
``--json PATH`` writes the table. Exit status 0 when no step failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _failure(proc) -> str:
    """A failed step in one line: how it ended (a signal by name) and its last meaningful line."""
    try:
        from moealign.exits import child_failure
    except ImportError:                 # the check runs before moealign is installed
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        return f"exit {proc.returncode}: {lines[-1][:90] if lines else ''}"
    return child_failure("", proc.returncode, proc.stderr or proc.stdout).strip()[:120]


@dataclass

class Step:
    name: str
    status: str          # ok | FAILED | TIMEOUT | skipped
    figure: str
    seconds: float


def _python() -> str:
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    if os.environ.get("MOEALIGN_SYSTEM_SITE") == "1" or not os.path.exists(venv):
        return sys.executable
    return venv


class Runner:
    def __init__(self, args):
        self.args = args
        self.python = _python()
        self.steps: list[Step] = []
        self.start = time.monotonic()
        self.scratch = tempfile.mkdtemp(prefix="moealign-gpu-check-")
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        self.notes: list[str] = []

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def run(self, name: str, cmd: list[str], limit: float, figure=None) -> subprocess.CompletedProcess | None:
        """Run one step (at most ``limit`` seconds, and never past the budget); record it."""
        if self.args.only and name not in self.args.only:
            return None
        limit = min(limit, max(self.left(), 1.0))
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"")
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            fig = ""
            if figure is not None:
                try:
                    fig = figure(subprocess.CompletedProcess(cmd, 124, out, ""))
                except Exception:       # a figure from a cut-off output is best effort
                    fig = ""
            self._add(name, "TIMEOUT", f"over {limit:.0f} s" + (f"; {fig}" if fig else ""), t0, out)
            return None
        status = "ok" if proc.returncode == 0 else "FAILED"
        fig = ""
        if figure is not None and status == "ok":
            try:
                fig = figure(proc)
            except Exception as e:      # noqa: BLE001 - a figure that cannot be read is shown, not fatal
                fig = f"(figure unreadable: {type(e).__name__})"
        if status == "FAILED" and not fig:
            fig = _failure(proc)
        self._add(name, status, fig, t0, proc.stdout + proc.stderr)
        return proc

    def _add(self, name, status, figure, t0, output):
        seconds = time.monotonic() - t0
        self.steps.append(Step(name, status, figure, round(seconds, 1)))
        log = os.path.join(self.scratch, f"{name}.log")
        with open(log, "w") as f:
            f.write(output or "")
        if self.args.verbose or status != "ok":
            print(f"[{name}] {status} ({seconds:.1f} s): {figure}   log: {log}", flush=True)
        else:
            print(f"[{name}] ok ({seconds:.1f} s): {figure}", flush=True)

    def skip(self, name: str, why: str) -> None:
        if self.args.only and name not in self.args.only:
            return
        self.steps.append(Step(name, "skipped", why, 0.0))
        print(f"[{name}] skipped: {why}", flush=True)


def _json(path):
    with open(path) as f:
        return json.load(f)


def _mismatch_figure(path):
    def figure(proc):
        runs = {r["name"]: r["metrics"] for r in _json(path)["runs"]}
        base, rep = runs.get("baseline", {}), runs.get("routing_replay", {})
        parts = []
        if base:
            parts.append(f"router flips {base['router_flip_rate']:.4f}")
        if rep:
            parts[-1:] = [f"{parts[-1] if parts else 'router flips ?'} -> {rep['router_flip_rate']:.4f} replayed"]
            parts.append(f"max|dlogp| replayed {rep['max_abs_logp_diff']:.3g}")
        if not rep and base:
            parts.append(f"max|dlogp| {base['max_abs_logp_diff']:.3g}")
        return ", ".join(parts)
    return figure


def _aligned_figure(path):
    def figure(proc):
        runs = {r["name"]: r["metrics"] for r in _json(path)["runs"]}
        # with the sampling mask (the kept set, as the rollout sampled) the aligned sides agree bitwise
        m = runs["routing_replay+sampling_mask"]
        return (f"max|dlogp| replay+mask {m['max_abs_logp_diff']:.3g} (0 expected), router flips "
                f"{runs['baseline']['router_flip_rate']:.4f}")
    return figure


def _canonical_figure(path):
    def figure(proc):
        a = _json(path)["aligned"]
        verdict = "bitwise equal" if a["bitwise_equal"] else f"NOT bitwise: max|dlogp| {a['max_abs_logp_diff']:.3g}"
        return f"{verdict}, {a['num_tokens'] - a['tokens_differing']} of {a['num_tokens']} log-probs torch.equal"
    return figure


def _bench_canonical_figure(path):
    def figure(proc):
        d = _json(path)
        parts = [f"{key.replace('_', ' ')} train {m['train_ratio']:.2f}x (fwd {m['forward_ratio']:.2f}x)"
                 for key, m in d.items() if isinstance(m, dict) and "train_ratio" in m]
        return "; ".join(parts) + (f"; goal <= {d['goal_train_ratio']}x" if "goal_train_ratio" in d else "")
    return figure


def _pytest_figure(proc):
    text = proc.stdout + proc.stderr
    m = re.findall(r"^=*\s*((?:\d+ (?:passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)"
                   r"(?:, )?)+)", text, flags=re.M)
    if m:
        return m[-1].strip().rstrip(",")
    counts = {k: len(re.findall(rf"\b{k}\b", text)) for k in ("PASSED", "FAILED")}
    return f"(cut off) {sum(1 for c in text if c == '.')} dots, {counts['FAILED']} FAILED lines"


def _failed_names(proc) -> list[str]:
    if proc is None:
        return []
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.M)


RANDOM_MOE = r'''
import json, os, shutil, sys
import torch
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
from moealign.embedded import embedded_model_path
out, hidden, layers, experts, top_k = sys.argv[1], *map(int, sys.argv[2:6])
src = str(embedded_model_path())
tok = AutoTokenizer.from_pretrained(src)
base = json.load(open(os.path.join(src, "config.json")))
cfg = Qwen3MoeConfig(vocab_size=base["vocab_size"], hidden_size=hidden, intermediate_size=4 * hidden,
                     moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=16,
                     num_key_value_heads=4, head_dim=hidden // 16, num_experts=experts, num_experts_per_tok=top_k,
                     decoder_sparse_step=1, max_position_embeddings=4096, norm_topk_prob=True,
                     bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"),
                     pad_token_id=base.get("pad_token_id"), tie_word_embeddings=False)
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"RESULT {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (the dry run)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes everywhere (the CPU dry run)")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for every step but the suite (default 300)")
    ap.add_argument("--suite-budget", type=float, default=0.0,
                    help="extra seconds for the whole suite as the last step (default 0: only what the budget "
                         "leaves; the suite takes ~15 min serially)")
    ap.add_argument("--no-suite", action="store_true", help="skip the whole-suite step")
    ap.add_argument("--only", type=lambda s: [x for x in s.split(",") if x], default=None,
                    help="comma-separated step names to run (the others are not listed)")
    ap.add_argument("--json", help="write the table as JSON")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    r = Runner(args)
    py, dev, quick = r.python, args.device, args.quick
    moealign = [py, "-m", "moealign"]
    print(f"moealign GPU check: python {py}, device {dev}{' (quick)' if quick else ''}, budget {args.budget:.0f} s, "
          f"logs in {r.scratch}", flush=True)

    r.run("env", [py, "-c", "import torch; print('RESULT', torch.__version__, torch.version.cuda, "
                            "torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"], 60,
          figure=lambda p: p.stdout.split("RESULT", 1)[1].strip())
    if dev.startswith("cuda"):
        probe = subprocess.run([py, "-c", "import torch; assert torch.cuda.is_available()"], env=r.env,
                               capture_output=True)
        if probe.returncode != 0:
            r.notes.append("CUDA is not available to this python: the cuda steps will fail (use --device cpu for "
                           "the dry run)")

    # megatron-core: importable, or installed offline from a wheel placed beside the repository (not probed when
    # --only names no step that needs it)
    needs_mg = {"megatron", "mismatch-hf-megatron", "canonical-fp32", "canonical-bf16", "bench-canonical",
                "bench-megatron"}
    have_mg = (args.only is None or bool(needs_mg & set(args.only))) and subprocess.run(
        [py, "-c", "import megatron.core"], env=r.env, capture_output=True).returncode == 0
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "megatron_core-*.whl"))
                    + glob.glob(os.path.join(ROOT, "tools", "megatron_core-*.whl")))
    if have_mg:
        r.run("megatron", [py, "-c", "import megatron.core as m; print('RESULT', m.__version__)"], 60,
              figure=lambda p: "megatron-core " + p.stdout.split("RESULT", 1)[1].strip())
    elif wheels:
        target = os.path.join(r.scratch, "site")
        proc = r.run("megatron", [py, "-m", "pip", "install", "--no-deps", "--no-index", "--target", target,
                                  wheels[-1]], 120, figure=lambda p: f"installed {os.path.basename(wheels[-1])}")
        if proc is not None and proc.returncode == 0:
            r.env["PYTHONPATH"] = os.pathsep.join([target, r.env["PYTHONPATH"]])
            have_mg = subprocess.run([py, "-c", "import megatron.core"], env=r.env,
                                     capture_output=True).returncode == 0
    else:
        r.skip("megatron", "megatron-core not importable and no .whl/megatron_core-*.whl or tools/megatron_core-*.whl")

    gpu_tests = [py, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-m", "gpu"]
    if quick:
        gpu_tests += ["tests/test_replay_no_host_sync.py"]
    r.run("gpu-tests", gpu_tests, 150, figure=_pytest_figure)

    small = ["--num-prompts", "2", "--max-new-tokens", "4"] if quick else ["--num-prompts", "16",
                                                                             "--max-new-tokens", "32"]
    pairs = [("hf", "hf")] + ([("hf", "megatron")] if have_mg else [])
    for rollout, train in pairs:
        out = os.path.join(r.scratch, f"mismatch-{rollout}-{train}.json")
        r.run(f"mismatch-{rollout}-{train}", moealign + ["mismatch", "--rollout", rollout, "--train", train,
                                                           "--device", dev, "-q", "--json", out] + small,
              90, figure=_mismatch_figure(out))
    if not have_mg:
        r.skip("mismatch-hf-megatron", "megatron-core not available")
    for dtype in ("fp32", "bf16"):
        out = os.path.join(r.scratch, f"aligned-{dtype}.json")
        r.run(f"aligned-{dtype}", moealign + ["mismatch", "--rollout", "hf", "--train", "hf", "--batch-invariant",
                                              "--rollout-dtype", dtype, "--train-dtype", dtype, "--device", dev,
                                              "-q", "--json", out] + small, 90, figure=_aligned_figure(out))

    # a random MoE of realistic width (the replay benchmarks' subject); tiny in the dry run
    model_dir = os.path.join(r.scratch, "random-moe")
    shape = ["256", "2", "8", "2"] if quick else ["1024", "8", "32", "4"]
    made = r.run("random-moe", [py, "-c", RANDOM_MOE, model_dir, *shape], 120,
                 figure=lambda p: f"hidden {shape[0]}, {shape[1]} layers, {shape[2]} experts top-{shape[3]}: "
                                  + p.stdout.split("RESULT", 1)[1].strip())
    if made is not None and made.returncode == 0:
        out = os.path.join(r.scratch, "bench-replay.json")
        sizes = ["--batch", "2", "--new-tokens", "4", "--repeats", "1"] if quick else ["--batch", "16",
                                                                                      "--new-tokens", "48"]

        def replay_figure(p):
            d = _json(out)
            return (f"replayed/plain {d['train_ratio']:.3f}x (median {d['train_ratio_median']:.3f}x), verifier "
                    f"{d['verify_ratio']:.3f}x, set_routes {d['set_routes_ms']:.2f} ms")
        r.run("bench-replay", [py, "tools/bench_replay.py", "--model", model_dir, "--device", dev, "--train-only",
                               "--json", out] + sizes, 120, figure=replay_figure)
    else:
        r.skip("bench-replay", "no random MoE")
    if have_mg:
        out = os.path.join(r.scratch, "bench-megatron.json")
        sizes = ["--batch", "2", "--seq", "16", "--repeats", "1"] if quick else []

        def megatron_figure(p):
            d = _json(out)
            return f"replayed/plain {d['ratio']:.3f}x, verifier {d['verify_ratio']:.3f}x"
        r.run("bench-megatron", [py, "tools/bench_megatron_replay.py", "--json", out] + sizes, 120,
              figure=megatron_figure)
    else:
        r.skip("bench-megatron", "megatron-core not available")
    out = os.path.join(r.scratch, "bench-bi.json")
    bi = (["--m", "1,8", "--k", "64", "--n", "64", "--repeats", "1", "--dtype", "fp32"] if quick else
          ["--m", "1,64,1024,4096", "--k", "4096", "--n", "4096", "--dtype", "bf16"])

    def bi_figure(p):
        rows = _json(out)
        rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
        return ", ".join(f"m={x['m']}: {x['ratio']:.2f}x" for x in rows if "m" in x and "ratio" in x)
    r.run("bench-bi", [py, "tools/bench_batch_invariant.py", "--device", dev, "--json", out] + bi, 120,
          figure=bi_figure)
    if dev.startswith("cuda"):
        r.run("canonical-triton", [py, "tests/canonical_triton_child.py", "--device", dev], 180,
              figure=lambda p: "bitwise invariances ok on " + p.stdout.split("RESULT ok on ", 1)[1].split(": ", 1)[0])
    else:
        r.skip("canonical-triton", "CUDA only (on the CPU: tests/test_canonical_triton_interp.py, the interpreter)")
    # issue 40: --aligned on CUDA (the canonical ops' Triton kernels in transformers and Megatron), bitwise
    for dtype in ("fp32", "bf16"):
        if not have_mg:
            r.skip(f"canonical-{dtype}", "megatron-core not available")
            continue
        out = os.path.join(r.scratch, f"canonical-{dtype}.json")
        r.run(f"canonical-{dtype}", moealign + ["mismatch", "--aligned", "--rollout", "hf", "--train", "megatron",
                                                "--rollout-dtype", dtype, "--device", dev, "-q", "--json", out,
                                                "--fail-above", "max_abs_logp_diff=0"] + small, 240,
              figure=_canonical_figure(out))
    if have_mg:
        out = os.path.join(r.scratch, "bench-canonical.json")
        sizes = (["--batch", "2", "--seq", "8", "--wide-batch", "1", "--wide-seq", "8", "--repeats", "1"] if quick
                 else ["--batch", "16", "--seq", "128", "--wide-batch", "8", "--wide-seq", "256", "--repeats", "5"])
        model = ["--model", model_dir] if made is not None and made.returncode == 0 else []
        r.run("bench-canonical", [py, "tools/bench_aligned.py", "--no-vllm", "--engines", "megatron,hf", "--device",
                                  dev, "--json", out] + model + sizes, 240, figure=_bench_canonical_figure(out))
    else:
        r.skip("bench-canonical", "megatron-core not available")
    out = os.path.join(r.scratch, "diagnose.json")

    def diagnose_figure(p):
        d = _json(out)
        runs = d.get("levers", {}).get("runs", d.get("runs", []))
        skipped = d.get("skipped_runs") or {}
        return f"{len(runs)} runs scored, {len(skipped)} skipped"
    r.run("diagnose", moealign + ["mismatch", "--rollout", "hf", "--train", "hf", "--diagnose", "--device", dev,
                                  "-q", "--json", out] + (["--num-prompts", "2", "--max-new-tokens", "2"] if quick
                                                          else small), 150, figure=diagnose_figure)

    suite = None
    if args.no_suite:
        r.skip("suite", "--no-suite")
    else:
        seconds = max(r.left(), 0.0) + args.suite_budget
        if seconds < 30:
            r.skip("suite", f"{seconds:.0f} s left (give --suite-budget SECONDS; the suite takes ~15 min)")
        else:
            args.budget += args.suite_budget
            cmd = [py, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider"]
            if quick:
                cmd += ["tests/test_replay_batch_validated.py"]
            suite = r.run("suite", cmd, seconds, figure=_pytest_figure)

    width = max(len(s.name) for s in r.steps)
    print("\n" + f"{'step':<{width}}  {'status':<8}  {'seconds':>7}  figure")
    for s in r.steps:
        print(f"{s.name:<{width}}  {s.status:<8}  {s.seconds:>7.1f}  {s.figure}")
    total = time.monotonic() - r.start
    print(f"total {total:.0f} s; logs in {r.scratch}")
    failed = _failed_names(suite)
    if failed:
        print(f"suite failures ({len(failed)}):")
        for name in failed:
            print(f"  {name}")
    for note in r.notes:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "quick": quick, "total_s": total, "steps": [asdict(s) for s in r.steps],
                       "suite_failures": failed}, f, indent=1)
    return 0 if all(s.status in ("ok", "skipped") for s in r.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
