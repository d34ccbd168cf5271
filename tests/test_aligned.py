"""`--aligned`: the canonical forward on both real engines (vLLM's CPU build rolling out, Megatron-core training) makes
the fully aligned run bitwise equal (torch.equal on the log-probs), in bf16 and fp32, at vLLM TP = 1 and 2, and at
every step of an RL loop through in-place refits; each canonical op left stock on the trainer is a negative control
(a nonzero gap); what the canonical forward does not cover is refused at setup, naming it."""

from __future__ import annotations

import json
import shutil
import sys
import warnings

import pytest
import torch

from moealign._optional import probe
from moealign.cli import main
from moealign.precision.canonical import OPS
import warm

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

VLLM = probe("vllm")
needs_vllm = pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")

SMALL = dict(num_prompts=6, max_new_tokens=12, device="cpu", rollout_engine="vllm", train_engine="megatron",
             aligned=True)


def _run(**overrides):
    from moealign.mismatch.rollout import MismatchConfig
    from moealign.mismatch.run import run_mismatch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_mismatch(MismatchConfig(**{**SMALL, **overrides}))


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """The fp32 run, its record kept: the negative controls re-score it (in bf16 an op's last-bit difference can
    vanish in the cast of its output to bf16; in fp32 every op's stock kernel leaves its bits)."""
    path = tmp_path_factory.mktemp("aligned") / "record.safetensors"
    report = _run(rollout_precision="fp32", save_record=str(path))
    return report, path


@pytest.fixture(scope="class")
def fp32_trainer():
    """One aligned Megatron engine for the re-scores (its canonical ops switched per test)."""
    from moealign.embedded import embedded_model_path
    from moealign.mismatch.engines import MegatronTrainEngine

    engine = MegatronTrainEngine(str(embedded_model_path()), "fp32", "cpu", aligned=True)
    yield engine
    engine.close()


def _score(record, trainer, skip=()):
    """The trainer's log-probs of the fully aligned run (replay + the kept sets), and the record's."""
    from moealign.mismatch.aligned import score_fully_aligned

    return score_fully_aligned(record, trainer, skip), torch.cat([s.logprobs.float() for s in record.samples])


@needs_vllm
class TestFullyAlignedFp32:
    """The fp32 record re-scored by one aligned Megatron engine (closed after this class: one Megatron world at a
    time)."""

    def test_bitwise_equal(self, fp32_run, fp32_trainer):
        from moealign.record import RolloutRecord

        report, path = fp32_run
        aligned = report["aligned"]
        assert aligned["bitwise_equal"] and aligned["max_abs_logp_diff"] == 0 and aligned["num_tokens"] == 6 * 12
        assert aligned["ops"] == list(OPS) and aligned["stock_ops"] == []
        assert (report["rollout"]["dtype"], report["train"]["dtype"]) == ("fp32", "fp32")
        runs = {r["name"]: r["metrics"] for r in report["runs"]}
        assert runs["routing_replay+sampling_mask"]["max_abs_logp_diff"] == 0
        assert runs["routing_replay"]["router_flip_rate"] == 0
        # the test's own check, not the report's: score the saved record again
        trained, rollout = _score(RolloutRecord.load(str(path)), fp32_trainer)
        assert torch.equal(trained, rollout)
        # issue 34 (3): same checkpoint, a saved record: no "another checkpoint" warning
        assert report["warnings"] == []

    def test_weights_warning_compares_like_with_like(self, fp32_run, fp32_trainer):
        """The record's contract (vLLM's weights under the canonical forward) against the aligned trainer's: digests
        stated (the check is not vacuous), equal; negative control: one expert weight of the trainer's layer 2
        changed, the warning names layer 2 alone."""
        from moealign.mismatch.run import weights_warnings
        from moealign.record import RolloutRecord

        contract = RolloutRecord.load(str(fp32_run[1])).contract
        assert sorted(contract["weights"]["digests"]) == ["bfloat16", "float16", "float32"]
        assert weights_warnings(contract, fp32_trainer) == []
        name, param = next((n, p) for n, p in fp32_trainer.model.named_parameters()
                           if ".layers.2." in n and ".experts." in n)
        saved = param.detach().clone()
        with torch.no_grad():
            param.mul_(1.5)
        try:
            warned = weights_warnings(contract, fp32_trainer)
        finally:
            with torch.no_grad():
                param.copy_(saved)
        assert len(warned) == 1 and "differ in layer 2 (digests at float32 rounding)" in warned[0], (name, warned)
        assert weights_warnings(contract, fp32_trainer) == []

    @pytest.mark.parametrize("op", OPS)
    def test_each_op_left_stock_on_the_trainer_leaves_a_gap(self, fp32_run, fp32_trainer, op):
        """Negative controls: Megatron with one op stock (its own kernel or formula) against the canonical rollout."""
        from moealign.record import RolloutRecord

        trained, rollout = _score(RolloutRecord.load(str(fp32_run[1])), fp32_trainer, skip=(op,))
        assert not torch.equal(trained, rollout)
        assert float((trained - rollout).abs().max()) > 0


@needs_vllm
def test_transformers_trainer_reproduces_the_vllm_fp32_record(fp32_run):
    """vLLM -> transformers (moealign/patches/hf/canonical.py) on the fp32 record: bitwise; the trainer's attention left
    stock (a negative control) is not. bf16 and the other transformers pairs: tests/test_aligned_hf.py."""
    from moealign.embedded import embedded_model_path
    from moealign.mismatch.engines import HFTrainEngine
    from moealign.record import RolloutRecord

    record = RolloutRecord.load(str(fp32_run[1]))
    engine = HFTrainEngine(str(embedded_model_path()), "fp32", "cpu", aligned=True)
    try:
        trained, rollout = _score(record, engine)
        assert torch.equal(trained, rollout)
        stock, _ = _score(record, engine, skip=("attention",))
        assert not torch.equal(stock, rollout)
    finally:
        engine.close()


@needs_vllm
def test_bf16_aligned_record_has_no_weights_warning(tmp_path):
    """Issue 34 (3) as reported: `mismatch --aligned --save-record` (bf16) warned that the record came from another
    checkpoint (vLLM's experts digested under their vLLM names and in the CPU build's prepacked layout). Negative
    control: the record loaded against a copy of the checkpoint with one expert weight of layer 2 changed warns,
    naming layer 2 alone; against the checkpoint itself it does not."""
    from safetensors.torch import load_file, save_file

    from moealign.embedded import embedded_model_path
    from moealign.mismatch.rollout import MismatchConfig
    from moealign.mismatch.run import run_mismatch

    record = tmp_path / "record.safetensors"
    report = _run(num_prompts=2, max_new_tokens=4, save_record=str(record))
    assert report["aligned"]["bitwise_equal"] and report["rollout"]["dtype"] == "bf16"
    assert report["warnings"] == []
    # the same bf16 vLLM record, vLLM -> transformers (moealign/patches/hf/canonical.py): bitwise
    from moealign.mismatch.engines import HFTrainEngine
    from moealign.record import RolloutRecord

    hf_trainer = HFTrainEngine(str(embedded_model_path()), "bf16", "cpu", aligned=True)
    try:
        trained, rollout = _score(RolloutRecord.load(str(record)), hf_trainer)
        assert torch.equal(trained, rollout)
    finally:
        hf_trainer.close()
    other = tmp_path / "other"
    shutil.copytree(embedded_model_path(), other)
    tensors = load_file(str(other / "model.safetensors"))
    tensors["model.layers.2.mlp.experts.0.down_proj.weight"] *= 1.5
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    for model, want in ((other, ["layer 2 (digests at bfloat16 rounding)"]), (embedded_model_path(), [])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scored = run_mismatch(MismatchConfig(model=str(model), load_record=str(record), device="cpu"))
        assert [w.split("differ in ", 1)[1].split(":")[0] for w in scored["warnings"]] == want, scored["warnings"]


@needs_vllm
def test_diagnose_names_the_op_left_stock():
    """--aligned-skip attention: vLLM's CPU attention kernel against Megatron's; the diagnosis names attention, and
    every op canonical on both, switched to stock on the trainer, opens a gap."""
    from moealign.mismatch.aligned import format_aligned

    report = _run(rollout_precision="fp32", num_prompts=4, max_new_tokens=8, aligned_skip=("attention",),
                  diagnose=True)
    section = report["aligned"]
    assert not section["bitwise_equal"] and section["stock_ops"] == ["attention"]
    assert section["diagnosis"]["residual_ops"] == ["attention"]
    assert "comes from attention" in section["diagnosis"]["headline"]
    levers = {lv["op"]: lv for lv in section["levers"]}
    assert set(levers) == set(OPS) and levers["attention"]["both"] == "stock"
    assert all(not lv["bitwise_equal"] for lv in levers.values())
    assert "canonical: attention" in format_aligned(section)


@needs_vllm
def test_vllm_tp2_fully_aligned_run_is_bitwise_equal(tmp_path):
    """Two vLLM worker processes (each runs the plugin's canonical patch) against Megatron at TP = 1."""
    out = tmp_path / "report.json"
    from vllm_util import child_env

    cmd = [sys.executable, "-m", "moealign", "mismatch", "--aligned", "--rollout-tp", "2", "--num-prompts", "4",
           "--max-new-tokens", "10", "--device", "cpu", "--json", str(out), "-q"]
    proc = warm.run(cmd, capture_output=True, text=True, timeout=900, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["aligned"]["bitwise_equal"], report["aligned"]
    assert "bitwise equal (torch.equal)" in proc.stdout


@needs_vllm
def test_rl_check_aligned_is_bitwise_equal_at_every_step_through_refits():
    """bf16 on both sides at vLLM TP = 1 (rl-check's default precision under --aligned), two steps."""
    from moealign.rl.config import RLCheckConfig
    from moealign.rl.loop import run_rl_check
    from moealign.rl.report import check_steps

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = run_rl_check(RLCheckConfig(aligned=True, steps=2, num_prompts=4, group_size=2, max_new_tokens=12,
                                            lr=2e-3, device="cpu"))
    (run,) = report["runs"]
    assert report["config"]["rollout_precision"] == report["config"]["train_precision"] == "bf16"
    assert [s["aligned"]["bitwise_equal"] for s in run["steps"]] == [True, True]
    # the three-log-prob certificate (issue 38): rollout, recompute before the update, first training forward
    for s in run["steps"]:
        cert = s["aligned"]
        assert cert["mismatch_count"] == 0 and cert["rollout_vs_recompute"] and cert["recompute_vs_train"], cert
        assert cert["tokens"] == s["response_tokens"]
    assert all(s["verify"]["ok"] for s in run["steps"])
    # the weights did move (a nonzero gradient at step 0, deterministic for this seed): step 1 rolled out and
    # trained on refitted, changed weights
    assert run["steps"][0]["grad_norm"] > 0
    assert all(s["refit"]["tensors"] > 0 for s in run["steps"])
    assert check_steps(report, {}) == []


def test_the_certificate_names_which_log_probs_differ():
    import torch

    from moealign.rl.loop import certificate

    rollout = torch.tensor([-0.5, -1.25, -3.0])
    same = certificate(rollout, rollout.clone(), rollout.clone())
    assert same["bitwise_equal"] and same["mismatch_count"] == 0
    off = rollout.clone()
    off[1] = torch.nextafter(off[1], torch.tensor(0.0))             # one ulp on one token
    recompute_off = certificate(rollout, off, off.clone())
    assert not recompute_off["bitwise_equal"] and recompute_off["mismatch_count"] == 1
    assert not recompute_off["rollout_vs_recompute"] and recompute_off["recompute_vs_train"]
    train_off = certificate(rollout, rollout.clone(), off)
    assert train_off["rollout_vs_recompute"] and not train_off["recompute_vs_train"] and train_off["mismatch_count"] == 1


@pytest.mark.parametrize("argv, words", [
    (["--rollout-precision", "fp32", "--train-precision", "bf16"], "one precision on both engines"),
    (["--rollout-precision", "fp16"], "one plain precision on both sides"),
    (["--aligned-skip", "attention,bogus"], "unknown ops ['bogus']"),
    (["--report", "{tmp}"], "--aligned --diagnose names the op"),
    (["--load-record", "{existing}"], "cannot score a --load-record"),
    (["--rollout-tp", "3"], "power-of-two TP sizes"),
    (["--rollout-tp", "4"], "moe_intermediate_size 64 does not split into whole 32-wide tree leaves"),
])
def test_mismatch_aligned_refusals_are_one_line(capsys, argv, words):
    from moealign.embedded import embedded_model_path

    argv = [a.format(existing=embedded_model_path() / "prompts.json", tmp="aligned-report-dir") for a in argv]
    assert main(["mismatch", "--aligned", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_aligned_skip_needs_aligned_and_rl_check_refusals(capsys):
    assert main(["mismatch", "--aligned-skip", "attention"]) == 2
    assert "needs --aligned" in capsys.readouterr().err
    for argv, words in ((["--levers", "replay"], "drop --levers replay"), (["--staleness", "1"], "drop --staleness 1"),
                        (["--compare"], "drop --compare"),
                        (["--rollout-precision", "bf16", "--train-precision", "fp32"], "one precision")):
        assert main(["rl-check", "--aligned", *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1


def test_uncovered_family_is_refused_before_any_work(tmp_path, capsys):
    from moealign.embedded import embedded_model_path

    model = tmp_path / "mixtral"
    model.mkdir()
    config = json.loads((embedded_model_path() / "config.json").read_text())
    config["model_type"] = "mixtral"
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes((embedded_model_path() / "model.safetensors").read_bytes())
    assert main(["mismatch", "--aligned", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert "model_type 'mixtral' is not covered" in err and err.count("\n") == 1


def test_megatron_canonical_forward_is_differentiable_and_undone():
    """The trainer's side alone: the canonical forward's logits and gradients stay close to Megatron's stock ones,
    and undo() restores the stock forward bit for bit."""
    pytest.importorskip("megatron.core")
    from moealign.embedded import embedded_model_path
    from moealign.mismatch.engines import MegatronTrainEngine
    from moealign.patches.megatron.canonical import apply_canonical_forward_from_hf

    engine = MegatronTrainEngine(str(embedded_model_path()), "fp32", "cpu")
    try:
        model = engine.model
        ids = torch.randint(2, 2000, (2, 10), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(10)[None].expand(2, -1)
        mask = torch.ones(10, 10, dtype=torch.bool).triu(1)[None, None]

        def run():
            model.zero_grad(set_to_none=True)
            logits = model(ids, pos, mask)
            logits.float().logsumexp(-1).sum().backward()
            grad = model.decoder.layers[0].self_attention.linear_qkv.weight.grad.clone()
            return logits.detach(), grad

        stock_logits, stock_grad = run()
        handle = apply_canonical_forward_from_hf(model, engine._hf_config)
        logits, grad = run()
        assert not torch.equal(logits, stock_logits)
        assert torch.allclose(logits, stock_logits, atol=1e-4) and torch.allclose(grad, stock_grad, atol=1e-4)
        handle.undo()
        assert torch.equal(run()[0], stock_logits)
    finally:
        engine.close()


def test_plugin_spec_for_the_canonical_patch(monkeypatch):
    from moealign.errors import ConfigError
    from moealign.patches.vllm import plugin

    spec = plugin.spec_for(canonical=True, canonical_skip=("attention", "rope"))
    assert spec == "canonical:skip=attention+rope"
    assert plugin.parse_spec(spec) == [("canonical", {"skip": "attention+rope"})]
    assert plugin.parse_spec(plugin.spec_for(canonical=True)) == [("canonical", {})]
    monkeypatch.setenv(plugin.ENV, "canonical:skip=attention+warp")
    with pytest.raises(ConfigError, match=r"unknown ops \['warp'\]"):
        plugin.load()
    assert "canonical" not in plugin.loaded()
