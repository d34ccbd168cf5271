"""The sharded Megatron trainer (moealign.patches.megatron.sharded): one process per rank, Megatron's own parallelism.

On the embedded model (16 experts top-4, 4 layers), for TP 2, EP 2, PP 2, TP 2 x EP 2 and EP 2 x PP 2 (gloo, at most 4
processes), both MoE token dispatchers: the fp32 logits / log-probs against the single-rank trainer
(moealign.mismatch.engines.MegatronTrainEngine), router flips 0 under replay, every rank's replay verifier, the
negative controls (routes shifted by one token, samples swapped), a rank killed, each rank's own checkpoint pieces.

Bitwise (torch.equal) where the reduction order is the single-rank trainer's: EP 2 with the all-to-all dispatcher
(each expert's GEMM receives the same tokens, only from two ranks), PP 2 (both dispatchers: at EP 1 / TP 1 they move
nothing), EP 2 x PP 2 with the all-to-all dispatcher. The reference is the single-rank trainer run on the samples each
expert GEMM sees together: on CPU (MKL) an expert's output rows depend on how many tokens its GEMM has, so a
micro-batch of two samples is compared with the single-rank trainer on those two samples. Within ``TOL`` elsewhere:
TP 2 (sequence parallelism, as the trainer runs TP: RowParallelLinear's reduce-scatter sums the two ranks' partial
products, another summation order; a call whose padded length is odd gets one more masked column), the all-gather
dispatcher with EP 2 (its reduce-scatter sums the experts' partial outputs across ranks), and records of ragged
lengths (padded to the longest sample of the call, the single-rank trainer to the longest of its batch).

The routes are random (distinct experts per row), so without replay the routers disagree with them on every row and
under replay every router must follow them: flips 0 is a real check. Records are built by hand (moealign.record).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytest.importorskip("megatron.core")

from moealign.embedded import embedded_model_path  # noqa: E402
from moealign.errors import ConfigError, EngineError, ReplayError  # noqa: E402
from moealign.model_config import ConfigView, read_model_config  # noqa: E402
from moealign.patches.megatron import checkpoint as mc  # noqa: E402
from moealign.patches.megatron.sharded import ShardedMegatronTrainer  # noqa: E402
from megatron_util import random_record  # noqa: E402
from moealign.record import RolloutRecord  # noqa: E402

pytestmark = pytest.mark.heavy          # long-running (rank processes): scheduled first, tests/conftest.py

E, K, LAYERS, V = 16, 4, 4, 2048
#: fp32 bound where the summation order differs (TP all-reduce, all-gather dispatcher's reduce-scatter, padding);
#: measured at most 8.6e-6 on logits, 1.0e-5 on log-probs
TOL = 5e-5


def _record(lengths, prompt_lens, seed) -> RolloutRecord:
    return random_record(lengths, prompt_lens, seed, "float32", experts=E, top_k=K, layers=LAYERS, vocab=V)


EQUAL = _record([16] * 4, [5, 7, 9, 11], seed=1)          # one length: every subset pads to the same T
RAGGED = _record([12, 17, 9, 14, 20], [4, 6, 3, 8, 5], seed=2)   # 5 samples: DP 2 leaves a filler slot


def ckpt_names(config) -> set[str]:
    """The transformers names (experts fused) of the embedded model: embedding, final norm, LM head; per layer two
    norms, q / k / v / o, q / k norms, the router and the two fused expert tensors."""
    per_layer = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight", "mlp.experts.gate_up_proj",
                 "mlp.experts.down_proj")
    return ({"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
            | {f"model.layers.{i}.{n}" for i in range(config["num_hidden_layers"]) for n in per_layer})


def _per_sample(logits: torch.Tensor, record: RolloutRecord, indices) -> list[torch.Tensor]:
    return list(logits.split([record.samples[i].length - record.samples[i].prompt_len for i in indices]))


# --------------------------------------------------------------------------------------------------
# refusals: no process starts
# --------------------------------------------------------------------------------------------------


def test_layouts_megatron_cannot_build_are_refused():
    config = read_model_config(embedded_model_path())
    assert mc.check_parallel_layout(config, tp=2, ep=2, pp=2).as_dict() == {"tp": 2, "ep": 2, "pp": 2, "dp": 2,
                                                                           "world": 8}
    assert mc.check_parallel_layout(config, ep=2, world=4).dp == 4          # negative control: these build
    cases = [
        (dict(ep=3), "expert parallel size 3 does not divide the model's 16 experts"),
        (dict(pp=3), "pipeline parallel size 3 does not divide the model's 4 decoder layers"),
        (dict(tp=2, pp=2, world=6), "a world of 6 ranks is not divisible by TP x PP = 2 x 2 = 4"),
        (dict(ep=2, dp=3), r"expert parallel size 2 does not divide the data-parallel x tensor-parallel ranks of "
                           r"a stage \(DP 3 x TP 1 = 3\)"),
        (dict(ep=4, world=2), r"expert parallel size 4 does not divide the data-parallel x tensor-parallel"),
        (dict(tp=4), r"tensor parallel size 4 does not divide the model's query groups \(num_key_value_heads\) \(2\)"),
        (dict(tp=0), "tp must be a positive integer, got 0"),
        (dict(ep=True), "ep must be a positive integer, got True"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            mc.check_parallel_layout(config, **kwargs)
    # MLA (tiny_deepseek: 4 heads, q LoRA 64, kv down projection 512 + 64 rows): TP splits heads and both down
    # projections' rows
    deepseek = read_model_config(embedded_model_path("tiny_deepseek"))
    assert mc.check_parallel_layout(deepseek, tp=4).tp == 4                 # negative control: this builds
    for change, message in [({}, r"tensor parallel size 8 does not divide the model's attention heads \(4\)"),
                            ({"num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 68},
                             r"does not divide the model's q LoRA rank \(q_lora_rank\) \(68\)"),
                            ({"num_attention_heads": 8, "num_key_value_heads": 8, "qk_rope_head_dim": 36},
                             r"kv down projection \(kv_lora_rank \+ qk_rope_head_dim\) \(548\)")]:
        with pytest.raises(ConfigError, match=message):
            mc.check_parallel_layout({**deepseek, **change}, tp=8)


def test_trainer_refuses_before_any_process_starts():
    import multiprocessing

    before = set(multiprocessing.active_children())
    for kwargs, message in [(dict(ep=3), "does not divide the model's 16 experts"),
                            (dict(dispatcher="flex"), "unknown MoE token dispatcher 'flex'"),
                            (dict(pp=8), "pipeline parallel size 8"),
                            (dict(precision="fp8-e4m3-tensor"), "fp8-e4m3-tensor")]:
        with pytest.raises(ConfigError, match=message):
            ShardedMegatronTrainer(embedded_model_path(), **kwargs)
    assert set(multiprocessing.active_children()) == before


# --------------------------------------------------------------------------------------------------
# the single-rank reference
# --------------------------------------------------------------------------------------------------

#: the groups of samples whose tokens each expert GEMM sees together, per layout (EQUAL, 4 samples)
GROUPS = {"whole": [[0, 1, 2, 3]], "pp2": [[0, 1], [2, 3]], "ep2pp2": [[0, 2], [1, 3]]}


@pytest.fixture(scope="module")
def reference():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moealign.mismatch.engines import MegatronTrainEngine

    saved = list(RouterReplay.global_router_replay_instances)
    engine = MegatronTrainEngine(str(embedded_model_path()), "fp32", "cpu")
    try:
        out = {}
        for replay in (False, True):
            for name, groups in GROUPS.items():
                per = {}
                for group in groups:
                    per.update(zip(group, _per_sample(engine.forward(EQUAL, group, replay=replay).logits, EQUAL,
                                                      group)))
                out[name, replay] = [per[i] for i in range(4)]
            out["ragged", replay] = _per_sample(engine.forward(RAGGED, range(5), replay=replay).logits, RAGGED,
                                                range(5))
        out["meta"] = engine.meta()
        # loading from the checkpoint path (tensor by tensor) gives the parameters the state-dict path gave
        model = engine.model
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        config = ConfigView(**read_model_config(embedded_model_path()))
        mc.load_hf_into_megatron(model, embedded_model_path(), config)
        out["path_load_equal"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        ckpt = mc.open_hf_checkpoint(embedded_model_path(), config)
        rows = ckpt.get("model.layers.1.mlp.experts.gate_up_proj", (4, 6))
        out["expert_rows"] = (torch.equal(rows[1], before["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1."
                                                          "weight"]),
                              torch.equal(rows[0], before["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1."
                                                          "weight"]))
        yield out
    finally:
        engine.close()
        RouterReplay.global_router_replay_instances[:] = saved


def test_single_rank_loads_the_checkpoint_path_as_the_state_dict(reference):
    assert reference["path_load_equal"]
    assert reference["expert_rows"] == (True, False)      # rows [4, 6): expert 5 is row 1, not row 0


# --------------------------------------------------------------------------------------------------
# the sharded worlds
# --------------------------------------------------------------------------------------------------


def _trainer(**layout) -> ShardedMegatronTrainer:
    return ShardedMegatronTrainer(embedded_model_path(), timeout_s=120, **layout)


def _compare(trainer, reference, *, bitwise: dict, dispatchers=("alltoall", "allgather")) -> dict:
    """Both dispatchers, without and with replay: the EQUAL record against the reference of its composition
    (``bitwise[dispatcher]``: the GROUPS name when torch.equal holds, None for the TOL bound against "whole"), the
    RAGGED record within TOL; flips 0 under replay on every rank's layers, every rank's verifier clean."""
    seen = {}
    for dispatcher in dispatchers:
        if trainer.dispatcher != dispatcher:
            trainer.set_dispatcher(dispatcher)
        for replay in (False, True):
            fwd = trainer.forward(EQUAL, range(4), replay=replay)
            got = _per_sample(fwd.logits, EQUAL, range(4))
            name = bitwise[dispatcher]
            want = reference[name or "whole", replay]
            if name is not None:
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (dispatcher, replay)
            worst = max(float((a - b).abs().max()) for a, b in zip(got, want))
            assert worst <= TOL, (dispatcher, replay, worst)
            lp_want = [torch.log_softmax(w, -1).gather(-1, EQUAL.samples[i].token_ids[EQUAL.samples[i].prompt_len:,
                                                                                     None])[:, 0]
                       for i, w in enumerate(want)]
            assert max(float((a - b).abs().max()) for a, b in zip(fwd.logprobs, lp_want)) <= TOL
            seen[dispatcher, replay] = got
            if replay:
                assert fwd.flips.router_flip_rate == 0.0 and fwd.flips.num_tokens == sum(
                    s.length - 1 for s in EQUAL.samples)
                for rank in fwd.ranks:
                    assert rank["mismatched_rows"] == 0 and rank["replayed_rows"] > 0, rank
                    assert rank["replayed_calls"] == len(rank["moe_layers"]) * rank["micro_batches"], rank
                assert sorted({layer for r in fwd.ranks for layer in r["moe_layers"]}) == list(range(LAYERS))
            else:
                assert fwd.flips.router_flip_rate > 0.5         # the random routes are not the model's own
        ragged = trainer.forward(RAGGED, range(5), replay=True)
        assert ragged.flips.router_flip_rate == 0.0
        got = _per_sample(ragged.logits, RAGGED, range(5))
        assert max(float((a - b).abs().max()) for a, b in zip(got, reference["ragged", True])) <= TOL
    return seen


def test_ep2_alltoall_bitwise_allgather_bounded(reference):
    trainer = _trainer(ep=2, dispatcher="alltoall")
    try:
        assert trainer.layout.as_dict() == {"tp": 1, "ep": 2, "pp": 1, "dp": 2, "world": 2}
        assert [r["local_experts"] for r in trainer.ranks] == [8, 8]
        reference["meta"].check_matches(trainer.meta(), require_weights=True)   # config and router weights
        seen = _compare(trainer, reference, bitwise={"alltoall": "whole", "allgather": None})
        # negative control of the bitwise claims: the all-gather dispatcher's reduce-scatter is not bitwise
        assert not all(torch.equal(a, b) for a, b in zip(seen["alltoall", True], seen["allgather", True]))
    finally:
        trainer.close()


def test_pp2_p2p_schedule_bitwise(reference):
    trainer = _trainer(pp=2, dispatcher="alltoall")
    try:
        assert [r["moe_layers"] for r in trainer.ranks] == [[0, 1], [2, 3]]
        assert [(r["first_stage"], r["last_stage"]) for r in trainer.ranks] == [(True, False), (False, True)]
        _compare(trainer, reference, bitwise={"alltoall": "pp2", "allgather": "pp2"})
        # negative control: two micro-batches of two are not the single-rank trainer's batch of four, bit for bit
        fwd = trainer.forward(EQUAL, range(4), replay=True)
        assert not all(torch.equal(a, b) for a, b in zip(_per_sample(fwd.logits, EQUAL, range(4)),
                                                          reference["whole", True]))
    finally:
        trainer.close()


def test_ep2_pp2_replay_negative_controls(reference):
    trainer = _trainer(ep=2, pp=2, dispatcher="alltoall")
    try:
        assert trainer.layout.world == 4
        _compare(trainer, reference, bitwise={"alltoall": "ep2pp2", "allgather": None})
        # routes shifted by one token, samples swapped: every rank's token check names it; the world survives
        with pytest.raises(ReplayError, match=r"rank \d \(tp 0, pp \d, dp \d, ep \d\) of TP 1 x EP 2 x PP 2 .*token"):
            trainer.forward(EQUAL, range(4), replay=True, fault="shift")
        trainer.set_dispatcher("allgather")
        with pytest.raises(ReplayError, match=r"rank \d .*token"):
            trainer.forward(RAGGED, range(5), replay=True, fault="swap")
        fwd = trainer.forward(EQUAL, range(4), replay=True)          # negative control: no fault, no error
        assert fwd.flips.router_flip_rate == 0.0
        from test_sharded_refit import check_stream_and_manifest     # the refit's stream and manifest, this world

        check_stream_and_manifest(trainer)
    finally:
        trainer.close()


def test_tp2_bounded_and_a_killed_rank_is_named(reference):
    trainer = _trainer(tp=2, dispatcher="allgather")
    try:
        _compare(trainer, reference, bitwise={"alltoall": None, "allgather": None}, dispatchers=("allgather",
                                                                                                  "alltoall"))
        # sequence parallelism splits the sequence over the 2 TP ranks: samples 1 and 2 pad to 17, one more masked
        # column makes it even; every rank replays and verifies its half, the routes come back in record order
        odd = trainer.forward(RAGGED, [1, 2], replay=True)
        assert odd.flips.router_flip_rate == 0.0 and odd.flips.num_tokens == 16 + 8
        assert all(r["mismatched_rows"] == 0 and r["verified_rows"] == 18 * 2 // 2 * LAYERS for r in odd.ranks)
        got = _per_sample(odd.logits, RAGGED, [1, 2])
        assert max(float((a - b).abs().max()) for a, b in zip(got, reference["ragged", True][1:3])) <= TOL
        pids = trainer.pids()
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"rank 1 \(tp 1, pp 0, dp 0, ep 0\) of TP 2 x EP 1 x PP 1 .* killed by "
                                              r"SIGKILL.*the other ranks \[0\] were stopped"):
            trainer.forward(EQUAL, range(4), replay=False)
        assert time.monotonic() - start < 30
        assert trainer.closed
        for pid in pids:                       # reaped: nothing orphaned
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        with pytest.raises(EngineError, match="closed"):
            trainer.forward(EQUAL, range(4), replay=False)
    finally:
        trainer.close()


def test_tp2_ep2_bounded_and_each_rank_holds_its_own_pieces(reference):
    trainer = _trainer(tp=2, ep=2, dispatcher="alltoall")
    try:
        assert trainer.layout.as_dict() == {"tp": 2, "ep": 2, "pp": 1, "dp": 2, "world": 4}
        _compare(trainer, reference, bitwise={"alltoall": None, "allgather": None})
        # every rank's own pieces, in transformers names with offsets, tile the checkpoint exactly
        config = read_model_config(embedded_model_path())
        ckpt = mc.open_hf_checkpoint(embedded_model_path(), ConfigView(**config))
        full, covered = {}, {}
        for rank_pieces in trainer.hf_shards():
            for name, tensor, offsets, full_shape in rank_pieces:
                if name not in full:
                    full[name] = torch.zeros(full_shape)
                    covered[name] = torch.zeros(full_shape, dtype=torch.bool)
                index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
                assert not covered[name][index].any() or torch.equal(full[name][index], tensor), name
                full[name][index], covered[name][index] = tensor, True
        assert set(full) == ckpt_names(config)
        for name in full:
            assert covered[name].all(), name
            assert torch.equal(full[name], ckpt.get(name)), name
        assert full["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 128, 128)
        from test_sharded_refit import check_stream_and_manifest     # the refit's stream and manifest, this world

        check_stream_and_manifest(trainer)
    finally:
        trainer.close()


# --------------------------------------------------------------------------------------------------
# multi-head latent attention at TP 2 (embedded:tiny_deepseek)
# --------------------------------------------------------------------------------------------------

#: at TP 2 against the single-rank trainer (measured on tiny_deepseek: |grad| 2.6e-7 relative, each parameter's
#: gradient squares at most 3.1e-6 relative; 2.7e-1 on kv_a_proj_with_mqa with Megatron's own column-parallel kv down
#: projection, whose gather drops the other rank's heads' share of the RoPE key's gradient: moealign.patches.megatron.mla)
MLA_NORM_RTOL, MLA_GRAD_RTOL = 1e-5, 1e-3


def _deepseek_record() -> RolloutRecord:
    """EQUAL's shape on tiny_deepseek: 3 layers, the MoE layers 1 and 2 (layer 0 dense)."""
    import dataclasses

    rec = random_record([16] * 4, [5, 7, 9, 11], 3, "float32", experts=E, top_k=K, layers=2, vocab=V)
    return RolloutRecord(dataclasses.replace(rec.meta, num_layers=3, moe_layers=(1, 2)), rec.samples)


def _read_back(trainer) -> dict[str, torch.Tensor]:
    """Every rank's own pieces (transformers names, offsets) joined into full tensors; each element covered."""
    full, covered = {}, {}
    for rank_pieces in trainer.hf_shards():
        for name, tensor, offsets, full_shape in rank_pieces:
            if name not in full:
                full[name] = torch.zeros(full_shape, dtype=tensor.dtype)
                covered[name] = torch.zeros(full_shape, dtype=torch.bool)
            index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
            assert not covered[name][index].any() or torch.equal(full[name][index], tensor), name
            full[name][index], covered[name][index] = tensor, True
    assert all(c.all() for c in covered.values())
    return full


def test_tp2_mla_forward_read_back_and_training_step(tmp_path):
    """tiny_deepseek (MLA with q LoRA, the shared expert, the dense first layer) at TP 2 (sequence parallelism):
    logits within TOL of the single-rank trainer without and with replay, flips 0, every rank's verifier clean; the
    ranks' pieces reassemble the checkpoint bit for bit; one training step's norm and every parameter's gradient
    squares within MLA_*_RTOL. Negative control by construction: a checkpoint with kv_b_proj's two TP slices (rank 0's
    and rank 1's heads) of layer 1 swapped: the logits leave TOL, the read-back names exactly that tensor."""
    import shutil

    from megatron.core.transformer.moe.router_replay import RouterReplay
    from safetensors.torch import load_file, save_file

    from moealign.mismatch.engines import MegatronTrainEngine

    path = embedded_model_path("tiny_deepseek")
    record, idx = _deepseek_record(), range(4)
    tokens = torch.cat([s.token_ids[s.prompt_len:] for s in record.samples])
    weights = torch.randn(len(tokens), generator=torch.Generator().manual_seed(0))

    def loss_of(logits):
        return (torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0] * weights).sum() / 10

    saved = list(RouterReplay.global_router_replay_instances)
    engine = MegatronTrainEngine(str(path), "fp32", "cpu")
    try:
        ref = {False: engine.forward(record, idx, replay=False).logits}
        params = list(engine.model.parameters())
        for p in params:
            p.requires_grad_(True)
        fwd = engine.forward(record, idx, replay=True, grad=True)
        ref[True] = fwd.logits.detach().clone()
        loss_of(fwd.logits).backward()
        squares = {n: float(p.grad.square().sum()) for n, p in engine.model.named_parameters()}
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    finally:
        engine.close()
        RouterReplay.global_router_replay_instances[:] = saved

    trainer = ShardedMegatronTrainer(path, tp=2, timeout_s=120)
    try:
        assert trainer.sequence_parallel
        for replay in (False, True):
            got = trainer.forward(record, idx, replay=replay)
            worst = float((got.logits - ref[replay]).abs().max())
            print(f"\ntiny_deepseek TP 2 vs single rank (replay {replay}): max |logit diff| {worst:.3g}")
            assert worst <= TOL, (replay, worst)
            if replay:
                assert got.flips.router_flip_rate == 0.0
                assert all(r["mismatched_rows"] == 0 and r["replayed_rows"] > 0 for r in got.ranks), got.ranks
                assert [r["moe_layers"] for r in got.ranks] == [[1, 2], [1, 2]]
        full = _read_back(trainer)
        # 3 + per layer 2 norms and MLA's 7 tensors; layer 0's dense GLU (3); layers 1, 2: router, bias, the two fused
        # expert tensors, the shared expert (3)
        assert len(full) == 3 + 3 * 9 + 3 + 2 * 7 and set(full) == set(trainer.hf_plan())
        ckpt = mc.open_hf_checkpoint(path, ConfigView(**read_model_config(path)))
        try:                                    # experts stored one by one: get() joins them as the mapping does
            want = {name: ckpt.get(name).to(full[name].dtype) for name in sorted(full)}
        finally:
            ckpt.close()
        assert [n for n in want if not torch.equal(full[n], want[n])] == []
        # negative control: layer 1's kv_b_proj with rank 0's and rank 1's head rows swapped
        swapped = tmp_path / "swapped"
        swapped.mkdir()
        shutil.copy(path / "config.json", swapped / "config.json")
        tensors = load_file(str(path / "model.safetensors"))
        name = "model.layers.1.self_attn.kv_b_proj.weight"
        tensors[name] = torch.cat(tensors[name].chunk(2, dim=0)[::-1]).contiguous()
        save_file(tensors, str(swapped / "model.safetensors"))
        trainer.load_checkpoint(swapped)
        assert float((trainer.forward(record, idx, replay=True).logits - ref[True]).abs().max()) > 100 * TOL
        full = _read_back(trainer)
        assert [n for n in want if not torch.equal(full[n], want[n])] == [name]
        # one training step (the original weights back): the norm and every parameter's gradient
        trainer.load_checkpoint(path)
        got = trainer.forward(record, idx, replay=True)
        leaf = got.logits.detach().clone().requires_grad_(True)
        loss_of(leaf).backward()
        step = trainer.train_step(record, idx, leaf.grad, replay=True, lr=1e-3, max_grad_norm=1e9)
        print(f"tiny_deepseek TP 2 train step: |grad| {step.grad_norm:.6g} vs {norm:.6g} (single rank)")
        assert abs(step.grad_norm - norm) <= MLA_NORM_RTOL * norm
        total: dict[str, float] = {}
        for rank in step.ranks:
            for key, value in rank["grad_squares"].items():
                total[key] = total.get(key, 0.0) + value
        assert set(total) == set(squares)
        assert sorted(n for n, v in total.items() if abs(v - squares[n]) > MLA_GRAD_RTOL * squares[n]) == []
    finally:
        trainer.close()
