"""``moealign rl-check`` (issue 21 parts 3-5): a short real run (vLLM rolls out, Megatron trains, refit and verified
every step; stock and aligned side by side), the options refused before any engine starts, the reward and the
group-relative advantages. The real run is skipped only where vLLM or Megatron-core is not installed."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from moealign._optional import probe
from moealign.cli import main
from moealign.errors import ConfigError
from moealign.rl import RLCheckConfig, balanced_brackets, group_advantages, rewards

from vllm_util import child_env
import warm

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

VLLM, MEGATRON = probe("vllm"), probe("megatron.core")
needs_engines = pytest.mark.skipif(not (VLLM.available and MEGATRON.available),
                                   reason=f"vLLM / Megatron-core not installed: {VLLM.error or MEGATRON.error}")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("rl")
    cmd = [sys.executable, "-m", "moealign", "rl-check", "--steps", "2", "--num-prompts", "4", "--group-size", "2",
           "--max-new-tokens", "8", "--compare", "--json", str(out / "rl.json"), "--report", str(out / "rep"), "-q"]
    proc = warm.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "rl.json").read_text())
    return {"report": report, "stdout": proc.stdout, "html": (out / "rep" / "report.html").read_text()}


@needs_engines
def test_short_run_every_step_measured_and_verified(short_run):
    report = short_run["report"]
    assert [r["name"] for r in report["runs"]] == ["stock", "aligned"]
    for run in report["runs"]:
        assert run["initial_refit"]["verify"]["ok"]
        assert run["probe"]["bound"] >= run["probe"]["step0_gap"] >= 0
        assert [s["step"] for s in run["steps"]] == [0, 1]
        for s in run["steps"]:
            assert s["verify"]["ok"] and s["verify"]["weights"]["checked"] == 167
            assert s["verify"]["probe_gap"] <= s["verify"]["probe_bound"]
            assert s["refit"]["tensors"] > 0 and s["refit"]["workers"] == 1
            assert 0.0 <= s["reward_mean"] <= 1.0 and math.isfinite(s["loss"]) and s["grad_norm"] >= 0
            assert set(s["time"]) == {"rollout", "train", "measure", "refit", "verify", "total"}
            for name in ("kl_k3", "max_abs_logp_diff", "router_flip_rate", "support_mismatch_rate"):
                assert math.isfinite(s["metrics"][name])


@needs_engines
def test_short_run_aligned_zero_flips_stock_not_aligned(short_run):
    stock, aligned = short_run["report"]["runs"]
    assert aligned["replay"] and aligned["sampling_mask"] and not stock["replay"] and not stock["sampling_mask"]
    # replay: the trainer ran exactly the recorded experts at every step
    assert all(s["metrics"]["router_flip_rate"] == 0.0 for s in aligned["steps"])
    # the sampling mask removes the truncation gap (top-p 0.9): the stock KL is orders of magnitude above
    for s_stock, s_aligned in zip(stock["steps"], aligned["steps"]):
        assert s_aligned["metrics"]["kl_k3"] < 0.1 * s_stock["metrics"]["kl_k3"]
        assert s_aligned["metrics"]["support_mismatch_rate"] == 0.0


@needs_engines
def test_short_run_table_and_report(short_run):
    out = short_run["stdout"]
    assert "[stock] levers none" in out and "[aligned] levers all" in out
    assert out.count(" ok ") >= 4
    page = short_run["html"]
    assert page.count("<svg") - page.count('<svg class="swatch"') == 6 and "<script" not in page   # 6 plots
    assert "refit verified at 2/2 steps" in page


# --------------------------------------------------------------------------------------------------
# bad input: one line, exit 2, before any engine starts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--steps", "0"], "--steps"),
    (["--group-size", "1"], "--group-size"),
    (["--num-prompts", "-3"], "--num-prompts"),
    (["--staleness", "8"], "--staleness 8 must be below --steps 8"),
    (["--levers", "everything"], "invalid choice"),
    (["--correction", "nope"], "unknown --correction preset"),
    (["--correction", "bypass_ppo_clip"], "bypass-mode preset"),
    (["--lr", "-1"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--top-p", "0"], "--top-p"),
    (["--temperature", "1e-9"], "--temperature"),
    (["--rollout-precision", "fp64"], "fp64"),
    (["--rollout-tp", "0"], "--rollout-tp"),
    (["--model", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["--json", "/dev/null/x.json"], "--json"),
    (["--fail-above", "pearson_prob=0.5"], "pearson_prob"),
    (["--fail-above", "kl_k3"], "METRIC=VALUE"),
])
def test_bad_options_one_line_exit_2(args, needle, capsys):
    assert main(["rl-check", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]


def test_json_onto_the_checkpoint_is_refused(tmp_path):
    from moealign.embedded import embedded_model_path

    with pytest.raises(ConfigError, match="--json"):
        RLCheckConfig(json=str(embedded_model_path() / "config.json"))


def test_config_defaults_are_valid_and_levers_map():
    cfg = RLCheckConfig()
    assert (cfg.steps, cfg.replay, cfg.mask, cfg.rollout_precision, cfg.train_precision) == (8, True, True, "bf16",
                                                                                              "fp32")
    assert (RLCheckConfig(levers="replay").mask, RLCheckConfig(levers="mask").replay) == (False, False)


# --------------------------------------------------------------------------------------------------
# the reward and the advantages
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("f(x)[0]", 1.0), ("print({'a': (1, 2)})", 1.0), ("no brackets here", 0.0), ("f(x", 0.0), ("f)x(", 0.0),
    ("([)]", 0.0), ("", 0.0), ("x = [1, 2,\n     3]", 1.0),
])
def test_balanced_brackets(text, value):
    assert balanced_brackets(text) == value


def test_group_advantages_are_group_relative():
    r = rewards(["f()", "f(", "f()", "f()", "x", "y"])            # groups of 3: [1, 0, 1], [1, 0, 0]
    a = group_advantages(r, 3)
    assert torch.allclose(a.reshape(2, 3).sum(1), torch.zeros(2), atol=1e-6)
    assert a[0] > 0 and a[1] < 0 and a[3] > 0 and a[4] < 0
    flat = group_advantages(torch.ones(4), 2)                     # no spread in a group: no signal
    assert torch.equal(flat, torch.zeros(4))


def test_unknown_engine_version_refused_before_any_engine(monkeypatch, capsys):
    from packaging.version import Version

    import moealign.patches.vllm.refit as vr

    monkeypatch.setattr(vr, "vllm_version", lambda: Version("0.40.0"))
    assert main(["rl-check", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0.40.0" in err[0] and "in-place refit" in err[0]
