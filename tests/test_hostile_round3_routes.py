"""Issue 23, "Silent wrong results" (the routes and weights that are not the model's): before the fix each of these
scored or inspected cleanly.

* ``mismatch`` warns (stderr ``moealign mismatch: WARNING ...`` and the report's ``warnings``) when the trainer's own
  top-k disagrees with the record on more (token, layer) pairs than any engine pair does
  (:data:`~moealign.routing_replay.flips.FOREIGN_FLIP_RATE`): routes shifted by one row flip 99% of pairs;
* ``record inspect --model`` runs the checkpoint's routers on the record's tokens: ``foreign_routes`` (exit 3) below
  half the (row, layer) pairs agreeing, ``other_model`` for a record that does not fit the checkpoint;
* ``mismatch`` compares the record's contract weight digests with the trainer's weights whenever the record has
  them, and warns naming the layers that differ (a record of checkpoint A scored against checkpoint B).

One record is made per module (transformers on both sides, 2 prompts x 8 tokens); each test derives its hostile
variant from it and runs the unmodified record as its negative control.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from round3_util import run_cli

from moealign.record import RolloutRecord
from moealign.routing_replay.flips import FOREIGN_FLIP_RATE, foreign_routes

SMALL = ["--num-prompts", "2", "--max-new-tokens", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A record of the embedded model (bf16 rollout, with its contract), saved once."""
    from moealign.cli import main

    path = tmp_path_factory.mktemp("routes") / "record.safetensors"
    assert main(["mismatch", "-q", "--rollout", "hf", "--train", "hf", *SMALL, "--save-record", str(path)]) == 0
    return path


def shifted(saved, tmp_path, shift: int = 1):
    """``saved`` with every sample's route rows rolled by ``shift`` (each row gets a neighbour's routes)."""
    record = RolloutRecord.load(saved)
    for s in record.samples:
        s.routes = torch.roll(s.routes, shift, dims=0)
        if s.route_missing is not None:
            s.route_missing = torch.roll(s.route_missing, shift, dims=0)
    path = tmp_path / f"shifted{shift}.safetensors"
    record.save(path)
    return path


def score(record, tmp_path, capsys, *extra):
    """``mismatch --load-record record --train hf``: (report JSON, stderr)."""
    out = tmp_path / "report.json"
    from moealign.cli import main

    assert main(["mismatch", "-q", "--device", "cpu", "--load-record", str(record), "--train", "hf", "--json", str(out),
                 *extra]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return json.loads(out.read_text()), err


def baseline_flip(report) -> float:
    return next(r["metrics"]["router_flip_rate"] for r in report["runs"] if r["name"] == "baseline")


# --- the threshold -----------------------------------------------------------------------------------------------

def test_foreign_routes_threshold():
    assert foreign_routes(FOREIGN_FLIP_RATE) is None
    assert foreign_routes(0.05) is None
    assert foreign_routes(math.nan) is None
    message = foreign_routes(FOREIGN_FLIP_RATE + 0.01, pairs=400)
    assert "of 400 (token, layer) pairs" in message and f"threshold {FOREIGN_FLIP_RATE:.0%}" in message
    assert "shifted" in message and "another model" in message


# --- mismatch warns on routes that are not the model's ---------------------------------------------------------

def test_mismatch_warns_on_routes_shifted_by_one_row(saved, tmp_path, capsys):
    report, err = score(shifted(saved, tmp_path), tmp_path, capsys)
    assert baseline_flip(report) > FOREIGN_FLIP_RATE
    lines = [line for line in err.splitlines() if line.startswith("moealign mismatch: WARNING")]
    assert len(lines) == 1 and "baseline run" in lines[0] and "shifted" in lines[0], err
    assert len(report["warnings"]) == 1 and "not this model's decisions" in report["warnings"][0]


def test_mismatch_does_not_warn_on_the_models_own_routes(saved, tmp_path, capsys):   # negative control
    report, err = score(saved, tmp_path, capsys)
    assert baseline_flip(report) < 0.1          # bf16 rollout vs fp32 trainer: a few percent
    assert report["warnings"] == []
    assert "WARNING" not in err


# --- record inspect --model runs the routers on the record's tokens ----------------------------------------------

def inspect(record, capsys, code, *needles, model=None):
    from moealign.embedded import embedded_model_path

    text = run_cli(["record", "inspect", str(record), "--model", str(model or embedded_model_path())], capsys, code,
                   *needles)
    return text


def test_inspect_finds_routes_shifted_by_one_row(saved, tmp_path, capsys):
    text = inspect(shifted(saved, tmp_path), capsys, 3, "FOUND foreign_routes", "not this model's decisions",
                   "moealign record inspect: FAIL foreign_routes")
    assert "router check: the checkpoint's routers (transformers, float32) on 78 recorded rows" in text


def test_inspect_passes_the_models_own_routes(saved, tmp_path, capsys):                # negative control
    out = tmp_path / "inspect.json"
    from moealign.cli import main
    from moealign.embedded import embedded_model_path

    assert main(["record", "inspect", str(saved), "--model", str(embedded_model_path()), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["findings"] == []
    assert 0.9 < result["summary"]["router_agreement"] <= 1.0      # bf16 rollout vs fp32 routers: a few pairs differ
    assert result["summary"]["router_pairs"] == 78 * 4
    assert "other_model, foreign_routes" in capsys.readouterr().out


def test_inspect_names_a_record_of_another_architecture(tmp_path, capsys):
    from test_record_inspect import _record

    path = tmp_path / "r.safetensors"
    _record().save(path)                     # top-2 over a 100-token vocabulary; the embedded model is top-4, 2048
    inspect(path, capsys, 3, "FOUND other_model", "top_k: record has 2")


def test_inspect_with_a_config_only_checkpoint_skips_the_router_check(tmp_path, capsys):   # and says so
    from test_record_inspect import _record

    from moealign.embedded import embedded_model_path

    model = tmp_path / "config-only"
    model.mkdir()
    (model / "config.json").write_bytes((embedded_model_path() / "config.json").read_bytes())
    path = tmp_path / "r.safetensors"
    _record().save(path)
    inspect(path, capsys, 0, "router check: not run", "holds no weights", model=model)


# --- a record of checkpoint A scored against checkpoint B ------------------------------------------------------

def test_mismatch_warns_when_the_records_weights_are_another_checkpoints(saved, tmp_path, capsys):
    from round3_util import copy_checkpoint
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    ckpt = copy_checkpoint(tmp_path)
    weights = ckpt / "model.safetensors"
    metadata = safe_open(str(weights), "pt").metadata()
    tensors = load_file(weights)
    tensors["model.layers.3.mlp.experts.0.down_proj.weight"] *= 1.5     # after layer 3's router: routes unchanged
    save_file(tensors, weights, metadata=metadata)
    report, err = score(saved, tmp_path, capsys, "--model", str(ckpt))
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "differ in layer 3 (digests at bfloat16 rounding)" in report["warnings"][0]
    assert "moealign mismatch: WARNING weights: the record's contract" in err
    # negative control: an unchanged copy of the checkpoint (score() of the saved record: no warning at all)
    report, err = score(saved, tmp_path, capsys, "--model", str(copy_checkpoint(tmp_path / "same")))
    assert report["warnings"] == [] and "WARNING" not in err


class _Trainer:
    name = "transformers"

    def __init__(self, weights):
        self.weights, self.asked = weights, []

    def weight_digests(self, roundings):
        self.asked.append(list(roundings))
        return self.weights


def test_weights_warning_compares_at_the_records_rounding_only():
    from moealign.contract import weight_digests
    from moealign.mismatch.run import weights_warnings

    tensors = {"model.layers.0.w": torch.ones(4), "model.layers.1.w": torch.ones(4)}
    record = {"engine": "transformers", "weights": weight_digests(
        [(k, v.bfloat16()) for k, v in tensors.items()], 2)}                         # a bf16 holder: bf16 digests
    same = weight_digests(tensors.items(), 2, roundings=["bfloat16"])
    assert list(same["digests"]) == ["bfloat16"]
    assert same["digests"]["bfloat16"] == weight_digests(tensors.items(), 2)["digests"]["bfloat16"]
    trainer = _Trainer(same)
    assert weights_warnings(record, trainer) == [] and trainer.asked == [["bfloat16"]]       # negative control
    tensors["model.layers.1.w"] = torch.full((4,), 2.0)
    changed = weight_digests(tensors.items(), 2, roundings=["bfloat16"])
    [line] = weights_warnings(record, _Trainer(changed))
    assert "differ in layer 1 (digests" in line and "layer 0" not in line
    # --diagnose's train contract is used as it is; no record digests, or no common rounding: nothing to compare
    assert weights_warnings(record, _Trainer(same), {"engine": "x", "weights": changed}) == [line]
    assert weights_warnings({"engine": "x"}, _Trainer(changed)) == []
    assert weights_warnings(record, _Trainer({"digests": {}})) == []
    with pytest.raises(Exception, match="unknown rounding"):
        weight_digests(tensors.items(), 2, roundings=["float8"])


def test_the_html_report_shows_the_warnings_first():
    from moealign.mismatch.html_report import render_html

    page = render_html({"model": "m", "warnings": ["routes <b>shifted</b>\u202e"], "runs": []})
    assert '<section id="warnings">' in page and "routes &lt;b&gt;shifted&lt;/b&gt;" in page
    assert page.index('id="warnings"') < page.index('id="diagnosis"')
    assert 'id="warnings"' not in render_html({"model": "m", "warnings": [], "runs": []})      # negative control
