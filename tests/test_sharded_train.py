"""The sharded Megatron trainer trains (issue 35 item 1: ``rl-check --train-tp / --train-ep / --train-pp``).

``ShardedMegatronTrainer.train_step`` against the single-rank trainer doing what ``rl-check``'s loop does (the loss a
function of the logits, backward, ``clip_grad_norm_``, ``torch.optim.Adam``), on the embedded model with a record
built by hand (4 samples of one length, random routes replayed: every router must follow them), fp32, gloo:

* EP 2 (2 ranks, DP 2): two steps. The logits at step 0 are the single-rank trainer's bit for bit (the all-to-all
  dispatcher hands each expert GEMM the same tokens), so the loss is too (``torch.equal``); the training pass's logits
  are the forward's bit for bit at every step; the gradient norm within ``NORM_RTOL`` (Megatron's norm: the sum of
  squares over the ranks, not torch's norm of the per-tensor norms) and the updated weights within ``WEIGHT_TOL``
  (the DP all-reduce adds the two ranks' partial gradients: another summation order; Adam's first step divides each
  gradient by its own magnitude, so elements with gradients near zero move by up to a fraction of ``lr``).
* Negative controls by construction in the same world: rank 1's optimizer step skipped (its experts' rows keep their
  values bit for bit, the comparison names the expert tensors), the loss's gradient withheld from rank 1 (the norm
  and every dense tensor leave the bound).
* TP 2 (sequence parallelism on, as Megatron trains MoE with TP: each rank's routers see half of the sequence, each
  expert every token once): one step within the same bounds (RowParallelLinear's reduce-scatter: another summation
  order), each rank sent only its vocabulary slice of the loss's gradient (the bound is the check that the slice is the
  right one), and every parameter's gradient (its squares summed over the ranks, ``grad_squares``) within
  ``GRAD_RTOL`` of the single-rank trainer's. Negative control by construction: a second step with rank 1's expert
  gradients multiplied by TP (``"expert-grad-x-tp"``: what TP without sequence parallelism did, each expert seeing
  TP copies of every token) leaves the norm's bound, and the comparison names exactly the expert tensors. A rank
  killed before a training step is named with its rank and signal, the other stopped.
* ``moealign rl-check --train-ep 2 --steps 2``: exits 0, ``train.parallel`` states the layout, every refit verified
  (the one vLLM engine start of this file).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import torch

pytest.importorskip("megatron.core")

from moealign.embedded import embedded_model_path  # noqa: E402
from moealign.errors import ConfigError, EngineError  # noqa: E402
from moealign.patches.megatron.sharded import ShardedMegatronTrainer  # noqa: E402
from moealign.record import RecordMeta, RolloutRecord, Sample  # noqa: E402
from moealign.rl.refit import trainer_tensors  # noqa: E402

pytestmark = pytest.mark.heavy          # rank processes: scheduled first, tests/conftest.py

E, K, LAYERS, V = 16, 4, 4, 2048
LR, MAX_NORM = 2e-3, 1.0
#: the global gradient norm's relative bound (measured: 6e-8 at EP 2, 6.6e-7 at TP 2 with sequence parallelism, 1e-7
#: at PP 2)
NORM_RTOL = 1e-5
#: the updated weights' bound after a step (measured max |delta w|: 1.2e-5 at EP 2, 1.41e-4 at TP 2 with sequence
#: parallelism, 3.1e-5 at PP 2; lr 2e-3: an element whose gradient is near zero moves by Adam's lr * g / (|g| + eps)
#: with g's last bits)
WEIGHT_TOL = LR / 4
#: each parameter's gradient squares (summed over the TP ranks) against the single-rank trainer's, relative (measured
#: at TP 2: at most 2.9e-6 at the first step, 2.1e-5 at the second, taken from weights within WEIGHT_TOL of the
#: reference's; the "expert-grad-x-tp" control moves the expert tensors' by ~2)
GRAD_RTOL = 1e-3


def _record() -> RolloutRecord:
    g = torch.Generator().manual_seed(1)
    meta = RecordMeta(engine="test", engine_version="0", model_fingerprint="test", num_layers=LAYERS,
                      moe_layers=tuple(range(LAYERS)), num_experts=E, top_k=K, vocab_size=V, dtype="float32")
    samples = []
    for prompt in (5, 7, 9, 11):
        ids = torch.randint(2, V, (16,), generator=g)
        routes = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(15 * LAYERS)])
        samples.append(Sample(token_ids=ids, prompt_len=prompt, logprobs=torch.full((16 - prompt,), -1.0),
                              routes=routes.reshape(15, LAYERS, K).to(torch.uint8)))
    return RolloutRecord(meta, samples)


RECORD = _record()
IDX = list(range(len(RECORD)))
N_TOKENS = sum(16 - p for p in (5, 7, 9, 11))        # 32 response tokens
WEIGHTS = torch.randn(N_TOKENS, generator=torch.Generator().manual_seed(0))


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A loss of the logits alone (as rl-check's: log-probs, per-token weights of both signs)."""
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    return (logp * WEIGHTS).sum() / 10


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer_tensors(trainer)}


def _beyond(a: dict, b: dict, tol: float) -> list[str]:
    return sorted(n for n in a if float((a[n] - b[n]).abs().max()) > tol)


@pytest.fixture(scope="module")
def reference():
    """The single-rank trainer, three steps as rl-check's loop takes them: per step the logits, loss, norm, weights."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moealign.mismatch.engines import MegatronTrainEngine

    saved = list(RouterReplay.global_router_replay_instances)
    engine = MegatronTrainEngine(str(embedded_model_path()), "fp32", "cpu")
    try:
        params = list(engine.model.parameters())
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=LR)
        steps = [{"weights": _weights(engine)}]
        for _ in range(3):
            fwd = engine.forward(RECORD, IDX, replay=True, grad=True)
            loss = _loss(fwd.logits, fwd.tokens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            squares = {n: float(p.grad.float().square().sum()) for n, p in engine.model.named_parameters()}
            norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
            optimizer.step()
            steps[-1].update(logits=fwd.logits.detach().clone(), loss=loss.detach().clone(), norm=norm,
                             grad_squares=squares)
            steps.append({"weights": _weights(engine)})
        yield steps
    finally:
        engine.close()
        RouterReplay.global_router_replay_instances[:] = saved


def _step(trainer, fault=None):
    """One sharded step as rl-check's loop takes it: pass 1 (forward), the loss's gradient w.r.t. the logits, pass 2."""
    fwd = trainer.forward(RECORD, IDX, replay=True)
    leaf = fwd.logits.detach().clone().requires_grad_(True)
    loss = _loss(leaf, fwd.tokens)
    loss.backward()
    step = trainer.train_step(RECORD, IDX, leaf.grad, replay=True, lr=LR, max_grad_norm=MAX_NORM, fault=fault)
    return fwd, loss.detach(), step


def _grads_beyond(step, ref: dict) -> list[str]:
    """The Megatron parameters whose gradient squares, summed over the ranks (a TP-only world: every rank holds the
    same names; TP duplicates counted once), differ from the single-rank trainer's by more than GRAD_RTOL."""
    total: dict[str, float] = {}
    for rank in step.ranks:
        for name, value in rank["grad_squares"].items():
            total[name] = total.get(name, 0.0) + value
    assert set(total) == set(ref["grad_squares"])
    return sorted(n for n, v in total.items() if abs(v - ref["grad_squares"][n]) > GRAD_RTOL * ref["grad_squares"][n])


def _check_step(trainer, ref: dict, after: dict, *, bitwise: bool):
    fwd, loss, step = _step(trainer)
    assert torch.equal(step.logits, fwd.logits)                 # pass 2 trained at the logits G was taken at
    if bitwise:
        assert torch.equal(fwd.logits, ref["logits"]) and torch.equal(loss, ref["loss"])
    else:
        assert float((fwd.logits - ref["logits"]).abs().max()) < 5e-5
    assert abs(step.grad_norm - ref["norm"]) <= NORM_RTOL * ref["norm"]
    weights = _weights(trainer)
    assert _beyond(weights, after["weights"], WEIGHT_TOL) == []
    for rank in step.ranks:                                      # replay checked on every rank in the training pass
        assert rank["mismatched_rows"] == 0 and rank["replayed_calls"] > 0
    return weights, step


def test_ep2_trains_as_the_single_rank_trainer_and_the_controls_are_named(reference):
    with ShardedMegatronTrainer(embedded_model_path(), ep=2, timeout_s=120) as trainer:
        assert _beyond(_weights(trainer), reference[0]["weights"], 0.0) == []
        with pytest.raises(ConfigError, match=r"grad_logits must be a float32 tensor \[32, 2048\]"):
            trainer.train_step(RECORD, IDX, torch.zeros(N_TOKENS - 1, V), replay=True, lr=LR, max_grad_norm=MAX_NORM)
        with pytest.raises(ConfigError, match="fault must be"):
            trainer.train_step(RECORD, IDX, torch.zeros(N_TOKENS, V), replay=True, lr=LR, max_grad_norm=MAX_NORM,
                               fault=("skip-step", 2))
        before = reference[0]["weights"]
        for s in range(2):
            weights, _ = _check_step(trainer, reference[s], reference[s + 1], bitwise=s == 0)
            assert _beyond(weights, before, WEIGHT_TOL) == sorted(weights)     # the step moved every tensor beyond it
            before = weights
        # negative control: the loss's gradient withheld from rank 1 (its samples' share of every gradient): the
        # norm and the weights leave the bounds, the comparison names the tensors
        _, _, step = _step(trainer, fault=("no-grad", 1))
        assert abs(step.grad_norm - reference[2]["norm"]) > 100 * NORM_RTOL * reference[2]["norm"]
        named = _beyond(_weights(trainer), reference[3]["weights"], WEIGHT_TOL)
        assert "model.layers.0.self_attn.q_proj.weight" in named and "lm_head.weight" in named
        # negative control: rank 1 (experts 8-15 of every layer) skips its optimizer step
        before = _weights(trainer)
        _step(trainer, fault=("skip-step", 1))
        weights = _weights(trainer)
        experts = sorted(n for n in weights if ".mlp.experts." in n)
        assert len(experts) == 2 * LAYERS
        for name in experts:                   # fused [experts, ...]: rank 1's rows untouched, rank 0's moved
            assert torch.equal(weights[name][8:], before[name][8:])
            assert not torch.equal(weights[name][:8], before[name][:8])
        assert not torch.equal(weights["lm_head.weight"], before["lm_head.weight"])


def test_tp2_within_the_bound_and_a_killed_rank_is_named(reference):
    trainer = ShardedMegatronTrainer(embedded_model_path(), tp=2, timeout_s=120)
    try:
        assert trainer.sequence_parallel
        _, step = _check_step(trainer, reference[0], reference[1], bitwise=False)
        # each TP rank was sent its own half of the loss's gradient (V / 2 columns), not the vocabulary
        assert [r["grad_columns"] for r in step.ranks] == [V // 2, V // 2]
        # sequence parallelism: each rank's routers replayed (and its verifier checked) its half of the 4 x 16 rows
        assert [r["verified_rows"] for r in step.ranks] == [4 * 16 * LAYERS // 2] * 2
        assert _grads_beyond(step, reference[0]) == []          # every gradient the single-rank trainer's
        # negative control by construction: rank 1's expert gradients TP times the loss's (TP without SP)
        _, _, step = _step(trainer, fault=("expert-grad-x-tp", 1))
        assert abs(step.grad_norm - reference[1]["norm"]) > 100 * NORM_RTOL * reference[1]["norm"]
        experts = sorted(n for n, v in reference[1]["grad_squares"].items() if ".mlp.experts." in n and v > 0)
        assert len(experts) > 2 * LAYERS and _grads_beyond(step, reference[1]) == experts
        pids = trainer.pids()
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"rank 1 \(tp 1, pp 0, dp 0, ep 0\) of TP 2 x EP 1 x PP 1 .* killed by "
                                              r"SIGKILL.* during the training step.*the other ranks \[0\] were stopped"):
            trainer.train_step(RECORD, IDX, torch.zeros(N_TOKENS, V), replay=True, lr=LR, max_grad_norm=MAX_NORM)
        assert time.monotonic() - start < 30 and trainer.closed
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        trainer.close()


def test_rl_check_trains_sharded_and_verifies_every_refit(tmp_path):
    from moealign._optional import probe

    if not probe("vllm").available:
        pytest.skip("vLLM not installed")
    import warm
    from vllm_util import child_env

    out = tmp_path / "rl.json"
    cmd = [sys.executable, "-m", "moealign", "rl-check", "--train-ep", "2", "--steps", "2", "--num-prompts", "4",
           "--group-size", "2", "--max-new-tokens", "8", "--seed", "2", "--device", "cpu", "--json", str(out), "-q"]
    proc = warm.run(cmd, capture_output=True, text=True, timeout=600, env=child_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["train"]["parallel"] == {"tp": 1, "ep": 2, "pp": 1, "dp": 2, "world": 2}
    assert report["train"]["dispatcher"] == "alltoall"
    (run,) = report["runs"]
    assert run["initial_refit"]["verify"]["ok"]
    for s in run["steps"]:
        assert s["verify"]["ok"] and s["verify"]["weights"]["ok"] and s["refit"]["tensors"] > 0
        assert s["grad_norm"] > 0 and s["metrics"]["router_flip_rate"] == 0.0
