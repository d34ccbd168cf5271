"""One option set (issue 36, item 3): the flags `moealign mismatch` and `moealign rl-check` share are defined once
(``moealign.options.add_shared_options``) and checked by the same functions, so a value means the same and is
refused with the same words in both commands."""

from __future__ import annotations

import argparse

import pytest

from moealign.cli import build_parser, main
from moealign.options import SHARED_FIELDS


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _actions(p: argparse.ArgumentParser) -> dict:
    return {s: a for a in p._actions for s in a.option_strings}


SHARED = [flag for flag, _ in SHARED_FIELDS] + ["--json", "--fail-above", "-q", "-v"]


@pytest.mark.parametrize("flag", SHARED)
def test_each_shared_flag_is_the_same_in_both_commands(flag):
    a, b = _actions(_subparser("mismatch"))[flag], _actions(_subparser("rl-check"))[flag]
    assert (type(a), a.dest, a.type, a.default, a.option_strings, a.metavar) == \
        (type(b), b.dest, b.type, b.default, b.option_strings, b.metavar)
    assert a.default is None or a.default is False          # "not given": each config fills its own default


@pytest.mark.parametrize("argv, words", [
    (["--device", "cudaXYZ"], "--device 'cudaXYZ': not a device"),
    (["--device", "meta"], "moealign runs on cpu or cuda"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63)"),
    (["--num-prompts", "0"], "--num-prompts must be an integer in [1, 100000]"),
    (["--rollout-tp", "0"], "--rollout-tp must be an integer in [1, 4096]"),
    (["--max-new-tokens", "600"], "512 positions"),
    (["--top-p", "0"], "--top-p"),
])
def test_both_commands_refuse_a_bad_value_with_the_same_words(argv, words, capsys):
    lines = {}
    for command in ("mismatch", "rl-check"):
        assert main([command, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, (command, err)
        lines[command] = err.split("error: ", 1)[1]
    if argv[0] not in ("--top-p",):                          # rl-check names its own (0, 1] range first
        assert lines["mismatch"] == lines["rl-check"], lines


@pytest.mark.parametrize("argv, words", [
    (["--aligned", "--rollout-tp", "3"], "--rollout-tp 3: the canonical forward cuts its trees at power-of-two TP"),
    (["--aligned", "--rollout-tp", "4"], "does not split into whole 32-wide tree leaves per rank"),
    (["--aligned", "--rollout-precision", "fp16", "--train-precision", "fp16"], "one plain precision"),
])
def test_aligned_is_checked_the_same_way_by_both_commands(argv, words, capsys):
    # rl-check --aligned never checked the vLLM TP cut that mismatch --aligned checks (issue 36)
    for command in ("mismatch", "rl-check"):
        assert main([command, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, (command, err)
