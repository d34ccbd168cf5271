"""Running a vLLM child script of the tests (vLLM keeps process-wide state, and class-level patches must precede
model loading: each engine runs in its own process) and reading the one ``RESULT {json}`` line it prints."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import warm

from moealign.exits import child_failure

HERE = pathlib.Path(__file__).parent


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without vLLM's variables and moealign's plugin variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "MOEALIGN_VLLM_PATCHES"}
    env.update(extra or {})
    return env


def run_child(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    """Run ``tests/<script>`` with ``args``; assert it succeeded and printed a ``RESULT`` line; return its JSON."""
    proc = warm.run([sys.executable, str(HERE / script), *map(str, args)], capture_output=True, text=True,
                    timeout=timeout, env=child_env() if env is None else env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (child_failure(script, proc.returncode, proc.stderr) + "\n"
                                            + proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])
