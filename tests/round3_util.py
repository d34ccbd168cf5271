"""Helpers of the issue-23 tests (``test_hostile_round3_*.py``): a command's one-line exit, a writable checkpoint."""

from __future__ import annotations

import shutil

from moealign.cli import main
from moealign.embedded import embedded_model_path


def run_cli(argv, capsys, code: int = 2, *needles: str) -> str:
    """``moealign argv`` exits ``code``; with exit 2 stderr is one line; every needle is in the output."""
    assert main(argv) == code
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text, text
    if code == 2:
        assert captured.err.count("\n") == 1, captured.err
    for needle in needles:
        assert needle in text, text
    return text


def exit_2(argv, capsys, *needles: str) -> str:
    return run_cli(argv, capsys, 2, *needles)


def copy_checkpoint(tmp_path):
    """A copy of the embedded checkpoint under ``tmp_path/ckpt`` (tests may break or watch its files)."""
    path = tmp_path / "ckpt"
    shutil.copytree(embedded_model_path(), path)
    return path
