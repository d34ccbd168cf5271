"""`moealign mismatch` against hostile but realistic command lines (issue 11, "CLI" and "Files and paths"):
every bad input is one line on stderr and exit code 2, found before any work starts, and no input or output
file is lost. Each test here failed on the code before the fix (silently accepted, a traceback, or data lost).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("transformers")

from moealign.cli import main  # noqa: E402
from moealign.embedded import default_prompts, embedded_model_path  # noqa: E402
from moealign.errors import ConfigError  # noqa: E402
from moealign.mismatch import MismatchConfig, parse_fail_above  # noqa: E402
from moealign.mismatch.report import HIGHER_IS_BETTER, LOWER_IS_BETTER, TWO_SIDED, judged_run  # noqa: E402
from moealign.record import RolloutRecord  # noqa: E402

TINY = ["--rollout", "hf", "--train", "hf", "--num-prompts", "2", "--max-new-tokens", "6", "--batch-size", "2", "-q",
        "--device", "cpu"]


def _one_line_exit_2(argv, capsys) -> str:
    assert main(["mismatch", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("moealign mismatch: error:"), err
    return err


@pytest.fixture(scope="module")
def record_path(tmp_path_factory):
    """A small record sampled at temperature 0.7, top-p 0.8 (not the command line's defaults)."""
    path = tmp_path_factory.mktemp("hostile") / "record.safetensors"
    assert main(["mismatch", *TINY, "--temperature", "0.7", "--top-p", "0.8", "--save-record", str(path)]) == 0
    return path


# --- --load-record: the record's own parameters, never the command line's ---------------------------------

@pytest.mark.parametrize("extra", [
    ["--temperature", "0.5"], ["--top-p", "0.5"], ["--top-k", "3"], ["--min-p", "0.1"], ["--seed", "1"],
    ["--num-prompts", "2"], ["--max-new-tokens", "3"], ["--rollout", "hf"], ["--rollout-precision", "fp32"],
    ["--rollout-dtype", "fp32"], ["--temperature", "1.0"],       # a default value given explicitly is given too
])
def test_rollout_flags_with_load_record_are_refused(record_path, extra, capsys):
    err = _one_line_exit_2(["--load-record", str(record_path), *extra], capsys)
    assert extra[0] in err and "--load-record" in err


def test_prompts_with_load_record_is_refused(record_path, tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text('["a b c"]')
    assert "--prompts" in _one_line_exit_2(["--load-record", str(record_path), "--prompts", str(prompts)], capsys)


def test_api_refuses_rollout_options_with_load_record(record_path):
    with pytest.raises(ConfigError, match="--temperature"):
        MismatchConfig(load_record=str(record_path), temperature=0.5)
    MismatchConfig(load_record=str(record_path), batch_size=2)       # training options are fine


def test_load_record_reports_the_records_sampling(record_path, tmp_path):
    out = tmp_path / "r.json"
    assert main(["mismatch", "-q", "--device", "cpu", "--train", "hf", "--load-record", str(record_path),
                 "--batch-size", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.8, "min_p": 0.0}
    record = RolloutRecord.load(record_path)
    assert report["rollout"]["engine"] == record.meta.engine
    assert report["rollout"]["engine_version"] == record.meta.engine_version
    assert report["rollout"]["record"] == str(record_path)


def test_record_without_kept_sets_gives_a_table_and_json(record_path, tmp_path, capsys):
    record = RolloutRecord.load(record_path)
    for s in record.samples:
        s.kept_offsets = s.kept_ids = None
    bare = tmp_path / "bare.safetensors"
    record.save(bare)
    out = tmp_path / "bare.json"
    rc = main(["mismatch", "-q", "--device", "cpu", "--train", "hf", "--load-record",
               str(bare), "--batch-size", "2", "--json", str(out),
               "--fail-above", "router_flip_rate=0"])
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "sampling_mask: not run (the record has no kept sets)" in printed
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["runs"]] == ["baseline", "routing_replay"]
    assert set(report["skipped_runs"]) == {"sampling_mask", "routing_replay+sampling_mask"}
    assert judged_run(report)["name"] == "routing_replay"


# --- --fail-above / --fail-below: a gate never points the wrong way ----------------------------------------

def test_fail_above_refuses_higher_is_better_metrics(capsys):
    err = _one_line_exit_2(["--fail-above", "pearson_prob=0.999"], capsys)
    assert "--fail-below pearson_prob" in err
    assert "--fail-above kl_k3" in _one_line_exit_2(["--fail-below", "kl_k3=1"], capsys)


def test_every_metric_has_one_direction():
    from moealign.mismatch import METRIC_NAMES

    groups = (LOWER_IS_BETTER, HIGHER_IS_BETTER, TWO_SIDED)
    assert sorted(sum(groups, ())) == sorted(METRIC_NAMES)
    assert parse_fail_above(["pearson_prob=0.9"], below=True) == {"pearson_prob": 0.9}
    assert parse_fail_above(["kl_k1=0.1"]) == parse_fail_above(["kl_k1=0.1"], below=True)


def test_fail_below_gates_the_judged_run(record_path, capsys):
    base = ["mismatch", "-q", "--device", "cpu", "--train", "hf", "--load-record", str(record_path),
            "--batch-size", "2"]
    assert main(base + ["--fail-below", "pearson_prob=0.5"]) == 0
    assert main(base + ["--fail-below", "pearson_prob=1.5"]) == 3
    assert "pearson_prob" in capsys.readouterr().err


# --- precision flags ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["--train-precision", "fp32", "--train-dtype", "bf16"],      # the precision equals its default: still given
    ["--rollout-precision", "bf16", "--rollout-dtype", "fp32"],
])
def test_contradicting_precision_flags(argv, capsys):
    assert "contradicts" in _one_line_exit_2(argv, capsys)


def test_dtype_alias_alone_still_sets_the_precision():
    cfg = MismatchConfig(train_dtype="bf16")
    assert cfg.train_precision == "bf16" and cfg.rollout_precision == "bf16"
    assert MismatchConfig().train_precision == "fp32"


# --- numbers name their flag ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--temperature", "1e-45"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"), (["--top-p", "0"], "--top-p"), (["--min-p", "2"], "--min-p"),
    (["--top-k", "-1"], "--top-k"), (["--seed", str(2 ** 70)], "--seed"), (["--seed", "2**70"], "--seed"),
    (["--max-new-tokens", "0"], "--max-new-tokens"), (["--batch-size", "0"], "--batch-size"),
    (["--max-new-tokens", "100000"], "max_position_embeddings"),
])
def test_bad_numbers_name_their_flag(argv, flag, capsys):
    assert flag in _one_line_exit_2(argv, capsys)


# --- --model: local checkpoints only, checked before loading -------------------------------------------

@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(embedded_model_path(), path)
    return path


def test_truncated_safetensors_is_named(checkpoint, capsys):
    weights = checkpoint / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert "truncated" in _one_line_exit_2(["--model", str(checkpoint)], capsys)


def test_safetensors_without_a_header_is_named(checkpoint, capsys):
    (checkpoint / "model.safetensors").write_bytes(b"\x00\x01")
    assert "not a safetensors file" in _one_line_exit_2(["--model", str(checkpoint)], capsys)


@pytest.mark.parametrize("text, message", [('{"x":', "is not JSON"), ("[1, 2]", "model_type"),
                                           ('{"hidden_size": 8}', "model_type")])
def test_bad_config_json_is_named(checkpoint, text, message, capsys):
    (checkpoint / "config.json").write_text(text)
    assert message in _one_line_exit_2(["--model", str(checkpoint)], capsys)


def test_unknown_architecture_is_an_engine_error(checkpoint, capsys):
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "no_such_model_type"
    (checkpoint / "config.json").write_text(json.dumps(config))
    err = _one_line_exit_2(["--model", str(checkpoint), *TINY], capsys)
    assert "EngineError" in err and "could not load the checkpoint" in err


@pytest.mark.parametrize("name", ["Qwen/Qwen3-30B-A3B", "hf://org/model"])
def test_hub_names_never_reach_the_network(name, capsys):
    assert "local checkpoints only" in _one_line_exit_2(["--model", name], capsys)


# --- files: no output overwrites an input; bounded reads ----------------------------------------------------

def test_json_onto_the_prompts_file_is_refused(tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text('["def f(x):", "import os"]')
    before = prompts.read_bytes()
    err = _one_line_exit_2([*TINY, "--prompts", str(prompts), "--json", str(prompts)], capsys)
    assert "--prompts" in err and prompts.read_bytes() == before


def test_save_record_onto_the_prompts_file_is_refused(tmp_path, capsys):
    prompts = tmp_path / "p.json"
    prompts.write_text('["def f(x):", "import os"]')
    link = tmp_path / "link.json"
    link.symlink_to(prompts)                                     # the same file under another name
    _one_line_exit_2([*TINY, "--prompts", str(prompts), "--save-record", str(link)], capsys)
    assert json.loads(prompts.read_text()) == ["def f(x):", "import os"]


def test_outputs_into_the_checkpoint_are_refused(checkpoint, capsys):
    weights = checkpoint / "model.safetensors"
    before = weights.stat().st_size
    for flag in ("--json", "--save-record"):
        assert "checkpoint" in _one_line_exit_2([*TINY, "--model", str(checkpoint), flag, str(weights)], capsys)
    assert weights.stat().st_size == before


def test_json_onto_the_saved_record_is_refused(tmp_path, capsys):
    path = tmp_path / "r.safetensors"
    _one_line_exit_2([*TINY, "--save-record", str(path), "--json", str(path)], capsys)
    assert not path.exists()


def test_prompts_from_a_fifo_or_device_are_refused(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in _one_line_exit_2(["--prompts", str(fifo)], capsys)   # would block on open
    assert "not a regular file" in _one_line_exit_2(["--prompts", "/dev/zero"], capsys)  # would read forever


def test_huge_prompt_file_is_refused_before_reading(tmp_path, capsys):
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate((64 << 20) + 1)                                  # sparse: no disk, no reading
    assert "more than" in _one_line_exit_2(["--prompts", str(big)], capsys)


def test_default_prompts_reads_a_bounded_amount():
    with pytest.raises(ConfigError, match="not a regular file"):
        default_prompts("/dev/zero")                               # the API, without the CLI's stat check


def test_json_write_is_atomic_and_leaves_no_temporary(record_path, tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text('{"old": true}')

    def broken_dump(obj, fh, **kw):
        fh.write('{"half": ')
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", broken_dump)
    assert main(["mismatch", "-q", "--device", "cpu", "--train", "hf", "--load-record", str(record_path),
                 "--batch-size", "2", "--json", str(out)]) == 130
    assert out.read_text() == '{"old": true}'
    assert os.listdir(tmp_path) == ["r.json"]


# --- tp-check ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--seed", "-1"], "--seed"), (["--seed", str(2 ** 70)], "--seed"),           # was: a worker's traceback
    (["--repeats", "0"], "--repeats"), (["--repeats", "100000000"], "--repeats"),   # was: ran for hours
])
def test_tp_check_numbers_name_their_flag(argv, flag, capsys):
    assert main(["tp-check", "--world-sizes", "1", "-q", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "Traceback" not in err
