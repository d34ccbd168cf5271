"""``moealign tp-check``: is each TP op bitwise equal to TP = 1, with real gloo processes?

For every world size, ``world_size`` processes are spawned (torch.distributed, gloo, 127.0.0.1). Each
rank builds the same global inputs from a seed, keeps its contiguous shard of the reduction axis, and runs
every op twice: the tree path (:mod:`moealign.precision.tree`) and the stock path (a plain per-shard
matmul / sum followed by ``dist.all_reduce(SUM)``, Megatron's arithmetic). Every rank's output is compared
with the TP = 1 output of the same path: the tree path should be equal, the stock path is the negative
control (it normally differs). Each op is timed (per repeat the slowest rank, then the fastest repeat).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .errors import ConfigError, EngineError, EngineTimeoutError
from .exits import child_failure, describe_exit, last_meaningful_line
from .precision.tree import (
    DEFAULT_LEAF_WIDTH,
    check_tree_world_size,
    row_parallel_linear_tree,
    tree_all_reduce,
    tree_sum,
    vocab_parallel_logprob_tree,
)

__all__ = ["OPS", "PATHS", "OpSpec", "parse_world_sizes", "run_gloo", "run_tp_check", "tree_failures", "format_results"]

PATHS = ("tree", "stock")


@dataclass(frozen=True)
class OpSpec:
    """One checked op: global sizes (the reduction axis is the last one and is sharded over ranks)."""

    name: str
    kind: str  # "linear", "logprob", "sum"
    dtype: torch.dtype
    rows: int
    reduce: int
    cols: int = 0  # output features (linear only)


# Sizes: the reduction axis is 64 leaves or more, so world sizes up to 8 cut the tree into whole subtrees,
# and long enough that the stock path's per-shard sums round differently from TP = 1.
OPS = (
    OpSpec("row_parallel_linear_fp32", "linear", torch.float32, rows=16, reduce=4096, cols=256),
    OpSpec("row_parallel_linear_bf16", "linear", torch.bfloat16, rows=16, reduce=4096, cols=256),
    OpSpec("vocab_parallel_logprob", "logprob", torch.float32, rows=64, reduce=32768),
    OpSpec("sharded_sum", "sum", torch.float32, rows=64, reduce=8192),
)


#: The most timed repeats per op (each one a gloo collective round in every process).
MAX_REPEATS = 1000


def parse_world_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; each a power of two from 1 to 16, no repeats."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--world-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes:
        raise ConfigError("--world-sizes is empty")
    for size in sizes:
        if not 1 <= size <= 16:
            raise ConfigError(f"world size {size} is outside 1..16 (each one is a set of local processes)")
        check_tree_world_size(size)
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"--world-sizes repeats a size: {text!r}")
    return sizes


# --------------------------------------------------------------------------------------------------
# Spawning gloo processes
# --------------------------------------------------------------------------------------------------


def _gloo_entry(rank: int, world: int, fn: Callable, args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        # a rendezvous file in this run's own directory: no TCP port to pick, so concurrent runs (pytest -n)
        # never meet in one another's world
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        sys.exit(1)


def run_gloo(world_size: int, fn: Callable, args: tuple = (), *, timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes; return the ranks'
    results in rank order. ``fn`` must be importable (module level). A failing rank raises RuntimeError with
    its traceback; ranks still running after ``timeout`` seconds are terminated and TimeoutError raised."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moealign-gloo-") as out_dir:
        procs = [ctx.Process(target=_gloo_entry, args=(rank, world_size, fn, args, out_dir), daemon=True)
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        grace_set = False
        while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
            if not grace_set and any(proc.exitcode not in (None, 0) for proc in procs):
                grace_set = True  # a rank failed: the others will fail too, or hang on a collective
                deadline = min(deadline, time.monotonic() + 2.0)
            time.sleep(0.02)
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
        # a rank killed by a signal (not by us) wrote no traceback; the others then fail on its closed sockets:
        # it is named first, as the cause
        killed = [rank for rank, proc in enumerate(procs) if rank not in hung and (proc.exitcode or 0) < 0]
        if killed:
            raise EngineError("; ".join(f"gloo rank {r} of {world_size} {describe_exit(procs[r].exitcode)}"
                                        for r in killed) + "; the other ranks were stopped")
        errors = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.err")
            if os.path.exists(path):
                with open(path) as fh:
                    text = fh.read()
                errors.append(f"rank {rank} of {world_size}: {last_meaningful_line(text)}")
        if errors:
            raise EngineError("gloo worker failed: " + "; ".join(errors))
        if hung:
            raise EngineTimeoutError(f"gloo ranks {hung} of {world_size} did not finish within {timeout:.0f} s")
        bad = [rank for rank, proc in enumerate(procs) if proc.exitcode != 0]
        if bad:
            raise EngineError("; ".join(f"gloo rank {r} of {world_size} {describe_exit(procs[r].exitcode)}"
                                        for r in bad) + " (no traceback)")
        return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


# --------------------------------------------------------------------------------------------------
# The ops (both paths), inputs and the worker
# --------------------------------------------------------------------------------------------------


def _global_inputs(spec: OpSpec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if spec.kind == "linear":
        x = torch.randn(spec.rows, spec.reduce, generator=gen)
        w = torch.randn(spec.cols, spec.reduce, generator=gen) / spec.reduce ** 0.5
        return {"x": x.to(spec.dtype), "w": w.to(spec.dtype)}
    if spec.kind == "logprob":
        logits = 4.0 * torch.randn(spec.rows, spec.reduce, generator=gen)
        target = torch.randint(0, spec.reduce, (spec.rows,), generator=gen)
        return {"logits": logits.to(spec.dtype), "target": target}
    if spec.kind == "sum":
        return {"x": torch.randn(spec.rows, spec.reduce, generator=gen).to(spec.dtype)}
    raise ConfigError(f"unknown op kind {spec.kind!r}")


def _shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[-1] // world
    return t[..., rank * n:(rank + 1) * n].contiguous()


def _stock_all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _stock_logprob(logits: torch.Tensor, target: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Megatron's vocab-parallel arithmetic: MAX all-reduce, local sum-exp, SUM all-reduces."""
    v_local = logits.shape[-1]
    m = logits.amax(-1)
    if world > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    sum_exp = _stock_all_reduce(torch.exp(logits - m.unsqueeze(-1)).sum(-1), world)
    local = target - rank * v_local
    owned = (local >= 0) & (local < v_local)
    picked = torch.gather(logits, -1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = _stock_all_reduce(torch.where(owned, picked, torch.zeros_like(picked)), world)
    return (picked - m) - torch.log(sum_exp)


def _run_op(spec: OpSpec, path: str, shards: dict[str, torch.Tensor], rank: int, world: int,
            leaf_width: int) -> torch.Tensor:
    if spec.kind == "linear":
        if path == "tree":
            return row_parallel_linear_tree(shards["x"], shards["w"], leaf_width=leaf_width)
        return _stock_all_reduce(F.linear(shards["x"], shards["w"]), world)
    if spec.kind == "logprob":
        if path == "tree":
            return vocab_parallel_logprob_tree(shards["logits"], shards["target"], leaf_width=leaf_width)
        return _stock_logprob(shards["logits"], shards["target"], rank, world)
    if path == "tree":
        return tree_all_reduce(tree_sum(shards["x"], -1, leaf_width=leaf_width))
    return _stock_all_reduce(shards["x"].sum(-1), world)


def _tp_check_worker(rank: int, world: int, specs: tuple, seed: int, repeats: int, leaf_width: int) -> dict:
    """One rank: every op and path, its output and per-repeat times (seconds)."""
    results = {}
    for index, spec in enumerate(specs):
        inputs = _global_inputs(spec, seed + index)
        shards = {name: (t if name == "target" else _shard(t, rank, world)) for name, t in inputs.items()}
        for path in PATHS:
            out = _run_op(spec, path, shards, rank, world, leaf_width)  # warm-up, and the checked output
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                _run_op(spec, path, shards, rank, world, leaf_width)
                times.append(time.perf_counter() - start)
            results[(spec.name, path)] = (out, times)
    return results


# --------------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------------


def run_tp_check(world_sizes: list[int], *, ops: tuple[OpSpec, ...] = OPS, seed: int = 0, repeats: int = 3,
                 leaf_width: int = DEFAULT_LEAF_WIDTH, timeout: float = 300.0,
                 log: Callable[[str], None] = lambda msg: None) -> dict:
    """Run every op at every world size (TP = 1 always, as the reference) and compare with TP = 1.

    Returns ``{"results": [{"op", "world_size", "path", "bitwise_equal", "max_abs_diff", "time_ms"}]}``;
    ``bitwise_equal`` means every rank's output equals the TP = 1 output of the same path (``torch.equal``),
    ``max_abs_diff`` is the largest difference over ranks and elements, ``time_ms`` the fastest repeat of the
    slowest rank.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= MAX_REPEATS:
        raise ConfigError(f"--repeats must be an integer in 1..{MAX_REPEATS}, got {repeats!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63 - len(ops):
        raise ConfigError(f"--seed must be an integer in [0, 2**63 - {len(ops)}) (one seed per op), got {seed!r}")
    for spec in ops:
        for size in world_sizes:
            if spec.reduce % (size * leaf_width):
                raise ConfigError(f"op {spec.name}: reduction axis {spec.reduce} does not split into {size} shards "
                                 f"of whole {leaf_width}-wide leaves")
    per_world = {}
    for size in sorted(set(world_sizes) | {1}):
        log(f"tp-check: world size {size} ...")
        per_world[size] = run_gloo(size, _tp_check_worker, (tuple(ops), seed, repeats, leaf_width), timeout=timeout)
    rows = []
    for spec in ops:
        for size in world_sizes:
            for path in PATHS:
                ref = per_world[1][0][(spec.name, path)][0]
                outs = [rank_result[(spec.name, path)][0] for rank_result in per_world[size]]
                times = [rank_result[(spec.name, path)][1] for rank_result in per_world[size]]
                slowest = [max(rank_times[i] for rank_times in times) for i in range(repeats)]
                diff = max(float((out.double() - ref.double()).abs().max()) for out in outs)
                rows.append({
                    "op": spec.name,
                    "world_size": size,
                    "path": path,
                    "bitwise_equal": all(torch.equal(out, ref) for out in outs),
                    "max_abs_diff": diff,
                    "time_ms": 1000.0 * min(slowest),
                })
    return {"results": rows}


def tree_failures(report: dict) -> list[str]:
    """The tree-path rows that are not bitwise equal to TP = 1 (each as a line)."""
    return [f"{row['op']} at world size {row['world_size']}: tree path differs from TP=1 "
            f"(max |diff| {row['max_abs_diff']:.3g})"
            for row in report["results"] if row["path"] == "tree" and not row["bitwise_equal"]]


def format_results(report: dict) -> str:
    """A plain-text table of the report."""
    lines = [f"{'op':<26} {'TP':>3}  {'path':<5}  {'== TP=1':<8} {'max |diff|':>10}  {'time ms':>9}"]
    for row in report["results"]:
        lines.append(f"{row['op']:<26} {row['world_size']:>3}  {row['path']:<5}  "
                     f"{'yes' if row['bitwise_equal'] else 'NO':<8} {row['max_abs_diff']:>10.3g}  "
                     f"{row['time_ms']:>9.3f}")
    controls = [row for row in report["results"] if row["path"] == "stock" and row["world_size"] > 1]
    if controls and all(row["bitwise_equal"] for row in controls):
        lines.append("note: the stock path equalled TP=1 everywhere; the negative control did not bite")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# --engine vllm: the whole model in vLLM, TP = n against TP = 1, stock and tree forwards
# --------------------------------------------------------------------------------------------------

#: What ``tp-check --engine vllm`` compares per (world size, path): the prompt log-probs of a prefill (independent
#: of sampling) and the sampled tokens with their log-probs.
VLLM_OPS = ("vllm_prompt_logprobs", "vllm_sample_logprobs")


def cpu_bind_spec(world_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world_size`` CPU ranks: this process's cores in equal contiguous groups."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world_size:
        raise ConfigError(f"vLLM's CPU build binds each TP rank to its own cores: TP={world_size} needs "
                          f"{world_size} cores, this process may use {len(cores)}")
    per = len(cores) // world_size
    return "|".join(",".join(str(c) for c in cores[r * per:(r + 1) * per]) for r in range(world_size))


def _vllm_probe(model: str, size: int, tree: bool, *, dtype: str, prompts: list[str], max_tokens: int, seed: int,
                leaf_width: int | None, timeout: float) -> dict:
    import json
    import subprocess

    from .patches.vllm.plugin import ENV, spec_for

    env = dict(os.environ)
    env.pop(ENV, None)
    if tree:
        env[ENV] = spec_for(tree=True, leaf_width=leaf_width)
    if size > 1 and not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_spec(size)
    with tempfile.TemporaryDirectory(prefix="moealign-vllm-tp-") as tmp:
        out = os.path.join(tmp, "probe.json")
        cmd = [sys.executable, "-m", "moealign.patches.vllm.tp_probe", "--model", str(model), "--tp", str(size),
               "--dtype", dtype, "--prompts", json.dumps(prompts), "--max-tokens", str(max_tokens),
               "--seed", str(seed), "--out", out] + (["--tree"] if tree else [])
        try:
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EngineTimeoutError(f"vLLM at TP={size} ({'tree' if tree else 'stock'}) did not finish within "
                                     f"{timeout:.0f} s") from None
        if proc.returncode != 0 or not os.path.exists(out):
            what = f"vLLM at TP={size} ({'tree' if tree else 'stock'})"
            if proc.returncode == 0:
                raise EngineError(f"{what} exited without writing its result: "
                                  f"{last_meaningful_line(proc.stderr) or 'no message'}")
            raise EngineError(child_failure(what, proc.returncode, proc.stderr))
        with open(out) as fh:
            return json.load(fh)


def _compare_vllm(run: dict, ref: dict, key: str) -> tuple[bool, float]:
    values = [v for row in run["rows"] for v in row[key]]
    ref_values = [v for row in ref["rows"] for v in row[key]]
    same_tokens = all(a["token_ids"] == b["token_ids"] for a, b in zip(run["rows"], ref["rows"]))
    a, b = torch.tensor(values, dtype=torch.float64), torch.tensor(ref_values, dtype=torch.float64)
    if a.shape != b.shape:
        return False, float("inf")
    equal = torch.equal(a, b) and (key == "prompt_logprobs" or same_tokens)
    return equal, float((a - b).abs().max()) if a.numel() else 0.0


def run_vllm_tp_check(world_sizes: list[int], *, model: str | None = None, dtype: str = "bf16", seed: int = 0,
                      num_prompts: int = 4, max_tokens: int = 8, leaf_width: int | None = None,
                      timeout: float = 600.0, log: Callable[[str], None] = lambda msg: None) -> dict:
    """The whole model in vLLM at each TP size against TP = 1, twice: stock vLLM (the negative control: its
    row-parallel and MoE all-reduces sum per-rank partials rounded to the model dtype) and with moealign's tree
    forward in every worker (:func:`moealign.patches.vllm.apply_tree_reductions` through the
    ``vllm.general_plugins`` entry point). One engine process per (TP size, path).

    Returns the same shape as :func:`run_tp_check`: ``{"results": [{"op", "world_size", "path",
    "bitwise_equal", "max_abs_diff", "time_ms"}], "engine": "vllm", "engine_version", "model", "dtype"}``, ops
    :data:`VLLM_OPS`; sampled log-probs are equal only when the sampled tokens are too. ``time_ms`` is the
    ``LLM.generate`` time of that run.
    """
    from .embedded import default_prompts, embedded_model_path

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise ConfigError(f"--seed must be an integer in [0, 2**63), got {seed!r}")
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"--dtype must be bf16, fp16 or fp32 for --engine vllm, got {dtype!r}")
    model = str(model or embedded_model_path())
    if not os.path.isdir(model):
        raise ConfigError(f"--model {model}: not a local checkpoint directory")
    prompts = default_prompts()[:num_prompts]
    for size in world_sizes:
        if size > 1 and not torch.cuda.is_available():
            cpu_bind_spec(size)   # refuse before starting anything
    runs = {}
    for tree in (False, True):
        for size in sorted(set(world_sizes) | {1}):
            log(f"tp-check: vLLM at TP={size}, {'tree' if tree else 'stock'} forward ...")
            runs[(size, tree)] = _vllm_probe(model, size, tree, dtype=dtype, prompts=prompts, max_tokens=max_tokens,
                                             seed=seed, leaf_width=leaf_width, timeout=timeout)
    rows = []
    for op, key in zip(VLLM_OPS, ("prompt_logprobs", "logprobs")):
        for size in world_sizes:
            for tree in (True, False):
                equal, diff = _compare_vllm(runs[(size, tree)], runs[(1, tree)], key)
                rows.append({"op": op, "world_size": size, "path": "tree" if tree else "stock",
                             "bitwise_equal": equal, "max_abs_diff": diff,
                             "time_ms": 1000.0 * runs[(size, tree)]["generate_s"]})
    return {"results": rows, "engine": "vllm", "engine_version": runs[(1, False)]["vllm_version"], "model": model,
            "dtype": dtype}
