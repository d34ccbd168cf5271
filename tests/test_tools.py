"""The benchmark scripts keep running (tiny sizes; the figures themselves live in the README)."""

import json
import sys
from pathlib import Path

import pytest
import warm

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]


def test_bench_correction_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = warm.run(
        [sys.executable, str(ROOT / "tools" / "bench_correction.py"), "--batch", "6", "--tokens", "40",
         "--repeats", "2", "--no-fused", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "x floor" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["case"].startswith("floor") and rows[0]["ratio_to_floor"] == 1.0
    assert len(rows) == 1 + 2 * 2  # floor + 2 presets x (plain, +agreement)
    assert all(r["ms"] > 0 for r in rows)


def test_bench_replay_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = warm.run(
        [sys.executable, str(ROOT / "tools" / "bench_replay.py"), "--batch", "2", "--new-tokens", "4",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ratio" in proc.stdout
    result = json.loads(out.read_text())
    assert result["generate_ratio"] > 0 and result["train_ratio"] > 0
    # uint8 routes: exactly top_k bytes per (token, MoE layer) for <= 256 experts
    assert result["route_dtype"] == "uint8"
    assert result["route_bytes_per_token_layer"] == result["top_k"]


def test_bench_megatron_replay_smoke(tmp_path):
    import pytest

    pytest.importorskip("megatron.core")
    out = tmp_path / "bench.json"
    proc = warm.run(
        [sys.executable, str(ROOT / "tools" / "bench_megatron_replay.py"), "--batch", "2", "--seq", "16",
         "--repeats", "1", "--recompute", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "target <= 1.03x" in proc.stdout
    result = json.loads(out.read_text())
    assert result["recompute"] is True and result["plain_ms"] > 0 and result["ratio"] > 0


def test_bench_vllm_record_smoke(tmp_path):
    import pytest

    from moealign._optional import probe

    if not probe("vllm").available:
        pytest.skip("vLLM is not installed")
    out = tmp_path / "bench.json"
    proc = warm.run(
        [sys.executable, str(ROOT / "tools" / "bench_vllm_record.py"), "--num-prompts", "2", "--max-new-tokens", "4",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["plain_s"] > 0 and result["record_s"] > 0 and result["ratio_min"] > 0


def test_probe_vllm_megatron_gap_smoke(tmp_path):
    import math

    import pytest

    from moealign._optional import probe

    if not probe("vllm").available:
        pytest.skip("vLLM is not installed")
    out = tmp_path / "gap.json"
    env = {k: v for k, v in __import__("os").environ.items() if k != "MOEALIGN_VLLM_PATCHES"}
    proc = warm.run([sys.executable, str(ROOT / "tools" / "probe_vllm_megatron_gap.py"), "--tokens", "16",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    ops = [row["op"] for row in result["rows"]]
    assert ops[0] == "embedding" and ops[-1] == "LM head" and len(ops) == 2 + 4 * 5 + 1
    assert result["rows"][0]["cumulative"] == 0.0          # the same table lookup on both sides
    assert all(math.isfinite(row["cumulative"]) for row in result["rows"])


def test_bench_diagnosis_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = warm.run(
        [sys.executable, str(ROOT / "tools" / "bench_diagnosis.py"), "--num-prompts", "2", "--max-new-tokens", "4",
         "--batch-size", "2", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "with --diagnose" in proc.stdout
    result = json.loads(out.read_text())
    assert result["diagnose_ratio"] > 0 and result["rescore_ratio"] > 0      # figures: README (tiny sizes here)
    assert result["lever_sets"] > 4 and result["one_worker_ratio"] > 0 and result["decode_workers"] >= 1


def test_bench_rl_check_smoke(tmp_path):
    import pytest

    from moealign._optional import probe

    if not (probe("vllm").available and probe("megatron.core").available):
        pytest.skip("vLLM / Megatron-core not installed")
    out = tmp_path / "bench.json"
    proc = warm.run(
        [sys.executable, str(ROOT / "tools" / "bench_rl_check.py"), "--num-prompts", "2", "--group-size", "2",
         "--max-new-tokens", "4", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["samples"] == 4 and result["verify_digests"] > 0 and result["probe"] > 0
    assert 0 <= result["moealign_share"] < 1 and 0 < result["verification_s"]
    assert result["recording_ratio"] > 0 and result["replay_ratio"] > 0 and result["refit_ratio_vs_vllm_reload"] > 0


def test_bench_aligned_smoke(tmp_path):
    import pytest

    pytest.importorskip("megatron.core")
    out = tmp_path / "bench.json"
    proc = warm.run([sys.executable, str(ROOT / "tools" / "bench_aligned.py"), "--no-vllm", "--batch", "2",
                           "--seq", "8", "--repeats", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "forward stock" in proc.stdout
    m = json.loads(out.read_text())["megatron_embedded"]
    assert m["tokens"] == 16 and m["forward_ratio"] > 0 and m["train_ratio"] > 0
