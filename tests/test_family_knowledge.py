"""Family knowledge lives in the family's file (issue 36, item 2): which paths are verified on a family beyond replay
(the canonical forward, vLLM's weight digests, the refit verifier) and its vLLM classes are fields of its
``MoEFamily``; the engine bindings read them, so a new family touches its own file (and its tests) only."""

from __future__ import annotations

import dataclasses

import pytest

from moealign.errors import CanonicalError, ConfigError
from moealign.families import FAMILIES, VERIFIED_PATHS, MoEFamily, get_family, register_family, verified_families


def test_qwen3_moe_is_the_verified_family_and_says_so_in_its_file():
    assert verified_families("aligned") == ("qwen3_moe", "deepseek_v3")       # tests/test_aligned_deepseek.py
    assert "Qwen3MoeSparseMoeBlock" in get_family("qwen3_moe").vllm_classes
    for name in ("qwen2_moe", "mixtral", "olmoe"):
        assert not FAMILIES[name].verified, name
    assert "refit" in FAMILIES["deepseek_v3"].verified          # MLA's refit verifier: tests/test_deepseek_refit.py


def test_a_family_declared_verified_is_covered_everywhere_it_is_read():
    from moealign.patches.vllm.canonical import _passive
    from moealign.precision.canonical import check_canonical_model, covered_families

    base = get_family("qwen3_moe")
    fake = dataclasses.replace(base, model_type="fake_moe", vllm_classes=("FakeMoeModel",),
                               verified=frozenset({"aligned", "vllm_digests"}))
    with pytest.raises(CanonicalError, match="fake_moe"):
        check_canonical_model({"model_type": "fake_moe"})        # negative control: not registered yet
    register_family(fake)
    try:
        assert "fake_moe" in covered_families() and "fake_moe" in verified_families("vllm_digests")
        assert "FakeMoeModel" in _passive()
        check_canonical_model({"model_type": "fake_moe"})
    finally:
        del FAMILIES["fake_moe"]
    assert "FakeMoeModel" not in _passive()


def test_an_unknown_verified_path_is_refused():
    with pytest.raises(ConfigError, match="unknown paths"):
        dataclasses.replace(get_family("qwen3_moe"), verified=frozenset({"bitwise-on-mars"}))
    with pytest.raises(ConfigError, match="unknown path"):
        verified_families("nope")
    assert set(VERIFIED_PATHS) == {"aligned", "vllm_digests", "refit"}
    assert isinstance(get_family("qwen3_moe"), MoEFamily)
