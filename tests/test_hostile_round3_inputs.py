"""Issue 23, "Hangs": one input-file guard (:func:`moealign._files.check_input_file`, used by
:func:`~moealign._files.read_input_bytes` / :func:`~moealign._files.read_json_file`) for every user file a command
reads: record convert's JSON and tensor inputs, ``--eplb``, the checkpoint's config.json and safetensors (through
:func:`moealign.model_config.read_model_config`, shared by record convert / record inspect / mismatch), the prompts
file. A FIFO, a device or a directory is refused by name before it is opened (each CLI case here blocked forever or
read forever before the fix); config values that size anything are integers within the record's bounds."""

from __future__ import annotations

import json
import os

import pytest
from round3_util import copy_checkpoint, exit_2

from moealign import _files
from moealign.errors import ConfigError, MissingFileError
from moealign.model_config import read_model_config


@pytest.fixture
def ckpt(tmp_path):
    return copy_checkpoint(tmp_path)


def _specials(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    return {"fifo": (str(fifo), "FIFO"), "device": ("/dev/zero", "device"), "directory": (str(tmp_path), "directory")}


# --- the guard, with negative controls -----------------------------------------------------------------------

def test_guard_names_each_kind_of_special_file(tmp_path):
    for path, kind in _specials(tmp_path).values():
        with pytest.raises(ConfigError, match=f"{kind}, not a regular file"):
            _files.read_input_bytes(path, "x")
    with pytest.raises(MissingFileError, match="no such file"):
        _files.check_input_file(tmp_path / "none", "x")
    big = tmp_path / "big"
    with open(big, "wb") as fh:
        fh.truncate(1001)                                           # sparse
    with pytest.raises(ConfigError, match="more than"):
        _files.read_input_bytes(big, "x", max_bytes=1000)
    ok = tmp_path / "ok.json"
    ok.write_text('[1, {"a": 2}]')
    assert _files.read_json_file(ok, "x") == [1, {"a": 2}]          # negative control


def test_json_bounds(tmp_path):
    with pytest.raises(ConfigError, match="nested too deeply"):
        _files.parse_json("[" * 100_000 + "]" * 100_000, "x")       # RecursionError in json itself
    with pytest.raises(ConfigError, match="nested too deeply"):
        _files.parse_json("[" * 500 + "]" * 500, "x")                # parses, then refused by depth
    with pytest.raises(ConfigError, match="NaN is not a JSON number"):
        _files.parse_json('{"a": NaN}', "x")
    with pytest.raises(ConfigError, match="not JSON"):
        _files.parse_json("1" * 5000, "x")                           # more digits than int() converts
    assert _files.parse_json("[" * 10 + "]" * 10, "x") == [[[[[[[[[[]]]]]]]]]]      # negative control


# --- every command, every user file ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_record_convert_inputs(tmp_path, ckpt, capsys, kind):
    path, name = _specials(tmp_path)[kind]
    out = str(tmp_path / "out" / "r.safetensors")
    os.makedirs(tmp_path / "out")
    for fmt in ("sglang", "nemo-rl"):
        exit_2(["record", "convert", "--from", fmt, path, "--model", str(ckpt), "-o", out], capsys, name)
    entry = tmp_path / "in.json"
    entry.write_text("[]")
    exit_2(["record", "convert", "--from", "trtllm", str(entry), "--model", str(ckpt), "--expert-ids", "physical",
             "--eplb", path, "-o", out], capsys, "--eplb", name)


@pytest.mark.parametrize("what", ["config.json", "model.safetensors"])
def test_checkpoint_files_that_are_fifos(tmp_path, ckpt, capsys, what):
    os.unlink(ckpt / what)
    os.mkfifo(ckpt / what)
    entry = tmp_path / "in.json"
    entry.write_text(json.dumps([{"input_ids": [1], "meta_info": {}}]))
    out = str(tmp_path / "r.safetensors")
    exit_2(["record", "convert", "--from", "sglang", str(entry), "--model", str(ckpt), "-o", out], capsys, "FIFO")
    exit_2(["mismatch", "-q", "--rollout", "hf", "--train", "hf", "--model", str(ckpt)], capsys, "FIFO")
    if what == "config.json":
        from test_record import make_record

        make_record(shapes=[(5, 2)]).save(tmp_path / "rec.safetensors")
        exit_2(["record", "inspect", str(tmp_path / "rec.safetensors"), "--model", str(ckpt)], capsys, "FIFO")


@pytest.mark.parametrize("field, value, fragment", [
    ("num_hidden_layers", 1e11, "num_hidden_layers must be an integer"),
    ("num_hidden_layers", 10 ** 11, "num_hidden_layers must be an integer in [1, 10000]"),
    ("num_hidden_layers", None, "lacks num_hidden_layers"),
    ("num_hidden_layers", "4", "num_hidden_layers must be an integer"),
    ("vocab_size", 10 ** 30, "vocab_size must be an integer"),
    ("num_experts", True, "num_experts must be an integer"),
    ("mlp_only_layers", 5, "mlp_only_layers must be a list"),
])
def test_config_values_are_typed_and_bounded_by_every_command(tmp_path, ckpt, capsys, field, value, fragment):
    config = json.loads((ckpt / "config.json").read_text())
    config[field] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        read_model_config(ckpt)
    assert fragment in str(info.value)
    entry = tmp_path / "in.json"
    entry.write_text("[]")
    from test_record import make_record

    make_record(shapes=[(5, 2)]).save(tmp_path / "rec.safetensors")
    for argv in (["record", "convert", "--from", "sglang", str(entry), "--model", str(ckpt), "-o",
                  str(tmp_path / "r.safetensors")],
                 ["record", "inspect", str(tmp_path / "rec.safetensors"), "--model", str(ckpt)],
                 ["mismatch", "-q", "--rollout", "hf", "--train", "hf", "--model", str(ckpt)]):
        exit_2(argv, capsys, fragment)


def test_the_shipped_config_passes(ckpt):
    assert read_model_config(ckpt)["num_hidden_layers"] == 4                         # negative control


def test_rollout_correction_yaml_file_goes_through_the_guard(tmp_path):
    pytest.importorskip("yaml")
    from moealign.correction import RolloutCorrectionConfig

    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="FIFO"):
        RolloutCorrectionConfig.from_yaml(str(fifo))
