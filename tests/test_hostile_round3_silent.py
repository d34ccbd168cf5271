"""Issue 23, "Silent wrong results" (the cheap ones): each of these gave a result without a word before the fix.

* broken-capture patterns are proportions with a stated threshold (``DOMINANT_SHARE``), not "every row identical";
* ``record inspect`` names a record without a route table (``no_routes``, exit 3);
* ``record convert`` refuses unknown ``sampling_params`` keys and names penalties a record cannot state;
* the temperature bound lives in ``SamplingParams``: every record, however made, obeys it;
* ``stitch_turns`` refuses a later turn whose prompt is shorter than an earlier turn (overlapping claims);
* ``mismatch --contract`` refuses ``--report`` / ``--diagnose`` / ``--inject-fault`` instead of ignoring them;
* the HTML report isolates every piece of text (``<bdi>``): a U+202E in a prompt cannot reorder the next cell.

(slime ``loss_mask`` / verl ``response_mask`` length mismatches: ``test_hostile_round3_tracebacks.py``.)
"""

from __future__ import annotations

import base64
import html.parser
import json

import numpy as np
import pytest
import torch
from round3_util import run_cli
from test_record import META, make_record

from moealign.cli import main
from moealign.embedded import embedded_model_path
from moealign.errors import RecordError, ReplayError
from moealign.record import MIN_TEMPERATURE, RolloutRecord, SamplingParams
from moealign.record.stitch import Turn, stitch_turns
from moealign.routing_replay.degenerate import DOMINANT_SHARE, find_degenerate
from moealign.routing_replay.protocol import ReplayBatch, model_routes

MODEL = str(embedded_model_path())


# --- degenerate patterns as proportions ------------------------------------------------------------------------

def _clean(rows=400, layers=2, experts=8, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(rows, layers, experts, generator=gen).argsort(-1)[..., :k]


def _with_share(share, pattern, rows=400):
    routes = _clean(rows)
    n = int(round(share * rows))
    idx = torch.randperm(rows, generator=torch.Generator().manual_seed(1))[:n]
    if pattern == "repeated_set":
        routes[idx] = torch.tensor([6, 1])
    elif pattern == "constant_layer":
        routes[idx, 1] = torch.tensor([2, 5])
    else:   # identical_layers
        routes[idx, 1] = routes[idx, 0]
    return routes


@pytest.mark.parametrize("pattern", ["repeated_set", "constant_layer", "identical_layers"])
def test_most_rows_alike_is_a_finding_with_its_threshold(pattern):
    for share in (0.93, 0.97):
        findings = find_degenerate(_with_share(share, pattern), (1, 3))
        assert [f["check"] for f in findings] == [pattern], findings
        assert f"threshold {DOMINANT_SHARE:.0%}" in findings[0]["detail"]
        with pytest.raises(ReplayError, match=pattern):      # and every adapter's set_routes refuses it
            routes = _with_share(share, pattern)
            model_routes(ReplayBatch.packed(routes, input_ids=torch.arange(400), cu_seqlens=[0, 400],
                                            moe_layers=(1, 3)), (1, 3), 2)
    # negative controls: 80% alike and a clean table pass
    assert find_degenerate(_with_share(0.8, pattern), (1, 3)) == []
    assert find_degenerate(_clean(), (1, 3)) == []


def test_degenerate_keys_are_exact_for_large_expert_ids():
    routes = _clean(rows=100, experts=300, k=4)
    routes[:95, 0] = torch.tensor([299, 298, 297, 1])
    assert [f["check"] for f in find_degenerate(routes, (0, 1))] == ["constant_layer"]
    routes[:95, 0] = torch.arange(95)[:, None].expand(95, 4) * torch.tensor([1, 2, 3, 0]) % 300   # all distinct
    assert find_degenerate(routes, (0, 1)) == []


# --- record inspect: no route table -------------------------------------------------------------------------

def test_inspect_names_a_record_without_routes(tmp_path, capsys):
    make_record(routes=False).save(tmp_path / "none.safetensors")
    run_cli(["record", "inspect", str(tmp_path / "none.safetensors")], capsys, 3, "no_routes", "no route table")
    make_record(routes=True).save(tmp_path / "some.safetensors")                      # negative control
    text = run_cli(["record", "inspect", str(tmp_path / "some.safetensors")], capsys, 0)
    assert "no_routes" not in text


# --- record convert: sampling_params ----------------------------------------------------------------------

def _sglang_file(tmp_path, params):
    routes = (np.arange(4)[None, None, :] + np.arange(4)[None, :, None] * 4 + np.zeros((4, 1, 1))).astype(np.int32)
    entry = {"input_ids": [1, 2, 3], "meta_info": {"routed_experts": base64.b64encode(routes.tobytes()).decode(),
                                                   "routed_experts_dtype": "int32",
                                                   "output_token_logprobs": [[-0.5, 4], [-0.5, 5]]},
             "sampling_params": params}
    path = tmp_path / "in.json"
    path.write_text(json.dumps([entry]))
    return ["record", "convert", "--from", "sglang", str(path), "--model", MODEL, "-o", str(tmp_path / "r.safetensors")]


@pytest.mark.parametrize("params, needles", [
    ({"temprature": 0.7}, ["unknown key 'temprature'"]),
    ({"temperature": 0.7, "repetition_penalty": 1.1}, ["repetition_penalty=1.1", "penalised"]),
    ({"presence_penalty": 0.5}, ["presence_penalty=0.5"]),
    ({"logit_bias": {"5": 3}}, ["logit_bias"]),
    ({"temperature": 1e-7}, ["temperature", str(MIN_TEMPERATURE)]),
])
def test_sampling_params_the_record_cannot_state_are_refused(tmp_path, capsys, params, needles):
    run_cli(_sglang_file(tmp_path, params), capsys, 2, *needles)
    assert not (tmp_path / "r.safetensors").exists()


def test_neutral_penalties_and_inert_keys_convert(tmp_path):                # negative control
    params = {"temperature": 0.7, "repetition_penalty": 1.0, "presence_penalty": 0.0, "max_new_tokens": 8,
              "stop": ["\n"], "seed": 3}
    assert main(_sglang_file(tmp_path, params)) == 0
    assert RolloutRecord.load(tmp_path / "r.safetensors").samples[0].sampling == SamplingParams(temperature=0.7)


# --- temperature bounds: everywhere a record is made --------------------------------------------------------

def test_temperature_bound_is_the_records_own(tmp_path, capsys):
    with pytest.raises(RecordError, match="at least 1e-05"):
        SamplingParams(temperature=1e-7)
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE       # negative control
    run_cli(_sglang_file(tmp_path, None) + ["--temperature", "1e-7"], capsys, 2, "temperature")
    run_cli(["mismatch", "-q", "--rollout", "hf", "--train", "hf", "--temperature", "1e-7"], capsys, 2,
          "--temperature")
    # a record file stating 1e-7 (checksum recomputed) does not load
    from test_record import write_raw

    record = make_record(shapes=[(5, 2)])
    tensors = record._tensors()
    tensors["sampling"][0, 0] = 1e-7
    write_raw(tmp_path / "t.safetensors", tensors)
    with pytest.raises(RecordError, match="temperature"):
        RolloutRecord.load(tmp_path / "t.safetensors")


# --- stitch_turns: overlapping claims ----------------------------------------------------------------------

def _turn(tokens, prompt_len):
    rows = tokens.numel() - 1
    routes = torch.arange(META.top_k).expand(rows, len(META.moe_layers), META.top_k).clone().to(META.route_dtype)
    return Turn(token_ids=tokens, prompt_len=prompt_len, logprobs=-torch.ones(tokens.numel() - prompt_len),
                routes=routes, weight_version=0)


def test_stitch_refuses_a_later_turn_claiming_earlier_tokens():
    tokens = torch.arange(12) % META.vocab_size
    with pytest.raises(RecordError, match="prompt_len 4, shorter than turn 0's 6 tokens"):
        stitch_turns(META, [_turn(tokens[:6], 3), _turn(tokens, 4)])
    assert stitch_turns(META, [_turn(tokens[:6], 3), _turn(tokens, 6)]).sample.prompt_len == 6   # control


# --- mismatch --contract combinations ------------------------------------------------------------------------

@pytest.mark.parametrize("extra, flag", [(["--diagnose"], "--diagnose"), (["--report", "REPORT"], "--report"),
                                         (["--inject-fault", "replay-off"], "--inject-fault")])
def test_contract_refuses_what_it_would_ignore(tmp_path, capsys, monkeypatch, extra, flag):
    import moealign.mismatch.contract_check as contract_check

    monkeypatch.setattr(contract_check, "run_contract_check", lambda *a, **k: pytest.fail("work started"))
    extra = [str(tmp_path / "rep") if x == "REPORT" else x for x in extra]
    run_cli(["mismatch", "--contract", "-q", "--rollout", "hf", "--train", "hf", *extra], capsys, 2, flag,
          "--contract")


# --- the HTML report: bidi isolation ------------------------------------------------------------------------

BIDI = set("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f")


class _Isolation(html.parser.HTMLParser):
    """Collects the text nodes holding a bidi control that are not inside a <bdi> (nor <title>)."""

    def __init__(self):
        super().__init__()
        self.stack, self.exposed = [], []

    def handle_starttag(self, tag, attrs):
        if tag not in ("meta", "br", "img", "input", "link", "hr"):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack.pop() != tag:
                pass

    def handle_data(self, data):
        if BIDI & set(data) and not {"bdi", "title", "style"} & set(self.stack):
            self.exposed.append(data)


def _exposed(page: str) -> list[str]:
    parser = _Isolation()
    parser.feed(page)
    return parser.exposed


def test_every_text_of_the_report_is_isolated():
    from moealign.mismatch.html_report import render_html

    rtl = "\u202e"
    report = {"model": f"model{rtl}", "rollout": {"engine": f"hf{rtl}"},
              "plots": {"worst_tokens": [{"sample": 0, "position": 3, "context": f"prompt{rtl}", "token": " opcode",
                                          "abs_logp_diff": 1.0, "rollout_logp": -1.0, "train_logp": -2.0,
                                          "flipped_layers": []}]},
              "diagnosis": {"headline": f"head{rtl}", "causes": [{"cause": f"c{rtl}", "lever": f"l{rtl}"}]}}
    page = render_html(report)
    assert rtl in page and _exposed(page) == []
    assert "<bdi> opcode</bdi>" in page
    assert _exposed(f"<p>text{rtl}</p><td> opcode</td>") == [f"text{rtl}"]    # negative control of the checker
