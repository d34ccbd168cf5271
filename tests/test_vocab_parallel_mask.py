"""Kept-set log-prob on vocab-parallel logits: without a group (bitwise the public kept_logprob), two gloo
processes holding vocabulary slices of the same logits, and a real Megatron GPTModel with
tensor_model_parallel_size=2 on CPU (gloo, eval mode) against the same model at TP=1."""

from __future__ import annotations

import os
import queue
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from moealign.routing_replay.routes import RouteError
from moealign.routing_replay.sampling_mask import (
    full_logprob,
    kept_logprob,
    kept_mask,
    kept_sets_from_logits,
    truncation_mask,
)
from moealign.routing_replay.vocab_parallel import (
    vocab_parallel_full_logprob,
    vocab_parallel_kept_logprob,
)

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

N, V, TEMP = 24, 96, 0.8


def _sample(logits: torch.Tensor, temperature: float, seed: int, **truncation):
    """Realistic kept sets (HF-order truncation on logits / T) and a token drawn from each."""
    mask = truncation_mask(logits, temperature=temperature, **truncation)
    offsets, ids = kept_sets_from_logits(torch.where(mask, logits, float("-inf")))
    probs = torch.where(mask, logits.double() / temperature, float("-inf")).softmax(-1)
    tokens = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).squeeze(1)
    return tokens, offsets, ids


def _case(seed: int = 0, boost_first: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * 2.5
    logits[:, :boost_first] += 15.0         # pulls every kept set into the first slice
    tokens, offsets, ids = _sample(logits, TEMP, seed, top_p=0.9, top_k=40)
    return logits, tokens, offsets, ids


# --------------------------------------------------------------------------------------------------
# one process (no tensor parallelism): the public kept_logprob's arithmetic, bitwise
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_group_is_the_public_function_bitwise(masked, dtype):
    logits, tokens, offsets, ids = _case(seed=1)
    logits = logits.to(dtype)
    leaf = logits.clone().requires_grad_()
    ref = kept_logprob(leaf, tokens, offsets, ids, temperature=TEMP) if masked else \
        full_logprob(leaf, tokens, temperature=TEMP)
    ref.sum().backward()
    shard = logits.clone().requires_grad_()
    out = vocab_parallel_kept_logprob(shard, tokens, (offsets, ids) if masked else None, 0, temperature=TEMP)
    out.sum().backward()
    assert out.dtype == torch.float32 and out.shape == (N,)
    assert torch.equal(out, ref)
    assert torch.equal(shard.grad, leaf.grad)


def test_public_function_without_group_matches_and_mask_matters():
    logits, tokens, offsets, ids = _case(seed=1)
    kept = vocab_parallel_kept_logprob(logits, tokens, (offsets, ids), 0, temperature=TEMP)
    full = vocab_parallel_full_logprob(logits, tokens, 0, temperature=TEMP)
    assert torch.equal(kept, kept_logprob(logits, tokens, offsets, ids, temperature=TEMP))
    assert torch.equal(full, full_logprob(logits, tokens, temperature=TEMP))
    # negative control: the kept set drops probability mass, so the full-vocabulary log-prob is lower
    assert bool((kept - full > 1e-3).all())
    # temperature is applied: T = 1 gives another answer
    assert not torch.allclose(vocab_parallel_kept_logprob(logits, tokens, (offsets, ids), 0), kept)


def _bad_token_outside_kept():
    logits, tokens, offsets, ids = _case(seed=4)
    row = 7
    kept_row = set(ids[offsets[row]:offsets[row + 1]].tolist())
    tokens = tokens.clone()
    tokens[row] = next(t for t in range(V) if t not in kept_row)
    return logits, tokens, (offsets, ids), 0


@pytest.mark.parametrize("make, message", [
    (_bad_token_outside_kept, r"row 7: token \d+ is not in its kept set .*-inf"),
    (lambda l, t, k: (l, torch.where(torch.arange(N) == 2, V, t), k, 0),
     rf"tokens\[2\] = {V} is not a token id in \[0, {V}\)"),
    (lambda l, t, k: (l, t.float(), k, 0), "tokens must be an integer tensor"),
    (lambda l, t, k: (l, t[:, None], k, 0), r"tokens must be a 1-D tensor"),
    (lambda l, t, k: (l[:-1], t, k, 0), f"logits_shard has {N - 1} rows but tokens has {N}"),
    (lambda l, t, k: (l[0], t, k, 0), r"logits_shard must have shape \[N, V/TP\]"),
    (lambda l, t, k: (l.long(), t, k, 0), "logits_shard must be a floating tensor"),
    (lambda l, t, k: (l, t, (k[0][:-1], k[1]), 0), f"kept sets have {N - 1} rows .* {N} tokens"),
    (lambda l, t, k: (l, t, k[0], 0), r"kept must be None \(full support\) or a pair"),
    (lambda l, t, k: (l, t, (k[0], k[1].float()), 0), "ids must be an integer tensor"),
    (lambda l, t, k: (l, t, (k[0], torch.where(k[1] == k[1].max(), V, k[1])), 0), "is not a token id"),
    (lambda l, t, k: (l, t, k, 4), r"vocab_start = 4 but this rank's slice starts at 0"),
    (lambda l, t, k: (l, t, k, 0.0), "vocab_start must be an int"),
])
def test_errors_name_the_problem(make, message):
    logits, tokens, offsets, ids = _case(seed=4)
    args = make() if make is _bad_token_outside_kept else make(logits, tokens, (offsets, ids))
    with pytest.raises(RouteError, match=message):
        vocab_parallel_kept_logprob(*args, temperature=TEMP)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_logits_name_row_and_vocab_id(value):
    logits, tokens, offsets, ids = _case(seed=6)
    bad = logits.clone()
    bad[5, 70] = value                 # outside most kept sets: still an error (a broken model)
    with pytest.raises(RouteError, match=rf"logits row 5 holds {value} at vocabulary id 70 \(logits_shard\[5, 70\]\)"):
        vocab_parallel_kept_logprob(bad, tokens, (offsets, ids), 0)
    with pytest.raises(RouteError, match=rf"logits row 5 holds {value} at vocabulary id 70$"):
        kept_logprob(bad, tokens, offsets, ids)                  # the same check in the public function


@pytest.mark.parametrize("temperature", [0, -1.0, float("nan"), True, "1"])
def test_bad_temperature(temperature):
    logits, tokens, offsets, ids = _case()
    with pytest.raises(RouteError, match="temperature"):
        vocab_parallel_kept_logprob(logits, tokens, (offsets, ids), 0, temperature=temperature)


def test_group_needs_initialised_distributed(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    logits, tokens, offsets, ids = _case()
    with pytest.raises(RouteError, match="not initialised"):
        vocab_parallel_kept_logprob(logits, tokens, (offsets, ids), 0, group=object())


# --------------------------------------------------------------------------------------------------
# gloo processes, pure torch: each rank holds its vocabulary slice of the same logits
# --------------------------------------------------------------------------------------------------


def _gloo_worker(rank: int, world: int, init: str, results) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        group = dist.group.WORLD
        width = V // world
        start = rank * width
        out = {}

        def sharded(logits, tokens, kept, dtype=None, **kw):
            shard = logits[:, start:start + width].clone()
            shard = (shard if dtype is None else shard.to(dtype)).requires_grad_()
            lp = vocab_parallel_kept_logprob(shard, tokens, kept, start, group=group, **kw)
            lp.sum().backward()
            return lp.detach(), shard.grad

        for masked in (True, False):
            logits, tokens, offsets, ids = _case(seed=0)
            leaf = logits.clone().requires_grad_()
            ref = kept_logprob(leaf, tokens, offsets, ids, temperature=TEMP) if masked else \
                full_logprob(leaf, tokens, temperature=TEMP)
            ref.sum().backward()
            lp, grad = sharded(logits, tokens, (offsets, ids) if masked else None, temperature=TEMP)
            out[f"value_diff_{masked}"] = float((lp - ref.detach()).abs().max())
            out[f"grad_diff_{masked}"] = float((grad - leaf.grad[:, start:start + width]).abs().max())
            out[f"values_{masked}"] = lp.tolist()        # compared across ranks: the same bits everywhere
            out[f"dtype_{masked}"] = str(lp.dtype)
            if masked:   # the gradient is this rank's part of (onehot - softmax over the kept set) / T
                softmax = torch.where(kept_mask(offsets, ids, V), logits / TEMP, float("-inf")).softmax(-1)
                want = (F.one_hot(tokens.long(), V).float() - softmax) / TEMP
                out["grad_formula_diff"] = float((grad - want[:, start:start + width]).abs().max())

        # every kept set inside rank 0's slice: rank 1 contributes nothing, its gradient is zero
        logits, tokens, offsets, ids = _case(seed=5, boost_first=8)
        lp, grad = sharded(logits, tokens, (offsets, ids), temperature=TEMP)
        out["empty_slice_max_id"] = int(ids.max())
        out["empty_slice_diff"] = float((lp - kept_logprob(logits, tokens, offsets, ids, temperature=TEMP)).abs().max())
        out["empty_slice_grad_zero"] = bool(torch.equal(grad, torch.zeros_like(grad))) if rank == 1 else None
        out["empty_slice_finite"] = bool(torch.isfinite(lp).all())

        # bf16 logits: float32 result, close to the unsharded one
        logits, tokens, offsets, ids = _case(seed=2)
        lp, _ = sharded(logits, tokens, (offsets, ids), dtype=torch.bfloat16, temperature=TEMP)
        ref = kept_logprob(logits.bfloat16(), tokens, offsets, ids, temperature=TEMP)
        out["bf16_dtype"], out["bf16_diff"] = str(lp.dtype), float((lp - ref).abs().max())

        # a NaN in rank 1's slice and a wrong vocab_start on rank 1: every rank raises, none hangs
        logits, tokens, offsets, ids = _case(seed=6)
        bad = logits[:, start:start + width].clone()
        if rank == 1:
            bad[5, 7] = float("nan")
        try:
            vocab_parallel_kept_logprob(bad, tokens, (offsets, ids), start, group=group)
        except RouteError as exc:
            out["nan_error"] = str(exc)
        try:
            vocab_parallel_kept_logprob(logits[:, start:start + width], tokens, (offsets, ids), 0, group=group)
        except RouteError as exc:
            out["start_error"] = str(exc)
        outside = tokens.clone()
        row_ids = set(ids[offsets[3]:offsets[4]].tolist())
        outside[3] = next(t for t in range(V) if t not in row_ids)
        try:
            vocab_parallel_kept_logprob(logits[:, start:start + width], outside, (offsets, ids), start, group=group)
        except RouteError as exc:
            out["outside_error"] = str(exc)
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_workers(target, world: int, timeout: float = 180) -> dict:
    """Start ``world`` spawned processes running ``target(rank, world, init, results)``; their results by rank.
    ``init`` is a rendezvous file of this call's own (no TCP port: parallel pytest workers never share a world)."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = tempfile.TemporaryDirectory(prefix="moealign-test-gloo-")
    init = f"file://{os.path.join(rendezvous.name, 'init')}"
    procs = [ctx.Process(target=target, args=(r, world, init, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < len(procs):
            try:
                rank, value = results.get(timeout=1)
            except queue.Empty:
                died = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if died or time.monotonic() > deadline:
                    pytest.fail(f"workers died ({died}) or timed out; results so far: {got}")
                continue
            got[rank] = value
            if isinstance(value, str):       # a traceback: the other ranks may be stuck, stop here
                break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        rendezvous.cleanup()
    for rank, value in sorted(got.items()):
        assert not isinstance(value, str), f"rank {rank} failed:\n{value}"
    return got


def test_gloo_tp2_equals_unsharded():
    got = _run_workers(_gloo_worker, 2)
    for rank, o in got.items():
        for masked in (True, False):
            assert o[f"dtype_{masked}"] == "torch.float32"
            assert o[f"value_diff_{masked}"] < 2e-6, (rank, masked, o[f"value_diff_{masked}"])
            assert o[f"grad_diff_{masked}"] < 2e-6, (rank, masked, o[f"grad_diff_{masked}"])
        assert o["grad_formula_diff"] < 2e-6
        assert o["empty_slice_max_id"] < V // 2                # the setup: rank 1's slice keeps nothing
        assert o["empty_slice_diff"] < 2e-6 and o["empty_slice_finite"]
        assert o["bf16_dtype"] == "torch.float32" and o["bf16_diff"] < 2e-6
        assert "row 3: token" in o["outside_error"] and "not in its kept set" in o["outside_error"]
    for masked in (True, False):                       # every rank returns the same bits
        assert got[0][f"values_{masked}"] == got[1][f"values_{masked}"]
    assert got[1]["empty_slice_grad_zero"]
    assert f"logits row 5 holds nan at vocabulary id {V // 2 + 7}" in got[1]["nan_error"]
    assert "tensor-parallel rank 1: logits_shard[5, 7]" in got[1]["nan_error"]
    assert "row 5 holds NaN or Inf on another tensor-parallel rank" in got[0]["nan_error"]
    assert f"vocab_start = 0 but this rank's slice starts at {V // 2}" in got[1]["start_error"]
    assert "tensor-parallel rank 1 rejected its input" in got[0]["start_error"]


# --------------------------------------------------------------------------------------------------
# two gloo processes: a real Megatron GPTModel at TP=1 and TP=2
# --------------------------------------------------------------------------------------------------

MB, MT, MV = 2, 12, 512      # batch, sequence, vocabulary of the Megatron model


def _megatron_model():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, init_method_std=0.3,
        use_cpu_initialization=True, params_dtype=torch.float32, add_bias_linear=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False)
    torch.manual_seed(0)                 # the master weights are drawn from the CPU RNG, then split
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=MV,
                         max_sequence_length=64, position_embedding_type="rope")
    return model.eval()


def _megatron_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MV, (MB, MT), generator=g)
    pos = torch.arange(MT).expand(MB, MT)
    mask = ~torch.tril(torch.ones(MT, MT, dtype=torch.bool))[None, None]
    return ids, pos, mask


def _megatron_worker(rank: int, world: int, init: str, results) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")          # Megatron's CPU-mode notices (Apex, CUDA env vars)
    import torch.distributed as dist

    from moealign.patches.megatron import enable_megatron_cpu

    mode = None
    try:
        mode = enable_megatron_cpu(pin_cpu=True)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        ids, pos, attn = _megatron_inputs()
        out = {}

        # TP = 1 reference (both processes compute it; data parallel 2)
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        model_parallel_cuda_manual_seed(123)
        model1 = _megatron_model()
        logits1 = model1(ids, pos, attention_mask=attn)
        assert logits1.shape == (MB, MT, MV), logits1.shape
        x1 = logits1.reshape(-1, MV)
        tokens, offsets, kept_ids = _sample(x1.detach(), TEMP, seed=9, top_p=0.9)
        ref_kept = kept_logprob(x1, tokens, offsets, kept_ids, temperature=TEMP)
        ref_full = full_logprob(x1.detach(), tokens, temperature=TEMP)
        ref_kept.sum().backward()
        head1, emb1 = model1.output_layer.weight, model1.embedding.word_embeddings.weight
        head_grad1, emb_grad1 = head1.grad.clone(), emb1.grad.clone()
        leaf1 = x1.detach().clone().requires_grad_()
        kept_logprob(leaf1, tokens, offsets, kept_ids, temperature=TEMP).sum().backward()
        ps.destroy_model_parallel()

        # TP = 2: each rank holds logits for its vocabulary slice
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        model_parallel_cuda_manual_seed(123)
        tp_rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        model2 = _megatron_model()
        logits2 = model2(ids, pos, attention_mask=attn)
        width = logits2.shape[-1]
        out["shard_shape"] = tuple(logits2.shape)
        start = tp_rank * width
        x2 = logits2.reshape(-1, width)

        head2, emb2 = model2.output_layer.weight, model2.embedding.word_embeddings.weight
        same = True
        for w2, w1 in ((head2, head1), (emb2, emb1)):        # vocab-parallel [V/TP, h] slices
            gathered = [torch.empty_like(w2) for _ in range(2)]
            dist.all_gather(gathered, w2.detach().contiguous(), group=group)
            same = same and torch.equal(torch.cat(gathered), w1.detach())
        out["same_master_weights"] = same
        gathered = [torch.empty_like(x2) for _ in range(2)]
        dist.all_gather(gathered, x2.detach().contiguous(), group=group)
        out["logits_diff"] = float((torch.cat(gathered, 1) - x1.detach()).abs().max())

        kept = vocab_parallel_kept_logprob(x2, tokens, (offsets, kept_ids), start, group=group, temperature=TEMP)
        full = vocab_parallel_full_logprob(x2.detach(), tokens, start, group=group, temperature=TEMP)
        out["kept_diff"] = float((kept - ref_kept).abs().max())
        out["full_diff"] = float((full - ref_full).abs().max())
        out["kept_minus_full_min"] = float((kept - full).min())
        out["kept_size_mean"] = float(offsets.diff().double().mean())
        kept.sum().backward()
        # gradients through the real model: the output layer's slice, and the embedding slice (its
        # gradient comes through the column-parallel output layer's all-reduced input gradient)
        out["head_grad_diff"] = float((head2.grad - head_grad1[start:start + width]).abs().max())
        out["head_grad_scale"] = float(head_grad1.abs().max())
        out["emb_grad_diff"] = float((emb2.grad - emb_grad1[start:start + width]).abs().max())
        out["emb_grad_scale"] = float(emb_grad1.abs().max())
        leaf2 = x2.detach().clone().requires_grad_()
        vocab_parallel_kept_logprob(leaf2, tokens, (offsets, kept_ids), start, group=group,
                                    temperature=TEMP).sum().backward()
        out["logit_grad_diff"] = float((leaf2.grad - leaf1.grad[:, start:start + width]).abs().max())

        # rank-local bad input: every rank raises (none is left waiting in a collective)
        bad = x2.detach().clone()
        if tp_rank == 1:
            bad[3, 5] = float("nan")
        try:
            vocab_parallel_kept_logprob(bad, tokens, (offsets, kept_ids), start, group=group)
        except RouteError as exc:
            out["nan_error"] = str(exc)
        try:
            vocab_parallel_kept_logprob(x2.detach(), tokens, (offsets, kept_ids), 0, group=group)
        except RouteError as exc:
            out["start_error"] = str(exc)
        out["tp_rank"] = tp_rank
        results.put((rank, out))
        ps.destroy_model_parallel()
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if mode is not None:
            mode.undo()


def test_megatron_tp2_kept_logprob_equals_tp1():
    pytest.importorskip("megatron.core")
    got = _run_workers(_megatron_worker, 2)
    print({r: {k: v for k, v in o.items() if not k.endswith("error")} for r, o in got.items()})
    for rank, o in got.items():
        assert o["shard_shape"] == (MB, MT, MV // 2)        # vocab-parallel logits, not gathered
        assert o["same_master_weights"], "TP=1 and TP=2 models do not share their master weights"
        assert o["logits_diff"] < 1e-4
        assert o["kept_diff"] < 2e-5, o["kept_diff"]
        assert o["full_diff"] < 2e-5, o["full_diff"]
        assert o["logit_grad_diff"] < 2e-6, o["logit_grad_diff"]
        assert o["head_grad_scale"] > 0 and o["emb_grad_scale"] > 0
        assert o["head_grad_diff"] < 1e-5 * max(1.0, o["head_grad_scale"]), o["head_grad_diff"]
        assert o["emb_grad_diff"] < 1e-5 * max(1.0, o["emb_grad_scale"]), o["emb_grad_diff"]
        assert o["kept_minus_full_min"] > 1e-3          # negative control: the mask changes the value
    # the NaN sits in rank 1's slice (vocabulary id 256 + 5); rank 0 stops too instead of hanging
    by_tp = {o["tp_rank"]: o for o in got.values()}
    assert "logits row 3 holds nan at vocabulary id 261" in by_tp[1]["nan_error"]
    assert "row 3 holds NaN or Inf on another tensor-parallel rank" in by_tp[0]["nan_error"]
    assert "vocab_start = 0 but this rank's slice starts at 256" in by_tp[1]["start_error"]
    assert "tensor-parallel rank 1 rejected its input" in by_tp[0]["start_error"]
