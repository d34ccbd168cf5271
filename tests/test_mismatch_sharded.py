"""``moealign mismatch --train-tp / --train-ep / --train-pp``: the main job with the sharded Megatron trainer.

One small vLLM rollout (4 prompts x 8 new tokens) is scored by the single-rank trainer and saved (``--save-record``);
``--load-record`` then scores the same record with the sharded trainer at EP 2 (2 rank processes, the all-to-all
dispatcher) and TP 2 (2 ranks). Under replay the router flips are 0 on every layout, and the all-levers gap (the
routing_replay+sampling_mask run's mean / max |delta log p|) is the single-rank run's: equal (==) at EP 2, where the
sharded trainer is bitwise (as at EP 2 x PP 2: tests/test_megatron_sharded.py), within the sharded trainer's
fp32 bound at TP 2 (its all-reduce sums the ranks' partial products in another order). Negative control: the same
sharded world with its replay made inert (``--inject-fault replay-off``) flips routers and moves the gap.

The bad layouts, what the sharded trainer does not do yet and vLLM's expert / data parallelism on its CPU build are
refused before any process starts (one line, exit 2; fast, in this process).
"""

from __future__ import annotations

import json
import multiprocessing
import sys

import pytest

pytest.importorskip("megatron.core")

import warm  # noqa: E402
from round3_util import exit_2  # noqa: E402

from moealign.mismatch import MismatchConfig  # noqa: E402
from moealign.options import train_parallel_note  # noqa: E402

ALL_LEVERS = "routing_replay+sampling_mask"
#: the sharded trainer's fp32 bound where its summation order differs (tests/test_megatron_sharded.py's TOL)
TOL = 5e-5


# --------------------------------------------------------------------------------------------------
# refusals: before any process starts
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["mismatch", "--train-ep", "3"], "--train-ep 3: Megatron cannot build this layout: expert parallel size 3 does "
                                      "not divide the model's 16 experts"),
    (["mismatch", "--train-pp", "3"], "--train-pp 3: Megatron cannot build this layout: pipeline parallel size 3"),
    (["mismatch", "--train-tp", "4", "--train-ep", "2"], "--train-tp 4 --train-ep 2: Megatron cannot build this "
                                                         "layout: tensor parallel size 4 does not divide"),
    (["mismatch", "--train-tp", "0"], "--train-tp must be an integer in [1, 4096], got 0"),
    (["mismatch", "--train-pp", "2", "--diagnose"], "does not run --diagnose / --report"),
    (["mismatch", "--train-tp", "2", "--contract"], "--contract with --train-tp / --train-ep / --train-pp above 1"),
    (["mismatch", "--train-ep", "2", "--train", "hf"], "--train-ep 2 shards the Megatron trainer"),
    (["mismatch", "--train-ep", "2", "--train-precision", "fp8-e4m3-tensor"], "Megatron's FP8 needs "
                                                                              "transformer-engine layers"),
    (["rl-check", "--train-ep", "3"], "--train-ep 3: Megatron cannot build this layout: expert parallel size 3"),
    (["rl-check", "--train-pp", "3"], "--train-pp 3: Megatron cannot build this layout"),
    # vLLM's expert / data parallelism where the CPU build cannot run them (docs/scale.md), with vLLM's reason
    (["mismatch", "--rollout-tp", "2", "--rollout-ep", "2"], "--rollout-ep 2: vLLM's CPU build cannot run expert "
                                                             "parallelism: its fused-MoE CPU kernel"),
    (["mismatch", "--rollout-ep", "2"], "vLLM's expert-parallel size is its TP x DP ranks"),
    (["rl-check", "--rollout-dp", "2"], "--rollout-dp 2: vLLM refuses LLM(data_parallel_size=N) in one process"),
])
def test_refused_before_any_process_starts(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(multiprocessing.active_children())
    exit_2([*argv, "--device", "cpu"], capsys, needle)
    assert set(multiprocessing.active_children()) == before


def test_layouts_megatron_builds_are_accepted_and_reported():
    """Negative control of the refusals: these layouts pass the checks (no process starts in a config)."""
    for sizes, want in [(dict(train_ep=2, train_pp=2), {"tp": 1, "ep": 2, "pp": 2, "dp": 2, "world": 4}),
                        (dict(train_tp=2), {"tp": 2, "ep": 1, "pp": 1, "dp": 1, "world": 2}),
                        ({}, {"tp": 1, "ep": 1, "pp": 1, "dp": 1, "world": 1})]:
        cfg = MismatchConfig(rollout_engine="vllm", train_engine="megatron", device="cpu", **sizes)
        assert cfg.train_layout.as_dict() == want
        assert cfg.train_sharded == (want["world"] > 1)
        assert cfg.train_dispatcher == "alltoall"
        assert cfg.train_parallel_kwargs() == ({} if want["world"] == 1 else dict(
            tp=want["tp"], ep=want["ep"], pp=want["pp"], dispatcher="alltoall"))


def test_more_ranks_than_cores_is_one_log_line(monkeypatch):
    layout = MismatchConfig(train_engine="megatron", train_ep=2, train_pp=2, device="cpu").train_layout
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    note = train_parallel_note(layout, "cpu")
    assert note is not None and "4 rank processes on 2 CPU cores" in note and "slow" in note and "\n" not in note
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert train_parallel_note(layout, "cpu") is None                  # negative control: enough cores
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    single = MismatchConfig(train_engine="megatron", device="cpu").train_layout
    assert train_parallel_note(single, "cpu") is None                  # one process: the in-process trainer


# --------------------------------------------------------------------------------------------------
# the main job, sharded
# --------------------------------------------------------------------------------------------------


def _mismatch(*args: str, timeout: float = 600) -> dict:
    from vllm_util import child_env

    proc = warm.run([sys.executable, "-m", "moealign", "mismatch", "--device", "cpu", *args],
                    capture_output=True, text=True, timeout=timeout, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = args[args.index("--json") + 1]
    report = json.loads(open(out).read())
    report["stderr"] = proc.stderr
    return report


def _runs(report: dict) -> dict:
    return {run["name"]: run["metrics"] for run in report["runs"]}


@pytest.mark.heavy
def test_sharded_layouts_measure_the_single_rank_gap(tmp_path):
    pytest.importorskip("vllm")
    record = tmp_path / "record.safetensors"
    single = _mismatch("--num-prompts", "4", "--max-new-tokens", "8", "--save-record", str(record),
                       "--json", str(tmp_path / "single.json"))
    assert single["train"]["parallel"] == {"tp": 1, "ep": 1, "pp": 1, "dp": 1, "world": 1}
    want = _runs(single)
    assert want[ALL_LEVERS]["router_flip_rate"] == 0.0 and want["baseline"]["router_flip_rate"] > 0

    # EP 2 here (2 ranks; EP 2 x PP 2, 4 ranks, is bitwise at the trainer level: tests/test_megatron_sharded.py)
    for sizes, layout, bitwise in [(("--train-ep", "2"), {"tp": 1, "ep": 2, "pp": 1, "dp": 2, "world": 2}, True),
                                   (("--train-tp", "2"), {"tp": 2, "ep": 1, "pp": 1, "dp": 1, "world": 2}, False)]:
        report = _mismatch("--load-record", str(record), *sizes, "--json", str(tmp_path / f"{sizes[1]}.json"))
        assert report["train"]["parallel"] == layout and report["train"]["dispatcher"] == "alltoall"
        got = _runs(report)
        assert got["baseline"]["router_flip_rate"] == want["baseline"]["router_flip_rate"]   # its own top-k: the same
        for run in ("routing_replay", ALL_LEVERS):
            assert got[run]["router_flip_rate"] == 0.0, (sizes, run)
            assert got[run]["per_layer_flip_rate"] == [0.0] * 4
        for metric in ("mean_abs_logp_diff", "max_abs_logp_diff"):
            a, b = got[ALL_LEVERS][metric], want[ALL_LEVERS][metric]
            if bitwise:
                assert a == b, (sizes, metric, a, b)
            assert abs(a - b) <= TOL, (sizes, metric, a, b)

    # negative control: the same sharded world with its replay inert is not the single-rank replayed run
    fault = _mismatch("--load-record", str(record), "--train-ep", "2", "--inject-fault", "replay-off",
                      "--json", str(tmp_path / "fault.json"))
    bad = _runs(fault)
    assert bad[ALL_LEVERS]["router_flip_rate"] > 0
    assert bad[ALL_LEVERS]["mean_abs_logp_diff"] != want[ALL_LEVERS]["mean_abs_logp_diff"]
