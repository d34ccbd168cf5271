"""The refit API (``moealign.rl.refit`` / ``verify_refit``) against hostile inputs (issue 34 (b) (c) (d) (e) (i) (j)
(k) (l) (m)): one fp16 vLLM engine and moealign's transformers train engine in a child process
(tests/vllm_refit_hostile_child.py), and the engine-free pieces (config comparison, value checks, the probe's
fields, the per-engine refit marker) here. Each refusal is checked with what the engine holds afterwards (its
log-probs, ``verify_refit``), and each check next to a case that passes."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from moealign._optional import probe as probe_module
from moealign.errors import ConfigError, InputTypeError, RefitError

from vllm_util import run_child

pytestmark = pytest.mark.heavy          # one vLLM engine (tests/conftest.py schedules heavy files first)

VLLM = probe_module("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")


@pytest.fixture(scope="module")
def r() -> dict:
    return run_child("vllm_refit_hostile_child.py")


def _refused(err: dict, *words: str) -> None:
    assert err["cls"] is not None, "not refused"
    assert err["moealign"], f"a raw {err['cls']}: {err['msg']}"
    for word in words:
        assert word in err["msg"], (word, err["msg"])


# --------------------------------------------------------------------------------------------------
# on the engine
# --------------------------------------------------------------------------------------------------


@needs_vllm
def test_no_section_raised(r):
    assert r["errors"] == {}                # a section that raised (raw or not) is recorded by the child


@needs_vllm
def test_probe_runs_with_the_transformers_train_engine(r):
    # (k) HFTrainEngine.forward takes no capture=: the probe used to fail with a raw TypeError
    assert r["calibrate"]["cls"] is None, r["calibrate"]
    assert r["base_ok"]
    d = r["base_dict"]
    assert d["probe_gap"] is not None and 0 <= d["probe_gap"] <= d["probe_bound"] and math.isfinite(d["probe_bound"])


@needs_vllm
def test_what_was_not_checked_is_stated(r):
    # (e) the probe scores a prefill and (calibrated with a decode: issue 38) a decode; the prefix cache is named
    # as not checked (certify_refit checks it)
    probed = r["base_dict"]["not_checked"]
    assert not any(x.startswith("decode path") for x in probed) and any("prefix" in x for x in probed)
    assert r["base_dict"]["decode_gap"] is not None and r["base_dict"]["decode_gap"] <= r["base_dict"]["decode_bound"]
    assert not any(x.startswith("the forward") for x in probed)
    plain = r["base_no_probe_dict"]["not_checked"]
    assert any(x.startswith("the forward") for x in plain)          # no probe: the logits were not compared


@needs_vllm
@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps", "norm_topk_prob", "hidden_act", "mlp_only_layers"])
def test_forward_changing_config_fields_are_refused_by_name(r, field):
    # (b) equal tensor shapes, another forward: refit refused naming the field, verify_refit not ok naming it
    case = r["arch"][field]
    _refused(case["refit"], field, "before any weight moved")
    assert case["refit"]["cls"] == "RefitError"
    assert not case["verify"]["ok"]
    assert any(field in m for m in case["verify"]["config_mismatches"])
    assert case["verify"]["weights"]["ok"]          # the tensors themselves are equal: only the config catches it


@needs_vllm
def test_config_refusals_moved_nothing_and_the_same_config_passes(r):
    assert r["arch_control"]                        # negative control: the unchanged config verifies
    assert r["arch_unchanged"]                      # the perturbed snapshot of every refused refit never arrived


@needs_vllm
def test_late_nan_is_refused_before_any_weight_moved(r):
    # (c) the NaN sits in the last tensor of the stream: the whole stream is checked before the first byte moves
    _refused(r["nan"], r["nan_last_name"], "NaN", "before any weight moved")
    assert r["nan_unchanged"]


@needs_vllm
def test_one_shot_stream_failure_says_the_engine_is_mixed_and_a_clean_refit_repairs_it(r):
    # (c) a stream that can be read only once is checked chunk by chunk: the error says what had moved
    _refused(r["nan_stream"], r["nan_last_name"], "NaN", "MIX", "had already been replaced")
    assert r["nan_stream_mixed"]                    # it really is mixed (the verifier sees the moved tensors)
    assert r["after_failure_ok"]                    # (i) the next refit after a failed one is exact


@needs_vllm
def test_fp16_overflow_is_refused_before_any_weight_moved(r):
    # (j) 1e6 becomes Inf in an fp16 engine
    _refused(r["overflow"], r["overflow_name"], "overflows", "float16", "before any weight moved")
    assert r["overflow_unchanged"]
    assert r["fits"]["cls"] is None and r["fits_verify"]      # control: 6e4 fits fp16 and is held exactly


@needs_vllm
def test_stale_lm_head_kernel_copy_is_caught(r):
    # (d) the logits come from the LM head's CPU kernel copy: a stale copy must fail the tensor check
    assert r["stale_moved"] > 1e-3                  # the planted copy really changes what the engine computes
    assert not r["stale_ok"]
    assert [m[0] for m in r["stale_mismatches"]] == ["lm_head.weight"]
    assert "kernel" in r["stale_mismatches"][0][2]
    assert r["stale_restored_ok"]                   # control: the real kernel verifies


@needs_vllm
def test_concurrent_refit_is_refused_by_name(r):
    # (i) a second refit, and a verification, while one is under way: refused, the first one completes
    _refused(r["concurrent_second"], "under way")
    _refused(r["concurrent_verify"], "under way")
    assert r["concurrent_first"]["cls"] is None, r["concurrent_first"]
    assert r["concurrent_after_ok"] and r["concurrent_next_ok"]


@needs_vllm
def test_values_and_engines_refit_cannot_use_are_named(r):
    # (m)
    _refused(r["list_value"], r["list_name"], "list", "not a tensor")
    assert r["list_value"]["cls"] == "InputTypeError"
    _refused(r["meta_value"], r["meta_name"], "meta")
    _refused(r["not_llm"], "vllm.LLM", "object")
    assert r["values_unchanged"]
    _refused(r["closed_rollout"], "closed")
    _refused(r["shut_down"], "shut down")
    _refused(r["shut_down_verify"], "shut down")
    _refused(r["deleted"], "no engine")
    assert "got LLM" not in r["deleted"]["msg"]


# --------------------------------------------------------------------------------------------------
# engine-free pieces
# --------------------------------------------------------------------------------------------------


QWEN = {"model_type": "qwen3_moe", "vocab_size": 2048, "hidden_size": 128, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "sliding_window": None, "attention_bias": False, "rope_parameters": {"rope_theta": 10000.0,
                                                                              "rope_type": "default"}}


@pytest.mark.parametrize("change, field", [
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, "rope_theta"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"sliding_window": 64}, "sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_architecture_differences_name_each_forward_field(change, field):
    from moealign.rl.refit import architecture_differences

    assert architecture_differences(QWEN, dict(QWEN)) == []                 # control
    differ = architecture_differences(QWEN, {**QWEN, **change})
    assert len(differ) >= 1 and any(field in d for d in differ), differ


def test_rope_compared_across_config_spellings():
    from moealign.rl.refit import architecture_differences

    legacy = {k: v for k, v in QWEN.items() if k != "rope_parameters"}
    assert architecture_differences(QWEN, {**legacy, "rope_theta": 10000.0}) == []     # same RoPE, old spelling
    assert any("rope_theta" in d for d in architecture_differences(QWEN, {**legacy, "rope_theta": 5e5}))
    scaled = {**legacy, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert any("rope_type" in d for d in architecture_differences(QWEN, scaled))


def test_check_values_refuses_nan_overflow_meta_and_lists_naming_them():
    from moealign.patches.vllm.refit import check_values

    ok = [("a", torch.ones(3)), ("b", torch.full((2,), 65504.0))]
    assert check_values(ok, torch.float16) == {"a": (3,), "b": (2,)}
    # 65519 rounds to fp16's largest finite value, 65520 to Inf: the check is the cast itself
    assert check_values([("x", torch.tensor([65519.0]))], torch.float16)
    with pytest.raises(RefitError, match=r"'x' overflows the engine's float16"):
        check_values([("a", torch.ones(3)), ("x", torch.tensor([65520.0]))], torch.float16)
    check_values([("x", torch.tensor([1e6]))], torch.float32)                 # fits fp32
    with pytest.raises(RefitError, match=r"'n' holds 1 NaN"):
        check_values([("a", torch.ones(3)), ("n", torch.tensor([1.0, float("nan")]))], torch.float32)
    with pytest.raises(RefitError, match=r"'m' is on the meta device"):
        check_values([("m", torch.ones(3, device="meta"))], torch.float32)
    with pytest.raises(InputTypeError, match=r"'l' is a list"):
        check_values([("l", [1.0, 2.0])], torch.float32)
    with pytest.raises(RefitError, match=r"lacks 1 announced"):
        check_values([("a", torch.ones(3))], torch.float32, {"a": (3,), "b": (2,)})
    with pytest.raises(RefitError, match=r"'a' \(4,\) is not what the manifest announced"):
        check_values([("a", torch.ones(4))], torch.float32, {"a": (3,)})


@pytest.mark.parametrize("kwargs, word", [
    ({"bound": math.inf}, "bound"), ({"bound": math.nan}, "bound"), ({"bound": 0.0}, "bound"),
    ({"bound": -1.0}, "bound"), ({"factor": "8"}, "factor"), ({"factor": math.inf}, "factor"),
    ({"factor": 0}, "factor"), ({"floor": -1e-6}, "floor"), ({"score_last": -5}, "score_last"),
    ({"score_last": True}, "score_last"), ({"score_last": 2.5}, "score_last"), ({"step0_gap": math.nan}, "step0_gap"),
])
def test_probe_fields_are_validated(kwargs, word):
    from moealign.rl.refit import Probe

    seqs = [torch.arange(40)]
    assert Probe(seqs, bound=0.5).bound == 0.5                    # control
    with pytest.raises(ConfigError, match=word):
        Probe(seqs, **kwargs)


def test_probe_sequences_are_validated_and_a_mutated_probe_is_caught_at_use():
    from moealign.rl.refit import Probe

    for bad in (torch.arange(40), [torch.arange(40.0)], [torch.arange(40) - 5], [[1, 2, 3] * 20], []):
        with pytest.raises(ConfigError):
            Probe(bad)
    p = Probe([torch.arange(40)], bound=0.5)
    p.bound = math.inf
    with pytest.raises(ConfigError, match="bound"):
        p.validate()


def test_refit_check_states_not_checked_and_fails_on_config_or_nan_gap():
    from moealign.patches.vllm.refit import WeightCheck
    from moealign.rl.refit import RefitCheck

    good = WeightCheck(checked=3)
    assert RefitCheck(good).ok and "decode path" in RefitCheck(good).describe()
    assert "not_checked" in RefitCheck(good).to_dict()
    assert not RefitCheck(good, config_mismatches=["rms_norm_eps: trainer 0.01, engine 1e-06"]).ok
    assert not RefitCheck(good, probe_gap=math.nan, probe_bound=1.0).ok
    assert RefitCheck(good, probe_gap=0.5, probe_bound=1.0).ok


def test_engine_busy_refuses_a_second_refit_and_reads_during_one():
    from moealign.patches.vllm.refit import engine_busy

    class Engine:
        pass

    llm = Engine()
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold():
        with engine_busy(llm, "refit"):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(10)
    for exclusive in (True, False):
        try:
            with engine_busy(llm, "refit", exclusive=exclusive):
                pass
        except RefitError as exc:
            errors.append(str(exc))
    release.set()
    t.join(10)
    assert len(errors) == 2 and all("under way" in e for e in errors)
    with engine_busy(llm, "refit"):                          # released: the next one runs
        pass
    with engine_busy(llm, "read", exclusive=False), engine_busy(llm, "read", exclusive=False):
        with pytest.raises(RefitError, match="reading"):     # reads may overlap each other, not a refit
            with engine_busy(llm, "refit"):
                pass
