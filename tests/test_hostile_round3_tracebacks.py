"""Issue 23, "Tracebacks and late errors": wrongly typed fields, deep JSON, huge integers and out-of-range seeds end in
one :class:`~moealign.errors.MoealignError` (the CLI: one line, exit 2), found before any work. ``record convert``
closes the class at its input boundary (:func:`moealign.record.convert.convert_to_record` turns any built-in error a
reader meets into an :class:`~moealign.errors.InputError` naming the file), besides the named checks."""

from __future__ import annotations

import base64
import copy
import json

import numpy as np
import pytest
import torch
from round3_util import exit_2
from test_record import META, make_record, write_raw

from moealign.cli import main
from moealign.embedded import embedded_model_path
from moealign.errors import InputError, RecordError, RecordFormatError
from moealign.record import RolloutRecord
from moealign.record.convert import convert_to_record, model_info
from moealign.record.stitch import Turn, stitch_turns

MODEL = str(embedded_model_path())          # 4 MoE layers, 16 experts, top-4, vocabulary 2048 (read only)


def _routes(rows):
    return (np.arange(4)[None, None, :] + np.arange(4)[None, :, None] * 4 + np.zeros((rows, 1, 1))).astype(np.int32)


def _sglang():
    return {"input_ids": [1, 2, 3], "output_ids": [4, 5],
            "meta_info": {"routed_experts": base64.b64encode(_routes(4).tobytes()).decode(),
                          "routed_experts_dtype": "int32", "output_token_logprobs": [[-0.5, 4, None], [-0.5, 5, None]]}}


def _vllm():
    return {"object": "text_completion", "prompt_routed_experts": _routes(3).tolist(),
            "choices": [{"index": 0, "token_ids": [4, 5], "prompt_token_ids": [1, 2, 3],
                         "routed_experts": _routes(1).tolist(), "logprobs": {"token_logprobs": [-0.5, -0.5]}}]}


def _trtllm():
    return {"prompt_token_ids": [1, 2, 3],
            "outputs": [{"token_ids": [4, 5], "routed_experts": _routes(4).tolist(), "logprobs": [-0.5, -0.5]}]}


def _set(obj, path, value):
    obj = copy.deepcopy(obj)
    *head, last = path
    target = obj
    for key in head:
        target = target[key]
    target[last] = value
    return obj


JSON_CASES = [
    ("sglang", _set(_sglang(), ["output_ids"], 5), "output_ids"),
    ("sglang", _set(_sglang(), ["meta_info", "routed_experts_start_len"], "x"), "routed_experts_start_len"),
    ("sglang", _set(_sglang(), ["meta_info", "output_token_logprobs"], {"a": 1}), "output_token_logprobs"),
    ("vllm-0.21", _set(_vllm(), ["usage"], [1]), "usage"),
    ("vllm-0.21", _set(_vllm(), ["usage"], {"prompt_tokens_details": 5}), "prompt_tokens_details"),
    ("vllm-0.21", _set(_vllm(), ["usage"], {"prompt_tokens_details": {"cached_tokens": "2"}}), "cached_tokens"),
    ("vllm-0.21", _set(_vllm(), ["choices"], [5]), "vllm-0.21"),
    ("vllm-0.21", _set(_vllm(), ["choices", 0, "logprobs"], [1]), "token_logprobs"),
    ("trtllm", _set(_trtllm(), ["outputs", 0, "logprobs"], [{"4": 5}, -0.5]), "logprobs"),
    ("trtllm", _set(_trtllm(), ["outputs", 0, "routed_experts"], 7), "routed_experts"),
]


@pytest.mark.parametrize("fmt, entry, needle", JSON_CASES)
def test_wrongly_typed_json_fields_are_one_line(tmp_path, capsys, fmt, entry, needle):
    path = tmp_path / "in.json"
    path.write_text(json.dumps([entry]))
    exit_2(["record", "convert", "--from", fmt, str(path), "--model", MODEL, "-o", str(tmp_path / "r.safetensors")],
            capsys, needle)
    assert not (tmp_path / "r.safetensors").exists()


@pytest.mark.parametrize("fmt, entry", [("sglang", _sglang()), ("vllm-0.21", _vllm()), ("trtllm", _trtllm())])
def test_the_untouched_entries_convert(tmp_path, fmt, entry):      # negative control of the cases above
    path = tmp_path / "in.json"
    path.write_text(json.dumps([entry]))
    assert main(["record", "convert", "--from", fmt, str(path), "--model", MODEL, "-o",
                 str(tmp_path / "r.safetensors")]) == 0
    assert RolloutRecord.load(tmp_path / "r.safetensors").samples[0].token_ids.tolist() == [1, 2, 3, 4, 5]


def test_json_nested_100000_deep(tmp_path, capsys):
    path = tmp_path / "in.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    exit_2(["record", "convert", "--from", "sglang", str(path), "--model", MODEL, "-o", str(tmp_path / "r.st")],
            capsys, "nested too deeply")


def _verl():
    return {"prompts": torch.tensor([[1, 2, 3]]), "responses": torch.tensor([[4, 5]]),
            "attention_mask": torch.ones(1, 5, dtype=torch.int64), "rollout_log_probs": torch.full((1, 2), -0.5),
            "routed_experts": torch.from_numpy(_routes(5)).unsqueeze(0)}


def _slime():
    return {"samples": [{"tokens": [1, 2, 3, 4, 5], "response_length": 2, "rollout_log_probs": [-0.5, -0.5],
                         "rollout_routed_experts": torch.from_numpy(_routes(4))}]}


@pytest.mark.parametrize("fmt, data, needle", [
    ("verl", {**_verl(), "response_mask": torch.ones(2, dtype=torch.int64)}, "response_mask must be a 2-D tensor"),
    ("verl", {**_verl(), "response_mask": torch.ones(1, 1, dtype=torch.int64)}, "response_mask has shape (1, 1)"),
    ("slime", {"samples": [{**_slime()["samples"][0], "loss_mask": 5}]}, "loss_mask must be a list of 2"),
    ("slime", {"samples": [{**_slime()["samples"][0], "loss_mask": [1]}]}, "loss_mask must be a list of 2"),
    ("slime", {"samples": [{**_slime()["samples"][0], "response_length": torch.tensor([1, 1])}]}, "response_length"),
    ("slime", {"samples": [{**_slime()["samples"][0], "rollout_routed_experts": "x"}]}, "slime"),
])
def test_wrongly_typed_tensor_fields_are_one_line(tmp_path, capsys, fmt, data, needle):
    torch.save(data, tmp_path / "in.pt")
    exit_2(["record", "convert", "--from", fmt, str(tmp_path / "in.pt"), "--model", MODEL, "-o",
             str(tmp_path / "r.safetensors")], capsys, needle)
    # negative control: the same batch without the change converts
    torch.save(_verl() if fmt == "verl" else _slime(), tmp_path / "ok.pt")
    assert main(["record", "convert", "--from", fmt, str(tmp_path / "ok.pt"), "--model", MODEL, "-o",
                 str(tmp_path / "ok.safetensors")]) == 0


def test_the_boundary_keeps_named_errors_and_converts_builtin_ones(tmp_path, monkeypatch):
    from moealign.record import convert as record_convert

    path = tmp_path / "in.json"
    path.write_text("[{}]")
    monkeypatch.setitem(record_convert._READERS, "sglang", lambda p, a: [][1])
    with pytest.raises(InputError, match="malformed sglang field .IndexError"):
        convert_to_record("sglang", str(path), model_info(MODEL))
    monkeypatch.setitem(record_convert._READERS, "sglang", lambda p, a: (_ for _ in ()).throw(InputError("named")))
    with pytest.raises(InputError, match="^named$"):
        convert_to_record("sglang", str(path), model_info(MODEL))


# --- forged records with valid checksums ---------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("vocab_size", 10 ** 30), ("num_layers", 10 ** 11), ("num_experts", 10 ** 9)])
def test_huge_meta_integers_are_format_errors(tmp_path, capsys, field, value):
    small = make_record(shapes=[(5, 2)], seed=1)
    meta = dict(json.loads(META.to_json()), **{field: value})
    path = tmp_path / "r.safetensors"
    write_raw(path, small._tensors(), meta_json=json.dumps(meta))
    with pytest.raises(RecordFormatError, match=f"{field} must be"):
        RolloutRecord.load(path)
    exit_2(["record", "inspect", str(path)], capsys, field)


def test_contract_nested_100000_deep_is_a_format_error(tmp_path, capsys):
    from safetensors.torch import save_file

    from moealign.record import io as rec_io

    small = make_record(shapes=[(5, 2)], seed=1)
    tensors = {k: v.contiguous() for k, v in small._tensors().items()}
    metadata = {"moealign.meta": META.to_json(), "moealign.format_version": "2",
                "moealign.contract": "[" * 100_000 + "]" * 100_000}
    metadata["moealign.checksum"] = rec_io._checksum(tensors, metadata)
    save_file(tensors, str(tmp_path / "r.safetensors"), metadata=metadata)
    with pytest.raises(RecordFormatError, match="nested too deeply"):
        RolloutRecord.load(tmp_path / "r.safetensors")
    exit_2(["record", "inspect", str(tmp_path / "r.safetensors")], capsys, "nested too deeply")


# --- stitch_turns ----------------------------------------------------------------------------------------------

def _turn(tokens, prompt_len, version=0, dtype=None):
    rows = tokens.numel() - 1
    routes = torch.arange(META.top_k).expand(rows, len(META.moe_layers), META.top_k).clone()
    return Turn(token_ids=tokens, prompt_len=prompt_len, logprobs=-torch.ones(tokens.numel() - prompt_len),
                routes=routes.to(dtype or META.route_dtype), weight_version=version)


def test_stitch_refuses_other_route_dtypes_and_huge_versions():
    tokens = torch.arange(10) % META.vocab_size
    with pytest.raises(RecordError, match="route dtype"):
        stitch_turns(META, [_turn(tokens[:6], 3), _turn(tokens, 7, dtype=torch.int16)])
    with pytest.raises(RecordError, match=r"weight_version must be an integer in \[0, 2\*\*63\)"):
        stitch_turns(META, [_turn(tokens, 3, version=2 ** 70)])
    assert stitch_turns(META, [_turn(tokens[:6], 3), _turn(tokens, 7)]).sample.length == 10    # negative control


# --- mismatch: found before any work -----------------------------------------------------------------------

@pytest.mark.parametrize("spec, needle", [("weights:layer=2,seed=18446744073709551616", "seed must be in"),
                                          ("weights:layer=2,seed=-1", "seed must be in"),
                                          ("weights:layer=99", "4 decoder layers")])
def test_inject_fault_values_refused_before_any_work(capsys, monkeypatch, spec, needle):
    import moealign.mismatch as mismatch

    monkeypatch.setattr(mismatch, "run_mismatch", lambda *a, **k: pytest.fail("work started"))
    exit_2(["mismatch", "-q", "--rollout", "hf", "--train", "hf", "--inject-fault", spec], capsys, needle)
    from moealign.mismatch.faults import parse_fault

    assert parse_fault("weights:layer=2,seed=9223372036854775807").seed == 2 ** 63 - 1   # negative control
