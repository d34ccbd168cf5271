"""CPU tests of the transformers adapter (moealign.patches.hf) on tiny randomly-initialised MoE models.

All four supported families (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) are built from a config, never
downloaded. Random init gives near-uniform routers and near-uniform next-token distributions, which
prove little: the router weights are multiplied by ``ROUTER_SCALE`` (peaked routing: replaying other ids
changes the output, and top-2 near-ties, where fp32 numerics could flip a route, are rare) and the
lm_head by ``LM_HEAD_SCALE`` (top-k / top-p / min-p sets far smaller than the vocabulary).

Conventions: bitwise claims use ``torch.equal`` and come with a negative control that shows the same
comparison failing where it must; "restored" means nothing is left in an instance ``__dict__`` and
every module's hook dictionaries have the keys they had before (transformers installs its own
output-capturing hooks on the routers at a model's first forward, so "no hook at all" would be wrong).

Replays go through the routing-replay protocol: routes travel in a ``ReplayBatch`` with the tokens they
were laid out for (helper :func:`rb`), and padding positions are never routed - so a test that replays
other ids on a padded batch compares the attended rows only (padding rows keep the router's own choice).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from moealign.errors import ConfigError, ReplayError  # noqa: E402
from moealign.patches import (
    UnsupportedEngineError,  # noqa: E402
    hf,  # noqa: E402
)
from moealign.record import RecordMismatchError, SamplingParams  # noqa: E402
from moealign.routing_replay.gates import RouterScoring, load_balancing_loss  # noqa: E402
from moealign.routing_replay.protocol import ReplayBatch, RoutingReplayAdapter  # noqa: E402
from moealign.routing_replay.routes import RouteError  # noqa: E402
from moealign.routing_replay.sampling_mask import (  # noqa: E402
    kept_logprob,
    kept_mask,
    support_mismatch,
    truncation_mask,
)

FAMILY_NAMES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
VOCAB, HIDDEN, E, K = 512, 64, 8, 2
PAD, BOS, EOS = 0, 1, 2
ROUTER_SCALE = 20.0
LM_HEAD_SCALE = 15.0
AUX_COEF = 0.1

COMMON = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              intermediate_size=128, num_experts_per_tok=K, head_dim=16, eos_token_id=EOS, bos_token_id=BOS,
              pad_token_id=PAD, router_aux_loss_coef=AUX_COEF)


def make_config(family: str, layers: int = 2, **overrides):
    kw = dict(COMMON, num_hidden_layers=layers)
    if family == "qwen2_moe":
        kw.update(num_experts=E, moe_intermediate_size=32, shared_expert_intermediate_size=64)
        cls = transformers.Qwen2MoeConfig
    elif family == "qwen3_moe":
        kw.update(num_experts=E, moe_intermediate_size=32)
        cls = transformers.Qwen3MoeConfig
    elif family == "mixtral":
        kw.update(num_local_experts=E)
        cls = transformers.MixtralConfig
    elif family == "olmoe":
        kw.update(num_experts=E)
        cls = transformers.OlmoeConfig
    else:
        raise AssertionError(family)
    kw.update(overrides)
    return cls(**kw)


MODEL_CLASSES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}


def build(family: str, *, layers: int = 2, seed: int = 0, peaked: bool = True, config=None, **overrides):
    torch.manual_seed(seed)
    config = config if config is not None else make_config(family, layers, **overrides)
    model = getattr(transformers, MODEL_CLASSES[family])(config).eval()
    if peaked:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.mul_(ROUTER_SCALE)
            model.lm_head.weight.mul_(LM_HEAD_SCALE)
    with torch.no_grad():   # first forward: transformers installs its output-capturing hooks now, not mid-test
        model(torch.tensor([[5, 6]]), use_cache=False)
    return model


@pytest.fixture(scope="module")
def models():
    return {name: build(name) for name in FAMILY_NAMES}


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def router_modules(model):
    return [m for _, m in hf.describe_model(model).routers]


def hook_state(model):
    return {name: (tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._forward_hooks_with_kwargs))
            for name, m in model.named_modules()}


def assert_restored(model, hooks_before):
    assert "forward" not in model.__dict__
    assert "_get_logits_processor" not in model.__dict__
    for name, m in model.named_modules():
        assert "forward" not in m.__dict__, name
    assert hook_state(model) == hooks_before


def native_routes(model, input_ids, **kwargs):
    """[rows, n_moe_layers, k] expert ids the unpatched model takes in one forward."""
    with torch.no_grad(), hf.capture_routes(model) as cap:
        out = model(input_ids, use_cache=False, **kwargs)
    return cap.last_forward(), out


def as_sets(routes):
    return routes.to(torch.int64).sort(dim=-1).values


def rotated(routes, shift=1):
    return (routes.to(torch.int64) + shift) % E


def padded_batch(seed=3, lengths=(9, 6)):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), PAD, dtype=torch.int64)
    am = torch.zeros_like(ids)
    for b, L in enumerate(lengths):
        ids[b, :L] = torch.randint(3, VOCAB, (L,), generator=g)
        am[b, :L] = 1
    return ids, am


def left_padded_prompts(seed=1, lengths=(7, 4, 2)):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), PAD, dtype=torch.int64)
    am = torch.zeros_like(ids)
    for b, L in enumerate(lengths):
        ids[b, T - L:] = torch.randint(3, VOCAB, (L,), generator=g)
        am[b, T - L:] = 1
    return ids, am


def rb(routes, ids, am=None, mask=None, *, layers=(0, 1)):
    """A padded :class:`ReplayBatch`: ``routes`` ``[B*T, n_layers, k]`` laid out batch-major for ``ids``
    ``[B, T]``; ``am`` defaults to all ones, ``mask`` (the routed rows) to every attended position."""
    am = torch.ones_like(ids) if am is None else am
    if routes.dim() == 3 and routes.shape[0] == ids.numel():      # else: let ReplayBatch name the malformed table
        routes = routes.reshape(*ids.shape, *routes.shape[1:])
    if mask is not None and mask.numel() == ids.numel():
        mask = mask.reshape(ids.shape)
    return ReplayBatch.padded(routes, input_ids=ids, attention_mask=am, moe_layers=layers, route_mask=mask)


def direct(model, routes, shape):
    """An attached replay for calling a router module directly (no model forward to check the tokens):
    ``routes`` ``[rows, n_layers, k]`` for a hidden-state batch of ``shape`` ``(B, T)``."""
    replay = hf.replay_routing(model)
    try:
        replay.set_routes(rb(routes, torch.full(shape, 5, dtype=torch.int64)), check_tokens=False)
    except BaseException:
        replay.undo()
        raise
    return replay


def independent_aux(router_logits, ids_per_layer, mask=None):
    """Switch load-balancing loss written out by hand: E * sum_e f_e * P_e over layers x real rows."""
    counts = torch.zeros(E, dtype=torch.float64)
    probs = torch.zeros(E, dtype=torch.float64)
    rows = 0
    for logits, ids in zip(router_logits, ids_per_layer):
        keep = torch.ones(logits.shape[0], dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
        p = logits.detach().double().softmax(-1)[keep]
        counts += torch.bincount(ids[keep].reshape(-1), minlength=E).double()
        probs += p.sum(0)
        rows += int(keep.sum())
    return float(E * ((counts / rows) * (probs / rows)).sum())


# --------------------------------------------------------------------------------------------------
# 1. recording in generate()
# --------------------------------------------------------------------------------------------------

# one truncation recipe per family, plus untruncated sampling
RECORD_CASES = [
    ("qwen2_moe", SamplingParams(temperature=0.7, top_k=20)),
    ("qwen3_moe", SamplingParams(top_p=0.8)),
    ("mixtral", SamplingParams(temperature=1.3, min_p=0.05)),
    ("olmoe", SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02)),
    ("qwen3_moe", SamplingParams()),
]
MAX_NEW = 8


@pytest.fixture(scope="module", params=RECORD_CASES, ids=lambda c: f"{c[0]}-{c[1].as_tuple()}")
def recorded(request, models):
    family_name, sampling = request.param
    model = models[family_name]
    ids, am = left_padded_prompts()
    hooks = hook_state(model)
    record = hf.generate_with_record(model, ids, am, sampling=sampling, max_new_tokens=MAX_NEW, seed=11,
                                     eos_token_id=EOS)
    assert_restored(model, hooks)
    return model, ids, am, sampling, record


def full_forward(model, token_ids):
    """Routes and fp32 logits of one unpadded full-sequence forward (no KV cache)."""
    routes, out = native_routes(model, token_ids[None])
    return routes, out.logits[0].float()


def test_record_shapes_and_prompts(recorded):
    model, ids, am, sampling, record = recorded
    info = hf.describe_model(model)
    assert len(record) == ids.shape[0]
    assert record.meta.moe_layers == info.moe_layers and record.meta.top_k == K and record.meta.num_experts == E
    for b, s in enumerate(record.samples):
        assert s.prompt_len == int(am[b].sum())                              # pad positions dropped
        assert torch.equal(s.token_ids[:s.prompt_len], ids[b][am[b].bool()])
        assert PAD not in s.token_ids[:s.prompt_len].tolist()
        assert 1 <= s.response_len <= MAX_NEW
        assert s.routes.shape == (s.length - 1, len(info.moe_layers), K)
        assert s.routes.dtype == torch.uint8
        assert s.logprobs.shape == (s.response_len,)
        assert s.kept_offsets.shape == (s.response_len + 1,)
        assert s.sampling == sampling
    # the batch really had different pad amounts
    assert len({s.prompt_len for s in record.samples}) == ids.shape[0]


def test_recorded_routes_match_full_forward(recorded):
    """The KV-cached, left-padded generate() routes every row as one unpadded full forward would.

    Numerics differ slightly (cache, padding, sdpa shapes, and the machine's kernels), so a route may flip
    only at a near-tie: every flipped (token, layer) must have a gap below 1e-4 between the router's k-th
    and (k+1)-th logit in the full forward (on the developers' machine there are none). A flip anywhere
    else is a recording bug (a row mapped to the wrong token or step).
    """
    model, _, _, _, record = recorded
    flips = rows = 0
    for s in record.samples:
        with hf.capture_routes(model, keep_logits=True) as cap, torch.no_grad():
            model(input_ids=s.token_ids[:-1][None], use_cache=False)
        routes = cap.last_forward()
        assert routes.shape == s.routes.shape
        flipped = (as_sets(routes) != as_sets(s.routes)).any(-1)                # [rows, layers]
        for layer in range(routes.shape[1]):
            top = cap.logits[layer][-1].float().topk(K + 1, dim=-1).values      # [rows, K + 1]
            gap = top[:, K - 1] - top[:, K]
            near_tie = gap < 1e-4
            assert not bool((flipped[:, layer] & ~near_tie).any()), f"layer {layer}: a flip away from a near-tie"
        flips += int(flipped.sum())
        rows += routes.shape[0] * routes.shape[1]
    assert rows > 0
    assert flips <= rows // 1000, f"{flips} / {rows} (token, layer) routes flipped"
    # negative control: the same comparison catches a shifted route table
    s = record.samples[0]
    routes, _ = full_forward(model, s.token_ids[:-1])
    assert not torch.equal(as_sets(routes), as_sets(rotated(s.routes)))


def test_recorded_logprobs_and_kept_sets(recorded):
    model, _, _, sampling, record = recorded
    T = sampling.temperature
    mismatched = total = 0
    for s in record.samples:
        _, logits = full_forward(model, s.token_ids)
        step_logits = logits[s.prompt_len - 1:s.length - 1]            # the steps that sampled the response
        tokens = s.response_ids
        # (a) against the recorded kept sets: recorded logprob == log_softmax over them, everywhere
        lp_kept = kept_logprob(step_logits, tokens, s.kept_offsets, s.kept_ids, temperature=T)
        torch.testing.assert_close(s.logprobs, lp_kept, atol=1e-4, rtol=0)
        # (b) fully independent: trainer-side truncation mask, then log_softmax over the kept set
        mask = truncation_mask(step_logits, temperature=T, top_k=sampling.top_k, top_p=sampling.top_p,
                               min_p=sampling.min_p)
        lp_trunc = torch.log_softmax((step_logits / T).masked_fill(~mask, float("-inf")), -1)
        lp_trunc = lp_trunc.gather(1, tokens[:, None]).squeeze(1)
        differs = support_mismatch(s.kept_offsets, s.kept_ids, mask)
        mismatched += int(differs.sum())
        total += differs.numel()
        torch.testing.assert_close(s.logprobs[~differs], lp_trunc[~differs], atol=1e-4, rtol=0)
        recorded_mask = kept_mask(s.kept_offsets, s.kept_ids, VOCAB)
        assert recorded_mask[torch.arange(len(tokens)), tokens].all()       # sampled token inside its set
        if sampling.truncates:
            assert recorded_mask.sum(-1).float().mean() < VOCAB / 2         # truncation really happened
            # negative control: the untruncated log-prob is not what was recorded
            full = torch.log_softmax(step_logits / T, -1).gather(1, tokens[:, None]).squeeze(1)
            assert (full - s.logprobs).abs().max() > 1e-3
        else:
            assert bool(recorded_mask.all())
    assert mismatched <= 0.05 * total, f"kept set != truncation mask for {mismatched}/{total} tokens"


def test_record_is_deterministic_with_seed(models):
    model = models["qwen3_moe"]
    ids, am = left_padded_prompts()
    sampling = SamplingParams(top_p=0.9)
    a = hf.generate_with_record(model, ids, am, sampling=sampling, max_new_tokens=4, seed=5)
    b = hf.generate_with_record(model, ids, am, sampling=sampling, max_new_tokens=4, seed=5)
    c = hf.generate_with_record(model, ids, am, sampling=sampling, max_new_tokens=4, seed=6)
    for x, y in zip(a.samples, b.samples):
        assert torch.equal(x.token_ids, y.token_ids) and torch.equal(x.logprobs, y.logprobs)
        assert torch.equal(x.routes, y.routes) and torch.equal(x.kept_ids, y.kept_ids)
    assert any(not torch.equal(x.token_ids, z.token_ids) for x, z in zip(a.samples, c.samples))


def test_kept_set_chunked_flush_equals_single_chunk(models, monkeypatch):
    """Kept-set masks flushed every step (many chunks) give the same record as one chunk; it validates."""
    model = models["qwen3_moe"]
    ids, am = left_padded_prompts()
    sampling = SamplingParams(top_p=0.9, top_k=40)
    one = hf.generate_with_record(model, ids, am, sampling=sampling, max_new_tokens=6, seed=3)
    monkeypatch.setattr(hf.rollout, "KEPT_SET_FLUSH_BYTES", 1)
    many = hf.generate_with_record(model, ids, am, sampling=sampling, max_new_tokens=6, seed=3, validate=True)
    many.validate()
    one.validate()
    for x, y in zip(one.samples, many.samples):
        assert torch.equal(x.kept_offsets, y.kept_offsets) and torch.equal(x.kept_ids, y.kept_ids)
        assert torch.equal(x.logprobs, y.logprobs)
    assert sum(s.kept_ids.numel() for s in one.samples) > 0


def test_record_without_routes_or_kept_sets(models):
    model = models["olmoe"]
    ids, am = left_padded_prompts()
    rec = hf.generate_with_record(model, ids, am, max_new_tokens=3, seed=0, record_routes=False,
                                  record_kept_sets=False)
    assert not rec.has_routes and not rec.has_kept_sets
    assert all(s.response_len >= 1 for s in rec.samples)


@pytest.fixture(scope="module")
def eos_model(models):
    """A copy whose lm_head has a bias on EOS: with the seed below half the samples stop early."""
    model = copy.deepcopy(models["mixtral"])
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[EOS] = 4.0
    model.lm_head = head
    return model


def test_response_cut_after_eos(eos_model):
    ids, am = left_padded_prompts(seed=4, lengths=(5, 3, 6, 2, 4, 5))
    rec = hf.generate_with_record(eos_model, ids, am, sampling=SamplingParams(temperature=1.0), max_new_tokens=12,
                                  seed=3)
    ended = [s for s in rec.samples if s.response_ids[-1].item() == EOS]
    running = [s for s in rec.samples if s.response_ids[-1].item() != EOS]
    assert ended and running, "the seed should give both finished and unfinished samples"
    assert any(s.response_len < 12 for s in ended)
    steps = max(s.response_len for s in rec.samples)
    for s in rec.samples:
        assert EOS not in s.response_ids[:-1].tolist()                      # cut right after the first EOS
        assert s.routes.shape[0] == s.length - 1
        assert s.logprobs.shape == (s.response_len,) and s.kept_offsets.numel() == s.response_len + 1
    for s in running:
        assert s.response_len == steps                                      # only EOS shortens a response
    # what is kept is exactly the sample up to its EOS: routes and log-probs agree with a full forward
    # over those tokens (post-EOS padding, had it leaked in, would shift or extend them)
    for s in ended:
        routes, logits = full_forward(eos_model, s.token_ids)
        assert torch.equal(as_sets(routes[:-1]), as_sets(s.routes))
        lp = torch.log_softmax(logits[s.prompt_len - 1:s.length - 1], -1)
        lp = lp.gather(1, s.response_ids[:, None]).squeeze(1)
        torch.testing.assert_close(s.logprobs, lp, atol=1e-4, rtol=0)
        assert s.logprobs[-1] > -5                                          # EOS was likely (bias 4), as intended


def test_generate_with_record_is_per_instance_and_restores(models):
    """While one instance records, another instance of the same class is untouched and runs natively."""
    a = models["qwen3_moe"]
    b = build("qwen3_moe", seed=1)
    assert type(a) is type(b)
    probe_ids = torch.tensor([[7, 8, 9, 10]])
    with torch.no_grad():
        b_ref = b(probe_ids, use_cache=False).logits
    baseline_a, hooks_b = hook_state(a), hook_state(b)
    seen = []

    def spy(module, args, output):
        with torch.no_grad():
            b_out = b(probe_ids, use_cache=False).logits
        seen.append(("_get_logits_processor" in a.__dict__, "_get_logits_processor" in b.__dict__,
                     hook_state(a) != with_spy, hook_state(b) == hooks_b, torch.equal(b_out, b_ref)))

    handle = a.lm_head.register_forward_hook(spy)
    with_spy = hook_state(a)
    try:
        ids, am = left_padded_prompts()
        rec = hf.generate_with_record(a, ids, am, max_new_tokens=4, seed=0, eos_token_id=VOCAB - 1)
    finally:
        handle.remove()
    assert len(seen) == 4                                                   # prefill + 3 decode steps
    assert all(seen_a for seen_a, _, _, _, _ in seen)                       # a was patched meanwhile ...
    assert all(hooked_a for _, _, hooked_a, _, _ in seen)                   # ... and had the capture hooks
    assert not any(seen_b for _, seen_b, _, _, _ in seen)                   # b never was
    assert all(b_clean and b_same for _, _, _, b_clean, b_same in seen)
    # b's forwards inside a's generate did not leak into a's route capture (else the call count check fires)
    assert all(s.routes.shape[0] == s.length - 1 for s in rec.samples)
    assert_restored(a, baseline_a)
    assert_restored(b, hooks_b)


def test_generate_with_record_restores_when_generate_raises(models, monkeypatch):
    model = models["olmoe"]
    hooks = hook_state(model)
    calls = []

    def boom(*args, **kwargs):
        calls.append(("_get_logits_processor" in model.__dict__, hook_state(model) != hooks))
        raise RuntimeError("generate failed")

    monkeypatch.setattr(model, "generate", boom)
    ids, am = left_padded_prompts()
    with pytest.raises(RuntimeError, match="generate failed"):
        hf.generate_with_record(model, ids, am, max_new_tokens=2)
    monkeypatch.undo()
    assert calls == [(True, True)]                                          # patched while generate ran
    assert_restored(model, hooks)


def test_record_then_replay_reproduces_rollout_logprobs(models, family):
    """End to end: record, lay out right-padded, replay: the trainer's kept-set log-probs equal the record's,
    and capture shows the recorded routes on every recorded row."""
    model = models[family]
    ids, am = left_padded_prompts(seed=9)
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    rec = hf.generate_with_record(model, ids, am, sampling=sampling, max_new_tokens=6, seed=2)
    batch = rec.replay_batch("padded", side="right")
    routes, mask = batch.routes, batch.route_mask
    assert batch.padding_side == "right" and torch.equal(batch.input_ids, rec.to_padded("right").input_ids)
    with torch.no_grad(), hf.replay_routing(model, batch) as replay, hf.capture_routes(model) as cap:
        with replay.forward():
            out = model(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        replay.check(calls=1)
    seen = cap.last_forward()
    assert torch.equal(seen[mask], routes[mask])
    B, Tn = batch.input_ids.shape
    logits = out.logits.float()
    for b, s in enumerate(rec.samples):
        step = logits[b, s.prompt_len - 1:s.length - 1]
        lp = kept_logprob(step, s.response_ids, s.kept_offsets, s.kept_ids, temperature=sampling.temperature)
        torch.testing.assert_close(lp, s.logprobs, atol=1e-4, rtol=0)
    assert seen.shape[0] == B * Tn


# --------------------------------------------------------------------------------------------------
# 2. replay
# --------------------------------------------------------------------------------------------------


def test_identity_replay_is_bitwise(models, family):
    model = models[family]
    ids, am = padded_batch()
    own, ref = native_routes(model, ids, attention_mask=am, output_router_logits=True)
    real = am.reshape(-1).bool()
    hooks = hook_state(model)
    with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)) as replay:
        out = model(ids, attention_mask=am, use_cache=False, output_router_logits=True)
        replay.check(calls=1)
    assert torch.equal(out.logits, ref.logits)
    assert len(out.router_logits) == len(ref.router_logits) == 2
    assert all(torch.equal(x, y) for x, y in zip(out.router_logits, ref.router_logits))
    assert torch.equal(out.aux_loss, ref.aux_loss)                           # the recomputed aux loss too
    assert_restored(model, hooks)
    # negative control: other ids change the logits, and the routers really took exactly those ids on the
    # routed (attended) rows; padding rows keep the router's own choice (layer 0: the unreplayed model's)
    target = rotated(own)
    with torch.no_grad(), hf.replay_routing(model, rb(target, ids, am)), hf.capture_routes(model) as cap:
        out2 = model(ids, attention_mask=am, use_cache=False)
    assert not torch.allclose(out2.logits, ref.logits, atol=1e-3)
    seen = cap.last_forward()
    assert torch.equal(seen[real], target[real])
    assert not torch.equal(as_sets(seen[real]), as_sets(own[real]))
    assert (~real).any() and torch.equal(seen[~real, 0], own[~real, 0])


@pytest.mark.parametrize("family_name", ["qwen3_moe", "mixtral"])
def test_identity_replay_is_bitwise_in_bf16(models, family_name):
    """bf16 weights: router logits in bf16, gate weights in bf16 (fp32 for Mixtral), still bitwise.
    (Router-level bf16 checks for all four families are in test_replayed_router_matches_native_router.)"""
    model = copy.deepcopy(models[family_name]).to(torch.bfloat16)
    ids, am = padded_batch()
    own, ref = native_routes(model, ids, attention_mask=am, output_router_logits=True)
    with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)):
        out = model(ids, attention_mask=am, use_cache=False, output_router_logits=True)
    assert out.logits.dtype == torch.bfloat16
    assert torch.equal(out.logits, ref.logits)
    assert all(torch.equal(x, y) for x, y in zip(out.router_logits, ref.router_logits))
    with torch.no_grad(), hf.replay_routing(model, rb(rotated(own), ids, am)):
        moved = model(ids, attention_mask=am, use_cache=False)
    assert not torch.equal(moved.logits, ref.logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_router_matches_native_router(models, family, dtype):
    """Called directly, a patched router returns the native router's logits, weights (values and dtype:
    fp32 for Mixtral, the logits' dtype otherwise) and ids at the native ids; at other ids the weights are
    the family's softmax probabilities gathered there (renormalised for Mixtral). A router called directly
    needs ``set_routes(..., check_tokens=False)``: by default it must run inside a checked model forward."""
    model = models[family] if dtype == torch.float32 else copy.deepcopy(models[family]).to(dtype)
    router = router_modules(model)[0]
    h = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        native_logits, native_w, native_ids = router(h)
    with torch.no_grad(), direct(model, native_ids.reshape(-1, 1, K).expand(-1, 2, -1), (2, 5)):
        logits, w, ids = router(h)
    assert torch.equal(logits, native_logits) and torch.equal(ids, native_ids)
    assert w.dtype == native_w.dtype and torch.equal(w, native_w)
    assert w.dtype == (torch.float32 if family == "mixtral" else dtype)
    other = rotated(native_ids, 3)
    with torch.no_grad(), direct(model, other.reshape(-1, 1, K).expand(-1, 2, -1), (2, 5)):
        _, w2, ids2 = router(h)
    assert torch.equal(ids2, other)
    want = native_logits.float().softmax(-1).gather(1, other)
    if family == "mixtral":
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(w2.float(), want, atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=1e-2)
    assert not torch.allclose(w2.float(), native_w.float())
    # with the token check on (the default), a router run outside the model's forward is refused
    batch = rb(other.reshape(-1, 1, K).expand(-1, 2, -1), torch.full((2, 5), 5, dtype=torch.int64))
    with torch.no_grad(), hf.replay_routing(model, batch) as replay:
        with pytest.raises(ReplayError, match="a router ran outside a checked forward"):
            router(h)
        assert [c.calls for c in replay.counters.counts] == [0, 0]


def test_padded_and_packed_replay_agree(models, family):
    model = models[family]
    lengths = (9, 6)
    ids, am = padded_batch(lengths=lengths)
    own, _ = native_routes(model, ids, attention_mask=am)
    T = ids.shape[1]
    real = am.reshape(-1).bool()
    target_padded = rotated(own, 2)
    # packed: the real tokens of both rows back to back, their own positions, no attention_mask
    packed_ids = ids[am.bool()][None]
    position_ids = torch.cat([torch.arange(L) for L in lengths])[None]
    target_packed = target_padded[real]
    packed = ReplayBatch.packed(target_packed, input_ids=packed_ids[0], cu_seqlens=[0, *torch.tensor(lengths)
                                                                                     .cumsum(0).tolist()],
                                moe_layers=(0, 1))
    with torch.no_grad():
        with hf.replay_routing(model, rb(target_padded, ids, am)) as replay:
            assert rb(target_padded, ids, am).route_mask.equal(real)           # default: the attended rows
            out_pad = model(ids, attention_mask=am, use_cache=False)
            replay.check(calls=1)
            assert replay.counters.counts[0].calls == 1 and 2 * T > int(real.sum())
            assert replay.counters.counts[0].rows == int(real.sum())        # replayed rows only
        with hf.replay_routing(model, packed) as replay, hf.capture_routes(model) as cap:
            out_pack = model(packed_ids, position_ids=position_ids, use_cache=False)
            replay.check(calls=1)
        assert torch.equal(cap.last_forward(), target_packed)
        torch.testing.assert_close(out_pack.logits[0], out_pad.logits[am.bool()], atol=1e-4, rtol=1e-4)
        # negative control: without position_ids the second sample attends to the first
        with hf.replay_routing(model, packed):
            out_bad = model(packed_ids, use_cache=False)
    assert not torch.allclose(out_bad.logits[0, lengths[0]:], out_pad.logits[1, :lengths[1]], atol=1e-3)


def test_route_mask_false_rows_keep_router_choice(models, family):
    model = models[family]
    ids, am = padded_batch()
    own, _ = native_routes(model, ids, attention_mask=am)
    target = rotated(own)
    mask = am.reshape(-1).bool()                                            # routed rows: attended positions ...
    mask[::3] = False                                                       # ... but every third
    assert (~mask & am.reshape(-1).bool()).any()
    with torch.no_grad(), hf.replay_routing(model, rb(target, ids, am, mask)), \
            hf.capture_routes(model, keep_logits=True) as cap:
        model(ids, attention_mask=am, use_cache=False)
    seen = cap.last_forward()
    assert torch.equal(seen[mask], target[mask])
    for layer in range(seen.shape[1]):
        own_choice = cap.logits[layer][-1].float().softmax(-1).topk(K, -1).indices
        assert torch.equal(seen[~mask, layer], own_choice[~mask])
    # layer 0's input does not depend on routing: False rows there are the unreplayed model's ids
    assert torch.equal(seen[~mask, 0], own[~mask, 0])
    assert not torch.equal(seen[~mask], target[~mask])                      # negative control


def test_gradients_reach_the_router(models, family):
    model = copy.deepcopy(models[family]).train()
    ids, am = padded_batch()
    own, _ = native_routes(model, ids, attention_mask=am)
    labels = ids.masked_fill(am == 0, -100)
    with hf.replay_routing(model, rb(rotated(own), ids, am)) as replay:
        with replay.forward():
            out = model(ids, attention_mask=am, labels=labels, use_cache=False)
        with replay.backward():
            out.loss.backward()
        replay.check(calls=1)
    for router in router_modules(model):
        assert router.weight.grad is not None
        assert torch.isfinite(router.weight.grad).all() and router.weight.grad.abs().sum() > 0
    # at the router's own ids the replayed backward is the native backward, bit for bit (aux loss included)
    grads = {}
    for replay in (False, True):
        model.zero_grad(set_to_none=True)
        with hf.replay_routing(model, rb(own, ids, am)) if replay else contextlib.nullcontext():
            out = model(ids, attention_mask=am, labels=labels, use_cache=False, output_router_logits=True)
        out.loss.backward()
        grads[replay] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(grads[True]) == len(grads[False]) > 0
    assert all(torch.equal(x, y) for x, y in zip(grads[True], grads[False]))
    # negative control: the verification variant (recorded weights as constants) cuts the router off
    model.zero_grad(set_to_none=True)
    with hf.replay_routing(model) as replay:
        replay.set_routes(rb(rotated(own), ids, am), recorded_weights=torch.full(own.shape, 0.5))
        out = model(ids, attention_mask=am, labels=labels, use_cache=False)
    out.loss.backward()
    for router in router_modules(model):
        assert router.weight.grad is None or not router.weight.grad.any()


def test_aux_loss_uses_replayed_choices(models, family):
    model = models[family]
    ids, am = padded_batch()
    own, _ = native_routes(model, ids, attention_mask=am)
    target = rotated(own)
    labels = ids.masked_fill(am == 0, -100)
    kw = dict(attention_mask=am, labels=labels, use_cache=False, output_router_logits=True)
    with torch.no_grad():
        with hf.replay_routing(model, rb(target, ids, am), aux_loss="own"):
            old = model(ids, **kw)
        with hf.replay_routing(model, rb(target, ids, am)):
            new = model(ids, **kw)
    assert torch.equal(old.logits, new.logits)
    # transformers' own aux loss counts the router's own top-k of the same logits
    module = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
    native_aux = module.load_balancing_loss_func(old.router_logits, E, K, am)
    torch.testing.assert_close(old.aux_loss, native_aux, atol=1e-6, rtol=0)
    per_layer = [target[:, i] for i in range(target.shape[1])]     # padding rows: not replayed, masked out below
    want = load_balancing_loss(list(new.router_logits), per_layer, E, K, attention_mask=am)
    torch.testing.assert_close(new.aux_loss, want, atol=1e-6, rtol=0)
    assert abs(float(new.aux_loss) - independent_aux(new.router_logits, per_layer, am)) < 1e-5
    assert abs(float(new.aux_loss) - float(old.aux_loss)) > 1e-3            # the ids differ, so does the loss
    # loss = cross-entropy + coef * aux, with the replayed aux
    shift_logits, shift_labels = new.logits[:, :-1].float(), labels[:, 1:]
    ce = F.cross_entropy(shift_logits.reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(old.loss, ce + AUX_COEF * old.aux_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(new.loss, ce + AUX_COEF * new.aux_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(new.loss, old.loss - AUX_COEF * old.aux_loss + AUX_COEF * new.aux_loss,
                               atol=1e-6, rtol=0)
    # identity replay: the fixed aux loss is transformers' own
    with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)):
        same = model(ids, **kw)
    torch.testing.assert_close(same.aux_loss, module.load_balancing_loss_func(same.router_logits, E, K, am),
                               atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def aux_setup(models):
    model = models["qwen3_moe"]
    ids, am = padded_batch()
    own, _ = native_routes(model, ids, attention_mask=am)
    target = rotated(own)
    labels = ids.masked_fill(am == 0, -100)
    with torch.no_grad(), hf.replay_routing(model, rb(target, ids, am)), hf.capture_routes(model) as cap:
        by_kw = model(ids, attention_mask=am, labels=labels, use_cache=False, output_router_logits=True)
    replayed = cap.last_forward()                          # target on attended rows, the router's own on padding
    per_layer = [replayed[:, i] for i in range(replayed.shape[1])]
    masked = load_balancing_loss(list(by_kw.router_logits), per_layer, E, K, attention_mask=am)
    unmasked = load_balancing_loss(list(by_kw.router_logits), per_layer, E, K)
    assert torch.equal(by_kw.aux_loss, masked)
    assert not torch.allclose(masked, unmasked)                             # the mask matters on this batch
    return model, ids, am, labels, target, by_kw


def test_aux_loss_fix_with_positional_attention_mask(aux_setup):
    """Regression: ``model(ids, am)`` (mask by position) must mask pad rows in the aux loss too."""
    model, ids, am, labels, target, by_kw = aux_setup
    with torch.no_grad(), hf.replay_routing(model, rb(target, ids, am)):
        by_pos = model(ids, am, labels=labels, use_cache=False, output_router_logits=True)
    assert torch.equal(by_pos.aux_loss, by_kw.aux_loss) and torch.equal(by_pos.loss, by_kw.loss)


def test_aux_loss_fix_with_tuple_output(aux_setup):
    """Regression: with return_dict=False the tuple carries the fixed losses. (``config.return_dict = False``
    is not tested: transformers 5.23's own MoE forwards fail with it, replay or not.)"""
    model, ids, am, labels, target, by_kw = aux_setup
    kw = dict(attention_mask=am, labels=labels, use_cache=False, output_router_logits=True)
    with torch.no_grad(), hf.replay_routing(model, rb(target, ids, am)):
        as_tuple = model(ids, return_dict=False, **kw)
        as_dict = model(ids, return_dict=True, **kw)
    assert isinstance(as_tuple, tuple)
    assert torch.equal(as_tuple[0], by_kw.loss) and torch.equal(as_tuple[1], by_kw.aux_loss)
    assert torch.equal(as_tuple[2], by_kw.logits)
    assert torch.equal(as_dict.aux_loss, by_kw.aux_loss)
    # negative control: transformers' own tuple holds the native aux loss, which differs
    with torch.no_grad():
        native = model(ids, return_dict=False, **kw)
    assert not torch.allclose(native[1], by_kw.aux_loss)


def test_aux_loss_fix_uses_the_models_coefficient(models):
    """Regression: the models apply ``self.router_aux_loss_coef`` (set from the config at init); when the
    instance attribute is changed, the replayed loss must swap the aux term with that coefficient."""
    model = copy.deepcopy(models["qwen3_moe"])
    model.router_aux_loss_coef = 0.5                                        # config still says AUX_COEF
    ids, am = padded_batch()
    own, _ = native_routes(model, ids, attention_mask=am)
    labels = ids.masked_fill(am == 0, -100)
    with torch.no_grad(), hf.replay_routing(model, rb(rotated(own), ids, am)):
        out = model(ids, attention_mask=am, labels=labels, use_cache=False, output_router_logits=True)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ce + 0.5 * out.aux_loss, atol=1e-6, rtol=0)


def test_replay_restores_a_preexisting_instance_forward(models):
    model = copy.deepcopy(models["olmoe"])
    calls = []

    def wrapper(*args, **kwargs):                                           # e.g. accelerate's autocast wrapper
        calls.append(1)
        return type(model).forward(model, *args, **kwargs)

    model.forward = wrapper
    ids, am = padded_batch()
    own, _ = native_routes(model, ids, attention_mask=am)
    with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)) as replay:
        model(ids, attention_mask=am, use_cache=False)
        replay.check(calls=1)
    assert model.__dict__["forward"] is wrapper
    assert len(calls) == 2                                                  # also ran inside the replay


def test_counters(models):
    model = models["mixtral"]
    ids, am = padded_batch()
    own, _ = native_routes(model, ids, attention_mask=am)
    n = int(am.sum())                                                       # routed rows (attended positions)
    with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)) as replay:
        with pytest.raises(hf.ReplayError, match=rf"expected 1 calls of {n} rows .*layer 0: 0 calls, 0 rows"):
            replay.check(calls=1)
        replay.check(calls=0)
        model(ids, attention_mask=am, use_cache=False)
        replay.check(calls=1)
        assert [c.calls for c in replay.counters.counts] == [1, 1]
        assert [c.rows for c in replay.counters.counts] == [n, n]
        assert n < own.shape[0]                                             # padding rows are not counted
        model(ids, attention_mask=am, use_cache=False)
        with pytest.raises(hf.ReplayError, match=rf"layer 0: 2 calls, {2 * n} rows"):
            replay.check(calls=1)
        replay.check(calls=2)
        replay.reset_counters()
        with pytest.raises(hf.ReplayError, match="unbalanced"):
            replay.check(calls=1)
        replay.check(calls=0)
        with pytest.raises(ConfigError, match="calls must be a non-negative int"):
            replay.check(calls=-1)


def enable_checkpointing(model, use_reentrant):
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:  # transformers before activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()


@pytest.mark.parametrize("case", [*((f, False) for f in FAMILY_NAMES), ("qwen3_moe", True)],
                         ids=lambda c: f"{c[0]}-{'reentrant' if c[1] else 'nonreentrant'}")
def test_gradient_checkpointing_replay(models, case):
    """Activation checkpointing recomputes every decoder layer in backward: each router runs twice per
    training step, both times with the same targets, so the counters show 2 calls (check(calls=2)).
    Non-reentrant checkpointing (transformers' default) keeps the aux loss's gradient; reentrant
    checkpointing runs the first pass under no_grad, so (as in plain transformers) only the LM loss is
    compared there."""
    family_name, reentrant = case
    base = copy.deepcopy(models[family_name]).train()
    ids, am = padded_batch()
    own, _ = native_routes(base, ids, attention_mask=am)
    target = rotated(own)
    real = am.reshape(-1).bool()
    labels = ids.masked_fill(am == 0, -100)
    kw = dict(attention_mask=am, labels=labels, use_cache=False, output_router_logits=not reentrant)
    with hf.replay_routing(base, rb(target, ids, am)):
        plain = base(ids, **kw)
    plain.loss.backward()
    plain_grads = [r.weight.grad.clone() for r in router_modules(base)]

    model = copy.deepcopy(base)
    model.zero_grad(set_to_none=True)
    enable_checkpointing(model, reentrant)
    with hf.replay_routing(model, rb(target, ids, am)) as replay, hf.capture_routes(model) as cap:
        with replay.forward():
            out = model(ids, **kw)
        assert cap.num_calls == [1, 1]
        replay.check(calls=1)
        with replay.backward():
            out.loss.backward()
        # the recomputation ran every router again, with the same targets on the routed rows
        assert cap.num_calls == [2, 2]
        assert all(torch.equal(c[real], target[real, i]) for i, calls in enumerate(cap.calls) for c in calls)
        replay.check(calls=2)
        assert [c.rows for c in replay.counters.counts] == [2 * int(real.sum())] * 2
        with pytest.raises(hf.ReplayError, match="expected 1 calls"):
            replay.check(calls=1)
    torch.testing.assert_close(out.loss, plain.loss, atol=1e-6, rtol=0)
    for got, want in zip((r.weight.grad for r in router_modules(model)), plain_grads):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert "forward" not in model.__dict__


def test_context_manager_restores_on_exit_and_on_error(models):
    model = models["qwen2_moe"]
    ids, am = padded_batch()
    own, ref = native_routes(model, ids, attention_mask=am)
    hooks = hook_state(model)
    with pytest.raises(RuntimeError, match="body failed"):
        with hf.replay_routing(model, rb(rotated(own), ids, am)):
            assert "forward" in model.__dict__
            assert all("forward" in r.__dict__ for r in router_modules(model))
            raise RuntimeError("body failed")
    assert_restored(model, hooks)
    with pytest.raises(hf.ReplayError, match="laid out for a padded batch"):  # raised by the model's forward
        with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)):
            model(ids[:, :-1], attention_mask=am[:, :-1], use_cache=False)
    assert_restored(model, hooks)
    with pytest.raises(hf.ReplayError, match="layer 0: the router saw"):     # raised inside a router
        with torch.no_grad(), hf.replay_routing(model) as replay:
            replay.set_routes(rb(own, ids, am), check_tokens=False)
            model(ids[:, :-1], attention_mask=am[:, :-1], use_cache=False)
    assert_restored(model, hooks)
    with torch.no_grad():
        after = model(ids, attention_mask=am, use_cache=False)
    assert torch.equal(after.logits, ref.logits)
    # manual attach / undo, undo twice is harmless
    replay = hf.RoutingReplay(model, hf.describe_model(model))
    replay.attach()
    replay.set_routes(rb(rotated(own), ids, am))
    with torch.no_grad():
        moved = model(ids, attention_mask=am, use_cache=False)
    replay.undo()
    replay.undo()
    assert not torch.equal(moved.logits, ref.logits)
    assert_restored(model, hooks)


def test_replay_is_per_instance(models):
    a = models["qwen3_moe"]
    b = build("qwen3_moe", seed=1)
    ids, am = padded_batch()
    own_a, ref_a = native_routes(a, ids, attention_mask=am)
    _, ref_b = native_routes(b, ids, attention_mask=am)
    hooks_b = hook_state(b)
    with torch.no_grad(), hf.replay_routing(a, rb(rotated(own_a), ids, am)) as replay:
        out_b = b(ids, attention_mask=am, use_cache=False)
        assert not any("forward" in m.__dict__ for m in b.modules())
        replay.check(calls=0)                                                  # b's forward was not counted
        out_a = a(ids, attention_mask=am, use_cache=False)
    assert torch.equal(out_b.logits, ref_b.logits)
    assert not torch.allclose(out_a.logits, ref_a.logits, atol=1e-3)
    assert_restored(b, hooks_b)


def test_capture_routes(models):
    model = models["olmoe"]
    ids, am = padded_batch()
    with hf.capture_routes(model, keep_logits=True) as cap:
        with pytest.raises(hf.ReplayError, match="no router call"):
            cap.last_forward()
        with torch.no_grad():
            out = model(ids, attention_mask=am, use_cache=False, output_router_logits=True)
        assert cap.num_calls == [1, 1]
        routes = cap.last_forward()
    assert routes.shape == (ids.numel(), 2, K) and routes.dtype == torch.int64
    for i, logits in enumerate(out.router_logits):
        assert torch.equal(cap.logits[i][-1], logits)
        assert torch.equal(routes[:, i], logits.float().softmax(-1).topk(K, -1).indices)


# --------------------------------------------------------------------------------------------------
# 2b. the replay protocol: routes travel with the tokens they were laid out for
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def protocol_record(models):
    """A qwen3_moe rollout of 3 prompts whose samples have different lengths (real padding either side)."""
    model = models["qwen3_moe"]
    ids, am = left_padded_prompts(seed=9)
    rec = hf.generate_with_record(model, ids, am, sampling=SamplingParams(temperature=0.8, top_p=0.9),
                                  max_new_tokens=6, seed=2)
    assert len({s.length for s in rec.samples}) == len(rec)
    return model, rec


def test_replay_routing_implements_the_protocol(models):
    model = models["olmoe"]
    with hf.replay_routing(model) as replay:
        assert isinstance(replay, RoutingReplayAdapter)
        assert replay.moe_layers == (0, 1) and replay.aux_loss == "replayed" and replay.active
    assert not replay.active


def test_padding_side_slip_is_refused(protocol_record):
    """(1) Routes laid out for right padding, fed with the left-padded batch of the same [B, T]: refused (the
    old API took any [B*T] table and replayed every slipped row's experts on another token). (2) The same
    routes with the batch they were laid out for replay and balance."""
    model, rec = protocol_record
    right = rec.replay_batch("padded", side="right")
    left = rec.to_padded("left")
    assert right.padding_side == "right" and tuple(left.input_ids.shape) == tuple(right.input_ids.shape)
    # what the slip would replay: routed rows whose token is another one in the left-padded batch
    slipped = (right.row_tokens != left.input_ids.reshape(-1)) & right.route_mask
    assert int(slipped.sum()) > 0.1 * right.num_replayed_rows
    hooks = hook_state(model)
    with torch.no_grad(), hf.replay_routing(model, right) as replay:
        model(left.input_ids, attention_mask=left.attention_mask, use_cache=False)   # checked on the device
        with pytest.raises(ReplayError, match=rf"not running the batch the routes were laid out for: "
                                              rf"{int(slipped.sum())} of {right.num_replayed_rows} routed rows"):
            replay.check(calls=1)                                           # ... and raised here
        replay.reset_counters()
        # the right tokens with the left mask: routed rows the model would treat as padding
        model(right.input_ids, attention_mask=left.attention_mask, use_cache=False)
        with pytest.raises(ReplayError, match="routed rows are masked in the attention_mask"):
            replay.check(calls=1)
        replay.reset_counters()
        replay.check(calls=0)
        # (2) the batch the routes were laid out for
        with hf.capture_routes(model) as cap, replay.forward():
            model(right.input_ids, attention_mask=right.attention_mask, use_cache=False)
        replay.check(calls=1)
        m = right.route_mask
        assert torch.equal(cap.last_forward()[m], right.routes[m])
    assert_restored(model, hooks)
    # routes laid out for left padding replay on the left-padded batch just as well
    left_routes = rec.replay_batch("padded", side="left")
    assert left_routes.padding_side == "left" and torch.equal(left_routes.input_ids, left.input_ids)
    with torch.no_grad(), hf.replay_routing(model, left_routes) as replay, hf.capture_routes(model) as cap:
        model(left.input_ids, attention_mask=left.attention_mask, use_cache=False)
        replay.check(calls=1)
    m = left_routes.route_mask
    assert torch.equal(cap.last_forward()[m], left_routes.routes[m])


def test_routes_on_padding_are_refused_when_built(protocol_record):
    """(3) A ReplayBatch whose route_mask marks padding positions is refused at construction."""
    _, rec = protocol_record
    right, left = rec.to_padded("right"), rec.to_padded("left")
    with pytest.raises(RouteError, match=r"routed rows sit on masked \(padding\) positions"):
        ReplayBatch.padded(right.routes, input_ids=left.input_ids, attention_mask=left.attention_mask,
                           moe_layers=right.moe_layers, route_mask=right.route_mask)
    ids, am = padded_batch()
    g = torch.Generator().manual_seed(3)     # distinct sets (one set everywhere is refused as a broken capture)
    routes = torch.rand(ids.numel(), 2, E, generator=g).argsort(-1)[..., :K]
    with pytest.raises(RouteError, match=r"3 routed rows sit on masked \(padding\) positions, first row 15 "
                                         r"\(batch 1, position 6\)"):
        rb(routes, ids, am, torch.ones(ids.numel(), dtype=torch.bool))
    hole = am.clone()
    hole[0, 4] = 0
    with pytest.raises(RouteError, match="neither left- nor right-padded"):
        rb(routes, ids, hole)
    with pytest.raises(RouteError, match="must have the shape of input_ids"):
        rb(routes, ids, am[:, 1:])
    batch = rb(routes, ids, am)                                             # negative control: built
    assert batch.num_replayed_rows == int(am.sum()) and batch.padding_side == "right"


def test_other_batch_of_same_shape_is_refused(models):
    """(4) Tokens permuted between rows, another batch, one changed token: refused; padding tokens (not
    routed) may differ; the batch itself replays bitwise."""
    model = models["olmoe"]
    ids, am = padded_batch(lengths=(8, 8))
    own, ref = native_routes(model, ids, attention_mask=am)
    other, _ = padded_batch(seed=4, lengths=(8, 8))
    one = ids.clone()
    one[1, 3] = (one[1, 3] + 1) % VOCAB
    with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)) as replay:
        for wrong, count in ((ids.flip(0), 16), (other, 16), (one, 1)):
            model(wrong, attention_mask=am, use_cache=False)                # checked on the device
            with pytest.raises(ReplayError, match=rf"not running the batch .*: {count} of 16 routed rows"):
                replay.check(calls=1)                                       # ... and raised here
            replay.reset_counters()
        replay.check(calls=0)
        out = model(ids, attention_mask=am, use_cache=False)
        replay.check(calls=1)
    assert torch.equal(out.logits, ref.logits)
    ids, am = padded_batch()                                                # lengths 9, 6: padding in row 1
    own, _ = native_routes(model, ids, attention_mask=am)
    pad_changed = ids.masked_fill(am == 0, 7)
    with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)) as replay:
        model(pad_changed, attention_mask=am, use_cache=False)
        replay.check(calls=1)


def test_inputs_embeds_is_refused(models):
    """(5) With inputs_embeds the replay cannot see the tokens: refused unless the token check is off."""
    model = models["qwen2_moe"]
    ids, am = padded_batch()
    own, ref = native_routes(model, ids, attention_mask=am)
    embeds = model.get_input_embeddings()(ids).detach()
    with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)) as replay:
        with pytest.raises(ReplayError, match=r"call the model with input_ids \(inputs_embeds hide them\)"):
            model(inputs_embeds=embeds, attention_mask=am, use_cache=False)
        replay.check(calls=0)
        replay.set_routes(rb(own, ids, am), check_tokens=False)
        out = model(inputs_embeds=embeds, attention_mask=am, use_cache=False)
        replay.check(calls=1)
    assert torch.equal(out.logits, ref.logits)


def test_aux_loss_modes(models):
    """(6) "warn": transformers' own aux loss is kept, ``aux_disagreement`` records per router call the
    fraction of replayed rows whose own top-k differs (0 at the native routes, > 0 rotated), one warning;
    "own": transformers' aux loss, nothing measured; anything else: ConfigError."""
    model = models["qwen3_moe"]
    ids, am = padded_batch()
    own, ref = native_routes(model, ids, attention_mask=am, output_router_logits=True)
    target = rotated(own)
    module = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
    kw = dict(attention_mask=am, use_cache=False, output_router_logits=True)
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error")                                  # native routes: no warning
            with hf.replay_routing(model, rb(own, ids, am), aux_loss="warn") as replay:
                same = model(ids, **kw)
        assert replay.aux_disagreement == [0.0, 0.0]
        assert torch.equal(same.aux_loss, ref.aux_loss) and torch.equal(same.logits, ref.logits)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with hf.replay_routing(model, rb(target, ids, am), aux_loss="warn") as replay:
                warned = model(ids, **kw)
                model(ids, **kw)
        ours = [w for w in caught if "differs from the replayed experts" in str(w.message)]
        assert len(ours) == 1                                               # once per replay
        assert len(replay.aux_disagreement) == 4
        assert replay.aux_disagreement[0] == 1.0                            # layer 0: every rotated row differs
        assert all(rate > 0 for rate in replay.aux_disagreement)
        torch.testing.assert_close(warned.aux_loss, module.load_balancing_loss_func(warned.router_logits, E, K, am),
                                   atol=0, rtol=0)
        with hf.replay_routing(model, rb(own, ids, am), aux_loss="own") as replay:
            own_same = model(ids, **kw)
        assert torch.equal(own_same.aux_loss, ref.aux_loss) and replay.aux_disagreement == []
        with hf.replay_routing(model, rb(target, ids, am), aux_loss="own") as replay:
            own_moved = model(ids, **kw)
        assert replay.aux_disagreement == []
        with hf.replay_routing(model, rb(target, ids, am)) as replay:
            fixed = model(ids, **kw)
    assert torch.equal(own_moved.logits, warned.logits) and torch.equal(own_moved.logits, fixed.logits)
    assert torch.equal(own_moved.aux_loss, warned.aux_loss)                 # own and warn: transformers' loss
    assert not torch.allclose(own_moved.aux_loss, fixed.aux_loss)           # replayed: the replayed experts'
    hooks = hook_state(model)
    for bad in ("fixed", "Replayed", False, None):
        with pytest.raises(ConfigError, match="aux_loss must be one of"):
            hf.replay_routing(model, rb(own, ids, am), aux_loss=bad)
    assert_restored(model, hooks)


def test_packed_record_replay_matches_padded(protocol_record):
    """(9) ``record.replay_batch("packed")`` fed as input_ids [1, N] with position_ids replays the same routes
    on the same tokens as the right-padded layout: routed rows bitwise, logits to fp32 noise."""
    model, rec = protocol_record
    padded = rec.replay_batch("padded", side="right")
    packed = rec.replay_batch("packed")
    pk = rec.to_packed()
    assert packed.layout == "packed" and torch.equal(packed.cu_seqlens, pk.cu_seqlens)
    real = padded.attention_mask.reshape(-1).bool()
    assert torch.equal(padded.row_tokens[real], packed.row_tokens)         # right padding: packed row = real rows
    assert torch.equal(padded.route_mask[real], packed.route_mask)
    assert torch.equal(padded.routes[real], packed.routes)
    with torch.no_grad():
        with hf.replay_routing(model, padded) as replay, hf.capture_routes(model) as cap:
            out_pad = model(padded.input_ids, attention_mask=padded.attention_mask, use_cache=False)
            replay.check(calls=1)
        seen_pad = cap.last_forward()
        with hf.replay_routing(model, packed) as replay, hf.capture_routes(model) as cap:
            with pytest.raises(ReplayError, match="the routes were laid out for a packed batch"):
                model(padded.input_ids, attention_mask=padded.attention_mask, use_cache=False)
            model(packed.input_ids.flip(0)[None], position_ids=pk.position_ids.flip(0)[None], use_cache=False)
            with pytest.raises(ReplayError, match="not running the batch"):    # samples in another order
                replay.check(calls=1)
            replay.reset_counters()
            out_pack = model(packed.input_ids[None], position_ids=pk.position_ids[None], use_cache=False)
            replay.check(calls=1)
            assert [c.rows for c in replay.counters.counts] == [packed.num_replayed_rows] * 2
        seen_pack = cap.last_forward()
    m = packed.route_mask
    assert torch.equal(seen_pack[m], packed.routes[m])
    assert torch.equal(seen_pack[m], seen_pad[real][m])
    assert torch.equal(as_sets(seen_pack[~m]), as_sets(seen_pad[real][~m]))  # last tokens: the router's own
    torch.testing.assert_close(out_pack.logits[0], out_pad.logits[padded.attention_mask.bool()], atol=1e-4,
                               rtol=1e-4)


# --------------------------------------------------------------------------------------------------
# 3. errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [-1, +1])
def test_row_count_mismatch_names_layer_and_counts(models, delta):
    """Routes for a batch of another length: the ReplayBatch refuses routes that do not cover its tokens, the
    model's forward refuses a batch of another shape, and (token check off) the router names the layer and
    both row counts."""
    model = models["qwen3_moe"]
    ids, am = padded_batch()
    own, _ = native_routes(model, ids, attention_mask=am)
    n = own.shape[0]
    with pytest.raises(RouteError, match=rf"padded routes must be \[batch, seq, n_layers, k\], got shape \({n + delta},"):
        rb(own[:n + delta] if delta < 0 else torch.cat([own, own[:delta]]), ids, am)
    # a well-formed batch laid out for one column less / more (B = 2: 2 rows per column)
    B, T = ids.shape
    if delta < 0:
        other_ids, other_am = ids[:, :T - 1], am[:, :T - 1]
    else:
        other_ids = torch.cat([ids, torch.full((B, 1), PAD)], 1)
        other_am = torch.cat([am, torch.zeros(B, 1, dtype=am.dtype)], 1)
    m = other_ids.numel()
    word = "missing" if delta < 0 else "extra"
    routes = torch.arange(K).expand(m, 2, K)
    with torch.no_grad(), hf.replay_routing(model, rb(routes, other_ids, other_am)) as replay:
        with pytest.raises(hf.ReplayError, match=rf"the model runs input_ids \({B}, {T}\), the routes were laid out "
                                                  rf"for a padded batch \({B}, {T + delta}\)"):
            model(ids, attention_mask=am, use_cache=False)
        replay.set_routes(rb(routes, other_ids, other_am), check_tokens=False)
        with pytest.raises(hf.ReplayError, match=rf"layer 0: the router saw {n} rows, the replay targets have "
                                                  rf"{m} rows \({word} rows"):
            model(ids, attention_mask=am, use_cache=False)
        assert [c.calls for c in replay.counters.counts] == [0, 0]


def test_set_routes_validation(models):
    model = models["qwen3_moe"]
    ids, am = padded_batch()
    own, _ = native_routes(model, ids, attention_mask=am)
    n = own.shape[0]
    with hf.replay_routing(model) as replay:
        assert isinstance(replay, RoutingReplayAdapter)
        # malformed batches are refused when built
        with pytest.raises(RouteError, match=r"routes have 3 layers but moe_layers lists 2"):
            rb(torch.cat([own, own[:, :1]], dim=1), ids, am)
        with pytest.raises(RouteError, match=r"padded routes must be \[batch, seq, n_layers, k\]"):
            rb(own[:, 0], ids, am)
        with pytest.raises(RouteError, match=r"route_mask \(3,\) must be \[batch, seq\]"):
            rb(own, ids, am, am.reshape(-1).bool()[:3])
        with pytest.raises(RouteError, match="must hold integer expert ids"):
            rb(own.float(), ids, am)
        # ... and those that do not fit this model by set_routes
        with pytest.raises(RouteError, match=r"no routes for the model's MoE layers \[1\]"):
            replay.set_routes(rb(own, ids, am, layers=(0, 2)))
        replay.set_routes(rb(torch.cat([own, own[:, :1]], dim=1), ids, am, layers=(0, 1, 2)))   # a superset is fine
        with pytest.raises(RouteError, match=r"replay routes have k=3, the model routes top-2"):
            replay.set_routes(rb(torch.cat([own, own[..., :1]], dim=2), ids, am))
        bad = own.clone()
        bad[4, 1, 0] = E
        with pytest.raises(RouteError, match=rf"replay routes\[4, 1, 0\] = {E} is not an expert id in \[0, {E}\)"):
            replay.set_routes(rb(bad, ids, am))
        dup = own.clone()
        dup[5, 0] = torch.tensor([3, 3])
        with pytest.raises(RouteError, match=r"replay routes row \[5, 0\] repeats expert 3"):
            replay.set_routes(rb(dup, ids, am))
        # bad ids on rows the mask leaves to the router are not an error
        mask = am.reshape(-1).bool()
        mask[4] = False
        replay.set_routes(rb(bad, ids, am, mask))
        with pytest.raises(RouteError, match="recorded_weights shape"):
            replay.set_routes(rb(own, ids, am), recorded_weights=torch.ones(n, 2, 3))
        # (7) anything but a ReplayBatch is refused: a bare route tensor carries no tokens to check
        for wrong in (own, (own, mask), None):
            with pytest.raises(RouteError, match="set_routes takes a ReplayBatch"):
                replay.set_routes(wrong)
        # no routes: an error at the forward, not a silent native forward
        replay.clear()
        with pytest.raises(hf.ReplayError, match="no routes are set"), torch.no_grad():
            model(ids, attention_mask=am, use_cache=False)
    hooks = hook_state(model)
    with pytest.raises(RouteError, match="set_routes takes a ReplayBatch"):
        hf.replay_routing(model, own)
    assert_restored(model, hooks)                                           # the failed start left nothing behind
    with pytest.raises(hf.ReplayError, match="was undone"):
        replay.set_routes(rb(own, ids, am))
    assert issubclass(RouteError, ValueError) and issubclass(RouteError, ReplayError)
    assert hf.ReplayError is ReplayError


def test_bad_route_is_named_by_its_batch_row(models):
    """A bad expert id on a routed row is reported at its row of the batch (``b * T + t``), not at its index
    among the routed rows (left padding and unrouted last tokens shift the two apart)."""
    model = models["qwen3_moe"]
    ids, am = left_padded_prompts()                                         # rows 0..6 | 7..13 | 14..20
    T = ids.shape[1]
    routes = torch.arange(K).expand(ids.numel(), 2, K).clone()
    row = T + T - 2                                                         # batch 1, position 5 (attended)
    assert am.reshape(-1)[row] == 1 and int(am.reshape(-1)[:row].sum()) != row
    routes[row, 1, 0] = E
    with hf.replay_routing(model) as replay:
        with pytest.raises(RouteError, match=rf"replay routes\[{row}, 1, 0\] = {E} is not an expert id"):
            replay.set_routes(rb(routes, ids, am))
        dup = torch.arange(K).expand(ids.numel(), 2, K).clone()
        dup[row, 0] = torch.tensor([3, 3])
        with pytest.raises(RouteError, match=rf"replay routes row \[{row}, 0\] repeats expert 3"):
            replay.set_routes(rb(dup, ids, am))


def test_two_replays_on_one_model(models):
    """(8) A second replay on a model that already replays is refused; the first one keeps replaying."""
    model = models["mixtral"]
    ids, am = padded_batch()
    own, ref = native_routes(model, ids, attention_mask=am)
    real = am.reshape(-1).bool()
    target = rotated(own)
    hooks = hook_state(model)
    with torch.no_grad(), hf.replay_routing(model, rb(target, ids, am)) as first:
        wrapped = model.__dict__["forward"]
        with pytest.raises(hf.ReplayError, match="already has an instance-level forward"):
            with hf.replay_routing(model, rb(own, ids, am)):
                pass
        with pytest.raises(hf.ReplayError, match="already has an instance-level forward"):
            hf.replay_routing(model, aux_loss="own")
        with pytest.raises(hf.ReplayError, match="already attached"):
            first.attach()
        assert model.__dict__["forward"] is wrapped                             # untouched by the refusals
        with hf.capture_routes(model) as cap:
            out = model(ids, attention_mask=am, use_cache=False)                # the first still works
        first.check(calls=1)
        assert torch.equal(cap.last_forward()[real], target[real])
    assert not torch.allclose(out.logits, ref.logits, atol=1e-3)
    assert_restored(model, hooks)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_unknown_family(arch):
    torch.manual_seed(0)
    kw = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, intermediate_size=128, head_dim=16, eos_token_id=EOS, bos_token_id=BOS,
              pad_token_id=PAD)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
    ids, am = left_padded_prompts()
    for call in (lambda: hf.describe_model(model), lambda: hf.record_meta(model),
                 lambda: hf.replay_routing(model).__enter__(), lambda: hf.capture_routes(model).__enter__(),
                 lambda: hf.generate_with_record(model, ids, am, max_new_tokens=2)):
        with pytest.raises(hf.UnsupportedModelError, match=rf"model_type '{arch}' is not a MoE family"):
            call()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_moe_family_without_routers():
    model = build("qwen2_moe", peaked=False, mlp_only_layers=[0, 1])
    with pytest.raises(hf.UnsupportedModelError, match="no Qwen2MoeTopKRouter modules found"):
        hf.describe_model(model)


@pytest.mark.parametrize("version", ["4.40.0", "6.0.0"])
def test_unsupported_transformers_version(models, monkeypatch, version):
    model = models["qwen3_moe"]
    hooks = hook_state(model)
    # sys.modules' entry, not this module's global: transformers swaps its lazy module object in
    # sys.modules once a model is built, so the name bound at import time can be stale
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    ids, am = left_padded_prompts()
    for call in (lambda: hf.describe_model(model), lambda: hf.replay_routing(model).__enter__(),
                 lambda: hf.generate_with_record(model, ids, am, max_new_tokens=2)):
        with pytest.raises(UnsupportedEngineError, match=rf"transformers {version} is not supported") as exc:
            call()
        assert type(exc.value) is UnsupportedEngineError
    assert_restored(model, hooks)
    monkeypatch.undo()
    hf.describe_model(model)                                                 # negative control


def test_generate_with_record_input_errors(models):
    model = models["qwen3_moe"]
    hooks = hook_state(model)
    ids, am = left_padded_prompts()
    right = am.flip(1)
    with pytest.raises(ValueError, match="must be left-padded"):
        hf.generate_with_record(model, ids.flip(1), right, max_new_tokens=2)
    gap = am.clone()
    gap[0, 3] = 0
    with pytest.raises(ValueError, match="must be left-padded"):
        hf.generate_with_record(model, ids, gap, max_new_tokens=2)
    empty = am.clone()
    empty[2] = 0
    with pytest.raises(ValueError, match=r"prompt rows \[2\] are empty"):
        hf.generate_with_record(model, ids, empty, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        hf.generate_with_record(model, ids, am, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"must both be \[batch, prompt_len\]"):
        hf.generate_with_record(model, ids, am[:, 1:], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"must both be \[batch, prompt_len\]"):
        hf.generate_with_record(model, ids[0], am[0], max_new_tokens=2)
    assert_restored(model, hooks)
    hf.generate_with_record(model, ids, am, max_new_tokens=1, seed=0)       # negative control: valid input


# --------------------------------------------------------------------------------------------------
# 4. register_family
# --------------------------------------------------------------------------------------------------


class AliasConfig(transformers.Qwen3MoeConfig):
    model_type = "moealign_test_alias"


def test_register_family_alias():
    config = AliasConfig(**dict(COMMON, num_hidden_layers=2, num_experts=E, moe_intermediate_size=32))
    model = build("qwen3_moe", config=config)
    assert model.config.model_type == "moealign_test_alias"
    with pytest.raises(hf.UnsupportedModelError, match="'moealign_test_alias'"):
        hf.describe_model(model)
    qwen3 = hf.FAMILIES["qwen3_moe"]
    try:
        hf.register_family(dataclasses.replace(qwen3, model_type="moealign_test_alias"))
        info = hf.describe_model(model)
        assert info.family.model_type == "moealign_test_alias" and info.moe_layers == (0, 1)
        ids, am = padded_batch()
        own, ref = native_routes(model, ids, attention_mask=am)
        with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)):
            out = model(ids, attention_mask=am, use_cache=False)
        assert torch.equal(out.logits, ref.logits)
        # a family registered with the wrong scoring replays other gate weights (negative control)
        wrong = dataclasses.replace(qwen3, model_type="moealign_test_alias",
                                    scoring=lambda c: RouterScoring(score="softmax", renormalize=True))
        with pytest.raises(ValueError, match="'moealign_test_alias' is already registered"):
            hf.register_family(wrong)
        hf.register_family(wrong, overwrite=True)
        with torch.no_grad(), hf.replay_routing(model, rb(own, ids, am)):
            out_wrong = model(ids, attention_mask=am, use_cache=False)
        assert not torch.equal(out_wrong.logits, ref.logits)
        # a family naming a router class the model does not have
        hf.register_family(dataclasses.replace(qwen3, model_type="moealign_test_alias", router_class="NoSuchRouter"),
                           overwrite=True)
        with pytest.raises(hf.UnsupportedModelError, match="no NoSuchRouter modules found"):
            hf.describe_model(model)
    finally:
        hf.FAMILIES.pop("moealign_test_alias", None)
    assert hf.FAMILIES["qwen3_moe"] is qwen3


def test_register_existing_family_needs_overwrite():
    original = hf.FAMILIES["mixtral"]
    with pytest.raises(ValueError, match=r"'mixtral' is already registered \(pass overwrite=True\)"):
        hf.register_family(dataclasses.replace(original, router_class="X"))
    assert hf.FAMILIES["mixtral"] is original
    try:
        hf.register_family(dataclasses.replace(original, router_class="X"), overwrite=True)
        assert hf.FAMILIES["mixtral"].router_class == "X"
    finally:
        hf.register_family(original, overwrite=True)
    assert hf.FAMILIES["mixtral"] is original


# --------------------------------------------------------------------------------------------------
# 5. record_meta and layer numbering
# --------------------------------------------------------------------------------------------------


def test_record_meta_dtype_independent(models, family):
    model = models[family]
    half = copy.deepcopy(model).to(torch.bfloat16)
    a, b = hf.record_meta(model), hf.record_meta(half)
    assert a.dtype == "float32" and b.dtype == "bfloat16"
    assert a.moe_layers == b.moe_layers == (0, 1)
    assert a.num_experts == b.num_experts == E and a.top_k == b.top_k == K
    assert a.num_layers == 2 and a.vocab_size == VOCAB
    assert a.model_fingerprint == b.model_fingerprint
    assert a.engine == "transformers" and a.engine_version == transformers.__version__
    assert len(a.router_signature) == 4
    a.check_matches(b)
    b.check_matches(a)
    # other weights (same config: same fingerprint): routers moved by noise of half their RMS. The signature is
    # per-router (mean, RMS) within 2%, so it cannot tell apart two fresh random inits of one distribution.
    moved = copy.deepcopy(model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for router in router_modules(moved):
            w = router.weight
            w.add_(0.5 * w.pow(2).mean().sqrt() * torch.randn(w.shape, generator=g))
    other = hf.record_meta(moved)
    assert other.model_fingerprint == a.model_fingerprint
    with pytest.raises(RecordMismatchError, match=r"router weights differ \(routers \[0, 1\]\)"):
        a.check_matches(other)
    with pytest.raises(RecordMismatchError, match="router weights differ"):
        hf.record_meta(build(family, seed=7, peaked=False)).check_matches(a)
    # another layer count
    deeper = hf.record_meta(build(family, layers=3))
    assert deeper.moe_layers == (0, 1, 2)
    with pytest.raises(RecordMismatchError, match=r"num_layers: record has 2, model has 3"):
        a.check_matches(deeper)


def test_dense_layers_are_skipped():
    """Qwen2-MoE with a dense middle layer: the route axis holds decoder layers 0 and 2 only."""
    model = build("qwen2_moe", layers=3, mlp_only_layers=[1])
    info = hf.describe_model(model)
    assert info.moe_layers == (0, 2) and info.num_layers == 3
    ids, am = left_padded_prompts()
    rec = hf.generate_with_record(model, ids, am, max_new_tokens=3, seed=0)
    assert rec.meta.moe_layers == (0, 2)
    assert all(s.routes.shape[1:] == (2, K) for s in rec.samples)
    batch = rec.replay_batch("padded", side="right")
    assert batch.moe_layers == (0, 2)
    own, ref = native_routes(model, batch.input_ids, attention_mask=batch.attention_mask)
    routes, mask = batch.routes, batch.route_mask
    assert torch.equal(as_sets(own[mask]), as_sets(routes[mask]))
    with torch.no_grad(), hf.replay_routing(model, batch) as replay, hf.capture_routes(model) as cap:
        out = model(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        replay.check(calls=1)
    assert torch.equal(cap.last_forward()[mask], routes[mask])
    with torch.no_grad(), hf.replay_routing(model, rb(own, batch.input_ids, batch.attention_mask, layers=(0, 2))):
        out = model(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    assert torch.equal(out.logits, ref.logits)
    # routes laid out for decoder layers 0 and 1 (a model without the dense layer) do not fit this one
    with pytest.raises(RouteError, match=r"no routes for the model's MoE layers \[2\]"), \
            hf.replay_routing(model) as r:
        r.set_routes(rb(routes, batch.input_ids, batch.attention_mask, mask, layers=(0, 1)))
