"""The replay verifier (issue 13, section 3): did the experts that ran equal the experts the record asked for?

``moealign.routing_replay.verify.ReplayVerifier`` on its own (pure torch), then in each adapter, where it reads what
the experts / the dispatcher *received* (transformers: the experts module's ``top_k_index``; Megatron-core: the
``routing_map`` ``token_dispatcher.dispatch_preprocess`` receives; vLLM: the ``topk_ids`` ``RoutedExperts.forward_modular``
receives), never what the adapter set. Per engine:

1. a correct replay verifies clean (0 mismatched rows) and reports the fraction of rows that ran without a recorded
   route equal to the one counted here from the batch's ``route_mask``. The routes replayed are the model's own
   choices shifted by one expert (``(e + 1) % E``), so they differ from the router's own choice on every row by
   construction (asserted): a clean report means the replayed experts ran;
2. a replay that was set but bypassed (the router's forward swapped for a plain top-k after ``set_routes``, so the
   experts that run are the router's own) is caught: ``check()`` raises ``ReplayError`` naming the layer, and the
   report counts every replayed row of that layer as mismatched (and no other layer's);
3. ``verify=False`` adds no hook and no wrapper.
"""

from __future__ import annotations

import pytest
import torch

from moealign.errors import ReplayError
from moealign.routing_replay.verify import ReplayVerifier, expected_ids, expected_map

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py

# --------------------------------------------------------------------------------------------------
# the verifier alone
# --------------------------------------------------------------------------------------------------


def test_sets_not_slots_and_masked_rows_ignored():
    v = ReplayVerifier([3, 7], source="unit")
    expected = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    ran = torch.tensor([[1, 0], [3, 2], [4, 6], [0, 7]])            # rows 0, 1 permuted slots; rows 2, 3 differ
    mask = torch.tensor([True, True, True, False])                   # row 3 has no recorded route
    v.observe(0, ran, expected, mask)
    v.observe(1, ran.to(torch.int32), expected_ids(expected, 8), None)     # set keys (bit masks), int32 ids
    r = v.report()
    a, b = r.layers
    assert (a.calls, a.rows, a.replayed_rows, a.unrouted_rows, a.mismatched_rows) == (1, 4, 3, 1, 1)
    assert a.first_mismatch == (0, 2) and a.first_ran == (4, 6) and a.first_expected == (4, 5)
    assert (b.replayed_rows, b.unrouted_rows, b.mismatched_rows, b.first_mismatch) == (4, 0, 2, (0, 2))
    assert b.first_ran == (4, 6) and b.first_expected == (4, 5)
    assert r.unrouted_fraction == 1 / 8 and r.mismatched_rows == 3 and not r.clean
    with pytest.raises(ReplayError, match=r"3 of 7 replayed rows in layers \[3, 7\]: layer 3: 1 of 3 rows "
                                          r"\(first: call 0, row 2: ran \[4, 6\], record \[4, 5\]\)"):
        v.check()
    v.reset()
    v.observe(0, ran[:2], expected[:2])
    assert v.check(router_calls=[1, 0]).clean
    with pytest.raises(ReplayError, match=r"layers \[7\] were observed on fewer calls.*layer 7: 0 of 1"):
        v.check(router_calls=[1, 1])


@pytest.mark.parametrize("num_experts", [16, 200], ids=["set-keys", "sorted-ids"])
def test_deferred_calls_compare_in_one_pass_with_the_same_report(num_experts, monkeypatch):
    """defer(): one forward's calls (one per router, the same rows) are compared in one batched pass, and the
    report equals observe()'s call by call: counts, the first bad (call, row) and its sets, over two forwards with
    mismatches planted in different routers and rows (masked rows ignored). A router's second call flushes the first;
    a call that does not match the others (another row count) is compared on its own; reset() drops what is queued."""
    from moealign.routing_replay import verify

    passes = []
    real = verify._bad_rows
    monkeypatch.setattr(verify, "_bad_rows", lambda ran, *a: passes.append(ran.dim()) or real(ran, *a))
    g = torch.Generator().manual_seed(0)
    rows, k, n = 12, 4, 3
    expected = [torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(rows)]) for _ in range(n)]
    prepared = [expected_ids(e, num_experts) for e in expected]
    sorted_ids = prepared[0].dim() == 2
    mask = torch.ones(rows, dtype=torch.bool)
    mask[5] = False
    plants = {(0, 1): [7], (1, 2): [3, 9], (1, 0): [5, 11]}     # (forward, router): rows with another expert set
    ran = {}
    for (f, i), bad_rows in plants.items():
        for r in bad_rows:
            x = ran.setdefault((f, i), expected[i].clone())
            x[r, 0] = next(e for e in range(num_experts) if e not in x[r].tolist())
    reports = {}
    for mode in ("observe", "defer"):
        v = ReplayVerifier([2, 4, 6], source="unit")
        passes.clear()
        for f in range(2):
            for i in range(n):
                got = ran.get((f, i), expected[i].flip(-1))             # slot order is not part of a route
                getattr(v, mode)(i, got, prepared[i], mask, replayed_rows=rows - 1, expected_sorted=sorted_ids)
        reports[mode] = (v.report().to_dict(), list(passes))
    (by_call, calls_observe), (deferred, calls_defer) = reports["observe"], reports["defer"]
    assert deferred == by_call
    assert calls_observe == [2] * 6 and calls_defer == [3, 3]         # one batched pass per forward
    layers = {x["layer"]: x for x in deferred["layers"]}
    assert layers[4]["mismatched_rows"] == 1 and layers[4]["first_mismatch"] == (0, 7)
    assert layers[6]["mismatched_rows"] == 2 and layers[6]["first_mismatch"] == (1, 3)
    assert layers[2]["mismatched_rows"] == 1 and layers[2]["first_mismatch"] == (1, 11)   # row 5 is masked
    with pytest.raises(ReplayError, match="layers \\[2, 4, 6\\]"):
        v.check()
    # a second call of router 0 before the others: the first is flushed, calls count 0 then 1
    v = ReplayVerifier([2, 4, 6], source="unit")
    v.defer(0, ran[(1, 0)], prepared[0], mask, replayed_rows=rows - 1, expected_sorted=sorted_ids)
    v.defer(0, expected[0], prepared[0], mask, replayed_rows=rows - 1, expected_sorted=sorted_ids)
    v.defer(1, expected[1][:6], prepared[1][:6], None, expected_sorted=sorted_ids)   # other rows: on its own
    v.defer(2, expected[2], prepared[2], mask, replayed_rows=rows - 1, expected_sorted=sorted_ids)
    r = v.report()
    assert [x.calls for x in r.layers] == [2, 1, 1] and r.layer(2).first_mismatch == (0, 11)
    assert r.layer(4).rows == 6 and r.mismatched_rows == 1
    v.reset()
    v.defer(0, ran[(1, 0)], prepared[0], mask, replayed_rows=rows - 1, expected_sorted=sorted_ids)
    v.reset()
    assert v.report().calls == 0 and v.report().clean


@pytest.mark.parametrize("num_experts", [8, 62, 63, 200])
def test_set_keys_and_sorted_sets_agree(num_experts):
    """Bit-mask keys (<= 62 experts) and sorted sets (more) decide alike: slot order ignored; a duplicate, a
    negative, a too-large or the sentinel id (``num_experts``, transformers' "no expert") never equals a set."""
    g = torch.Generator().manual_seed(num_experts)
    E, k, rows = num_experts, 4, 64
    expected = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])
    ran = expected[:, torch.randperm(k, generator=g)].clone()            # same sets, other slot order
    bad = torch.zeros(rows, dtype=torch.bool)
    for row, value in ((3, None), (9, -1), (17, 1000), (25, E), (33, 63)):
        if value is None:
            ran[row, 1] = ran[row, 0]
        else:
            ran[row, 2] = value
        bad[row] = True
    ran[40] = (expected[40] + 1) % E                                        # another set
    bad[40] = True
    v = ReplayVerifier([0])
    v.observe(0, ran, expected_ids(expected, E))
    layer = v.report().layers[0]
    assert layer.mismatched_rows == int(bad.sum()) and layer.first_mismatch == (0, 3)
    assert layer.first_expected == tuple(sorted(expected[3].tolist()))
    v.reset()
    v.observe(0, ran, expected)                                             # sorted, unprepared
    assert v.report().layers[0].mismatched_rows == int(bad.sum())
    assert expected_ids(expected, E).dim() == (1 if E <= 62 else 2)


def test_routing_maps_first_bad_call_and_shapes():
    v = ReplayVerifier([0])
    ids = torch.tensor([[0, 1], [2, 3], [1, 3]])
    want = expected_map(ids, 4)
    v.observe(0, want.clone(), want, replayed_rows=3)
    other = want.clone()
    other[1] = expected_map(torch.tensor([[0, 3]]), 4)[0]
    v.observe(0, other, want, torch.tensor([True, True, False]), replayed_rows=2)
    layer = v.report().layers[0]
    assert (layer.calls, layer.rows, layer.replayed_rows, layer.mismatched_rows) == (2, 6, 5, 1)
    assert layer.first_mismatch == (1, 1) and layer.first_ran == (0, 3) and layer.first_expected == (2, 3)
    with pytest.raises(ReplayError, match="received"):
        v.observe(0, ids, want)                       # ids against a map
    with pytest.raises(ReplayError, match="rows must match"):
        v.observe(0, ids[:2], ids)


# --------------------------------------------------------------------------------------------------
# helpers shared by the engine tests
# --------------------------------------------------------------------------------------------------


def assert_differs_everywhere(own: torch.Tensor, replayed: torch.Tensor) -> None:
    """The replayed table differs from the router's own choice on every row and layer, as sets."""
    a, b = own.to(torch.int64).sort(-1).values, replayed.to(torch.int64).sort(-1).values
    assert bool((a != b).any(-1).all())


def unrouted_fraction(route_mask: torch.Tensor) -> float:
    m = route_mask.reshape(-1).bool()
    return int((~m).sum()) / m.numel()


# --------------------------------------------------------------------------------------------------
# transformers (the embedded Qwen3-MoE)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_setup():
    pytest.importorskip("transformers")
    from moealign.embedded import embedded_model_path
    from moealign.patches import hf
    from moealign.patches.hf.loading import load_model
    from moealign.routing_replay.protocol import ReplayBatch

    model, _ = load_model(embedded_model_path(), "fp32")
    info = hf.describe_model(model)
    g = torch.Generator().manual_seed(0)
    B, T = 3, 14
    ids = torch.randint(3, info.vocab_size, (B, T), generator=g)
    am = torch.ones_like(ids)
    am[1, 10:] = 0
    am[2, 6:] = 0
    ids[am == 0] = 1
    with torch.no_grad(), hf.capture_routes(model) as cap:
        model(ids, attention_mask=am, use_cache=False)
    own = cap.last_forward().to(torch.int64)                        # [B*T, layers, k], batch-major
    shifted = (own + 1) % info.num_experts
    assert_differs_everywhere(own, shifted)
    mask = am.bool().clone()
    lengths = am.sum(1)
    mask[torch.arange(B), lengths - 1] = False                      # each sample's last token
    mask[0, 4] = False                                              # a row the record marks missing
    batch = ReplayBatch.padded(shifted.reshape(B, T, *own.shape[1:]), input_ids=ids, attention_mask=am,
                               moe_layers=info.moe_layers, route_mask=mask)
    return dict(model=model, info=info, ids=ids, am=am, own=own, shifted=shifted, mask=mask, batch=batch, hf=hf)


def _hook_state(model):
    return {name: (tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._forward_hooks_with_kwargs),
                   tuple(m._forward_pre_hooks_with_kwargs), "forward" in vars(m))
            for name, m in model.named_modules()}


def test_hf_correct_replay_verifies_clean(hf_setup):
    s = hf_setup
    model, hf, batch, mask = s["model"], s["hf"], s["batch"], s["mask"]
    model.train()
    try:
        with hf.replay_routing(model, batch, aux_loss="own") as replay:
            out = model(input_ids=s["ids"], attention_mask=s["am"], use_cache=False)
            out.logits.float().logsumexp(-1).mean().backward()
            report = replay.verify_report()
            replay.check(calls=1)
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    rows = mask.numel()
    assert report.clean and report.mismatched_rows == 0
    assert len(report.layers) == len(s["info"].moe_layers)
    for layer in report.layers:
        assert (layer.calls, layer.rows, layer.replayed_rows) == (1, rows, int(mask.sum()))
        assert layer.unrouted_fraction == unrouted_fraction(mask)
    assert report.unrouted_fraction == unrouted_fraction(mask) > 0


def _plain_topk(router):
    """A router forward that ignores the replay: the router's own softmax top-k (what transformers computes)."""
    def forward(hidden_states):
        h = hidden_states.reshape(-1, router.hidden_dim)
        logits = torch.nn.functional.linear(h, router.weight)
        probs = logits.float().softmax(-1)
        w, i = probs.topk(router.top_k, dim=-1)
        return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), i
    return forward


def test_hf_bypassed_router_is_caught(hf_setup):
    s = hf_setup
    model, hf, info, mask = s["model"], s["hf"], s["info"], s["mask"]
    index = 0                      # the first MoE layer: its input is the unreplayed one, its own choice is `own`
    layer, router = info.routers[index]
    with torch.no_grad(), hf.replay_routing(model, aux_loss="own") as replay:
        replay.set_routes(s["batch"])
        router.forward = _plain_topk(router)          # swapped after the replay bound (and set) the router
        model(input_ids=s["ids"], attention_mask=s["am"], use_cache=False)
        report = replay.verify_report()
        with pytest.raises(ReplayError, match=rf"differ from the record on {int(mask.sum())} of .* in layers "
                                              rf"\[{layer}\]: layer {layer}: {int(mask.sum())} of"):
            replay.check(calls=1)
    assert "forward" not in vars(router)             # undo put the class forward back
    bad = report.layer(layer)
    assert bad.mismatched_rows == bad.replayed_rows == int(mask.sum())
    assert all(x.mismatched_rows == 0 for x in report.layers if x.layer != layer)
    # the first bad row is the first replayed row, and what ran there is the router's own choice
    first = int(mask.reshape(-1).nonzero()[0, 0])
    assert bad.first_mismatch == (0, first)
    assert list(bad.first_ran) == sorted(s["own"][first, index].tolist())
    assert list(bad.first_expected) == sorted(s["shifted"][first, index].tolist())


def test_hf_unobserved_experts_are_caught(hf_setup):
    """Experts module replaced after the replay attached: the router replays, but nothing observes what ran."""
    s = hf_setup
    model, hf, info = s["model"], s["hf"], s["info"]
    layer, router = info.routers[1]
    block = next(m for m in model.modules() if getattr(m, "gate", None) is router)
    with torch.no_grad(), hf.replay_routing(model, s["batch"], aux_loss="own") as replay:
        original = block.experts
        block.experts = type(original)(model.config)               # a fresh module (no hooks), same weights
        block.experts.load_state_dict(original.state_dict())
        try:
            model(input_ids=s["ids"], attention_mask=s["am"], use_cache=False)
        finally:
            block.experts = original
        with pytest.raises(ReplayError, match=rf"cannot be verified: .* layers \[{layer}\] were observed on fewer "
                                              rf"calls .*layer {layer}: 0 of 1"):
            replay.check(calls=1)


def test_hf_verify_off_adds_no_hooks(hf_setup):
    s = hf_setup
    model, hf = s["model"], s["hf"]
    before = _hook_state(model)
    with torch.no_grad(), hf.replay_routing(model, s["batch"], aux_loss="own", verify=False) as replay:
        during = _hook_state(model)
        model(input_ids=s["ids"], attention_mask=s["am"], use_cache=False)
        replay.check(calls=1)
        assert replay.verify_report() is None and replay.verifier is None
        assert not any("verify" in p for p in replay.patched)
    # only the router and model forwards are patched (as before the verifier existed): no hook anywhere
    changed = {name for name in before if before[name] != during[name]}
    routers = {name for name, m in model.named_modules() if any(m is r for _, r in s["info"].routers)}
    assert changed == routers | {""}
    assert all(before[n][:4] == during[n][:4] for n in before)
    with torch.no_grad(), hf.replay_routing(model, s["batch"], aux_loss="own") as replay:
        assert sum(len(m._forward_pre_hooks) for m in model.modules()) > \
            sum(len(before[n][1]) for n in before)
        assert any("verify" in p for p in replay.patched)
    assert _hook_state(model) == before


# --------------------------------------------------------------------------------------------------
# Megatron-core (the tiny GPT-MoE of tests/megatron_util.py, allgather dispatcher)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mg_world():
    pytest.importorskip("megatron.core")
    from moealign.patches import megatron as mg

    with mg.init_single_process(seed=123, device="cpu"):
        yield mg


def _mg_model(mg, **overrides):
    from megatron_util import build, config

    torch.manual_seed(0)
    model = build(config(hidden_dropout=0.0, attention_dropout=0.0, **overrides))   # deterministic forwards
    with torch.no_grad():       # peaked routers (as in test_patches_megatron)
        for _, router in mg.moe_routers(model):
            router.weight.mul_(20)
    return model


def _mg_case(mg, model):
    """The model's own routes on a token batch (record order b*T + t), shifted by one expert, and a route_mask
    with each sample's last token and two more rows unrouted."""
    from megatron_util import B, E, K, T, inputs, replay_batch, routing_maps

    ids, pos, attn = inputs(1)
    routers = mg.moe_routers(model)
    maps, handles = routing_maps(model, routers)
    try:
        with torch.no_grad():
            model(ids, pos, attention_mask=attn)
    finally:
        for h in handles:
            h.remove()
    own = torch.stack([m.reshape(T, B, E).transpose(0, 1).reshape(B * T, E).nonzero()[:, 1].reshape(-1, K)
                       for m in maps], dim=1)
    shifted = (own + 1) % E
    assert_differs_everywhere(own, shifted)
    route_mask = torch.ones(B * T, dtype=torch.bool)
    route_mask[T - 1::T] = False
    route_mask[[4, T + 2]] = False
    return dict(ids=ids, pos=pos, attn=attn, own=own, shifted=shifted, mask=route_mask,
                batch=replay_batch(shifted, ids, route_mask), routers=routers)


@pytest.mark.parametrize("recompute", [False, True])
def test_megatron_correct_replay_verifies_clean(mg_world, recompute):
    mg = mg_world
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    model = _mg_model(mg, **extra)
    model.train()
    c = _mg_case(mg, model)
    with mg.replay_routing(model, aux_loss="own") as driver:
        driver.set_routes(c["batch"])
        with driver.forward():
            out = model(c["ids"], c["pos"], attention_mask=c["attn"])
        with driver.backward():
            out.float().logsumexp(-1).mean().backward()
        report = driver.verify_report()
        calls = 2 if recompute else 1           # full recompute re-runs router and dispatcher in backward
        driver.check(calls=calls)
    mask = c["mask"]
    assert report.clean and report.mismatched_rows == 0
    assert [x.layer for x in report.layers] == [0, 1]
    for layer in report.layers:
        assert (layer.calls, layer.rows, layer.replayed_rows) == (calls, calls * mask.numel(), calls * int(mask.sum()))
        assert layer.unrouted_fraction == unrouted_fraction(mask)
    assert report.unrouted_fraction == unrouted_fraction(mask) > 0


def _mg_plain_topk(router, E, K, chosen):
    """A TopKRouter forward that never asks RouterReplay: top-k of the router's own logits, softmax over them
    (Megatron's softmax router without pre-softmax); appends the ids it chose to ``chosen``."""
    def forward(input, padding_mask=None):
        logits = router.gating(input).reshape(-1, E)
        top, idx = logits.topk(K, dim=-1)
        chosen.append(idx.detach().clone())
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        return torch.zeros_like(logits).scatter(1, idx, top.softmax(-1)), routing_map
    return forward


def test_megatron_bypassed_router_is_caught(mg_world):
    from megatron_util import B, E, K, T

    mg = mg_world
    model = _mg_model(mg)
    c = _mg_case(mg, model)
    layer, router = c["routers"][0]          # layer 0 sees the unreplayed input: its own choice is c["own"][:, 0]
    replayed = int(c["mask"].sum())
    chosen = []
    with torch.no_grad(), mg.replay_routing(model, aux_loss="own") as driver:
        driver.set_routes(c["batch"])
        router.forward = _mg_plain_topk(router, E, K, chosen)   # swapped after the driver bound the routers
        try:
            with driver.forward():
                model(c["ids"], c["pos"], attention_mask=c["attn"])
        finally:
            del router.forward
        report = driver.verify_report()
        with pytest.raises(ReplayError, match=rf"differ from the record on {replayed} of .* in layers \[{layer}\]: "
                                              rf"layer {layer}: {replayed} of {replayed} rows"):
            driver.check(calls=1)
    bad = report.layer(layer)
    # what the bypassed router chose is its own choice: the routes replayed differ from it on every row
    (ran,) = chosen                                                    # sequence-first rows (t*B + b)
    ran = ran.reshape(T, B, K).transpose(0, 1).reshape(B * T, K)       # record order (b*T + t)
    assert torch.equal(ran.sort(-1).values, c["own"][:, 0].sort(-1).values)
    assert bad.mismatched_rows == bad.replayed_rows == replayed
    assert report.layer(1).mismatched_rows == 0
    # the first routed row of the dispatcher is token (b=0, t=0), record row 0
    assert bad.first_mismatch == (0, 0)
    assert list(bad.first_ran) == sorted(c["own"][0, 0].tolist())
    assert list(bad.first_expected) == sorted(c["shifted"][0, 0].tolist())


def test_megatron_verify_off_adds_no_wrapper(mg_world):
    mg = mg_world
    model = _mg_model(mg)
    c = _mg_case(mg, model)
    dispatchers = [m.token_dispatcher for m in model.modules() if getattr(m, "token_dispatcher", None) is not None]
    assert len(dispatchers) == 2
    with torch.no_grad(), mg.replay_routing(model, aux_loss="own", verify=False) as driver:
        assert all("dispatch_preprocess" not in vars(d) for d in dispatchers)
        driver.set_routes(c["batch"])
        with driver.forward():
            model(c["ids"], c["pos"], attention_mask=c["attn"])
        driver.check(calls=1)
        assert driver.verify_report() is None and driver.verifier is None
        assert not any("verify" in p for p in driver.patched)
    with torch.no_grad(), mg.replay_routing(model, aux_loss="own") as driver:
        assert all("dispatch_preprocess" in vars(d) for d in dispatchers)
    assert all("dispatch_preprocess" not in vars(d) for d in dispatchers)


# --------------------------------------------------------------------------------------------------
# vLLM (the embedded model in vLLM's CPU build; a child process: tests/vllm_verify_child.py)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_result():
    from moealign._optional import probe

    available = probe("vllm")
    if not available.available:
        pytest.skip(f"vLLM is not installed: {available.error}")
    from vllm_util import run_child

    return run_child("vllm_verify_child.py")


def test_vllm_correct_replay_verifies_clean(vllm_result):
    r = vllm_result
    assert r["differs_everywhere"] and r["missing_rows"] == 3
    # independently: the packed replay batch's route_mask (each sample's last token and the missing rows False)
    assert r["mask_rows"] == r["tokens"] and r["mask_unrouted"] == r["samples"] + r["missing_rows"]
    want = r["mask_unrouted"] / r["mask_rows"]
    for key in ("forced", "scored"):                   # force_routes in this process; score_with_routes via RPC
        rep = r[key]
        assert rep["mismatched"] == 0, key
        assert rep["unrouted_fraction"] == want, key
        for layer, calls, rows, replayed, mismatched, unrouted in rep["layers"]:
            assert (rows, replayed, mismatched, unrouted) == (r["tokens"], r["tokens"] - r["mask_unrouted"], 0,
                                                              r["mask_unrouted"]), (key, layer)
            assert calls >= 1
    assert r["forced_calls"] == [rep["layers"][0][1]] * len(rep["layers"])   # every step forced rows, every layer
    assert r["undone_after_forced"] and r["undone_after_scored"]


def test_vllm_bypassed_router_is_caught(vllm_result):
    r = vllm_result
    layer = r["bypass_layer"]
    rep = r["bypassed"]
    replayed = r["tokens"] - r["mask_unrouted"]
    by_layer = {x[0]: x for x in rep["layers"]}
    assert by_layer[layer][4] == replayed                       # every forced row of that layer ran other experts
    assert all(x[4] == 0 for x in rep["layers"] if x[0] != layer)
    assert r["bypass_error"] is not None
    assert f"in layers [{layer}]: layer {layer}: {replayed} of {replayed} rows" in r["bypass_error"]
    assert "topk_ids RoutedExperts.forward_modular received" in r["bypass_error"]
    assert r["undone_after_bypass"]


def test_vllm_verify_off_wraps_nothing(vllm_result):
    r = vllm_result
    assert r["noverify_wrapped"] == [False] * len(r["noverify_wrapped"])
    assert r["noverify_report"] and r["noverify_scored_report"]
    assert r["undone_at_end"]
