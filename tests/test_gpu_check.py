"""tools/gpu_check.py's dry run on the CPU (``--device cpu --quick``): every step runs with tiny sizes and the
summary table comes out, so the script a GPU machine runs is known to work before one is lent. A selection of its
steps keeps this test short; the negative control: a step that cannot succeed (a device the machine lacks fails
the mismatch step) is recorded, the exit status is 1, and the script goes on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *extra):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--no-suite", "--json", str(out), *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    return proc, json.loads(out.read_text())


def test_quick_cpu_dry_run(tmp_path):
    proc, result = _run(tmp_path, "--only", "env,mismatch-hf-hf,bench-bi")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {s["name"]: s for s in result["steps"]}
    assert set(steps) == {"env", "mismatch-hf-hf", "bench-bi"}
    assert all(s["status"] == "ok" for s in steps.values()), steps
    assert "router flips" in steps["mismatch-hf-hf"]["figure"] and "replayed" in steps["mismatch-hf-hf"]["figure"]
    assert "m=1:" in steps["bench-bi"]["figure"]
    assert "step" in proc.stdout and "status" in proc.stdout and "figure" in proc.stdout     # the table


def test_a_failed_step_is_recorded_and_the_script_goes_on(tmp_path):
    # a device this machine does not have: the mismatch step fails (the CLI's exit 2), the next step still runs
    out = tmp_path / "bad.json"
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "nodevice", "--quick",
                          "--no-suite", "--only", "mismatch-hf-hf,random-moe", "--json", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    steps = {s["name"]: s for s in json.loads(out.read_text())["steps"]}
    assert bad.returncode == 1 and steps["mismatch-hf-hf"]["status"] == "FAILED"
    assert "exited with code 2: moealign mismatch: error:" in steps["mismatch-hf-hf"]["figure"]   # the CLI's line
    assert steps["random-moe"]["status"] == "ok"                   # ran after the failure
    assert "FAILED" in bad.stdout.split("step", 1)[-1]             # and the table shows it
