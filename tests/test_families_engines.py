"""Every supported MoE family through the main job's engines: a tiny random checkpoint per family (2 layers, hidden
64, 8 experts top-2, the embedded tokenizer) rolled out by vLLM and scored by Megatron-core (the default engines), in
this one test process, one family after the other, so a family that breaks on one engine pair is seen.

qwen3_moe, qwen2_moe (q/k/v bias, a shared expert and its gate) and mixtral run vLLM -> Megatron; qwen2_moe also
vLLM -> transformers (``--train hf``); olmoe, which Megatron's local spec cannot express, runs vLLM -> transformers
and is refused on Megatron by a one-line message naming ``--train hf``. Issue 34 (5): vLLM's record of a qwen2_moe
checkpoint carried another model fingerprint than the trainer's (vLLM writes ``sliding_window=None`` over the
checkpoint's ``0`` in the config it holds); the fingerprint is now the checkpoint's config.json as written on both
engines (:func:`moealign.model_config.checkpoint_fingerprint`). Negative control: a record loaded against a checkpoint
whose config differs in one architecture field is still refused."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from moealign._optional import probe
from moealign.cli import main

VLLM = probe("vllm")
pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")]

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
SMALL = ["--num-prompts", "2", "--max-new-tokens", "4", "--device", "cpu", "-q"]


def _build(model_type: str, out) -> None:
    """A random ``model_type`` checkpoint in ``out`` (every tensor drawn, biases and the shared-expert gate included;
    written by save_pretrained) with the embedded model's tokenizer."""
    transformers = pytest.importorskip("transformers")
    from moealign.embedded import embedded_model_path

    common = dict(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if model_type == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=True)
    elif model_type == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, shared_expert_intermediate_size=64,
                                          norm_topk_prob=False, qkv_bias=True)
    elif model_type == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                         sliding_window=None)
    elif model_type == "olmoe":
        cfg = transformers.OlmoeConfig(**common, intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    else:
        raise AssertionError(model_type)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.08 * torch.randn_like(p))
        model.save_pretrained(out)
    src = embedded_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for model_type in FAMILIES:
        out[model_type] = root / model_type
        _build(model_type, out[model_type])
    return out


def _mismatch(*argv) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        code = main(["mismatch", *argv])
    return code, err.getvalue()


#: (family, --train): the default engines for every family Megatron converts, and --train hf (qwen2_moe: both)
RUNS = (("qwen3_moe", "megatron"), ("qwen2_moe", "megatron"), ("qwen2_moe", "hf"), ("mixtral", "megatron"),
        ("olmoe", "hf"))


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """Each of :data:`RUNS` through the CLI, in this process, one after the other: ``{(family, train): (exit code,
    stderr, report or None, record path)}``."""
    root = tmp_path_factory.mktemp("family_runs")
    out = {}
    for model_type, train in RUNS:
        report, record = root / f"{model_type}-{train}.json", root / f"{model_type}-{train}.safetensors"
        code, err = _mismatch("--model", str(checkpoints[model_type]), "--train", train, *SMALL,
                              "--json", str(report), "--save-record", str(record))
        out[model_type, train] = (code, err, json.loads(report.read_text()) if code == 0 else None, record)
    return out


def test_every_family_runs_on_its_engines(checkpoints, runs):
    failed = {f"{m} vllm -> {t}": err.strip().splitlines()[-1:] for (m, t), (code, err, _, _) in runs.items() if code}
    assert failed == {}
    from moealign.record import RolloutRecord
    from moealign.model_config import checkpoint_fingerprint

    for (model_type, train), (_, _, report, record) in runs.items():
        assert report["rollout"]["engine"] == "vllm"
        assert report["train"]["engine"] == ("megatron" if train == "megatron" else "transformers")
        assert report["num_tokens"] == 2 * 4
        metrics = {r["name"]: r["metrics"] for r in report["runs"]}
        # the record's routes are replayed: the trainer runs exactly the experts vLLM chose
        assert metrics["routing_replay"]["router_flip_rate"] == 0, model_type
        assert report["warnings"] == [], (model_type, train, report["warnings"])
        meta = RolloutRecord.load(str(record)).meta
        assert meta.engine == "vllm" and meta.model_fingerprint == checkpoint_fingerprint(checkpoints[model_type])


def test_olmoe_on_megatron_is_refused_naming_train_hf(checkpoints):
    """Refused before any work (no vLLM rollout first: its only output is the one line)."""
    code, err = _mismatch("--model", str(checkpoints["olmoe"]), *SMALL)
    assert code == 2 and err.count("\n") == 1, err
    assert "olmoe: full-width q_norm/k_norm" in err and "--train hf" in err


def test_a_record_of_another_architecture_is_still_refused(checkpoints, runs, tmp_path):
    """Negative control: the qwen2_moe record vLLM made, loaded against a copy of its checkpoint whose config.json
    differs in one architecture field (rms_norm_eps), is refused by the model fingerprint (the checkpoint itself
    accepted it: test_every_family_runs_on_its_engines)."""
    code, err, _, record = runs["qwen2_moe", "megatron"]
    assert code == 0, err
    other = tmp_path / "qwen2_other"
    shutil.copytree(checkpoints["qwen2_moe"], other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(config))
    code, err = _mismatch("--model", str(other), "--load-record", str(record), "-q")
    last = err.strip().splitlines()[-1]
    assert code == 2 and "RecordMismatchError" in last and "model_fingerprint" in last, err
