"""One error base: every error class moealign defines or raises derives from moealign.errors.MoealignError,
with the built-in it replaces kept as a mixin; the CLI turns any of them into one line and exit code 2."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
import pkgutil

import pytest

import moealign
from moealign import errors
from moealign.errors import MoealignError

ROOT = pathlib.Path(moealign.__file__).parent
BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                      if isinstance(obj, type) and issubclass(obj, BaseException)}
# raised on purpose and not an error of the package: control flow / protocol exceptions
ALLOWED_BUILTINS = {"StopIteration", "NotImplementedError", "KeyboardInterrupt", "SystemExit",
                    "AttributeError"}   # a module-level __getattr__ must raise AttributeError


def _sources():
    return sorted(p for p in ROOT.rglob("*.py"))


def _raised_builtins(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_EXCEPTIONS and exc.id not in ALLOWED_BUILTINS:
                out.append((node.lineno, exc.id))
    return out


def test_no_builtin_exception_is_raised_directly():
    bad = [f"{path.relative_to(ROOT)}:{line} raises {name}" for path in _sources()
           for line, name in _raised_builtins(path.read_text())]
    assert not bad, "raise a moealign.errors class instead:\n" + "\n".join(bad)


def test_the_checker_catches_a_builtin_raise():   # negative control of the test above
    assert _raised_builtins("def f(x):\n    if x:\n        raise ValueError('no')\n") == [(3, "ValueError")]
    assert _raised_builtins("raise errors.InputError('fine')\nraise StopIteration\n") == []


def _modules():
    for info in pkgutil.walk_packages([str(ROOT)], prefix="moealign."):
        if "_triton" in info.name or info.name.endswith("__main__"):   # triton (GPU only); the CLI entry
            continue
        yield importlib.import_module(info.name)


def test_every_error_class_derives_from_the_base():
    seen = set()
    for module in _modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Warning) and obj.__module__.startswith("moealign"):
                assert issubclass(obj, errors.MoealignWarning), f"{obj.__module__}.{obj.__qualname__}"
            elif issubclass(obj, BaseException) and obj.__module__.startswith("moealign"):
                seen.add(obj)
                assert issubclass(obj, MoealignError), f"{obj.__module__}.{obj.__qualname__}"
    assert errors.RouteError in seen and errors.RecordError in seen


@pytest.mark.parametrize("cls, builtin", [
    (errors.RouteError, ValueError), (errors.ReplayError, RuntimeError), (errors.RecordError, ValueError),
    (errors.UnsupportedEngineError, RuntimeError), (errors.UnknownPolicyError, KeyError),
    (errors.PrecisionAuditError, AssertionError), (errors.ConfigError, ValueError),
    (errors.InputTypeError, TypeError), (errors.MissingFileError, FileNotFoundError),
])
def test_builtin_bases_are_kept(cls, builtin):
    assert issubclass(cls, MoealignError) and issubclass(cls, builtin)


def test_one_replay_error_for_every_adapter():
    assert issubclass(errors.RouteError, errors.ReplayError)
    assert issubclass(errors.ReplayConfigError, errors.ReplayError)
    from moealign.patches import hf

    assert hf.ReplayError is errors.ReplayError


def test_unknown_policy_message_is_not_quoted():
    assert str(errors.UnknownPolicyError("no policy 'x'")) == "no policy 'x'"


@pytest.mark.parametrize("argv", [
    ["mismatch", "--num-prompts", "x"], ["mismatch", "--num-prompts", "0"], ["mismatch", "--top-p", "2"],
    ["mismatch", "--fail-above", "nope"], ["mismatch", "--train-precision", "fp4"], ["tp-check", "--world-sizes", "3"],
    ["tp-check", "--world-sizes", "a,b"], ["nope"], ["mismatch", "--sweep", "--save-record", "x"],
    ["mismatch", "--load-record", "/nonexistent/record.safetensors"], ["mismatch", "--device", "foo"],
    ["mismatch", "--device", "meta"], ["mismatch", "--model", "/nonexistent/checkpoint"], ["mismatch", "--seed", "-1"],
    ["mismatch", "--json", "/nonexistent/dir/report.json"], ["mismatch", "--json", "/"],
    ["mismatch", "--prompts", "/nonexistent/prompts.json"], ["tp-check", "--json", "/nonexistent/dir/tp.json"],
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, capsys):
    from moealign.cli import main

    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith("moealign"), captured.err


def test_cli_refuses_json_onto_the_record(tmp_path, capsys):
    from moealign.cli import main

    record = tmp_path / "r.safetensors"
    record.write_bytes(b"not touched")
    assert main(["mismatch", "--load-record", str(record), "--json", str(record)]) == 2
    assert "is also the --load-record file: refusing to overwrite it" in capsys.readouterr().err
    assert record.read_bytes() == b"not touched"


def test_cli_cuda_without_cuda_is_a_clear_error(capsys, monkeypatch):
    import torch

    from moealign.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["mismatch", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
