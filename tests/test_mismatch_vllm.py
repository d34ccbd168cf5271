"""The main job: `moealign mismatch` with no engine flags rolls out with vLLM (its CPU build here) and trains
with Megatron-core, on the embedded model, with the default sizes (32 prompts x 48 tokens, bf16 vs fp32)."""

from __future__ import annotations

import json
import warnings

import pytest

from moealign._optional import probe
from moealign.cli import main

VLLM = probe("vllm")
pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("main_job") / "report.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["mismatch", "-q", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_default_engines_are_vllm_and_megatron_with_versions(report):
    from importlib.metadata import version

    assert report["rollout"]["engine"] == "vllm" and report["rollout"]["engine_version"] == VLLM.version
    assert report["train"]["engine"] == "megatron"
    assert report["train"]["engine_version"] == version("megatron-core")
    assert (report["rollout"]["dtype"], report["train"]["dtype"]) == ("bf16", "fp32")
    assert report["num_tokens"] == 32 * 48


def test_each_lever_removes_what_it_should(report):
    runs = {r["name"]: r["metrics"] for r in report["runs"]}
    # negative controls: bf16 vLLM vs fp32 Megatron flips routers and truncates differently without the levers
    assert runs["baseline"]["router_flip_rate"] > 0
    assert runs["baseline"]["support_mismatch_rate"] > 0
    # routing replay: Megatron runs exactly the experts vLLM recorded; the sampling mask: exactly its kept sets
    assert runs["routing_replay"]["router_flip_rate"] == 0
    assert runs["routing_replay+sampling_mask"]["router_flip_rate"] == 0
    assert runs["sampling_mask"]["support_mismatch_rate"] == 0
    assert runs["routing_replay+sampling_mask"]["support_mismatch_rate"] == 0
    assert (runs["routing_replay+sampling_mask"]["mean_abs_logp_diff"]
            < 0.5 * runs["baseline"]["mean_abs_logp_diff"])


def test_transformers_only_options_name_the_engines(capsys):
    for argv in (["--batch-invariant"], ["--sweep"], ["--attention", "eager"]):
        assert main(["mismatch", *argv]) == 2
        err = capsys.readouterr().err
        assert "--rollout hf --train hf" in err and err.count("\n") == 1
