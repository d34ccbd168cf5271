"""certify_refit (issue 38 items 1-4, 6): every check of a refit certificate against a fault planted where it
looks, on the real engine (tests/vllm_certify_child.py: the embedded model, fp32, TP = 1; one engine with prefix
caching on (moealign's default) and a Megatron trainer, then a plain one with caching on). Each check has its negative control: the fault it
catches is invisible to the checks before it (a decode-only fault passes the prefill probe, a stale prefix cache and
a nudged RoPE cache pass the digests). Engine-free pieces (bad input, the verdict) run without vLLM."""

from __future__ import annotations

import json

import pytest
import torch

from moealign._optional import probe as probe_module
from moealign.errors import ConfigError, RefitError
from moealign.rl import CHECKS, Probe, RefitCertificate

from vllm_util import run_child

pytestmark = pytest.mark.heavy          # long-running (engines): scheduled first, tests/conftest.py

VLLM = probe_module("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")

BUGS = {"engine_awake": "TRL #5312", "tensor_digests": "SkyRL #1816", "derived_buffers": "SGLang #28676",
        "decode_probe": "NeMo-RL #2895", "prefix_cache": "NeMo-RL #4018"}


@pytest.fixture(scope="module")
def child() -> dict:
    return run_child("vllm_certify_child.py")


# --------------------------------------------------------------------------------------------------
# engine-free
# --------------------------------------------------------------------------------------------------


def test_checks_name_what_they_catch_and_their_public_bug():
    assert list(CHECKS) == ["engine_awake", "config", "tensor_digests", "derived_buffers", "prefill_probe",
                            "decode_probe", "prefix_cache"]
    for name, bug in BUGS.items():
        assert bug in CHECKS[name][1]


def test_verdict_names_the_first_failed_check_and_raises():
    checks = [{"name": n, "status": s, "detail": d} for n, s, d in
              (("tensor_digests", "passed", ""), ("decode_probe", "failed", "decode"), ("prefix_cache", "failed", "x"))]
    cert = RefitCertificate(checks=checks, config={})
    assert not cert.ok and cert.first_failed == "decode_probe"
    assert json.loads(json.dumps(cert.to_dict()))["first_failed"] == "decode_probe"
    with pytest.raises(RefitError, match="decode_probe FAILED"):
        cert.check()
    ok = RefitCertificate(checks=[dict(checks[0]), {"name": "prefix_cache", "status": "not_run", "detail": ""}],
                          config={})
    assert ok.ok and ok.first_failed is None and ok.check() is ok


@pytest.mark.parametrize("kwargs, match", [({"decode_tokens": -1}, "decode_tokens"), ({"decode_tokens": 1.5},
                                                                                       "decode_tokens"),
                                           ({"seed": -3}, "seed"), ({"decode_bound": float("nan")}, "decode_bound")])
def test_probe_decode_fields_refused_when_built(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Probe([torch.arange(30)], **kwargs)


# --------------------------------------------------------------------------------------------------
# on the engine
# --------------------------------------------------------------------------------------------------


@needs_vllm
def test_clean_refit_passes_every_check_with_one_json_verdict(child):
    c = child["clean"]
    assert c["ok"] and c["json"]["ok"] and c["json"]["first_failed"] is None
    assert c["statuses"] == {"engine_awake": "passed", "config": "passed", "tensor_digests": "passed",
                             "derived_buffers": "passed", "prefill_probe": "passed", "decode_probe": "passed",
                             "prefix_cache": "passed"}           # the rollout engine caches prefixes (the default)
    for entry in c["json"]["checks"]:
        assert entry["catches"] and entry["stands_for"] and entry["seconds"] >= 0
    assert c["json"]["config"]["sleep_mode"]["available"] is False
    assert not any(x.startswith("decode path") for x in c["json"]["not_checked"])


@needs_vllm
def test_one_call_probes_measure_what_the_two_calls_measure(child):
    """certify_refit's probes (Probe.both_gaps: one vLLM call, one trainer forward) give the gaps the separate calls
    (Probe.gaps, Probe.decode_gaps) calibrated at step 0, so the calibrated bounds apply to them."""
    import math

    for kind in ("prefill", "decode"):
        assert math.isclose(child["both_step0"][kind], child["step0"][kind], rel_tol=0.05, abs_tol=1e-7), kind


@needs_vllm
def test_decode_only_fault_passes_the_prefill_probe_and_fails_the_decode_probe(child):
    d = child["decode_fault"]
    # the negative control: the prefill probe (and the digests) cannot see a fault on decode steps
    assert d["statuses"]["prefill_probe"] == "passed" and d["statuses"]["tensor_digests"] == "passed"
    assert d["statuses"]["decode_probe"] == "failed" and d["first_failed"] == "decode_probe"
    assert "DECODE PATH" in d["detail"]
    assert d["verify_probe_ok"] and not d["verify_decode_ok"] and not d["verify_ok"]     # verify_refit decodes too
    assert child["decode_fault_undone_ok"]


@needs_vllm
def test_stale_prefix_cache_is_named_and_moealigns_refit_passes(child):
    assert child["primed"] == 2
    ok = child["cache_ok"]
    assert ok["ok"] and ok["prefix"]["status"] == "passed"       # moealign's refit reset the cache
    stale = child["cache_stale"]
    assert stale["first_failed"] == "prefix_cache" and stale["statuses"]["tensor_digests"] == "passed"
    assert stale["prefix"]["cached_tokens"] > 0 and "PREFIX CACHE" in stale["prefix"]["detail"]
    after = child["cache_after"]
    assert after["still_stale"] == "prefix_cache"               # stale blocks stay until a reset
    assert after["reset"] == [True, 0]
    ok_hit, hit_tokens = after["genuine_hit"]
    assert ok_hit and hit_tokens > 0                             # a genuine hit equals a cold run, bitwise


@needs_vllm
def test_default_prefix_check_one_probe_sequence_one_token_names_a_stale_cache(child):
    """certify_refit's own prefix check (no cache_prompts: the probe's first sequence tiled to a KV block + 8 tokens,
    one sampled token per run) on moealign's rollout engine: with the refit's cache reset disabled, the digests and
    both probes pass (their requests never read the prefix cache) and the prefix check alone fails."""
    s = child["probe_cache_stale"]
    assert s["first_failed"] == "prefix_cache"
    assert all(s["statuses"][n] == "passed" for n in ("tensor_digests", "derived_buffers", "prefill_probe",
                                                      "decode_probe"))
    assert s["prefix"]["cached_tokens"] == 128 and "PREFIX CACHE" in s["prefix"]["detail"]   # one block, one prompt
    clean = next(c for c in child["clean"]["json"]["checks"] if c["name"] == "prefix_cache")
    assert clean["status"] == "passed" and clean["detail"].startswith("1 prompt of 136 tokens, 1 sampled token:")


@needs_vllm
def test_derived_buffer_fault_passes_the_digests_and_is_named(child):
    r = child["rope_fault"]
    assert r["statuses"]["tensor_digests"] == "passed" and r["first_failed"] == "derived_buffers"
    assert "rotary_emb.cos_sin_cache" in r["detail"]


@needs_vllm
def test_base_weights_restored_are_caught_by_the_digests(child):
    b = child["base_restored"]
    assert b["updated_ok"]
    assert b["first_failed"] == "tensor_digests" and b["named"]
    assert all("self_attn" in n for n in b["named"])


@needs_vllm
@pytest.mark.parametrize("level", ["1", "2"])
def test_sleeping_engine_refused_by_name_cpu_has_no_sleep_mode(child, level):
    s = child["sleep"][level]
    for what, message in s["refused"]:
        assert message is not None, what
        assert "asleep" in message and "CPU build has no sleep mode" in message
    assert s["woken_ok"] and s["sleep_mode"]["available"] is False
    assert "Sleep mode is not supported on current platform" in child["vllm_sleep_mode"]


@needs_vllm
def test_probe_that_cannot_run_refused_at_construction(child):
    r = child["refused"]
    assert "exceed the engine's context" in r["too_long"]
    assert "no trainer for its teacher-forced side" in r["manifest"]
    assert "no trainer for its teacher-forced side" in r["snapshot"]
    assert r["manifest_without_probe"]["tensor_digests"] == "passed"
    assert r["manifest_without_probe"]["prefill_probe"] == "not_run"
