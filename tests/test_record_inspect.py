"""``moealign record inspect``: a record's summary, and every broken-capture pattern caught (exit 3) on records
corrupted exactly that way; a clean record of random routes has no finding (exit 0); a record whose rows do not
match its tokens does not load (exit 2)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moealign.cli import main
from moealign.embedded import embedded_model_path
from moealign.record import RecordMeta, RolloutRecord, Sample, SamplingParams
from moealign.record.inspect import MIN_ROWS, inspect_record
from moealign.routing_replay.routes import compact_routes

META = RecordMeta(engine="vllm", engine_version="0.0-test", model_fingerprint="0123456789abcdef", num_layers=4,
                  moe_layers=(0, 1, 2, 3), num_experts=16, top_k=2, vocab_size=100, dtype="bfloat16",
                  model_name="tiny-moe")


def _record(edit=None, meta=META, samples=3, length=12) -> RolloutRecord:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(samples):
        tokens = torch.randint(0, meta.vocab_size, (length,), generator=gen)
        ids = torch.rand(length - 1, len(meta.moe_layers), meta.num_experts, generator=gen).argsort(-1)[..., :meta.top_k]
        if edit is not None:
            ids = edit(ids)
        out.append(Sample(token_ids=tokens, prompt_len=4, logprobs=-torch.rand(length - 4, generator=gen),
                          routes=compact_routes(ids, meta.num_experts), sampling=SamplingParams()))
    return RolloutRecord(meta, out)


def _set(ids, layers, experts):
    ids = ids.clone()
    ids[:, layers] = torch.tensor(experts)
    return ids


CORRUPTIONS = {
    "constant_layer": lambda ids: _set(ids, [2], [3, 5]),
    "identical_layers": lambda ids: ids[:, :1].expand_as(ids).clone(),
    "repeated_set": lambda ids: _set(ids, [0, 1, 2, 3], [7, 2]),
}


def test_clean_record_has_no_finding(tmp_path, capsys):
    path = tmp_path / "r.safetensors"
    _record().save(path)
    out = tmp_path / "inspect.json"
    model = tmp_path / "model"         # config only: random routes are no model's own (test_hostile_round3_routes.py)
    model.mkdir()
    (model / "config.json").write_bytes((embedded_model_path() / "config.json").read_bytes())
    assert main(["record", "inspect", str(path), "--model", str(model), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no broken-capture pattern found" in text and "33 route rows" in text
    result = json.loads(out.read_text())
    assert result["findings"] == [] and result["summary"]["route_rows"] == 33
    assert result["summary"]["moe_layers"] == [0, 1, 2, 3] and result["summary"]["route_dtype"] == "uint8"


@pytest.mark.parametrize("check", list(CORRUPTIONS))
def test_each_broken_capture_pattern_is_found(check, tmp_path, capsys):
    path = tmp_path / "r.safetensors"
    _record(CORRUPTIONS[check]).save(path)
    assert main(["record", "inspect", str(path)]) == 3
    captured = capsys.readouterr()
    assert f"FOUND {check}" in captured.out and f"FAIL {check}" in captured.err
    found = [f["check"] for f in inspect_record(RolloutRecord.load(path))["findings"]]
    assert found == [check]


def test_all_zero_rows_top1_found_and_top2_refused_at_load(tmp_path, capsys):
    top1 = dataclasses.replace(META, top_k=1)
    zero_some = lambda ids: torch.where(torch.arange(ids.shape[0])[:, None, None] % 3 == 0, 0, ids)  # noqa: E731
    path = tmp_path / "r1.safetensors"
    _record(zero_some, meta=top1).save(path)
    assert main(["record", "inspect", str(path)]) == 3
    assert "FOUND zero_rows" in capsys.readouterr().out
    # with top-k 2 an all-zero row repeats expert 0: the record itself refuses it
    with pytest.raises(Exception, match="(?i)distinct|repeat|twice|duplicate"):
        _record(lambda ids: torch.zeros_like(ids))


def test_dense_layers_in_the_record_are_found_with_the_model(tmp_path, capsys):
    config = json.loads((embedded_model_path() / "config.json").read_text())
    config["mlp_only_layers"] = [1]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    path = tmp_path / "r.safetensors"
    _record().save(path)
    assert main(["record", "inspect", str(path), "--model", str(model)]) == 3
    assert "FOUND dense_layers" in capsys.readouterr().out


def test_short_records_are_not_judged_and_bad_files_exit_2(tmp_path, capsys):
    path = tmp_path / "r.safetensors"
    record = _record(lambda ids: _set(ids, [2], [3, 5]), samples=1, length=MIN_ROWS)   # 15 rows < MIN_ROWS
    record.save(path)
    assert inspect_record(RolloutRecord.load(path))["findings"] == []
    assert main(["record", "inspect", str(tmp_path / "missing.safetensors")]) == 2
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a record")
    assert main(["record", "inspect", str(bad)]) == 2
    assert main(["record", "inspect", str(path), "--json", str(path)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
