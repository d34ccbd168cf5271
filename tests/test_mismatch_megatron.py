"""`moealign mismatch --train megatron`: the transformers rollout against the converted Megatron model, and a
training step of that model with replay and activation recompute (CPU, gloo, one process)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from moealign.cli import main  # noqa: E402
from moealign.embedded import default_prompts, embedded_model_path  # noqa: E402
from moealign.mismatch.engines import (  # noqa: E402
    HFRolloutEngine,
    HFTrainEngine,
    MegatronTrainEngine,
)
from moealign.record import SamplingParams  # noqa: E402

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

SMALL = ["--num-prompts", "8", "--max-new-tokens", "24", "--batch-size", "8", "-q", "--device", "cpu"]


@pytest.fixture(scope="module")
def record():
    engine = HFRolloutEngine(str(embedded_model_path()), "bf16")
    return engine.generate(default_prompts()[:6], sampling=SamplingParams(temperature=1.0, top_p=0.9),
                           max_new_tokens=16, seed=3, batch_size=6)


def test_cli_train_megatron_replay_is_exact(tmp_path):
    out = tmp_path / "report.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["mismatch", *SMALL, "--rollout", "hf", "--train", "megatron", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    from importlib.metadata import version

    assert report["train"] == {"engine": "megatron", "engine_version": version("megatron-core"), "precision": "fp32",
                               "dtype": "fp32", "parallel": {"tp": 1, "ep": 1, "pp": 1, "dp": 1, "world": 1}}
    runs = {r["name"]: r["metrics"] for r in report["runs"]}
    for name in ("routing_replay", "routing_replay+sampling_mask"):
        assert runs[name]["router_flip_rate"] == 0.0
        assert runs[name]["per_layer_flip_rate"] == [0.0] * len(report["moe_layers"])
    assert runs["baseline"]["router_flip_rate"] > 0.0          # negative control: bf16 rollout flips routes
    assert runs["routing_replay+sampling_mask"]["support_mismatch_rate"] == 0.0
    assert runs["routing_replay+sampling_mask"]["max_abs_logp_diff"] < runs["baseline"]["max_abs_logp_diff"]


def test_megatron_engine_matches_transformers_engine(record):
    """Same checkpoint, same record, fp32: the converted Megatron model scores like transformers."""
    path = str(embedded_model_path())
    idx = list(range(len(record)))
    hf = HFTrainEngine(path, "fp32")
    want = [hf.forward(record, idx, replay=r) for r in (False, True)]
    del hf
    mg = MegatronTrainEngine(path, "fp32")
    try:
        got = [mg.forward(record, idx, replay=r) for r in (False, True)]
    finally:
        mg.close()
    for w, g in zip(want, got):
        assert torch.equal(w.tokens, g.tokens)
        assert (w.logits - g.logits).abs().max() < 1e-4
        same = (w.routes.sort(-1).values == g.routes.sort(-1).values).all(-1).float().mean()
        assert same > 0.999                     # fp32 on both sides: near-ties aside, the same experts
    recorded = torch.cat([s.routes.to(torch.int64) for s in record.samples])
    assert torch.equal(got[1].routes.sort(-1).values, recorded.sort(-1).values)   # replay: exactly the record's
    assert not torch.equal(got[0].routes.sort(-1).values, recorded.sort(-1).values)  # bf16 rollout != fp32 native


def test_training_step_with_replay_and_recompute(record):
    """Forward + backward + SGD step of the converted embedded model, replaying the record's routes with full
    activation recompute: counters balanced (forward + recompute), gradients reach every router."""
    import transformers

    from moealign.patches import megatron as mgp
    from moealign.patches.megatron import checkpoint as mc

    with mgp.init_single_process(device="cpu"):
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(embedded_model_path()), dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = mc.build_megatron_from_hf(hf_model, recompute_granularity="full", recompute_method="uniform",
                                              recompute_num_layers=1)
        model.train()
        batch = record.to_padded("right", 1)
        B, T = batch.input_ids.shape
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)[None, None] | (batch.attention_mask == 0)[:, None, None, :]
        routers = mgp.moe_routers(model)
        before = [r.weight.detach().clone() for _, r in routers]
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with mgp.replay_routing(model, aux_loss="replayed") as driver:
            driver.set_routes(batch.replay_batch())
            with driver.forward():
                logits = model(batch.input_ids, batch.position_ids, mask)
            driver.check(calls=1)
            b, p = batch.response_mask.nonzero(as_tuple=True)
            logp = torch.log_softmax(logits[b, p - 1].float(), -1).gather(-1, batch.input_ids[b, p][:, None])
            loss = -logp.mean()
            with driver.backward():
                loss.backward()
            driver.check(calls=2)          # each router: the forward and the recompute, B*T rows each
        for _, r in routers:
            assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
        opt.step()
        assert all(not torch.equal(w, r.weight) for w, (_, r) in zip(before, routers))
        assert torch.isfinite(loss)


def test_capture_routes_gives_record_row_order(record):
    """The Megatron adapter's route capture: [B*T, n_layers, k] int64 ids ascending per row, in the record's
    batch-major row order (under replay exactly the recorded experts), hooks gone on exit."""
    from moealign.errors import ReplayError
    from moealign.patches.megatron import moe_routers
    from moealign.patches.megatron.capture import capture_routes

    mg = MegatronTrainEngine(str(embedded_model_path()), "fp32")
    try:
        batch = record.to_padded("right", mg.pad_token_id)
        B, T = batch.input_ids.shape
        assert B != T                                           # a swapped B / T would not go unnoticed
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)[None, None] | (batch.attention_mask == 0)[:, None, None, :]
        routers = [r for _, r in moe_routers(mg.model)]
        hooks_before = [len(r._forward_hooks) for r in routers]
        with capture_routes(mg.model) as capture:
            with pytest.raises(ReplayError, match="no model forward"):
                capture.last_forward()
            assert [len(r._forward_hooks) for r in routers] == [n + 1 for n in hooks_before]
            mg.driver.set_routes(batch.replay_batch())
            with torch.no_grad(), mg.driver.forward():
                mg.model(batch.input_ids, batch.position_ids, mask)
            mg.driver.check(calls=1)
        mg.driver.clear()
        mg.driver.reset_counters()
        assert [len(r._forward_hooks) for r in routers] == hooks_before and not capture.active
        used = capture.last_forward()                            # still readable after the hooks are gone
        k = int(routers[0].topk)
        assert used.dtype == torch.int64 and used.shape == (B * T, len(record.meta.moe_layers), k)
        assert bool((used.diff(dim=-1) > 0).all())                # ascending, distinct
        recorded = torch.cat([s.routes.to(torch.int64) for s in record.samples])
        got = used[batch.route_mask.reshape(-1)]
        assert torch.equal(got, recorded.sort(-1).values)
    finally:
        mg.close()


def test_megatron_precision_comes_from_the_translators():
    """What the engine can express is decided by moealign.precision.policy: megatron_gaps lists the fp32
    router / LM head, to_megatron_config_fields refuses FP8 without transformer-engine layers."""
    from moealign.precision.policy import POLICIES, megatron_gaps

    wider = {name for name, p in POLICIES.items()
             if any(d is not None and d != p.dtype for d in (p.router_dtype, p.lm_head_dtype, p.attention_dtype,
                                                             p.experts_dtype))}
    assert "fp16-fp32-router-head" in wider and "bf16-fp32-router" in wider
    assert {name for name in POLICIES if megatron_gaps(name)} == wider
    gaps = megatron_gaps("fp16-fp32-router-head")
    assert len(gaps) == 2 and "router" in gaps[0] and "LM head" in gaps[1]
    path = str(embedded_model_path())
    with pytest.raises(ValueError, match="cannot express precision policy 'fp16-fp32-router-head'.*moe_router_dtype"):
        MegatronTrainEngine(path, "fp16-fp32-router-head")
    with pytest.raises(ValueError, match="cannot run precision policy 'fp8-e4m3-tensor'") as info:
        MegatronTrainEngine(path, "fp8-e4m3-tensor")
    assert isinstance(info.value.__cause__, RuntimeError)        # the translator's refusal, chained
