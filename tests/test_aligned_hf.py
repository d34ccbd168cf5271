"""`--aligned` with the transformers engines (moealign/patches/hf/canonical.py): a transformers rollout (generate()
with its KV cache, left-padded batches) and a transformers trainer (one right-padded forward) run the canonical
forward, so `--rollout hf --train megatron`, `--rollout vllm --train hf` and `--rollout hf --train hf` are bitwise
equal (torch.equal on the fully aligned run's log-probs) in fp32 and bf16 on the embedded model. Negative controls by
construction: one op left stock (--aligned-skip attention) on both engines, or on the trainer alone. The binding's
undo() gives back the stock forward (torch.equal to a fresh model's), and what it does not cover is refused by name.
(vLLM -> transformers re-scores tests/test_aligned.py's vLLM records, fp32 and bf16: no vLLM engine started here.)"""

from __future__ import annotations

import warnings

import pytest
import torch

from moealign.cli import main
from moealign.precision.canonical import OPS

pytestmark = pytest.mark.heavy          # engines in this process: scheduled first, tests/conftest.py

SMALL = dict(num_prompts=3, max_new_tokens=6, device="cpu", aligned=True)


def _run(**overrides):
    from moealign.mismatch.rollout import MismatchConfig
    from moealign.mismatch.run import run_mismatch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_mismatch(MismatchConfig(**{**SMALL, **overrides}))


def _recorded(record) -> torch.Tensor:
    return torch.cat([s.logprobs.float() for s in record.samples])


@pytest.fixture(scope="module")
def hf_fp32_record(tmp_path_factory):
    """transformers -> Megatron in fp32, the record kept (the transformers trainer re-scores it below)."""
    pytest.importorskip("megatron.core")
    path = tmp_path_factory.mktemp("aligned_hf") / "record.safetensors"
    report = _run(rollout_engine="hf", train_engine="megatron", rollout_precision="fp32", save_record=str(path))
    return report, path


def test_hf_rollout_megatron_trainer_fp32(hf_fp32_record):
    report, _ = hf_fp32_record
    aligned = report["aligned"]
    assert aligned["bitwise_equal"] and aligned["max_abs_logp_diff"] == 0, aligned
    assert aligned["ops"] == list(OPS) and aligned["num_tokens"] > 0
    assert (report["rollout"]["engine"], report["train"]["engine"]) == ("transformers", "megatron")
    assert (report["rollout"]["dtype"], report["train"]["dtype"]) == ("fp32", "fp32")
    assert report["warnings"] == []          # the saved record's contract: the trainer's checkpoint (issue 34 (3))


def test_hf_trainer_rescores_the_hf_record_and_each_side_alone_opens_a_gap(hf_fp32_record):
    """transformers -> transformers on the same record: bitwise; the trainer alone with its stock attention (a negative
    control by construction) is not; switched back, bitwise again (set_canonical_ops both ways)."""
    from moealign.embedded import embedded_model_path
    from moealign.mismatch.aligned import score_fully_aligned
    from moealign.mismatch.engines import HFTrainEngine
    from moealign.record import RolloutRecord

    record = RolloutRecord.load(str(hf_fp32_record[1]))
    trainer = HFTrainEngine(str(embedded_model_path()), "fp32", "cpu", aligned=True)
    try:
        rollout = _recorded(record)
        assert torch.equal(score_fully_aligned(record, trainer), rollout)
        stock = score_fully_aligned(record, trainer, skip=("attention",))
        assert not torch.equal(stock, rollout) and float((stock - rollout).abs().max()) > 0
        assert torch.equal(score_fully_aligned(record, trainer), rollout)
    finally:
        trainer.close()


@pytest.mark.parametrize("train", ["megatron", "hf"])
def test_hf_rollout_bf16(train):
    if train == "megatron":
        pytest.importorskip("megatron.core")
    report = _run(rollout_engine="hf", train_engine=train, num_prompts=2)
    assert report["aligned"]["bitwise_equal"], report["aligned"]
    assert (report["rollout"]["dtype"], report["train"]["dtype"]) == ("bf16", "bf16")


def test_hf_to_hf_with_attention_left_stock_is_not_bitwise_and_diagnosed():
    """The negative control through the command's own option: both engines run their stock attention; --diagnose
    (the transformers trainer's canonical levers) names it."""
    report = _run(rollout_engine="hf", train_engine="hf", rollout_precision="fp32", num_prompts=2,
                  aligned_skip=("attention",), diagnose=True)
    section = report["aligned"]
    assert section["stock_ops"] == ["attention"] and not section["bitwise_equal"], section
    assert section["tokens_differing"] > 0
    assert section["diagnosis"]["residual_ops"] == ["attention"]
    levers = {lv["op"]: lv for lv in section["levers"]}
    assert set(levers) == set(OPS) and levers["attention"]["both"] == "stock"
    assert not levers["attention"]["bitwise_equal"]          # the trainer's canonical attention vs the stock rollout


def test_binding_decode_padding_undo_and_refusals():
    """On the model alone: the canonical logits differ from the stock ones; a decode step over the KV cache gives the
    full forward's row and a left-padded row its unpadded bits (bitwise); undo() gives back the stock forward
    (torch.equal to a fresh model's); fp16, an attention implementation it does not replace and a module it does
    not know are refused by name."""
    from moealign.embedded import embedded_model_path
    from moealign.errors import CanonicalError
    from moealign.patches.hf.canonical import apply_canonical_forward
    from moealign.patches.hf.loading import load_model

    path = str(embedded_model_path())
    model, _ = load_model(path, "bf16", "cpu")
    ids = torch.randint(2, 2000, (2, 7), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)

    def logits(m, **kw):
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=ones, use_cache=False, **kw).logits

    handle = apply_canonical_forward(model)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=ones, use_cache=False).logits
        out = model(input_ids=ids[:, :4], attention_mask=ones[:, :4], use_cache=True)
        rows = [out.logits[:, -1]]
        for t in range(4, 7):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=ones[:, :t + 1], use_cache=True,
                        past_key_values=out.past_key_values, position_ids=torch.full((2, 1), t))
            rows.append(out.logits[:, -1])
        assert torch.equal(torch.stack(rows, 1), full[:, 3:])
        padded_mask = ones.clone()
        padded_mask[1, :3] = 0
        positions = (padded_mask.cumsum(-1) - 1).clamp_min(0)
        padded = model(input_ids=ids, attention_mask=padded_mask, position_ids=positions, use_cache=False).logits
        alone = model(input_ids=ids[1:, 3:], attention_mask=ones[1:, 3:], use_cache=False).logits
        assert torch.equal(padded[1, 3:], alone[0]) and bool(torch.isfinite(padded).all())
    handle.undo()
    fresh, _ = load_model(path, "bf16", "cpu")
    stock = logits(fresh)
    assert torch.equal(logits(model), stock)
    assert not torch.equal(full, stock)                     # the canonical forward did run

    with pytest.raises(CanonicalError, match="fp32 or bf16; this model holds"):
        apply_canonical_forward(fresh.to(torch.float16))
    fresh.to(torch.bfloat16)
    fresh.config._attn_implementation_internal = "flash_attention_2"
    with pytest.raises(CanonicalError, match="attn_implementation 'flash_attention_2'"):
        apply_canonical_forward(fresh)
    assert apply_canonical_forward(fresh, [op for op in OPS if op != "attention"]).undo() is None
    fresh.config._attn_implementation_internal = "sdpa"
    fresh.model.extra = torch.nn.GELU()
    with pytest.raises(CanonicalError, match=r"model\.extra \(GELU\)"):
        apply_canonical_forward(fresh)


def test_the_rollouts_log_softmax_context():
    """canonical_log_softmax (what the transformers rollout records its log-probs under) is c_log_softmax where the
    stock kernel differs (a row chosen to differ: the negative control), and stock when the op is left out."""
    from moealign.patches.hf.canonical import HF_OPS, canonical_log_softmax
    from moealign.precision.canonical import c_log_softmax

    x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(1)) * 3
    stock, canonical = torch.log_softmax(x, -1), c_log_softmax(x, -1)
    assert not torch.equal(stock, canonical)
    with canonical_log_softmax(HF_OPS):
        assert torch.equal(torch.log_softmax(x, -1), canonical)
    with canonical_log_softmax([op for op in HF_OPS if op != "log_softmax"]):
        assert torch.equal(torch.log_softmax(x, -1), stock)


def test_transformers_engine_with_another_family_is_refused_in_one_line(capsys):
    assert main(["mismatch", "--aligned", "--rollout", "hf", "--train", "megatron",
                 "--model", "embedded:tiny_deepseek"]) == 2
    err = capsys.readouterr().err
    assert "covers ['qwen3_moe'] checkpoints; model_type 'deepseek_v3'" in err and err.count("\n") == 1
