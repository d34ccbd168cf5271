"""Issue 34 (a), (g), (h): a checkpoint whose config.json disagrees with its tensors, a run longer than the model's
positions and an rl-check ``--fail-above`` it cannot judge are refused before any engine starts (one line, exit 2).

The hostile checkpoints are copies of the embedded one with config.json or the safetensors edited; the families'
expected tensors are also checked against checkpoints transformers itself saves (every built-in family)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from round3_util import copy_checkpoint, exit_2

from moealign.checkpoint_check import check_checkpoint_tensors, checkpoint_shapes, read_safetensors_header
from moealign.embedded import embedded_model_path
from moealign.errors import CheckpointMismatchError, ConfigError
from moealign.model_config import check_max_new_tokens, read_model_config

EMBEDDED = read_model_config(embedded_model_path())


@pytest.fixture(scope="module")
def tensors():
    from safetensors.torch import load_file

    return load_file(embedded_model_path() / "model.safetensors")


def _write(ckpt, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def _edit_config(ckpt, **changes) -> dict:
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))
    return config


def _refusal(ckpt) -> str:
    with pytest.raises(CheckpointMismatchError) as info:
        check_checkpoint_tensors(ckpt, read_model_config(ckpt))
    return str(info.value)


# --- config.json edited: each disagreement named by tensor, expected vs found --------------------------------------

CONFIG_EDITS = {
    "fewer experts": ({"num_local_experts": 8}, ["mlp.gate.weight", "(16, 128), config.json implies (8, 128)",
                                                 "96 tensor(s) the config has no place for"]),
    "more experts": ({"num_local_experts": 32}, ["implies (32, 128)", "192 tensor(s) missing",
                                                 "model.layers.0.mlp.experts.16.down_proj.weight"]),
    "vocabulary": ({"vocab_size": 4096}, ["model.embed_tokens.weight has shape (2048, 128), config.json implies "
                                          "(4096, 128)", "lm_head.weight"]),
    "fewer layers": ({"num_hidden_layers": 3}, ["tensor(s) the config has no place for: "
                                                "model.layers.3.input_layernorm.weight"]),
    "more layers": ({"num_hidden_layers": 6}, ["tensor(s) missing: model.layers.4."]),
    "attention heads": ({"num_attention_heads": 8}, ["self_attn.q_proj.weight (4 tensors, layers 0-3) has shape "
                                                     "(128, 128), config.json implies (256, 128)"]),
    "kv heads": ({"num_key_value_heads": 4}, ["self_attn.k_proj.weight (4 tensors, layers 0-3) has shape (64, 128), "
                                              "config.json implies (128, 128)"]),
    "head dim": ({"head_dim": 16}, ["self_attn.q_norm.weight (4 tensors, layers 0-3) has shape (32,), config.json "
                                    "implies (16,)"]),
    "hidden size": ({"hidden_size": 256}, ["model.embed_tokens.weight has shape (2048, 128), config.json implies "
                                           "(2048, 256)", "(13 shapes differ)"]),
    "moe intermediate size": ({"moe_intermediate_size": 32}, ["mlp.experts.*.gate_proj.weight (64 tensors, layers "
                                                              "0-3) has shape (64, 128), config.json implies (32, 128)"]),
    "dense layer (mlp_only_layers)": ({"mlp_only_layers": [1]}, ["3 tensor(s) missing: "
                                                                 "model.layers.1.mlp.down_proj.weight"]),
    "dense layers (decoder_sparse_step)": ({"decoder_sparse_step": 2}, ["6 tensor(s) missing: "
                                                                        "model.layers.0.mlp.down_proj.weight"]),
    "attention bias": ({"attention_bias": True}, ["tensor(s) missing: model.layers.0.self_attn.k_proj.bias"]),
    "another family (qwen2_moe)": ({"model_type": "qwen2_moe"}, ["qwen2_moe", "mlp.shared_expert_gate.weight",
                                                                 "self_attn.q_norm.weight"]),
    "another family (mixtral)": ({"model_type": "mixtral"}, ["tensor(s) missing: "
                                                             "model.layers.0.block_sparse_moe.experts.0.w1.weight"]),
}


@pytest.mark.parametrize("case", list(CONFIG_EDITS))
def test_config_that_disagrees_with_its_tensors_is_named(tmp_path, case):
    changes, needles = CONFIG_EDITS[case]
    ckpt = copy_checkpoint(tmp_path)
    _edit_config(ckpt, **changes)
    message = _refusal(ckpt)
    assert "the checkpoint's tensors disagree with its config.json" in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("changes", [{"intermediate_size": 5}, {"tie_word_embeddings": True},
                                     {"max_position_embeddings": 64}, {"num_experts_per_tok": 2}])
def test_config_edits_the_tensors_do_not_depend_on_pass(tmp_path, changes):
    """Negative controls: the dense intermediate size of an all-sparse model, tied embeddings (lm_head.weight may
    stay), the position count and the top-k change no tensor."""
    ckpt = copy_checkpoint(tmp_path)
    _edit_config(ckpt, **changes)
    check_checkpoint_tensors(ckpt, read_model_config(ckpt))


def test_a_config_implying_far_more_tensors_is_refused_before_they_are_listed(tmp_path):
    ckpt = copy_checkpoint(tmp_path)
    _edit_config(ckpt, num_hidden_layers=10_000, num_local_experts=4096)
    assert "config.json implies about 123040000 tensors (10000 layers x 4096 experts), the checkpoint holds 231" \
        in _refusal(ckpt)


def test_topk_above_the_expert_count_is_refused(tmp_path):
    ckpt = copy_checkpoint(tmp_path)
    _edit_config(ckpt, num_experts_per_tok=17)
    with pytest.raises(ConfigError, match=r"num_experts_per_tok 17 exceeds the 16 experts"):
        check_checkpoint_tensors(ckpt, read_model_config(ckpt))


# --- tensors edited --------------------------------------------------------------------------------------------------

def test_missing_tensor_is_named(tmp_path, tensors):
    ckpt = copy_checkpoint(tmp_path)
    _write(ckpt, {k: v for k, v in tensors.items() if k != "model.layers.2.self_attn.k_norm.weight"})
    assert "1 tensor(s) missing: model.layers.2.self_attn.k_norm.weight" in _refusal(ckpt)


def test_extra_tensor_is_named(tmp_path, tensors):
    ckpt = copy_checkpoint(tmp_path)
    _write(ckpt, {**tensors, "model.layers.0.mlp.experts.16.up_proj.weight": torch.zeros(64, 128)})
    assert "1 tensor(s) the config has no place for: model.layers.0.mlp.experts.16.up_proj.weight" in _refusal(ckpt)


def test_reshaped_tensor_is_named(tmp_path, tensors):
    ckpt = copy_checkpoint(tmp_path)
    _write(ckpt, {**tensors, "model.layers.1.mlp.experts.3.down_proj.weight": torch.zeros(64, 128)})
    assert ("model.layers.1.mlp.experts.3.down_proj.weight has shape (64, 128), config.json implies (128, 64)"
            in _refusal(ckpt))


def test_renamed_tensor_is_missing_and_extra(tmp_path, tensors):
    ckpt = copy_checkpoint(tmp_path)
    renamed = {("model.layers.0.self_attn.qproj.weight" if k == "model.layers.0.self_attn.q_proj.weight" else k): v
               for k, v in tensors.items()}
    _write(ckpt, renamed)
    message = _refusal(ckpt)
    assert "missing: model.layers.0.self_attn.q_proj.weight" in message
    assert "no place for: model.layers.0.self_attn.qproj.weight" in message


def test_tensor_in_two_shards_is_refused(tmp_path, tensors):
    from safetensors.torch import save_file

    ckpt = copy_checkpoint(tmp_path)
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, ckpt / "model-extra.safetensors")
    assert "model.norm.weight is stored twice" in _refusal(ckpt)


def test_only_the_files_the_index_maps_are_the_model(tmp_path, tensors):
    """With ``model.safetensors.index.json`` only the files it maps count (a ``consolidated.safetensors`` in
    another naming next to the shards, as some releases ship, is not the model's); a file it maps is checked."""
    from safetensors.torch import save_file

    ckpt = copy_checkpoint(tmp_path)
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, ckpt / "consolidated.safetensors")
    assert "no place for: layers.0.attention.wq.weight" in _refusal(ckpt)
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in tensors}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    check_checkpoint_tensors(ckpt, read_model_config(ckpt))
    index["weight_map"]["layers.0.attention.wq.weight"] = "consolidated.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "no place for: layers.0.attention.wq.weight" in _refusal(ckpt)


def test_experts_stored_fused_pass(tmp_path, tensors):
    """transformers 5's in-memory layout (``experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) is
    accepted in place of the experts one by one; shaped otherwise it is named."""
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(4):
        p = f"model.layers.{i}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"],
                                                             tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(16)])
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(16)])
    ckpt = copy_checkpoint(tmp_path)
    _write(ckpt, fused)
    check_checkpoint_tensors(ckpt, read_model_config(ckpt))
    _edit_config(ckpt, moe_intermediate_size=32)
    assert "mlp.experts.gate_up_proj (4 tensors, layers 0-3) has shape (16, 128, 128), config.json implies " \
           "(16, 64, 128)" in _refusal(ckpt)


def test_header_reader_is_bounded_and_names_the_file(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        read_safetensors_header(bad)
    bad.write_bytes((2).to_bytes(8, "little") + b"[]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        read_safetensors_header(bad)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ConfigError, match="entry 'w' is malformed"):
        read_safetensors_header(bad)
    assert checkpoint_shapes(embedded_model_path())["model.layers.0.mlp.gate.weight"] == (16, 128)


# --- the families' expected tensors against checkpoints transformers saves ------------------------------------------

@pytest.mark.parametrize("model_type, overrides", [
    ("qwen3_moe", {"mlp_only_layers": [1]}), ("qwen2_moe", {}), ("qwen2_moe", {"shared_expert_intermediate_size": 0}),
    ("mixtral", {}), ("mixtral", {"tie_word_embeddings": True}), ("olmoe", {}),
])
def test_checkpoints_transformers_saves_pass_and_a_wrong_expert_count_is_named(tmp_path, model_type, overrides):
    transformers = pytest.importorskip("transformers")
    from test_families import tiny_config, tiny_model

    model = tiny_model(transformers, tiny_config(transformers, model_type, layers=2, **overrides))
    model.save_pretrained(tmp_path)
    config = read_model_config(tmp_path)
    check_checkpoint_tensors(tmp_path, config)
    key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    (tmp_path / "config.json").write_text(json.dumps({**config, key: 5}))
    message = _refusal(tmp_path)
    assert "gate.weight" in message and "has shape (6, 32), config.json implies (5, 32)" in message, message
    assert "model.layers.0.mlp.experts.5." in message or "mixtral" in message, message


def test_a_family_without_stated_tensors_gets_the_generic_check(tmp_path):
    from moealign.families import FAMILIES, MoEFamily, register_family, sparse_by_step
    from moealign.routing_replay.gates import RouterScoring

    register_family(MoEFamily("x_moe", "XTopKRouter", lambda c: RouterScoring(), lambda c: c.num_experts,
                              moe_layer_pattern=sparse_by_step))
    try:
        ckpt = copy_checkpoint(tmp_path)
        config = _edit_config(ckpt, model_type="x_moe")
        check_checkpoint_tensors(ckpt, config)
        for changes, needle in (({"num_hidden_layers": 3}, "tensor(s) of layers past the 3 config.json has"),
                                ({"num_hidden_layers": 5}, "no tensors for layer(s) [4]"),
                                ({"num_local_experts": 8}, "route to 16 experts, config.json has 8"),
                                ({"num_local_experts": 8}, "96 tensor(s) of experts past the 8"),
                                ({"vocab_size": 99}, "implies (99, 128)")):
            with pytest.raises(CheckpointMismatchError, match=r"x_moe") as info:
                check_checkpoint_tensors(ckpt, {**config, **changes})
            assert needle in str(info.value), str(info.value)
    finally:
        FAMILIES.pop("x_moe", None)


# --- the commands: refused before any engine starts, one line, exit 2 ------------------------------------------------

@pytest.fixture
def no_work(monkeypatch):
    """Any run that starts fails the test (the refusals must come first)."""
    import moealign.mismatch as mismatch
    import moealign.rl.loop as loop

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(mismatch, "run_mismatch", started)
    monkeypatch.setattr(loop, "run_rl_check", started)


def test_mismatch_and_rl_check_refuse_the_checkpoint(tmp_path, capsys, no_work):
    ckpt = copy_checkpoint(tmp_path)
    _edit_config(ckpt, num_local_experts=8)
    for argv in (["mismatch", "-q", "--model", str(ckpt)], ["rl-check", "-q", "--model", str(ckpt)]):
        err = exit_2(argv, capsys, "CheckpointMismatchError", "mlp.gate.weight", "implies (8, 128)")
        assert err.count("\n") == 1


def test_rl_check_refuses_a_reshaped_tensor(tmp_path, capsys, no_work, tensors):
    ckpt = copy_checkpoint(tmp_path)
    _write(ckpt, {**tensors, "lm_head.weight": torch.zeros(2000, 128)})
    exit_2(["rl-check", "-q", "--model", str(ckpt)], capsys, "lm_head.weight has shape (2000, 128), config.json "
           "implies (2048, 128)")


def test_max_new_tokens_past_the_positions_is_refused_by_both_commands(tmp_path, capsys, no_work):
    for command in ("mismatch", "rl-check"):
        exit_2([command, "-q", "--max-new-tokens", "600"], capsys, "--max-new-tokens 600: the embedded model holds "
               "at most 512 positions (max_position_embeddings)")
    ckpt = copy_checkpoint(tmp_path)
    _edit_config(ckpt, max_position_embeddings=16)
    for command in ("mismatch", "rl-check"):
        exit_2([command, "-q", "--model", str(ckpt)], capsys, "holds at most 16 positions")
    with pytest.raises(ConfigError, match="holds at most 512"):
        check_max_new_tokens(EMBEDDED, 512)
    check_max_new_tokens(EMBEDDED, 511)


@pytest.mark.parametrize("item, needle", [
    ("token_flip_rate=0.1", "rl-check does not report 'token_flip_rate' per step; choose one of router_flip_rate"),
    ("pearson_prob=0.5", "rl-check does not report 'pearson_prob'"),
    ("kl_k1=abc", "'abc' is not a number"),
    ("kl_k1=nan", "must be finite"),
    ("kl_k3=inf", "must be finite"),
    ("kl_k3", "expects METRIC=VALUE"),
])
def test_rl_check_fail_above_is_checked_before_any_work(tmp_path, capsys, no_work, item, needle):
    out = tmp_path / "rl.json"
    exit_2(["rl-check", "-q", "--fail-above", item, "--json", str(out)], capsys, "--fail-above", needle)
    assert not out.exists()


def test_rl_check_config_checks_fail_above():
    from moealign.rl import RLCheckConfig
    from moealign.rl.config import parse_fail_above

    assert parse_fail_above(["kl_k3=0.5", "router_flip_rate=1e-3"]) == {"kl_k3": 0.5, "router_flip_rate": 1e-3}
    for bounds, needle in (({"token_flip_rate": 0.1}, "does not report"), ({"kl_k3": math.nan}, "finite"),
                           ({"kl_k3": "0.1"}, "finite"), ({"kl_k3": True}, "finite")):
        with pytest.raises(ConfigError, match=needle):
            RLCheckConfig(fail_above=bounds)
    assert RLCheckConfig(fail_above={"kl_k3": 1}).fail_above == {"kl_k3": 1.0}


def test_the_embedded_checkpoint_passes():
    check_checkpoint_tensors(embedded_model_path(), EMBEDDED)
