"""tools/run_tests.sh, the one test runner of the README's command (setup.sh test, .ci/run) and the lowest-versions
job (ci_lowest.sh): pytest's exit code 5 (nothing collected) passes with a message, every other code passes through,
and a bad worker count is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, **env):
    return subprocess.run(["bash", str(ROOT / "tools" / "run_tests.sh"), sys.executable, *args, "-p", "no:cacheprovider"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "MOEALIGN_TEST_WORKERS": "1", **env})


def test_nothing_collected_passes_with_a_message_and_other_codes_pass_through():
    none = _run("tests/test_errors.py", "-k", "no_test_has_this_name")
    assert none.returncode == 0 and "exit 5" in none.stderr, none.stdout + none.stderr
    missing = _run("tests/no_such_file.py")
    assert missing.returncode == 4, missing.stdout + missing.stderr      # pytest's usage error, not swallowed


def test_a_bad_worker_count_is_refused():
    bad = _run("tests/test_errors.py", MOEALIGN_TEST_WORKERS="two")
    assert bad.returncode == 2 and "MOEALIGN_TEST_WORKERS must be a whole number" in bad.stderr
