"""moealign.families: one registry, one module per family; the engine adapters read everything from it.

Checks: every registered family states every field; the package imports no engine; a family added in one
module works end to end (describe_model, record_meta, the Megatron mapping); the record fingerprint of every
family is unchanged from the single global key tuple it replaced; the Megatron converter has no model_type
branches left; each family's stated scoring is what its transformers router computes."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import moealign
from moealign import families
from moealign.errors import ConfigError, MoealignError, UnsupportedConversionError, UnsupportedModelError
from moealign.families import (
    ARCH_KEYS,
    FAMILIES,
    MegatronSpec,
    MoEFamily,
    TensorPair,
    arch_keys,
    get_family,
    register_family,
)
from moealign.record import RecordMeta, config_fingerprint
from moealign.routing_replay.gates import RouterScoring, select_topk

BUILTIN = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
CONVERTIBLE = ("qwen3_moe", "qwen2_moe", "mixtral")
ENGINES = ("transformers", "megatron", "vllm")
PACKAGE = Path(moealign.__file__).parent

# The global key tuple of moealign.record before the registry (_ARCH_KEYS), copied verbatim: the fingerprint
# of every built-in family must still be computed from exactly these keys, or saved records stop matching.
OLD_ARCH_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace",
    "moe_layer_freq", "n_group", "topk_group", "routed_scaling_factor", "scoring_func",
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters", "tie_word_embeddings",
    "sliding_window", "qk_norm", "clip_qkv",
)


def old_fingerprint(config: dict) -> str:
    """config_fingerprint as it was computed before the family registry."""
    import hashlib

    picked = {k: config[k] for k in OLD_ARCH_KEYS if k in config and config[k] is not None}
    text = json.dumps(picked, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def old_layer_pattern(config) -> list[int]:
    """checkpoint._moe_layer_pattern as it was (model_type branches)."""
    n = int(config.num_hidden_layers)
    if config.model_type == "mixtral":
        return [1] * n
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [0 if (i in dense or (i + 1) % step != 0) else 1 for i in range(n)]


# the configs of tests/test_record.py and of the embedded model, with the fingerprints the code before the
# registry gave them (literal: independent of the inline copy above)
RECORD_TEST_CONFIG = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "_name_or_path": "Qwen/Qwen3-30B-A3B",
}
RECORD_TEST_FINGERPRINT = "3cd800eaeea4f0a9"
EMBEDDED_FINGERPRINTS = {"qwen3_moe": "d03948ed1f6d8a2a", "qwen2_moe": "fb3d1d7f2d4621ad",
                         "mixtral": "1d8edf0583114d43", "olmoe": "d7d131e66d2325a1"}


def _embedded_config() -> dict:
    from moealign.embedded import embedded_model_path

    with open(os.path.join(embedded_model_path(), "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def transformers():
    mod = pytest.importorskip("transformers")
    return mod


TINY = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, head_dim=8,
            num_experts_per_tok=2, bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)


def tiny_config(transformers, model_type: str, layers: int = 3, **overrides):
    kw = dict(TINY, num_hidden_layers=layers)
    if model_type == "qwen3_moe":
        kw.update(intermediate_size=48, moe_intermediate_size=16, num_experts=6)
        cls = transformers.Qwen3MoeConfig
    elif model_type == "qwen2_moe":
        kw.update(intermediate_size=48, moe_intermediate_size=16, num_experts=6, shared_expert_intermediate_size=24,
                  mlp_only_layers=[1])
        cls = transformers.Qwen2MoeConfig
    elif model_type == "mixtral":
        kw.update(intermediate_size=16, num_local_experts=6)
        cls = transformers.MixtralConfig
    elif model_type == "olmoe":
        kw.update(intermediate_size=16, num_experts=6)
        cls = transformers.OlmoeConfig
    else:
        raise AssertionError(model_type)
    kw.update(overrides)
    return cls(**kw)


def tiny_model(transformers, config, dtype=torch.float32, cls=None):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if cls is not None:
            return cls(config).to(dtype).eval()
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


# --------------------------------------------------------------------------------------------------
# 1. the registry
# --------------------------------------------------------------------------------------------------


def test_builtin_families_registered_in_order():
    assert tuple(FAMILIES)[:4] == BUILTIN
    for name in BUILTIN:
        module = getattr(families, name)
        assert module.FAMILY is FAMILIES[name] and module.FAMILY.model_type == name
        assert module.router_scoring is FAMILIES[name].scoring      # one clearly named function per family


@pytest.mark.parametrize("name", BUILTIN)
def test_every_family_has_every_field(name):
    family = FAMILIES[name]
    for f in dataclasses.fields(MoEFamily):
        assert getattr(family, f.name) is not None, f"{name}: {f.name} is not set"
    assert isinstance(family.router_class, str) and family.router_class.endswith("TopKRouter")
    assert isinstance(family.scores_in_fp32, bool)
    assert callable(family.scoring) and callable(family.num_experts) and callable(family.moe_layer_pattern)
    assert "model_type" in family.arch_keys and set(ARCH_KEYS) <= set(family.arch_keys)
    spec = family.megatron
    assert isinstance(spec, MegatronSpec)
    if name in CONVERTIBLE:
        assert spec.convertible and spec.refused is None
        for f in dataclasses.fields(MegatronSpec):
            if f.name != "refused":
                assert callable(getattr(spec, f.name)), f"{name}: megatron.{f.name}"
    else:
        assert not spec.convertible and "q_norm/k_norm" in spec.refused


@pytest.mark.parametrize("name", BUILTIN)
def test_family_functions_on_a_plain_config(name):
    """The family functions read plain attributes (no engine object needed)."""
    experts_key = "num_local_experts" if name == "mixtral" else "num_experts"
    config = dataclasses.make_dataclass("Cfg", [("model_type", str), ("num_hidden_layers", int), (experts_key, int),
                                                ("norm_topk_prob", bool), ("decoder_sparse_step", int),
                                                ("mlp_only_layers", list)])(
        name, 4, 8, False, 2, [3])
    family = get_family(name)
    assert family.num_experts(config) == 8
    scoring = family.scoring(config)
    assert isinstance(scoring, RouterScoring) and scoring.score == "softmax"
    assert scoring.renormalize is (name == "mixtral")      # norm_topk_prob=False; Mixtral always renormalises
    assert family.scores_in_fp32 is (name == "mixtral")
    pattern = tuple(family.moe_layer_pattern(config))
    assert pattern == ((1, 1, 1, 1) if name in ("mixtral", "olmoe") else (0, 1, 0, 0))


def test_get_family_names_the_known_families():
    assert get_family("mixtral") is FAMILIES["mixtral"]
    for bad in ("llama", None, 3):
        with pytest.raises(UnsupportedModelError, match=rf"model_type {bad!r} is not a MoE family") as info:
            get_family(bad)
        assert str(sorted(FAMILIES)) in str(info.value) and isinstance(info.value, MoealignError)


def test_register_family_refuses_duplicates_and_non_families():
    original = FAMILIES["qwen2_moe"]
    with pytest.raises(ConfigError, match=r"'qwen2_moe' is already registered \(pass overwrite=True\)"):
        register_family(dataclasses.replace(original, router_class="X"))
    assert FAMILIES["qwen2_moe"] is original
    with pytest.raises(ConfigError, match="takes a MoEFamily"):
        register_family("qwen2_moe")
    try:
        register_family(dataclasses.replace(original, router_class="X"), overwrite=True)
        assert get_family("qwen2_moe").router_class == "X"
    finally:
        register_family(original, overwrite=True)
    assert FAMILIES["qwen2_moe"] is original


def test_dataclass_validation():
    with pytest.raises(ConfigError, match="kind 'copy'"):
        TensorPair("copy", ("a",), "b")
    with pytest.raises(ConfigError, match="'qkv' takes 3"):
        TensorPair("qkv", ("q", "k"), "qkv")
    with pytest.raises(ConfigError, match="needs expert_ffn_size"):
        MegatronSpec()
    MegatronSpec(refused="nothing maps")                   # a refusal needs no pieces
    qwen3 = FAMILIES["qwen3_moe"]
    with pytest.raises(ConfigError, match="must include 'model_type'"):
        dataclasses.replace(qwen3, arch_keys=("hidden_size",))
    with pytest.raises(ConfigError, match="non-empty str"):
        dataclasses.replace(qwen3, model_type="")


def test_old_constructor_call_still_works():
    """``MoEFamily(model_type, router_class, scoring, num_experts[, scores_in_fp32])`` as before the registry."""
    family = MoEFamily("x_moe", "XTopKRouter", lambda c: RouterScoring(), lambda c: c.num_experts)
    assert family.arch_keys == ARCH_KEYS and family.megatron is None and not family.scores_in_fp32


def test_hf_reexports_the_registry(transformers):
    from moealign.patches import hf

    assert hf.FAMILIES is FAMILIES and hf.MoEFamily is MoEFamily and hf.register_family is register_family


def test_package_imports_no_engine():
    code = ("import sys, moealign.families, moealign.record; "
            f"print([m for m in sys.modules if m.split('.')[0] in {ENGINES!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", out.stdout
    for path in (PACKAGE / "families").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert not [n for n in names if n.split(".")[0] in ENGINES], (path.name, names)


# --------------------------------------------------------------------------------------------------
# 2. record fingerprints: unchanged
# --------------------------------------------------------------------------------------------------


def test_fingerprint_of_known_configs_is_unchanged():
    assert config_fingerprint(RECORD_TEST_CONFIG) == RECORD_TEST_FINGERPRINT == old_fingerprint(RECORD_TEST_CONFIG)
    embedded = _embedded_config()
    for name, want in EMBEDDED_FINGERPRINTS.items():
        config = dict(embedded, model_type=name)
        assert config_fingerprint(config) == want == old_fingerprint(config), name


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_families_fingerprint_the_old_keys(name):
    assert set(arch_keys(name)) == set(OLD_ARCH_KEYS)
    assert arch_keys("no_such_family") == ARCH_KEYS and set(ARCH_KEYS) == set(OLD_ARCH_KEYS)


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": True}, {"num_hidden_layers": 4, "rms_norm_eps": 1e-5}])
def test_fingerprint_of_family_configs_is_unchanged(transformers, name, overrides):
    overrides = {k: v for k, v in overrides.items() if name != "mixtral" or k != "norm_topk_prob"}
    config = tiny_config(transformers, name, **overrides).to_dict()
    assert config_fingerprint(config) == old_fingerprint(config)


@pytest.mark.parametrize("name", BUILTIN)
def test_records_saved_before_still_match(transformers, name):
    """A record whose metadata was written before the registry (old fingerprint) matches the model today."""
    from moealign.patches import hf

    model = tiny_model(transformers, tiny_config(transformers, name))
    now = hf.record_meta(model)
    saved = RecordMeta.from_json(json.dumps(dict(json.loads(now.to_json()),
                                                 model_fingerprint=old_fingerprint(model.config.to_dict()))))
    assert saved.model_fingerprint == now.model_fingerprint
    saved.check_matches(now)                                    # no RecordMismatchError
    other = tiny_model(transformers, tiny_config(transformers, name, rms_norm_eps=1e-3))
    with pytest.raises(moealign.errors.RecordMismatchError, match="model_fingerprint"):
        saved.check_matches(hf.record_meta(other))             # negative control: another architecture


# --------------------------------------------------------------------------------------------------
# 3. each family's statements hold for its transformers model
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_family_statements_match_the_transformers_model(transformers, name, norm_topk_prob):
    from moealign.patches import hf

    overrides = {} if name == "mixtral" else {"norm_topk_prob": norm_topk_prob}
    if name in ("qwen3_moe", "qwen2_moe"):
        overrides.update(layers=5, decoder_sparse_step=2, mlp_only_layers=[3])
    config = tiny_config(transformers, name, **overrides)
    model = tiny_model(transformers, config, dtype=torch.bfloat16)
    family = get_family(name)
    info = hf.describe_model(model)
    assert info.family is family and info.scoring == family.scoring(config)
    assert info.moe_layers == tuple(i for i, s in enumerate(family.moe_layer_pattern(config)) if s)
    assert list(family.moe_layer_pattern(config)) == old_layer_pattern(config)
    if name in ("qwen3_moe", "qwen2_moe"):
        assert info.moe_layers == (1,)                          # layer 3 is in mlp_only_layers
    assert info.num_experts == family.num_experts(config) == 6
    # the router computes exactly the stated scoring, in the stated dtype
    torch.manual_seed(1)
    for _, router in info.routers:
        with torch.no_grad():
            router.weight.normal_(0, 2.0)
            logits, scores, ids = router(torch.randn(17, config.hidden_size, dtype=torch.bfloat16))
        out_dtype = torch.float32 if family.scores_in_fp32 else logits.dtype
        assert scores.dtype == out_dtype
        want_w, want_ids = select_topk(logits, info.top_k, family.scoring(config), out_dtype=out_dtype)
        assert torch.equal(ids, want_ids) and torch.equal(scores, want_w)
        other = dataclasses.replace(family.scoring(config), renormalize=not family.scoring(config).renormalize)
        assert not torch.equal(scores, select_topk(logits, info.top_k, other, out_dtype=out_dtype)[0])


# --------------------------------------------------------------------------------------------------
# 4. a family added in one module
# --------------------------------------------------------------------------------------------------

FAKE_MODULE = textwrap.dedent('''
    """A made-up family: the Qwen3-MoE architecture under its own model_type, every second layer sparse, and a
    fingerprint key of its own. Everything moealign needs is in this one module."""

    from moealign.families import ARCH_KEYS, MegatronSpec, MoEFamily, RouterScoring, TensorPair, register_family


    def router_scoring(config):
        return RouterScoring(score="softmax", renormalize=bool(getattr(config, "norm_topk_prob", False)))


    def moe_layer_pattern(config):
        return tuple(int(i % 2 == 1) for i in range(config.num_hidden_layers))


    FAMILY = MoEFamily(
        model_type="moealign_fake_moe",
        router_class="Qwen3MoeTopKRouter",
        scoring=router_scoring,
        num_experts=lambda c: int(c.num_experts),
        scores_in_fp32=False,
        moe_layer_pattern=moe_layer_pattern,
        arch_keys=ARCH_KEYS + ("moealign_fake_knob",),
        megatron=MegatronSpec(
            expert_ffn_size=lambda c: int(c.moe_intermediate_size),
            config_fields=lambda c: {"qk_layernorm": True},
            attention_tensors=lambda c: (
                TensorPair("same", ("self_attn.q_norm.weight",), "self_attention.q_layernorm.weight"),
                TensorPair("same", ("self_attn.k_norm.weight",), "self_attention.k_layernorm.weight")),
        ),
    )

    register_family(FAMILY)
''')


@pytest.fixture
def fake_family(tmp_path, monkeypatch):
    (tmp_path / "moealign_fake_family.py").write_text(FAKE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import moealign_fake_family

        yield moealign_fake_family.FAMILY
    finally:
        FAMILIES.pop("moealign_fake_moe", None)
        sys.modules.pop("moealign_fake_family", None)
    with pytest.raises(UnsupportedModelError):
        get_family("moealign_fake_moe")


def _fake_model(transformers, **overrides):
    class FakeConfig(transformers.Qwen3MoeConfig):
        model_type = "moealign_fake_moe"

    kw = dict(TINY, num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=16, num_experts=6,
              decoder_sparse_step=2, moealign_fake_knob=3)
    kw.update(overrides)
    return tiny_model(transformers, FakeConfig(**kw), cls=transformers.Qwen3MoeForCausalLM)


def test_fake_family_describe_model_and_record_meta(transformers, fake_family):
    from moealign.patches import hf

    assert get_family("moealign_fake_moe") is fake_family and hf.FAMILIES["moealign_fake_moe"] is fake_family
    model = _fake_model(transformers)
    info = hf.describe_model(model)
    assert info.family is fake_family and info.moe_layers == (1, 3) and info.num_experts == 6
    assert info.scoring == RouterScoring(score="softmax", renormalize=False)
    meta = hf.record_meta(model)
    assert meta.moe_layers == (1, 3)
    # the family's own fingerprint key counts (a built-in family would ignore it)
    assert hf.record_meta(_fake_model(transformers, moealign_fake_knob=4)).model_fingerprint != meta.model_fingerprint
    assert meta.model_fingerprint != old_fingerprint(model.config.to_dict())
    plain = dict(model.config.to_dict(), model_type="qwen3_moe")
    assert config_fingerprint(plain) == config_fingerprint(dict(plain, moealign_fake_knob=4))


def test_fake_family_megatron_mapping(transformers, fake_family):
    pytest.importorskip("megatron.core")
    from moealign.patches.megatron import checkpoint as mc

    assert "moealign_fake_moe" in mc.CONVERTIBLE_FAMILIES
    model = _fake_model(transformers)
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = mc.megatron_state_dict_from_hf(sd, model.config)      # every transformers tensor consumed
        cfg = mc.megatron_config_from_hf(model.config, cpu=True)
    assert cfg.moe_layer_freq == [0, 1, 0, 1] and cfg.qk_layernorm and cfg.num_moe_experts == 6
    assert cfg.moe_ffn_hidden_size == 16 and cfg.moe_router_pre_softmax
    assert torch.equal(full["decoder.layers.2.self_attention.q_layernorm.weight"],
                       sd["model.layers.2.self_attn.q_norm.weight"])
    assert "decoder.layers.1.mlp.router.weight" in full and "decoder.layers.0.mlp.linear_fc1.weight" in full
    # refusing it is one field too
    register_family(dataclasses.replace(fake_family, megatron=MegatronSpec(refused="made-up reason")),
                    overwrite=True)
    assert "moealign_fake_moe" not in mc.CONVERTIBLE_FAMILIES
    with pytest.raises(UnsupportedConversionError, match="moealign_fake_moe: made-up reason cannot be expressed"):
        mc.megatron_state_dict_from_hf(sd, model.config)
    register_family(dataclasses.replace(fake_family, megatron=None), overwrite=True)
    with pytest.raises(UnsupportedConversionError, match="'moealign_fake_moe' has no Megatron conversion"):
        mc.megatron_state_dict_from_hf(sd, model.config)


# --------------------------------------------------------------------------------------------------
# 5. the Megatron converter reads the families
# --------------------------------------------------------------------------------------------------


def test_checkpoint_has_no_model_type_branches():
    path = PACKAGE / "patches" / "megatron" / "checkpoint.py"
    source = path.read_text()
    assert "model_type ==" not in source and "model_type !=" not in source
    tree = ast.parse(source)
    names = set(FAMILIES) | set(BUILTIN)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            text = ast.unparse(node)
            assert "model_type" not in text, text
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert node.value not in names, f"family name {node.value!r} spelled out in checkpoint.py"


def test_convertible_families_follow_the_registry():
    pytest.importorskip("megatron.core")
    from moealign.patches.megatron import checkpoint as mc

    assert mc.CONVERTIBLE_FAMILIES == mc.convertible_families() == CONVERTIBLE + ("deepseek_v3",)  # issue 37
    with pytest.raises(AttributeError):
        mc.NO_SUCH_NAME      # noqa: B018


@pytest.mark.parametrize("name", CONVERTIBLE)
def test_megatron_layer_pattern_is_the_familys(transformers, name):
    pytest.importorskip("megatron.core")
    from moealign.patches.megatron import checkpoint as mc

    config = tiny_config(transformers, name, layers=4, **({} if name == "mixtral" else {"decoder_sparse_step": 2}))
    assert mc._moe_layer_pattern(config) == list(get_family(name).moe_layer_pattern(config)) == old_layer_pattern(config)


def test_olmoe_refusal_comes_from_its_module(transformers):
    pytest.importorskip("megatron.core")
    from moealign.patches.megatron import checkpoint as mc

    config = tiny_config(transformers, "olmoe")
    with pytest.raises(UnsupportedConversionError, match=r"olmoe: full-width q_norm/k_norm") as info:
        mc.megatron_state_dict_from_hf({}, config)
    assert FAMILIES["olmoe"].megatron.refused in str(info.value)
