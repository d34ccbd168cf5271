"""`--aligned` across ranks: the canonical forward (moealign.patches.megatron.canonical) on the sharded Megatron trainer
(moealign.patches.megatron.sharded, one process per rank, gloo) gives the single-rank canonical trainer's bits.

bf16 (`--aligned`'s default precision: where a partial rounded to the activation dtype shows), a ragged record (the
canonical ops do not depend on the padding), with and without routing replay, both MoE token dispatchers:

* TP 2 (sequence parallelism, as the trainer runs TP; this record's length 17 gets one more masked column): each
  row-parallel linear's K shard is a subtree of the canonical tree; the fp32 subtree roots are added by
  tree_reduce_scatter over Megatron's TP group; the experts' intermediate shards by tree_all_reduce over the
  expert-TP group.
* EP 2: each (token, expert) pair computed on its expert's rank, brought back unsummed by the dispatcher, combined
  in ascending expert id on the token's rank.
* PP 2: each stage its own layers.

torch.equal on the logits and on the log-probs (c_log_softmax) against the single-rank canonical trainer
(moealign.mismatch.engines.MegatronTrainEngine(aligned=True)), router flips 0 under replay. Negative control: TP 2
with Megatron's stock all-reduce of the partials rounded to bf16 (tp_reduce="stock") is not bitwise equal. Each
world is started once.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from moealign.embedded import embedded_model_path  # noqa: E402
from moealign.errors import CanonicalError, ConfigError  # noqa: E402
from moealign.patches.megatron.sharded import ShardedMegatronTrainer  # noqa: E402
from moealign.precision.canonical import c_log_softmax  # noqa: E402
from megatron_util import random_record  # noqa: E402
from moealign.record import RolloutRecord  # noqa: E402

pytestmark = pytest.mark.heavy          # long-running (rank processes): scheduled first, tests/conftest.py

E, K, LAYERS, V = 16, 4, 4, 2048


def _record(lengths, prompt_lens, seed) -> RolloutRecord:
    return random_record(lengths, prompt_lens, seed, "bfloat16", experts=E, top_k=K, layers=LAYERS, vocab=V)


RECORD = _record([12, 17, 9, 14], [4, 6, 3, 8], seed=2)     # ragged: every call pads to its longest sample


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return c_log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]


@pytest.fixture(scope="module")
def reference():
    """The single-rank canonical trainer (bf16) on RECORD, without and with replay; and its refusals of what the
    canonical binding still does not cover (config fields set on its live model, then restored)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moealign.mismatch.engines import MegatronTrainEngine
    from moealign.model_config import ConfigView, read_model_config
    from moealign.patches.megatron.canonical import apply_canonical_forward_from_hf

    saved = list(RouterReplay.global_router_replay_instances)
    engine = MegatronTrainEngine(str(embedded_model_path()), "bf16", "cpu", aligned=True)
    try:
        out = {}
        for replay in (False, True):
            fwd = engine.forward(RECORD, range(len(RECORD)), replay=replay)
            out[replay] = (fwd.logits, _logprobs(fwd.logits, fwd.tokens))
        hf = ConfigView(**read_model_config(embedded_model_path()))
        refusals = {}
        config = engine.model.config
        for name, value in (("sequence_parallel", True), ("context_parallel_size", 2),
                            ("tensor_model_parallel_size", 3), ("moe_grouped_gemm", True)):
            before = getattr(config, name)
            setattr(config, name, value)
            try:
                apply_canonical_forward_from_hf(engine.model, hf).undo()
                refusals[name] = None
            except CanonicalError as exc:
                refusals[name] = str(exc)
            finally:
                setattr(config, name, before)
        out["refusals"] = refusals
        yield out
    finally:
        engine.close()
        RouterReplay.global_router_replay_instances[:] = saved


def _check_world(reference, **layout) -> dict:
    """Both dispatchers, without and with replay, against the reference: torch.equal on logits and log-probs,
    flips 0 under replay, every rank's verifier clean. Returns what it saw (for the negative control)."""
    seen = {}
    with ShardedMegatronTrainer(embedded_model_path(), precision="bf16", timeout_s=180, aligned=True,
                                **layout) as trainer:
        assert [r["moe_layers"] for r in trainer.ranks]     # every rank built its stage
        for dispatcher in ("alltoall", "allgather"):
            if trainer.dispatcher != dispatcher:
                trainer.set_dispatcher(dispatcher)
            for replay in (False, True):
                fwd = trainer.forward(RECORD, range(len(RECORD)), replay=replay)
                logits, logprobs = reference[replay]
                seen[dispatcher, replay] = (torch.equal(fwd.logits, logits),
                                            torch.equal(torch.cat(fwd.logprobs), logprobs),
                                            float((fwd.logits.float() - logits.float()).abs().max()))
                if replay:
                    assert fwd.flips.router_flip_rate == 0.0, (layout, dispatcher)
                    for rank in fwd.ranks:
                        if rank["moe_layers"]:
                            assert rank["mismatched_rows"] == 0 and rank["verified_rows"] > 0, rank
                else:
                    assert fwd.flips.router_flip_rate > 0.5     # the random routes are not the model's own
    return seen


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2), dict(pp=2)], ids=["tp2", "ep2", "pp2"])
def test_sharded_canonical_trainer_is_bitwise_the_single_rank_one(reference, layout):
    seen = _check_world(reference, **layout)
    assert all(lg and lp for lg, lp, _ in seen.values()), (layout, seen)


def test_stock_all_reduce_at_tp2_is_not_bitwise(reference):
    """Negative control: the same TP 2 world with each rank's partials rounded to bf16 and added by Megatron's own
    all-reduce (and the dispatcher's reduce-scatter for the experts) instead of the tree's fp32 roots."""
    with ShardedMegatronTrainer(embedded_model_path(), precision="bf16", timeout_s=180, aligned=True, tp=2,
                                tp_reduce="stock") as trainer:
        fwd = trainer.forward(RECORD, range(len(RECORD)), replay=True)
    logits, logprobs = reference[True]
    assert fwd.flips.router_flip_rate == 0.0
    assert not torch.equal(fwd.logits, logits)
    assert not torch.equal(torch.cat(fwd.logprobs), logprobs)


def test_what_the_canonical_binding_still_refuses(reference):
    refusals = reference["refusals"]
    assert "sequence_parallel=True" in refusals["sequence_parallel"]
    assert "context_parallel_size=2" in refusals["context_parallel_size"]
    assert "tensor_model_parallel_size=3" in refusals["tensor_model_parallel_size"]
    assert "moe_grouped_gemm=True" in refusals["moe_grouped_gemm"]


def test_aligned_options_of_the_sharded_trainer_are_checked_before_any_process():
    import multiprocessing

    from moealign.options import check_aligned_run

    before = set(multiprocessing.active_children())
    for kwargs, message in [(dict(aligned_skip=("router",)), "aligned_skip leaves canonical ops stock: it needs "
                                                             "aligned=True"),
                            (dict(aligned=True, aligned_skip=("gemm",)), r"unknown canonical ops \['gemm'\]"),
                            (dict(aligned=True, tp_reduce="ring"), "tp_reduce must be one of"),
                            (dict(aligned=1), "aligned must be a bool")]:
        with pytest.raises(ConfigError, match=message):
            ShardedMegatronTrainer(embedded_model_path(), ep=2, **kwargs)
    assert set(multiprocessing.active_children()) == before
    with pytest.raises(CanonicalError, match="--train-tp 3: the canonical forward cuts its trees at power-of-two"):
        check_aligned_run(str(embedded_model_path()), rollout_precision="bf16", train_precision="bf16",
                          device="cpu", rollout_tp=1, train_tp=3)
    check_aligned_run(str(embedded_model_path()), rollout_precision="bf16", train_precision="bf16", device="cpu",
                      rollout_tp=1, train_tp=2)        # negative control: TP 2 cuts the trees


def test_mismatch_accepts_aligned_with_a_sharded_trainer():
    from moealign.mismatch.rollout import MismatchConfig

    cfg = MismatchConfig(rollout_engine="vllm", train_engine="megatron", device="cpu", aligned=True, train_ep=2,
                         train_pp=2)
    assert cfg.train_layout.as_dict() == {"tp": 1, "ep": 2, "pp": 2, "dp": 2, "world": 4}
    assert cfg.train_precision == cfg.rollout_precision == "bf16"


def test_mismatch_aligned_ep2_pp2_is_bitwise_equal_to_vllm(tmp_path):
    """End to end: vLLM at TP 1 rolls out under the canonical forward, the EP 2 x PP 2 sharded trainer (4 rank
    processes) scores: the fully aligned run's log-probs bitwise equal (the report's torch.equal), flips 0."""
    import json
    import sys

    from moealign._optional import probe

    if not probe("vllm").available:
        pytest.skip("vLLM is not installed")
    import warm
    from vllm_util import child_env

    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "moealign", "mismatch", "--aligned", "--train-ep", "2", "--train-pp", "2",
           "--num-prompts", "4", "--max-new-tokens", "8", "--device", "cpu", "--json", str(out), "-q"]
    proc = warm.run(cmd, capture_output=True, text=True, timeout=600, env=child_env(), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["train"]["parallel"] == {"tp": 1, "ep": 2, "pp": 2, "dp": 2, "world": 4}
    aligned = report["aligned"]
    assert aligned["bitwise_equal"] and aligned["max_abs_logp_diff"] == 0 and aligned["num_tokens"] == 4 * 8, aligned
    runs = {r["name"]: r["metrics"] for r in report["runs"]}
    assert runs["routing_replay"]["router_flip_rate"] == 0
    assert "bitwise equal (torch.equal)" in proc.stdout
