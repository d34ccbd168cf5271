"""``moealign record convert``: each format end to end (an input file in the form the engine or framework emits it
-> a record whose tokens, log-probs, routes and missing rows are the ones put in), the round trip of each writable
format (record -> batch file -> record, tensor for tensor), and bad inputs ending in one line and exit code 2."""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest
import torch

from moealign.cli import main
from moealign.embedded import embedded_model_path
from moealign.record import RolloutRecord, SamplingParams
from moealign.record.convert import model_info

EXPERTS, TOP_K, VOCAB = 16, 4, 2048


@pytest.fixture(scope="module")
def tiny():
    """The embedded model: 4 decoder layers, all MoE, 16 experts, top-4, with its safetensors (router signature)."""
    return str(embedded_model_path())


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    """The embedded config with layers 0 and 2 dense (mlp_only_layers), no weights: MoE layers 1 and 3."""
    d = tmp_path_factory.mktemp("sparse")
    config = json.loads((embedded_model_path() / "config.json").read_text())
    config["mlp_only_layers"] = [0, 2]
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _case(prompt_len, response_len, n_moe, seed):
    g = np.random.default_rng(seed)
    L = prompt_len + response_len
    tokens = g.integers(0, VOCAB, L).tolist()
    routes = np.argsort(g.random((L - 1, n_moe, EXPERTS)), axis=-1)[..., :TOP_K].astype(np.int64)
    logprobs = (-g.random(response_len) * 3).astype(np.float32).tolist()
    return dict(prompt=tokens[:prompt_len], response=tokens[prompt_len:], routes=routes, logprobs=logprobs)


def _convert(fmt, path, model, out, *extra):
    return main(["record", "convert", "--from", fmt, str(path), "--model", model, "-o", str(out), *extra])


def _check(record, cases, moe_layers, missing=None):
    assert len(record) == len(cases) and record.meta.moe_layers == tuple(moe_layers)
    for i, (s, c) in enumerate(zip(record.samples, cases)):
        assert s.token_ids.tolist() == c["prompt"] + c["response"] and s.prompt_len == len(c["prompt"])
        assert torch.equal(s.logprobs, torch.tensor(c["logprobs"], dtype=torch.float32))
        want = torch.from_numpy(c["routes"]).to(torch.uint8)
        rows = (missing or {}).get(i, [])
        want[rows] = 0
        assert torch.equal(s.routes, want)
        got = [] if s.route_missing is None else s.route_missing.nonzero().flatten().tolist()
        assert got == list(rows)


def _all_layers(routes, moe_layers, filler=0, layers=4):
    out = np.full((routes.shape[0], layers, routes.shape[2]), filler, dtype=np.int64)
    out[:, list(moe_layers)] = routes
    return out


def _one_line_exit_2(argv, capsys, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("moealign record") and " error: " in err, err
    assert needle in err, err
    return err


# --------------------------------------------------------------------------------------------------
# each format
# --------------------------------------------------------------------------------------------------


def test_sglang(tmp_path, sparse):
    cases = [_case(5, 4, 2, 0), _case(3, 6, 2, 1)]
    entries = []
    for i, c in enumerate(cases):
        start = 2 if i else 0                                  # a second turn resent from routed_experts_start_len
        rows = _all_layers(c["routes"], (1, 3), filler=-1)[start:].astype(np.int32)     # SGLang: int32, dense -1
        meta_info = {"routed_experts": base64.b64encode(rows.tobytes()).decode(), "routed_experts_dtype": "int32",
                     "output_token_logprobs": [[lp, t, None] for lp, t in zip(c["logprobs"], c["response"])]}
        if start:
            meta_info["routed_experts_start_len"] = start
        entries.append({"input_ids": c["prompt"], "output_ids": c["response"], "meta_info": meta_info,
                        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": -1}})
    path = tmp_path / "sglang.json"
    path.write_text(json.dumps(entries))
    assert _convert("sglang", path, sparse, tmp_path / "r.safetensors") == 0
    record = RolloutRecord.load(tmp_path / "r.safetensors")
    assert record.meta.engine == "sglang" and record.meta.num_layers == 4
    assert record.samples[0].sampling == SamplingParams(temperature=0.7, top_p=0.9)
    _check(record, cases, (1, 3), missing={1: [0, 1]})


def test_vllm_0_21_completion_and_chat(tmp_path, sparse):
    cases = [_case(6, 4, 2, 2), _case(4, 5, 2, 3)]
    # vLLM 0.21 (entrypoints/openai/completion/serving.py): prompt_routed_experts [P, moe, k] on the response, per
    # choice routed_experts [R - 1, moe, k], prompt_token_ids on the choice; prefix-cache hits left zero
    c = cases[0]
    prompt_rows = c["routes"][:6].copy()
    prompt_rows[:2] = 0                                         # 2 cached prompt tokens: never computed
    completion = {"object": "text_completion", "prompt_routed_experts": prompt_rows.tolist(),
                  "usage": {"prompt_tokens_details": {"cached_tokens": 2}},
                  "choices": [{"index": 0, "token_ids": c["response"], "prompt_token_ids": c["prompt"],
                               "routed_experts": c["routes"][6:].tolist(),
                               "logprobs": {"token_logprobs": c["logprobs"]}}]}
    c = cases[1]
    chat = {"object": "chat.completion", "prompt_routed_experts": c["routes"][:4].tolist(),
            "prompt_token_ids": c["prompt"],
            "choices": [{"index": 0, "token_ids": c["response"], "routed_experts": c["routes"][4:].tolist(),
                         "logprobs": {"content": [{"token": "x", "logprob": lp} for lp in c["logprobs"]]}}]}
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps([completion, chat]))
    assert _convert("vllm-0.21", path, sparse, tmp_path / "r.safetensors", "--top-k", "20") == 0
    record = RolloutRecord.load(tmp_path / "r.safetensors")
    assert record.meta.engine == "vllm" and record.meta.engine_version == "0.21"
    assert record.samples[1].sampling == SamplingParams(top_k=20)
    _check(record, cases, (1, 3), missing={0: [0, 1]})


def test_trtllm_logical_and_physical(tmp_path, sparse):
    cases = [_case(5, 3, 2, 4)]
    c = cases[0]
    entry = {"prompt_token_ids": c["prompt"],
             "outputs": [{"token_ids": c["response"], "routed_experts": c["routes"].tolist(),
                          "logprobs": [{str(t): {"logprob": lp}} for t, lp in zip(c["response"], c["logprobs"])]}]}
    path = tmp_path / "trt.json"
    path.write_text(json.dumps([entry]))
    assert _convert("trtllm", path, sparse, tmp_path / "r.safetensors") == 0
    record = RolloutRecord.load(tmp_path / "r.safetensors")
    assert record.meta.engine == "tensorrt-llm"
    _check(record, cases, (1, 3))
    # the same routes as EPLB slots: slot s + 16 is a replica of expert s (placement of 32 slots)
    slots = list(range(EXPERTS)) * 2
    placement = {"num_slots": 32, "layer_updates_per_iter": 0, "initial_global_assignments": {1: slots, 3: slots}}
    (tmp_path / "eplb.json").write_text(json.dumps(placement))
    physical = c["routes"] + EXPERTS * (np.arange(c["routes"].size).reshape(c["routes"].shape) % 2)
    entry["outputs"][0]["routed_experts"] = physical.tolist()
    path.write_text(json.dumps([entry]))
    assert _convert("trtllm", path, sparse, tmp_path / "p.safetensors", "--expert-ids", "physical",
                    "--eplb", str(tmp_path / "eplb.json")) == 0
    _check(RolloutRecord.load(tmp_path / "p.safetensors"), cases, (1, 3))


def test_nemo_rl_round_trip(tmp_path, tiny):
    cases = [_case(5, 4, 4, 5), _case(3, 3, 4, 6)]
    T = 11
    out = {"output_ids": torch.zeros(2, T, dtype=torch.int64), "logprobs": torch.zeros(2, T),
           "generation_lengths": torch.tensor([4, 3]), "unpadded_sequence_lengths": torch.tensor([9, 6]),
           "routed_experts": torch.arange(TOP_K, dtype=torch.int8).expand(2, T, 4, TOP_K).clone()}
    for b, c in enumerate(cases):
        L = len(c["prompt"]) + len(c["response"])
        out["output_ids"][b, :L] = torch.tensor(c["prompt"] + c["response"])
        out["logprobs"][b, len(c["prompt"]):L] = torch.tensor(c["logprobs"])
        out["routed_experts"][b, :L - 1] = torch.from_numpy(c["routes"]).to(torch.int8)
    out["routed_experts"][1, 3:5] = -1                          # vLLM did not return the last two rows
    torch.save(out, tmp_path / "nemo.pt")
    assert _convert("nemo-rl", tmp_path / "nemo.pt", tiny, tmp_path / "r.safetensors") == 0
    record = RolloutRecord.load(tmp_path / "r.safetensors")
    assert record.meta.engine == "nemo-rl" and record.meta.router_signature      # from the embedded safetensors
    _check(record, cases, (0, 1, 2, 3), missing={1: [3, 4]})
    assert main(["record", "convert", "--to", "nemo-rl", str(tmp_path / "r.safetensors"),
                 "-o", str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths"):
        assert torch.equal(back[key], out[key][:, :9] if key == "output_ids" else out[key]), key
    assert torch.equal(back["routed_experts"], out["routed_experts"][:, :9])
    assert torch.equal(back["logprobs"], out["logprobs"][:, :9])


def test_verl_round_trip(tmp_path, sparse):
    cases = [_case(4, 5, 2, 7), _case(2, 3, 2, 8)]
    Sp, Sr = 4, 5
    batch = {"prompts": torch.zeros(2, Sp, dtype=torch.int64), "responses": torch.zeros(2, Sr, dtype=torch.int64),
             "attention_mask": torch.zeros(2, Sp + Sr, dtype=torch.int64), "rollout_log_probs": torch.zeros(2, Sr),
             "routed_experts": torch.zeros(2, Sp + Sr, 4, TOP_K, dtype=torch.int16)}
    for b, c in enumerate(cases):
        P, R = len(c["prompt"]), len(c["response"])
        batch["prompts"][b, Sp - P:] = torch.tensor(c["prompt"])
        batch["responses"][b, :R] = torch.tensor(c["response"])
        batch["attention_mask"][b, Sp - P:Sp + R] = 1
        batch["rollout_log_probs"][b, :R] = torch.tensor(c["logprobs"])
        rows = _all_layers(c["routes"], (1, 3))                  # vLLM >= 0.22 rows: every decoder layer, dense 0
        if b == 1:
            rows = rows[:2]                                       # the engine stopped recording after row 1
        batch["routed_experts"][b, Sp - P:Sp - P + rows.shape[0]] = torch.from_numpy(rows).to(torch.int16)
    batch["input_ids"] = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    batch["response_mask"] = batch["attention_mask"][:, Sp:].clone()
    from safetensors.torch import save_file

    save_file(batch, str(tmp_path / "verl.safetensors"))
    assert _convert("verl", tmp_path / "verl.safetensors", sparse, tmp_path / "r.safetensors") == 0
    record = RolloutRecord.load(tmp_path / "r.safetensors")
    _check(record, cases, (1, 3), missing={1: [2, 3]})
    assert main(["record", "convert", "--to", "verl", str(tmp_path / "r.safetensors"),
                 "-o", str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    for key, value in batch.items():
        assert torch.equal(back[key].to(value.dtype), value), key
    assert back["routed_experts"].dtype == torch.int16
    # the written batch converts back to the same record
    assert _convert("verl", tmp_path / "back.pt", sparse, tmp_path / "r2.safetensors") == 0
    again = RolloutRecord.load(tmp_path / "r2.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(again._tensors().values(), record._tensors().values()))


def test_slime_round_trip(tmp_path, sparse):
    cases = [_case(3, 4, 2, 9), _case(5, 2, 2, 10)]
    samples = [{"index": i, "tokens": c["prompt"] + c["response"], "response_length": len(c["response"]),
                "rollout_log_probs": c["logprobs"], "status": "completed", "loss_mask": None,
                "rollout_routed_experts": torch.from_numpy(_all_layers(c["routes"], (1, 3), -1)).to(torch.int32)}
               for i, c in enumerate(cases)]
    torch.save({"rollout_id": 3, "samples": samples}, tmp_path / "slime.pt")
    assert _convert("slime", tmp_path / "slime.pt", sparse, tmp_path / "r.safetensors") == 0
    record = RolloutRecord.load(tmp_path / "r.safetensors")
    assert record.meta.engine == "slime"
    _check(record, cases, (1, 3))
    assert main(["record", "convert", "--to", "slime", str(tmp_path / "r.safetensors"),
                 "-o", str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)["samples"]
    for a, b in zip(back, samples):
        assert a["tokens"] == b["tokens"] and a["response_length"] == b["response_length"]
        assert torch.equal(a["rollout_routed_experts"], b["rollout_routed_experts"].clamp(min=0))
    # slime's train_data form reads the same
    train = {"tokens": [torch.tensor(s["tokens"]) for s in samples],
             "response_lengths": [s["response_length"] for s in samples],
             "rollout_log_probs": [torch.tensor(s["rollout_log_probs"]) for s in samples],
             "rollout_routed_experts": [s["rollout_routed_experts"] for s in samples]}
    torch.save(train, tmp_path / "train.pt")
    assert _convert("slime", tmp_path / "train.pt", sparse, tmp_path / "t.safetensors") == 0
    _check(RolloutRecord.load(tmp_path / "t.safetensors"), cases, (1, 3))


def test_model_info_reads_the_family(tiny, sparse):
    info = model_info(tiny)
    assert (info.num_layers, info.moe_layers, info.num_experts, info.top_k, info.vocab_size) == (4, (0, 1, 2, 3),
                                                                                                  16, 4, 2048)
    assert info.dtype == "float32" and len(info.router_signature) == 8
    assert model_info(sparse).moe_layers == (1, 3) and model_info(sparse).router_signature == ()


# --------------------------------------------------------------------------------------------------
# bad inputs: one line, exit 2
# --------------------------------------------------------------------------------------------------


def test_bad_inputs_exit_2_with_one_line(tmp_path, sparse, capsys):
    out = str(tmp_path / "r.safetensors")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    cmd = ["record", "convert"]
    _one_line_exit_2([*cmd, "--from", "sglang", str(bad_json), "--model", sparse, "-o", out], capsys, "not JSON")
    _one_line_exit_2([*cmd, "--from", "sglang", str(tmp_path / "none.json"), "--model", sparse, "-o", out], capsys,
                     "no such file")
    good = tmp_path / "g.json"
    good.write_text(json.dumps([{"input_ids": [1, 2], "meta_info": {}}]))
    _one_line_exit_2([*cmd, "--from", "sglang", str(good), "--model", sparse, "-o", out], capsys,
                     "output_token_logprobs")
    _one_line_exit_2([*cmd, "--from", "sglang", str(good), "-o", out], capsys, "--from needs --model")
    _one_line_exit_2([*cmd, str(good), "-o", out], capsys, "exactly one of --from")
    _one_line_exit_2([*cmd, "--from", "sglang", str(good), "--model", sparse, "-o", str(good)], capsys,
                     "is also the input file")
    (tmp_path / "empty").mkdir()
    _one_line_exit_2([*cmd, "--from", "sglang", str(good), "--model", str(tmp_path / "empty"), "-o", out], capsys,
                     "no config.json")
    _one_line_exit_2([*cmd, "--from", "sglang", str(good), "--model", sparse, "-o", out, "--eplb", str(good)],
                     capsys, "trtllm format only")
    _one_line_exit_2([*cmd, "--from", "trtllm", str(good), "--model", sparse, "-o", out, "--expert-ids",
                      "physical"], capsys, "needs --eplb")
    _one_line_exit_2([*cmd, "--from", "verl", str(good), "--model", sparse, "-o", out], capsys,
                     "does not load as a tensor file")
    _one_line_exit_2([*cmd, "--to", "sglang", str(good), "-o", out], capsys, "invalid choice")
    # a NeMo-RL batch with a partly -1 row: corruption, named
    routed = torch.arange(TOP_K, dtype=torch.int8).expand(1, 5, 2, TOP_K).clone()
    routed[0, 1, 0, 0] = -1
    torch.save({"output_ids": torch.tensor([[1, 2, 3, 4, 0]]), "logprobs": torch.full((1, 5), -0.5),
                "generation_lengths": torch.tensor([2]), "unpadded_sequence_lengths": torch.tensor([4]),
                "routed_experts": routed}, tmp_path / "n.pt")
    _one_line_exit_2([*cmd, "--from", "nemo-rl", str(tmp_path / "n.pt"), "--model", sparse, "-o", out], capsys,
                     "row 1 is partly negative")
    # a verl response holding tool tokens (response_mask 0): their log-probs are placeholders
    batch = {"prompts": torch.tensor([[0, 5, 6]]), "responses": torch.tensor([[7, 8, 9, 0]]),
             "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 0]]), "rollout_log_probs": torch.full((1, 4), -0.5),
             "response_mask": torch.tensor([[1, 0, 1, 0]]),
             "routed_experts": torch.arange(TOP_K, dtype=torch.int16).expand(1, 7, 2, TOP_K).clone()}
    torch.save(batch, tmp_path / "v.pt")
    _one_line_exit_2([*cmd, "--from", "verl", str(tmp_path / "v.pt"), "--model", sparse, "-o", out], capsys,
                     "response token 1 has response_mask 0")
    # slime: non-trainable tokens; vLLM's -9999 floor in a log-prob
    sample = {"tokens": [1, 2, 3, 4], "response_length": 2, "rollout_log_probs": [-0.1, -0.2], "loss_mask": [1, 0],
              "rollout_routed_experts": torch.arange(TOP_K, dtype=torch.int32).expand(3, 4, TOP_K).clone()}
    torch.save({"samples": [sample]}, tmp_path / "s.pt")
    _one_line_exit_2([*cmd, "--from", "slime", str(tmp_path / "s.pt"), "--model", sparse, "-o", out], capsys,
                     "loss_mask holds 0")
    torch.save({"samples": [{**sample, "loss_mask": None, "rollout_log_probs": [-0.1, -9999.0]}]}, tmp_path / "s.pt")
    _one_line_exit_2([*cmd, "--from", "slime", str(tmp_path / "s.pt"), "--model", sparse, "-o", out], capsys,
                     "floor for -inf")
    assert not (tmp_path / "r.safetensors").exists()


def test_records_with_missing_rows_refused_where_the_format_cannot_hold_them(tmp_path, sparse, capsys):
    c = _case(4, 3, 2, 11)
    rows = _all_layers(c["routes"], (1, 3), -1)[2:].astype(np.int32)
    meta_info = {"routed_experts": base64.b64encode(rows.tobytes()).decode(), "routed_experts_start_len": 2,
                 "output_token_logprobs": [[lp, t] for lp, t in zip(c["logprobs"], c["response"])]}
    (tmp_path / "s.json").write_text(json.dumps([{"input_ids": c["prompt"], "meta_info": meta_info}]))
    assert _convert("sglang", tmp_path / "s.json", sparse, tmp_path / "r.safetensors") == 0
    _one_line_exit_2(["record", "convert", "--to", "slime", str(tmp_path / "r.safetensors"), "-o",
                      str(tmp_path / "x.pt")], capsys, "slime has no missing-row marker")
    _one_line_exit_2(["record", "convert", "--to", "verl", str(tmp_path / "r.safetensors"), "-o",
                      str(tmp_path / "x.pt"), "--model", sparse], capsys, "options of --from")
    assert not (tmp_path / "x.pt").exists()
    # verl holds missing rows as zero rows (top_k = 4 > 1), and they come back missing
    assert main(["record", "convert", "--to", "verl", str(tmp_path / "r.safetensors"), "-o",
                 str(tmp_path / "v.pt")]) == 0
    assert _convert("verl", tmp_path / "v.pt", sparse, tmp_path / "v.safetensors") == 0
    assert RolloutRecord.load(tmp_path / "v.safetensors").samples[0].route_missing.tolist() == [True, True] + [False] * 4


def test_copied_model_dir_keeps_the_signature(tmp_path, tiny):
    d = tmp_path / "copy"
    shutil.copytree(tiny, d)
    assert model_info(str(d)).router_signature == model_info(tiny).router_signature
