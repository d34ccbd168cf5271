"""The diagnosis names TP = 2 stock reductions on the vLLM side first (vLLM's CPU build, two worker processes).

The rollout side is vLLM at TP = 2 with its stock all-reduce, the trainer transformers at TP = 1, both bf16. vLLM's
side cannot be re-scored along its own path, so the players are the trainer-side levers; the TP difference is
named from the two execution contracts (TP sizes differ with tree reductions off on both sides).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import warm

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

pytest.importorskip("vllm")


def test_tp2_stock_reductions_on_the_vllm_side_are_named_first(tmp_path):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "MOEALIGN_VLLM_PATCHES"}   # stock reductions
    cmd = [sys.executable, "-m", "moealign", "mismatch", "--rollout", "vllm", "--rollout-tp", "2", "--train", "hf",
           "--rollout-precision", "bf16", "--train-precision", "bf16", "--num-prompts", "6", "--max-new-tokens", "16",
           "--diagnose", "--json", str(out), "-q"]
    proc = warm.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # -q: vLLM's C++ NUMA note is silenced in its TP worker processes too (the plugin's "quiet" patch; it printed once
    # per worker before)
    assert "NUMA binding" not in proc.stderr
    report = json.loads(out.read_text())
    diagnosis = report["diagnosis"]
    assert diagnosis["first_cause"] == "reduction order / TP", diagnosis["headline"]
    assert diagnosis["first_lever"] == "tree_reductions"
    rows = {r["field"]: r for r in report["contract"]["fields"]}
    assert rows["parallel.tp"]["rollout"] == 2 and rows["parallel.tp"]["train"] == 1
    assert rows["parallel.tp"]["status"] == "gap"
    # the dtypes agree, so nothing else is a gap in the contract
    assert [f for f, r in rows.items() if r["status"] == "gap"] == ["parallel.tp"]
    assert "diagnosis: reduction order / TP" in proc.stdout
