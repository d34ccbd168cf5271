"""The DeepSeek-V3 architecture (``embedded:tiny_deepseek``, issue 37 phase 1): the family, the replay semantics
against a hand computation, transformers replay (bitwise identity, the shared expert untouched, the verifier),
vLLM's CPU rollout (route capture = the engine's grouped, biased top-k; forced routes; the forced gate weights
vLLM's own, bitwise), ``mismatch`` (vllm -> hf, hf -> hf: flips > 0 stock, 0 replayed), ``record inspect --model``,
and the refusals by name (what the Megatron conversion does not map, MTP layers, DeepSeek-V3.2's indexer).

vLLM runs in a child process: this file run as a script (``python tests/test_deepseek.py vllm-child OUT``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys

import pytest
import torch

from moealign.embedded import checkpoint_path, embedded_model_path, model_label

MODEL = "embedded:tiny_deepseek"


def _sets(ids: torch.Tensor) -> torch.Tensor:
    return ids.to(torch.int64).sort(-1).values


# ------------------------------------------------------------------------------------------------ the vLLM child
def vllm_child(out: str) -> None:
    """(In a child process) record a vLLM rollout of tiny_deepseek, with vLLM's CPU grouped top-k logged; force the
    record's routes and rotated ones; print one RESULT line."""
    import vllm.model_executor.layers.fused_moe.router.cpu_router as cpu_router

    from moealign.embedded import default_prompts
    from moealign.families import get_family
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.replay import score_with_routes, vllm_router_scoring
    from moealign.patches.vllm.rollout import generate_with_record, model_runner, moe_routers
    from moealign.record import RolloutRecord, SamplingParams
    from moealign.routing_replay.gates import replay_gate_weights, select_topk

    calls = []
    original = cpu_router._grouped_topk

    def logged(**kwargs):
        weights, ids = original(**kwargs)
        calls.append((kwargs["gating_output"].detach().clone(), kwargs["e_score_correction_bias"].detach().clone(),
                      weights.clone(), ids.clone(), kwargs["topk"]))
        return weights, ids

    cpu_router._grouped_topk = logged
    path = str(embedded_model_path("tiny_deepseek"))
    llm = open_llm(path, dtype="bf16", max_num_seqs=8, max_model_len=256, enable_prefix_caching=False)
    runner = model_runner(llm)
    routers = moe_routers(runner.model)
    hf_config = runner.model_config.hf_config
    family = get_family(hf_config.model_type).scoring(hf_config)
    scoring = vllm_router_scoring(routers[0][2], family)
    prompts = [p[:64] for p in default_prompts()[:6]]
    record = generate_with_record(llm, prompts, sampling=SamplingParams(temperature=1.0, top_p=0.9),
                                  max_new_tokens=16, seed=3)
    record.save(out)
    result = {"routers": [type(r).__name__ for _, _, r in routers], "calls": len(calls),
              "moe_layers": list(record.meta.moe_layers)}
    same, weights_equal, no_bias, no_groups, rows = True, True, 0, 0, 0
    seen = set()
    for logits, bias, weights, ids, k in calls:
        own = select_topk(logits.float(), k, family, expert_bias=bias)[1]
        same &= torch.equal(_sets(own), _sets(ids))
        weights_equal &= torch.equal(replay_gate_weights(logits, ids, scoring, out_dtype=weights.dtype), weights)
        no_bias += int((_sets(select_topk(logits.float(), k, family)[1]) != _sets(ids)).any(-1).sum())
        flat = dataclasses.replace(family, n_group=None, topk_group=None)
        no_groups += int((_sets(select_topk(logits.float(), k, flat, expert_bias=bias)[1]) != _sets(ids))
                         .any(-1).sum())
        rows += ids.shape[0]
        seen.update(tuple(r) for r in _sets(ids).tolist())
    recorded = torch.cat([s.routes for s in record.samples]).to(torch.int64)
    result.update(engine_topk_is_grouped_biased_sigmoid=bool(same), forced_weights_bitwise=bool(weights_equal),
                  rows_changed_without_bias=no_bias / rows, rows_changed_without_groups=no_groups / rows,
                  record_rows_from_engine_topk=all(tuple(r) in seen for r in _sets(recorded).flatten(0, 1).tolist()))
    lp_own, ran_own, report = score_with_routes(llm, record, return_routes=True, return_verify=True)
    result["forced_own_verified"] = (report.mismatched_rows, report.replayed_rows)
    result["forced_own_ran_equal"] = all(torch.equal(r, s.routes.to(torch.int64))
                                         for r, s in zip(ran_own, record.samples))
    rotated = RolloutRecord(record.meta, [dataclasses.replace(s, routes=((s.routes.to(torch.int64) + 5) % 16)
                                                              .to(s.routes.dtype)) for s in record.samples])
    lp_rot, ran_rot = score_with_routes(llm, rotated, return_routes=True)
    result["forced_rotated_ran_equal"] = all(torch.equal(r, s.routes.to(torch.int64))
                                             for r, s in zip(ran_rot, rotated.samples))
    result["rotated_changes_logprobs"] = any(not torch.equal(a, b) for a, b in zip(lp_own, lp_rot))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["vllm-child"]:
        vllm_child(sys.argv[2])
        sys.exit(0)

pytest.importorskip("transformers")

from moealign.cli import main  # noqa: E402
from moealign.errors import (  # noqa: E402
    CheckpointMismatchError,
    ConfigError,
    ReplayError,
    UnsupportedConversionError,
    UnsupportedModelError,
)
from moealign.families import REFUSED, get_family  # noqa: E402
from moealign.families.deepseek_v3 import uncovered  # noqa: E402
from moealign.model_config import ConfigView, read_model_config  # noqa: E402
from moealign.patches import hf  # noqa: E402
from moealign.routing_replay.gates import (  # noqa: E402
    RouterScoring,
    expert_bias_update,
    replay_gate_weights,
    select_topk,
)
from moealign.routing_replay.protocol import ReplayBatch  # noqa: E402

import warm  # noqa: E402  (tests/: the warm children)

pytestmark = pytest.mark.heavy          # engines (a vLLM child, CLI runs): scheduled first, tests/conftest.py

PATH = checkpoint_path(MODEL)
CONFIG = read_model_config(PATH)
E, K, LAYERS = CONFIG["n_routed_experts"], CONFIG["num_experts_per_tok"], (1, 2)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    return m


def _batch(routes, ids):
    """A padded ReplayBatch for ``ids`` [B, T] (every row routed); ``routes`` [B*T, layers, k]."""
    return ReplayBatch.padded(routes.reshape(*ids.shape, *routes.shape[1:]), input_ids=ids,
                              attention_mask=torch.ones_like(ids), moe_layers=LAYERS)


def _tokens(seed=0, shape=(2, 12)):
    return torch.randint(2, CONFIG["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def _own_routes(model, ids):
    with torch.no_grad(), hf.capture_routes(model) as cap:
        out = model(input_ids=ids, use_cache=False)
    return cap.last_forward().to(torch.int64), out


def _rotated(routes, by=5):
    return (routes + by) % E


# ------------------------------------------------------------------------------------------------ embedded model
def test_embedded_names():
    assert checkpoint_path("embedded:tiny_deepseek") == str(embedded_model_path("tiny_deepseek"))
    assert checkpoint_path("embedded:tiny_moe") == checkpoint_path(None) == str(embedded_model_path())
    assert model_label(None) == "embedded:tiny_moe" and model_label(PATH) == MODEL
    with pytest.raises(ConfigError, match="no such embedded model.*embedded:tiny_deepseek"):
        checkpoint_path("embedded:tiny_nothing")
    info = json.loads((embedded_model_path("tiny_deepseek") / "build_info.json").read_text())
    assert info["route_flip_rate_bf16_vs_fp32"] > 0            # the routes bf16 and fp32 choose differ
    assert info["route_change_rate_without_bias"] > 0          # the correction bias decides routes
    assert (embedded_model_path("tiny_deepseek") / "model.safetensors").stat().st_size < 8e6


def test_config_is_deepseek_v3_with_every_routing_feature():
    c = CONFIG
    assert c["model_type"] == "deepseek_v3" and c["topk_method"] == "noaux_tc" and c["scoring_func"] == "sigmoid"
    assert c["kv_lora_rank"] + c["qk_rope_head_dim"] == 576 and c["q_lora_rank"]        # vLLM's CPU MLA kernel
    assert c["first_k_dense_replace"] == 1 and c["n_shared_experts"] == 1 and c["num_nextn_predict_layers"] == 0
    assert c["n_group"] > c["topk_group"] >= 1 and c["routed_scaling_factor"] != 1.0 and c["norm_topk_prob"]


# ------------------------------------------------------------------------------------------------ the family
def test_family_registration_and_fields():
    fam = get_family("deepseek_v3")
    view = ConfigView(**CONFIG)
    assert fam.router_class == "DeepseekV3TopkRouter" and fam.scores_in_fp32 and fam.logits_in_fp32
    assert fam.bias_attr == "e_score_correction_bias"
    assert fam.moe_layer_pattern(view) == (0, 1, 1) and fam.num_experts(view) == E
    assert fam.scoring(view) == RouterScoring("sigmoid", renormalize=True, scaling_factor=2.5, n_group=4, topk_group=2)
    assert {"kv_lora_rank", "q_lora_rank", "n_shared_experts", "num_nextn_predict_layers"} <= set(fam.arch_keys)
    assert fam.megatron.convertible and fam.megatron.own_attention(view)      # MLA: tests/test_deepseek_megatron.py


def test_checkpoint_tensors_checked(tmp_path):
    from safetensors.torch import load_file, save_file

    from moealign.checkpoint_check import check_checkpoint_tensors

    check_checkpoint_tensors(PATH, CONFIG)                           # the embedded checkpoint passes
    broken = tmp_path / "broken"
    shutil.copytree(PATH, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    tensors["model.layers.1.self_attn.kv_b_proj.weight"] = tensors["model.layers.1.self_attn.kv_b_proj.weight"][:8]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match=r"e_score_correction_bias.*|kv_b_proj"):
        check_checkpoint_tensors(broken, CONFIG)


@pytest.mark.parametrize("change, words", [
    ({"num_nextn_predict_layers": 1}, "multi-token-prediction"),
    ({"num_nextn_predict_layers": None}, "multi-token-prediction"),        # transformers' default is 1
    ({"index_topk": 2048}, "lightning indexer"),
    ({"topk_method": "greedy"}, "noaux_tc"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
])
def test_uncovered_features_refused_by_name(change, words):
    config = {k: v for k, v in CONFIG.items() if not (k in change and change[k] is None)}
    config.update({k: v for k, v in change.items() if v is not None})
    view = ConfigView(**config)
    assert words in uncovered(view)
    fam = get_family("deepseek_v3")
    for read in (fam.scoring, fam.moe_layer_pattern, fam.checkpoint_tensors):
        with pytest.raises(UnsupportedModelError, match=words):
            read(view)
    assert uncovered(ConfigView(**CONFIG)) is None                  # negative control


def test_deepseek_v32_refused_by_name():
    assert "deepseek_v32" in REFUSED
    with pytest.raises(UnsupportedModelError, match="DeepSeek-V3.2's lightning indexer"):
        get_family("deepseek_v32")


def test_megatron_refuses_what_it_does_not_map_by_name():
    """The Megatron conversion (tests/test_deepseek_megatron.py) refuses, by name and before any model is built,
    the DeepSeek features it does not map."""
    from moealign.patches.megatron.checkpoint import check_family_convertible, megatron_config_from_hf

    assert check_family_convertible("deepseek_v3").model_type == "deepseek_v3"
    for change, words in (({"rope_interleave": False}, "rope_interleave"), ({"norm_topk_prob": False}, "norm_topk_prob"),
                          ({"q_lora_rank": None}, "q_lora_rank"), ({"num_nextn_predict_layers": 1}, "multi-token")):
        with pytest.raises(UnsupportedConversionError, match=words):
            megatron_config_from_hf(ConfigView(**{**CONFIG, **change}), cpu=True)


# ------------------------------------------------------------------------------------------------ replay semantics
def test_replay_gate_weights_hand_computation():
    """Replayed experts as given (outside the best groups too); weights = sigmoid(logit) of those experts WITHOUT
    the bias, divided by their sum, times routed_scaling_factor (float64 by hand)."""
    scoring = get_family("deepseek_v3").scoring(ConfigView(**CONFIG))
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.1, -0.4, 0.9, 1.5, -2.2, 0.0, 0.7, -0.8, 1.1, -0.1, 0.2, 0.5, -1.0],
                           [1.0, 0.5, -0.5, -1.5, 0.8, 0.2, -0.3, 2.5, -1.1, 0.4, 0.6, -0.7, 1.9, -2.0, 0.05, 0.3]])
    ids = torch.tensor([[0, 5, 10, 15], [13, 7, 2, 9]])          # row 0: four groups, though topk_group = 2
    bias = torch.linspace(-0.2, 0.2, E)
    got = replay_gate_weights(logits, ids, scoring)
    hand = []
    for row, chosen in zip(logits.tolist(), ids.tolist()):
        s = [1 / (1 + math.exp(-row[e])) for e in chosen]
        hand.append([2.5 * x / sum(s) for x in s])
    torch.testing.assert_close(got, torch.tensor(hand), rtol=1e-6, atol=0)
    with_bias = []                                               # negative control: the bias must not enter
    for row, chosen in zip(logits.tolist(), ids.tolist()):
        s = [1 / (1 + math.exp(-row[e])) + float(bias[e]) for e in chosen]
        with_bias.append([2.5 * x / sum(s) for x in s])
    assert not torch.allclose(got, torch.tensor(with_bias), rtol=1e-3, atol=0)
    # the native choice: bias and groups select, the weights stay unbiased; at the native ids replay is bitwise
    w, native = select_topk(logits, K, scoring, expert_bias=bias)
    assert torch.equal(replay_gate_weights(logits, native, scoring), w)
    assert not torch.equal(_sets(native), _sets(select_topk(logits, K, scoring)[1]))     # the bias decides


def test_expert_bias_update_counts_the_given_ids():
    bias = torch.zeros(4)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])                  # loads 3, 2, 1, 0: mean 1.5
    assert torch.equal(expert_bias_update(bias, ids, 0.01), torch.tensor([-0.01, -0.01, 0.01, 0.01]))
    mask = torch.tensor([False, True, True])                      # loads 2, 1, 1, 0: mean 1
    assert torch.equal(expert_bias_update(bias, ids, 0.01, row_mask=mask), torch.tensor([-0.01, 0.0, 0.0, 0.01]))
    with pytest.raises(ReplayError):
        expert_bias_update(bias, torch.tensor([[0, 4]]), 0.01)


# ------------------------------------------------------------------------------------------------ transformers replay
def test_hf_router_matches_select_topk(model):
    """transformers' DeepseekV3TopkRouter is moealign's sigmoid grouped scoring with the bias, bitwise."""
    router = model.model.layers[1].mlp.gate
    assert router.e_score_correction_bias.abs().max() > 0          # a trained, non-zero bias
    h = torch.randn(40, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, w, ids = router(h)
        scoring = get_family("deepseek_v3").scoring(model.config)
        mine_w, mine_ids = select_topk(logits, K, scoring, expert_bias=router.e_score_correction_bias)
    assert torch.equal(_sets(mine_ids), _sets(ids))
    # weights at the same ids in the same slot order: bitwise (the sum's order follows the slots)
    assert torch.equal(replay_gate_weights(logits, ids, scoring), w)
    torch.testing.assert_close(mine_w.gather(1, mine_ids.argsort(-1)), w.gather(1, ids.argsort(-1)), rtol=1e-6, atol=0)


def test_hf_identity_replay_bitwise_and_other_routes(model):
    ids = _tokens()
    own, ref = _own_routes(model, ids)
    with torch.no_grad(), hf.replay_routing(model, _batch(own, ids)) as replay:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        replay.check(calls=1)
        report = replay.verify_report()
        assert report.mismatched_rows == 0 and report.replayed_rows == len(LAYERS) * ids.numel()
    assert torch.equal(out.logits, ref.logits)
    other = _rotated(own)
    shared, routed = {}, {}
    layer = model.model.layers[1].mlp
    hooks = [layer.shared_experts.register_forward_hook(lambda m, a, o: shared.setdefault(len(shared), o)),
             layer.experts.register_forward_hook(lambda m, a, o: routed.setdefault(len(routed), o))]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        with torch.no_grad(), hf.replay_routing(model, _batch(other, ids)) as replay, hf.capture_routes(model) as cap:
            moved = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            replay.check(calls=1)
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(cap.last_forward().to(torch.int64), other)   # the experts replayed, slot for slot
    assert not torch.equal(moved.logits, ref.logits)
    assert torch.equal(shared[0], shared[1])                        # the shared expert untouched by replay
    assert not torch.equal(routed[0], routed[1])                     # (the routed experts moved)


def test_hf_replayed_router_weights_are_unbiased_scaled_sigmoid(model):
    router = model.model.layers[2].mlp.gate
    ids = _tokens(3, (1, 8))
    own, _ = _own_routes(model, ids)
    other = _rotated(own, 3)
    got = {}
    router.register_forward_hook(lambda m, a, o: got.update(h=a[0], out=o))
    try:
        with torch.no_grad(), hf.replay_routing(model, _batch(other, ids)):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        router._forward_hooks.clear()
    logits, weights, chosen = got["out"]
    h = got["h"].reshape(-1, CONFIG["hidden_size"]).double()
    s = torch.sigmoid(h @ router.weight.double().T).gather(1, chosen)
    torch.testing.assert_close(weights.double(), 2.5 * s / s.sum(-1, keepdim=True), rtol=1e-5, atol=0)
    assert weights.dtype == torch.float32 and torch.equal(chosen, other[:, 1])


def test_hf_verifier_reads_the_experts_that_ran(model):
    ids = _tokens(5)
    own, _ = _own_routes(model, ids)
    router = model.model.layers[2].mlp.gate
    with torch.no_grad(), hf.replay_routing(model, _batch(_rotated(own), ids)) as replay:
        bound = router.forward

        def bypass(hidden_states):                  # swapped after the replay bound the router: its own top-k
            logits, w, _ = bound(hidden_states)
            native = select_topk(logits, K, replay.info.scoring, expert_bias=router.e_score_correction_bias)[1]
            return logits, w, native
        router.forward = bypass
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        with pytest.raises(ReplayError, match=r"differ from the record.*layers \[2\]"):
            replay.check(calls=1)
        router.forward = bound


# ------------------------------------------------------------------------------------------------ the commands
def _cli(args, timeout=600):
    return warm.run([sys.executable, "-m", "moealign", *args], capture_output=True, text=True, timeout=timeout)


def test_mismatch_hf_hf(tmp_path):
    out = tmp_path / "r.json"
    assert main(["mismatch", "--model", MODEL, "--rollout", "hf", "--train", "hf", "--num-prompts", "8",
                 "--max-new-tokens", "16", "--batch-size", "8", "--device", "cpu", "-q", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = {r["name"]: r["metrics"] for r in report["runs"]}
    assert report["model"] == MODEL and report["moe_layers"] == list(LAYERS)
    assert runs["baseline"]["router_flip_rate"] > 0
    assert runs["routing_replay"]["router_flip_rate"] == 0.0
    assert runs["routing_replay+sampling_mask"]["router_flip_rate"] == 0.0


def test_vllm_rollout_capture_forced_routes_and_mismatch(tmp_path):
    from vllm_util import child_env, run_child

    record = tmp_path / "rec.safetensors"
    r = run_child("test_deepseek.py", "vllm-child", str(record))
    assert r["routers"] == ["CPURouter", "CPURouter"] and r["moe_layers"] == list(LAYERS) and r["calls"] > 0
    assert r["engine_topk_is_grouped_biased_sigmoid"] and r["record_rows_from_engine_topk"]
    assert r["rows_changed_without_bias"] > 0 and r["rows_changed_without_groups"] >= 0
    assert r["forced_weights_bitwise"]
    assert r["forced_own_verified"][0] == 0 and r["forced_own_verified"][1] > 0 and r["forced_own_ran_equal"]
    assert r["forced_rotated_ran_equal"] and r["rotated_changes_logprobs"]
    # inspect --model: the checkpoint's own routers (transformers, fp32) choose the record's experts on most pairs
    proc = _cli(["record", "inspect", str(record), "--model", MODEL])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    own = float(proc.stdout.split("the record's expert set is the model's own on ")[1].split("%")[0])
    # vLLM 0.32's CPU MLA computes another attention than transformers on this model (report of issue 37 phase 1:
    # fp32 layer-0 attention differs from position 1 on), so the routes agree on ~60%, not ~99%: still the model's
    assert 50.0 <= own < 100.0
    # the record formats (verl's batch and back, the dense first layer included): the same routes
    from moealign.record import RolloutRecord

    batch, back = tmp_path / "verl.pt", tmp_path / "back.safetensors"
    assert main(["record", "convert", "--to", "verl", str(record), "-o", str(batch)]) == 0
    assert main(["record", "convert", "--from", "verl", str(batch), "--model", MODEL, "-o", str(back),
                 "--temperature", "1.0", "--top-p", "0.9"]) == 0
    a, b = RolloutRecord.load(record), RolloutRecord.load(back)
    assert b.meta.moe_layers == LAYERS and b.meta.model_fingerprint == a.meta.model_fingerprint
    assert all(torch.equal(x.routes, y.routes) for x, y in zip(a.samples, b.samples))
    # the main job with vLLM rolling out, transformers training
    out = tmp_path / "m.json"
    proc = warm.run([sys.executable, "-m", "moealign", "mismatch", "--model", MODEL, "--rollout", "vllm",
                     "--train", "hf", "--num-prompts", "8", "--max-new-tokens", "16", "--batch-size", "8",
                     "--device", "cpu", "-q", "--json", str(out)], capture_output=True, text=True, timeout=600,
                    env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {x["name"]: x["metrics"] for x in json.loads(out.read_text())["runs"]}
    assert runs["baseline"]["router_flip_rate"] > 0
    assert runs["routing_replay"]["router_flip_rate"] == 0.0

