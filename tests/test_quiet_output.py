"""The commands' default output (issue 34): Megatron's transformer-engine / Apex fallback warnings (expected on every
machine without them, about ten lines before moealign's table) and vLLM's torch-deprecation warning are hidden unless
``-v`` is given; every other warning, Megatron's included, is still shown."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

from moealign.patches.megatron.version import FALLBACK_WARNINGS, quiet_fallback_warnings
from moealign.patches.vllm.engine import quiet_expected_warnings


def _shown(message: str, module: str, category=UserWarning) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_fallback_warnings()
        quiet_expected_warnings()()                   # the warning filters stay; the log level is put back
        warnings.warn_explicit(message, category, filename=module.replace(".", "/") + ".py", lineno=1, module=module)
    return bool(seen)


def test_only_the_engines_expected_warnings_are_hidden():
    assert not _shown("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                      "megatron.core.optimizer")
    assert not _shown("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.gpt.gpt_layer_specs")
    assert not _shown("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
                      "vllm.triton_utils.dispatcher", FutureWarning)
    # negative controls: the same text from another package, and another warning from Megatron, are shown
    assert _shown("Apex is not installed. Falling back to Torch Norm", "mypackage.norms")
    assert _shown("moe_router_topk is larger than the number of experts", "megatron.core.transformer")
    assert _shown("`torch.distributed.reduce_op` is deprecated", "mypackage.x", FutureWarning)
    assert len(FALLBACK_WARNINGS) >= 2


def _info_stderr(*flags: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "moealign", "info", *flags], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_the_command_hides_them_and_v_shows_them():
    assert "Apex" not in _info_stderr()
    assert "Transformer Engine and Apex are not installed" in _info_stderr("-v")      # Megatron imported by info


def test_vllm_start_up_logs_are_errors_only_until_the_command_ends(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    restore = quiet_expected_warnings()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"           # read by vLLM at import and by its workers
    # set before vLLM's first import too: its Triton probe warns while vLLM imports, before its logging is set up
    assert logging.getLogger("vllm").level == logging.ERROR
    restore()
    assert logging.getLogger("vllm").level != logging.ERROR      # put back
    assert "VLLM_LOGGING_LEVEL" not in os.environ                # the caller's process keeps its environment
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")            # the user's choice wins
    quiet_expected_warnings()()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"

