"""Issue 23, "Lost data": one output guard (:func:`moealign._files.check_outputs`) checks every output of every command
against every input of that command (the record, the prompts, the EPLB table, any file of the checkpoint directory;
through symlinks and hard links) before any work. Each CLI test here replaced a user's file on the code before the
fix; the unit tests carry the negative controls (an output that is no input passes)."""

from __future__ import annotations

import json
import os

import pytest
from round3_util import copy_checkpoint, exit_2
from test_record import make_record

from moealign import _files
from moealign.cli import main
from moealign.embedded import embedded_model_path
from moealign.errors import ConfigError


@pytest.fixture
def ckpt(tmp_path):
    return copy_checkpoint(tmp_path)


@pytest.fixture
def record_file(tmp_path):
    path = tmp_path / "r.safetensors"
    make_record(shapes=[(5, 2), (4, 1)], seed=1).save(path)
    return path


def _snapshot(directory):
    return {p: (directory / p).read_bytes() for p in sorted(os.listdir(directory)) if (directory / p).is_file()}


# --- the guard itself, with its negative controls ------------------------------------------------------------

def test_guard_refuses_inputs_through_links_and_passes_other_paths(tmp_path, ckpt):
    src = tmp_path / "in.json"
    src.write_text("[]")
    (tmp_path / "sym.json").symlink_to(src)
    os.link(src, tmp_path / "hard.json")
    os.link(ckpt / "config.json", tmp_path / "cfg-hard.json")            # a hard link to a checkpoint file, outside it
    (tmp_path / "cfg-sym.json").symlink_to(ckpt / "config.json")
    inputs = {"INPUT": str(src), "--model": str(ckpt)}
    for out in (src, tmp_path / "sym.json", tmp_path / "hard.json", tmp_path / "cfg-hard.json",
                tmp_path / "cfg-sym.json", ckpt / "config.json", ckpt / "model.safetensors", ckpt / "new.json"):
        with pytest.raises(ConfigError, match="refusing"):
            _files.check_outputs({"-o": str(out)}, inputs)
    # negative controls: new files and other files outside every input pass
    (tmp_path / "other.json").write_text("{}")
    for out in (tmp_path / "other.json", tmp_path / "fresh.json"):
        _files.check_outputs({"-o": str(out)}, inputs)
    with pytest.raises(ConfigError, match="also the --json"):                  # two outputs, one file
        _files.check_outputs([("-o", str(tmp_path / "a")), ("--json", str(tmp_path / "a"))], {})


def test_guard_follows_checkpoint_links_to_their_blobs(tmp_path):
    """A hub-cache snapshot holds symlinks to blobs elsewhere: the blob is a file of the checkpoint."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir(), snap.mkdir()
    (blobs / "abc").write_text("{}")
    (snap / "config.json").symlink_to(blobs / "abc")
    with pytest.raises(ConfigError, match="a checkpoint"):
        _files.check_outputs({"-o": str(blobs / "abc")}, {"--model": str(snap)})
    _files.check_outputs({"-o": str(blobs / "other")}, {"--model": str(snap)})    # negative control


def test_check_not_an_input_keeps_its_signature(tmp_path):
    from moealign.mismatch.rollout import check_not_an_input

    src = tmp_path / "p.json"
    src.write_text("[]")
    with pytest.raises(ConfigError, match="--prompts"):
        check_not_an_input(str(src), "--json", {"--prompts": str(src), "--model": None})
    check_not_an_input(str(tmp_path / "x.json"), "--json", {"--prompts": str(src)})


def test_report_dir_checks(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        _files.check_output_dir("/dev/null/sub", "--report")
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        _files.check_output_dir(tmp_path / "f" / "a" / "b", "--report")
    _files.check_output_dir(tmp_path / "new" / "deeper", "--report")          # negative control: created later


# --- the commands ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["config.json", "model.safetensors", "new.safetensors"])
def test_record_convert_never_writes_into_the_checkpoint(tmp_path, ckpt, capsys, target):
    entry = tmp_path / "in.json"
    entry.write_text(json.dumps([{"input_ids": [1, 2], "meta_info": {}}]))
    before = _snapshot(ckpt)
    exit_2(["record", "convert", "--from", "sglang", str(entry), "--model", str(ckpt), "-o", str(ckpt / target)],
            capsys, "--model", "refusing")
    assert _snapshot(ckpt) == before


def test_record_convert_never_writes_onto_the_eplb_table(tmp_path, ckpt, capsys):
    entry, eplb = tmp_path / "in.json", tmp_path / "eplb.json"
    entry.write_text("[]")
    eplb.write_text('{"num_slots": 16}')
    exit_2(["record", "convert", "--from", "trtllm", str(entry), "--model", str(ckpt), "--expert-ids", "physical",
             "--eplb", str(eplb), "-o", str(eplb)], capsys, "--eplb", "refusing")
    assert eplb.read_text() == '{"num_slots": 16}'


def test_record_inspect_json_never_replaces_an_input(tmp_path, ckpt, record_file, capsys):
    before = _snapshot(ckpt)
    exit_2(["record", "inspect", str(record_file), "--model", str(ckpt), "--json", str(ckpt / "config.json")],
            capsys, "--model", "refusing")
    os.link(record_file, tmp_path / "hard.safetensors")
    exit_2(["record", "inspect", str(record_file), "--json", str(tmp_path / "hard.safetensors")], capsys, "record file")
    assert _snapshot(ckpt) == before
    assert main(["record", "inspect", str(record_file), "--json", str(tmp_path / "ok.json")]) in (0, 3)  # control
    assert json.loads((tmp_path / "ok.json").read_text())["summary"]["samples"] == 2


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_mismatch_report_never_replaces_the_record(tmp_path, record_file, capsys, monkeypatch, link):
    import moealign.mismatch as mismatch

    monkeypatch.setattr(mismatch, "run_mismatch", lambda *a, **k: pytest.fail("work started"))
    report = tmp_path / "rep"
    report.mkdir()
    (report / "report.json").symlink_to(record_file) if link == "symlink" else os.link(record_file,
                                                                                         report / "report.json")
    before = record_file.read_bytes()
    exit_2(["mismatch", "-q", "--train", "hf", "--load-record", str(record_file), "--report", str(report)], capsys,
            "--report", "--load-record")
    assert record_file.read_bytes() == before


def test_mismatch_outputs_checked_before_any_work(tmp_path, record_file, capsys, monkeypatch):
    import moealign.mismatch as mismatch

    monkeypatch.setattr(mismatch, "run_mismatch", lambda *a, **k: pytest.fail("work started"))
    base = ["mismatch", "-q", "--train", "hf", "--load-record", str(record_file)]
    exit_2([*base, "--report", "/dev/null/sub"], capsys, "--report", "not a directory")
    rep = tmp_path / "rep"
    exit_2([*base, "--report", str(rep), "--json", str(rep / "report.json")], capsys, "--json", "--report")
    exit_2([*base, "--json", str(record_file)], capsys, "--load-record")
    assert not rep.exists()


def test_mismatch_inputs_name_the_embedded_model_when_no_model_is_given(tmp_path):
    from moealign.mismatch import MismatchConfig

    cfg = MismatchConfig()
    assert os.path.samefile(cfg.inputs()["--model"], embedded_model_path())
    with pytest.raises(ConfigError, match="refusing"):     # checked without writing anything
        _files.check_outputs({"--json": str(embedded_model_path() / "config.json")}, cfg.inputs())
