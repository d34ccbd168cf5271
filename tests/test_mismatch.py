"""`moealign mismatch` on the embedded model: schema, the levers' guarantees, --fail-above, records."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from moealign.cli import main  # noqa: E402
from moealign.mismatch import (  # noqa: E402
    METRIC_NAMES,
    RUN_NAMES,
    MismatchConfig,
    parse_fail_above,
    run_mismatch,
)
from moealign.record import RecordMismatchError, RolloutRecord  # noqa: E402

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

SMALL = ["--num-prompts", "8", "--max-new-tokens", "24", "--batch-size", "8", "-q", "--device", "cpu"]
HF = ["--rollout", "hf", "--train", "hf"]


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("mm") / "report.json"
    record = out.parent / "record.safetensors"
    rc = main(["mismatch", *HF, *SMALL, "--json", str(out), "--save-record", str(record)])
    assert rc == 0
    return json.loads(out.read_text()), record


def test_report_schema(small_report):
    report, _ = small_report
    assert set(report) >= {"model", "rollout", "train", "num_tokens", "elapsed_s", "runs"}
    import transformers

    v = transformers.__version__
    assert report["rollout"] == {"engine": "transformers", "precision": "bf16", "dtype": "bf16", "engine_version": v}
    assert report["train"] == {"engine": "transformers", "precision": "fp32", "dtype": "fp32", "engine_version": v,
                               "parallel": {"tp": 1, "ep": 1, "pp": 1, "dp": 1, "world": 1}}
    assert report["batch_invariant"] is False
    assert [r["name"] for r in report["runs"]] == list(RUN_NAMES)
    n_layers = len(report["moe_layers"])
    for run in report["runs"]:
        m = run["metrics"]
        assert set(METRIC_NAMES) <= set(m)
        assert len(m["per_layer_flip_rate"]) == n_layers
        for name in METRIC_NAMES:
            assert isinstance(m[name], float)
    assert report["num_tokens"] > 8 * 4


def test_levers_are_exact(small_report):
    report, _ = small_report
    runs = {r["name"]: r["metrics"] for r in report["runs"]}
    for name in ("routing_replay", "routing_replay+sampling_mask"):
        assert runs[name]["router_flip_rate"] == 0.0
        assert runs[name]["token_flip_rate"] == 0.0
        assert runs[name]["per_layer_flip_rate"] == [0.0] * len(report["moe_layers"])
    for name in ("sampling_mask", "routing_replay+sampling_mask"):
        assert runs[name]["support_mismatch_rate"] == 0.0
    # negative controls: without the lever the trainer's own choices differ from the rollout's
    assert runs["baseline"]["support_mismatch_rate"] > 0.0
    # the sampling mask removes the truncation bias: the log-prob gap shrinks a lot
    assert runs["sampling_mask"]["mean_abs_logp_diff"] < 0.5 * runs["baseline"]["mean_abs_logp_diff"]


def test_fp32_both_sides_shrinks_the_gap(small_report):
    report, _ = small_report
    r32 = run_mismatch(MismatchConfig(num_prompts=8, max_new_tokens=24, batch_size=8, rollout_dtype="fp32",
                                      device="cpu"))
    bf16 = {r["name"]: r["metrics"] for r in report["runs"]}
    fp32 = {r["name"]: r["metrics"] for r in r32["runs"]}
    aligned = "routing_replay+sampling_mask"
    assert fp32[aligned]["max_abs_logp_diff"] < bf16[aligned]["max_abs_logp_diff"]
    assert fp32[aligned]["max_abs_logp_diff"] < 1e-3


def test_load_record_reproduces(small_report, tmp_path):
    report, record = small_report
    again = tmp_path / "again.json"
    assert main(["mismatch", "-q", "--device", "cpu", "--train", "hf", "--load-record", str(record),
                 "--batch-size", "8", "--json", str(again)]) == 0
    rerun = json.loads(again.read_text())
    assert [r["metrics"] for r in rerun["runs"]] == [r["metrics"] for r in report["runs"]]


def test_record_of_other_model_is_refused(small_report, tmp_path):
    _, path = small_report
    record = RolloutRecord.load(path)
    record.meta = type(record.meta)(**{**record.meta.__dict__, "model_fingerprint": "0" * 16})
    other = tmp_path / "other.safetensors"
    record.save(other)
    with pytest.raises(RecordMismatchError, match="model_fingerprint"):
        run_mismatch(MismatchConfig(load_record=str(other), batch_size=8))


def test_fail_above_exit_codes(small_report, tmp_path, capsys):
    _, record = small_report
    base = ["mismatch", "-q", "--device", "cpu", "--train", "hf", "--load-record", str(record), "--batch-size", "8"]
    assert main(base + ["--fail-above", "router_flip_rate=0", "--fail-above", "support_mismatch_rate=0"]) == 0
    assert main(base + ["--fail-above", "kl_k3=-1"]) == 3
    assert "kl_k3" in capsys.readouterr().err


@pytest.mark.parametrize("item, message", [
    ("kl_k1", "METRIC=VALUE"),
    ("=1", "METRIC=VALUE"),
    ("nonsense=1", "unknown metric 'nonsense'"),
    ("kl_k1=abc", "not a number"),
    ("kl_k1=nan", "finite"),
])
def test_fail_above_parse_errors(item, message):
    with pytest.raises(ValueError, match=message):
        parse_fail_above([item])


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be an integer in [1, 100000]"),
    (["--top-p", "1.5"], "top_p"),
    (["--temperature", "0"], "temperature"),
    (["--num-prompts", "100000"], "exceeds"),
    (["--fail-above", "bogus=1"], "unknown metric"),
    (["--load-record", "/nonexistent/record.safetensors"], "no record file"),
    (["--prompts", "/nonexistent/prompts.json"], "--prompts /nonexistent/prompts.json: no such file"),
])
def test_cli_bad_input(argv, message, capsys):
    assert main(["mismatch", "-q", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_corrupt_record(small_report, tmp_path, capsys):
    _, path = small_report
    data = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    assert main(["mismatch", "-q", "--train", "hf", "--load-record", str(bad)]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err


def test_cli_unknown_engine_and_dtype(capsys):
    for argv in (["--train", "nope"], ["--rollout-dtype", "fp8"]):
        assert main(["mismatch", *argv]) == 2
        err = capsys.readouterr().err
        assert "invalid choice" in err and err.count("\n") == 1 and "Traceback" not in err   # one line


def test_engine_registry_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown training engine 'megatron2'"):
        MismatchConfig(train_engine="megatron2")
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        MismatchConfig(rollout_dtype="int4")


def test_routes_recorded_are_compact(small_report):
    _, path = small_report
    record = RolloutRecord.load(path)
    assert record.meta.num_experts <= 256
    assert all(s.routes.dtype == torch.uint8 for s in record.samples)


# ----------------------------------------------------------------------------------------- the module map


def test_the_steps_are_importable_from_the_package_and_from_run():
    import moealign.mismatch as mm
    from moealign.mismatch import report, rollout, run, scoring

    assert mm.MismatchConfig is rollout.MismatchConfig is run.MismatchConfig
    for name in ("RUN_NAMES", "METRIC_NAMES", "format_table", "format_sweep", "parse_fail_above", "check_fail_above"):
        assert getattr(mm, name) is getattr(report, name) is getattr(run, name), name
    for name in ("run_mismatch", "run_sweep", "SWEEP"):
        assert getattr(mm, name) is getattr(run, name), name
    assert callable(scoring.score_record) and not hasattr(scoring, "kept_logprob_dense")   # one kept_logprob


class _Counting:
    """An engine wrapper that counts close() calls (and can fail its forward)."""

    def __init__(self, inner, closed: list, fail: bool = False):
        self._inner, self._closed, self._fail = inner, closed, fail

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward(self, *args, **kwargs):
        if self._fail:
            raise RuntimeError("forward failed on purpose")
        return self._inner.forward(*args, **kwargs)

    def close(self):
        self._closed.append(self._inner.name)
        self._inner.close()


@pytest.mark.parametrize("fail", [False, True])
def test_run_mismatch_closes_both_engines(monkeypatch, fail):
    """run_mismatch closes the rollout engine after the rollout and the trainer after scoring, also when
    the trainer fails."""
    from moealign.mismatch import engines

    closed: list = []
    monkeypatch.setitem(engines.ROLLOUT_ENGINES, "counting",
                        lambda *a, **k: _Counting(engines.HFRolloutEngine(*a, **k), closed))
    monkeypatch.setitem(engines.TRAIN_ENGINES, "counting",
                        lambda *a, **k: _Counting(engines.HFTrainEngine(*a, **k), closed, fail=fail))
    cfg = MismatchConfig(rollout_engine="counting", train_engine="counting", num_prompts=2, max_new_tokens=4,
                         batch_size=2, device="cpu")
    if fail:
        with pytest.raises(RuntimeError, match="on purpose"):
            run_mismatch(cfg)
    else:
        report = run_mismatch(cfg)
        assert [r["name"] for r in report["runs"]] == list(RUN_NAMES)
    assert closed == ["transformers", "transformers"]          # rollout, then trainer, each once


def test_hf_engines_close_releases_the_model():
    from moealign.embedded import embedded_model_path
    from moealign.mismatch.engines import HFRolloutEngine, HFTrainEngine

    for cls in (HFRolloutEngine, HFTrainEngine):
        engine = cls(str(embedded_model_path()), "bf16")
        assert engine.model is not None
        engine.close()
        engine.close()                                          # a second close does nothing
        assert engine.model is None


# ----------------------------------------------------------------------------------------- the loading path


def test_load_model_applies_the_policy_and_restores_the_progress_bar():
    import transformers

    from moealign.embedded import embedded_model_path
    from moealign.patches.hf.loading import load_model, load_tokenizer
    from moealign.patches.hf.precision import module_roles

    logging = transformers.utils.logging
    was = logging.is_progress_bar_enabled()
    try:
        for enabled in (True, False):
            (logging.enable_progress_bar if enabled else logging.disable_progress_bar)()
            model, handle = load_model(embedded_model_path(), "fp16-fp32-router-head")
            assert logging.is_progress_bar_enabled() is enabled          # the user's setting, as it was
    finally:
        (logging.enable_progress_bar if was else logging.disable_progress_bar)()
    assert not model.training and handle.active and handle.policy.name == "fp16-fp32-router-head"
    modules = dict(model.named_modules())
    assert all(modules[name].weight.dtype == torch.float32 for name in module_roles(model))
    assert model.model.embed_tokens.weight.dtype == torch.float16
    handle.undo()
    assert model.model.embed_tokens.weight.dtype == torch.float32          # loaded in fp32, then cast
    bi, _ = load_model(embedded_model_path(), "fp32", attention="bi")
    assert bi.config._attn_implementation == "moealign_bi"
    tok = load_tokenizer(embedded_model_path(), padding_side="right")
    assert tok.padding_side == "right" and tok.pad_token_id is not None
