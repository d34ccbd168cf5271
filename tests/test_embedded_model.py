"""The embedded default model (moealign/assets/tiny_moe) loads with plain transformers and is peaked.

Peaked is what makes it useful: routing replay and sampling-mask replay are only tested by a model whose
routers prefer some experts and whose top-p sets are small. Each peakedness check runs next to a
negative control, a randomly initialised model of the same config, which must fail it.
"""

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import warm

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "moealign" / "assets" / "tiny_moe"
BUILD = ROOT / "tools" / "build_tiny_moe.py"
MAX_BYTES = 20 * 1024 * 1024
N_PROMPTS_MEASURED = 8


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(ASSET)
    return m.eval()


@pytest.fixture(scope="module")
def prompts():
    return json.loads((ASSET / "prompts.json").read_text(encoding="utf-8"))


def peakedness(model, tokenizer, prompts):
    """(mean router entropy / log E over layers and tokens, mean top-p 0.9 kept-set size) on prompts."""
    n_experts = model.config.num_experts
    router_entropies, kept_sizes = [], []
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            out = model(input_ids=ids, output_router_logits=True, use_cache=False)
            assert len(out.router_logits) == model.config.num_hidden_layers
            for logits in out.router_logits:
                assert logits.shape == (ids.shape[1], n_experts)
                logp = logits.float().log_softmax(-1)
                router_entropies.append(-(logp.exp() * logp).sum(-1))
            probs = out.logits[0].float().softmax(-1)
            sorted_probs = probs.sort(-1, descending=True).values
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            kept_sizes.append((mass_before < 0.9).sum(-1).float())
    router_ratio = torch.cat(router_entropies).mean().item() / math.log(n_experts)
    return router_ratio, torch.cat(kept_sizes).mean().item()


def test_files_and_size():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "prompts.json", "build_info.json"):
        assert (ASSET / name).is_file(), name
    total = sum(p.stat().st_size for p in ASSET.iterdir() if p.is_file())
    assert (ASSET / "model.safetensors").stat().st_size <= MAX_BYTES
    assert total <= MAX_BYTES, total


def test_config_family_and_sizes(model, tokenizer):
    cfg = model.config
    assert cfg.model_type == "qwen3_moe"
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (4, 16, 4)
    assert cfg.norm_topk_prob is True
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128, 4, 2, 32)
    assert cfg.vocab_size == 2048 and cfg.max_position_embeddings == 512
    assert cfg.decoder_sparse_step == 1 and list(cfg.mlp_only_layers) == []
    assert cfg.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # every layer is a MoE layer with 16 experts
    for layer in model.model.layers:
        assert type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
        assert layer.mlp.experts.gate_up_proj.shape[0] == 16
    # special tokens are real tokenizer tokens, inside the vocabulary
    assert len(tokenizer) <= cfg.vocab_size
    for tid, name in ((cfg.bos_token_id, "<|endoftext|>"), (cfg.eos_token_id, "<|endoftext|>"),
                      (cfg.pad_token_id, "<|pad|>")):
        assert 0 <= tid < cfg.vocab_size
        assert tokenizer.convert_ids_to_tokens(tid) == name
    assert tokenizer.eos_token_id == cfg.eos_token_id and tokenizer.pad_token_id == cfg.pad_token_id
    gen = transformers.GenerationConfig.from_pretrained(ASSET)
    assert (gen.eos_token_id, gen.pad_token_id) == (cfg.eos_token_id, cfg.pad_token_id)


def test_tokenizer_round_trip(tokenizer):
    text = "def main(argv=None):\n    return 0  # \u00e9\n"
    ids = tokenizer(text).input_ids
    assert len(ids) < len(text.encode())  # BPE merges happened
    assert tokenizer.decode(ids) == text  # byte-level: lossless, no bos/eos added


def test_prompts(prompts, tokenizer):
    assert isinstance(prompts, list) and len(prompts) == 64
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert len(set(prompts)) == 64
    lengths = [len(tokenizer(p).input_ids) for p in prompts]
    assert min(lengths) >= 20 and max(lengths) <= 40, (min(lengths), max(lengths))


def test_model_is_peaked(model, tokenizer, prompts):
    router_ratio, kept = peakedness(model, tokenizer, prompts[:N_PROMPTS_MEASURED])
    assert router_ratio < 0.9, f"router entropy {router_ratio:.3f} x log E: routers near uniform"
    assert kept < 200, f"top-p 0.9 keeps {kept:.0f} tokens on average: next-token distributions near uniform"


def test_random_model_is_not_peaked(model, tokenizer, prompts):
    """Negative control: the same checks reject random weights of the same config."""
    torch.manual_seed(0)
    random_model = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    router_ratio, kept = peakedness(random_model, tokenizer, prompts[:2])
    assert router_ratio >= 0.9
    assert kept >= 200


def test_build_info_matches_weights():
    info = json.loads((ASSET / "build_info.json").read_text())
    assert info["weights_sha256"] == hashlib.sha256((ASSET / "model.safetensors").read_bytes()).hexdigest()
    assert len(info["router_entropy_over_logE_per_layer"]) == 4


def test_build_script_quick(tmp_path):
    out = tmp_path / "tiny"
    # the timeout only guards against a hang: under pytest -n on a loaded 2-core machine the quick build took > 120 s
    # the tokenizer's trainer on one thread (its thread pool spins against the other test worker's cores otherwise:
    # 6 s alone, up to 44 s in the suite)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
    proc = warm.run([sys.executable, str(BUILD), "--quick", "--out", str(out)],
                    capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weights sha256" in proc.stdout
    tok = transformers.AutoTokenizer.from_pretrained(out)
    m = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert m.config.model_type == "qwen3_moe" and m.config.num_experts == 16
    ids = tok("def f(x):\n    return", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], m.config.vocab_size) and torch.isfinite(logits).all()
    info = json.loads((out / "build_info.json").read_text())
    assert info["steps"] >= 1 and math.isfinite(info["heldout_loss"])
    assert len(json.loads((out / "prompts.json").read_text())) == 64
