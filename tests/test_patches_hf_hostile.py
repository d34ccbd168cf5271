"""Hostile inputs to the transformers adapter (issue 11): a checkpoint's generation config, undo of a precision
policy, non-finite logits, bad prompts and sampling arguments, and replay onto the wrong tokens.

Bitwise claims use ``torch.equal`` next to a negative control that shows the same comparison failing where it
must. The embedded Qwen3-MoE checkpoint (``moealign.embedded``) is the model; rollouts are a few short prompts.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moealign.embedded import embedded_model_path  # noqa: E402
from moealign.errors import (  # noqa: E402
    ConfigError,
    EngineError,
    InputError,
    MoealignError,
    MoealignWarning,
    RecordError,
    ReplayError,
    RouteError,
)
from moealign.mismatch.engines import HFRolloutEngine, HFTrainEngine  # noqa: E402
from moealign.patches import hf  # noqa: E402
from moealign.patches.hf.loading import load_model, load_tokenizer  # noqa: E402
from moealign.patches.hf.precision import apply_precision  # noqa: E402
from moealign.record import SamplingParams, concat_kept_sets  # noqa: E402
from moealign.routing_replay.protocol import ReplayBatch  # noqa: E402
from moealign.routing_replay.sampling_mask import full_logprob, kept_logprob  # noqa: E402

PROMPTS = ["def add(a, b):", "import os\nprint("]
SAMPLING = SamplingParams(temperature=0.9, top_p=0.9)
MAX_NEW = 8


@pytest.fixture(scope="module")
def model():
    m, _ = load_model(embedded_model_path(), "fp32")
    return m


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(embedded_model_path(), padding_side="left")
    enc = tok(PROMPTS + ["x = [1, 2, 3]\nfor i in x:\n    print(i"], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """The rollout with the embedded model's own (neutral) generation config."""
    ids, am = prompts
    return hf.generate_with_record(model, ids, am, sampling=SAMPLING, max_new_tokens=MAX_NEW, seed=5)


def same_record(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x.token_ids, y.token_ids) and torch.equal(x.logprobs, y.logprobs)
                                    and torch.equal(x.kept_ids, y.kept_ids) for x, y in zip(a.samples, b.samples))


# --------------------------------------------------------------------------------------------------
# 1. the checkpoint's generation config: rollout uses exactly the record's sampling parameters
# --------------------------------------------------------------------------------------------------


def test_checkpoint_repetition_penalty_keeps_the_exact_zero(tmp_path):
    """The issue's run: repetition_penalty 1.3 in generation_config.json, fp32 rollout and trainer, routing
    replay, kept sets, batch-invariant ops and attention. The record's log-probs equal the trainer's kept-set
    recompute bitwise (the penalty was applied at rollout only: max |d log p| 2.14); the rollout warns that
    it did not apply the penalty. Negative control by construction: the penalty applied to the trainer's own
    logits changes the log-probs, so the equality can fail."""
    path = tmp_path / "ckpt"
    shutil.copytree(embedded_model_path(), path)
    cfg_file = path / "generation_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "repetition_penalty": 1.3}))

    rollout = HFRolloutEngine(str(path), "fp32", batch_invariant=True)
    assert rollout.model.generation_config.repetition_penalty == 1.3
    with pytest.warns(MoealignWarning, match=r"generation config sets repetition_penalty=1.3: generate_with_record "
                                             r"does not apply it"):
        record = rollout.generate(PROMPTS, sampling=SAMPLING, max_new_tokens=MAX_NEW, seed=3, batch_size=2)
    rollout.close()
    trainer = HFTrainEngine(str(path), "fp32", batch_invariant=True)
    indices = list(range(len(record)))
    fwd = trainer.forward(record, indices, replay=True)
    offsets, ids = concat_kept_sets(record.samples)
    recorded = torch.cat([s.logprobs for s in record.samples])
    from moealign.precision.batch_invariant import batch_invariant_mode

    with batch_invariant_mode():
        recompute = kept_logprob(fwd.logits, fwd.tokens, offsets, ids, temperature=SAMPLING.temperature)
    assert recorded.dtype == recompute.dtype == torch.float32
    assert torch.equal(recompute, recorded)

    # negative control: the checkpoint's penalty applied to the same logits, each row with its own context
    penalty = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    rows, r = [], 0
    for s in record.samples:
        for j in range(s.response_len):
            context = s.token_ids[:s.prompt_len + j][None]
            rows.append(penalty(context, fwd.logits[r:r + 1].clone()))
            r += 1
    penalised = torch.cat(rows)
    assert not torch.equal(penalised, fwd.logits)
    keep_all = torch.arange(penalised.shape[1], dtype=torch.int32).repeat(penalised.shape[0])
    full_offsets = torch.arange(penalised.shape[0] + 1) * penalised.shape[1]
    with batch_invariant_mode():
        penalised_logp = kept_logprob(penalised, fwd.tokens, full_offsets, keep_all, temperature=SAMPLING.temperature)
        plain_logp = kept_logprob(fwd.logits, fwd.tokens, full_offsets, keep_all, temperature=SAMPLING.temperature)
    assert not torch.equal(penalised_logp, plain_logp)
    assert float((penalised_logp - plain_logp).abs().max()) > 1e-3


CHECKPOINT_OPTIONS = [
    dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2), dict(typical_p=0.5), dict(epsilon_cutoff=0.05),
    dict(eta_cutoff=0.05), dict(sequence_bias={(5,): 3.0}), dict(bad_words_ids=[[7], [9]]),
    dict(suppress_tokens=[7, 9]), dict(begin_suppress_tokens=[7]), dict(forced_bos_token_id=7),
    dict(forced_eos_token_id=0), dict(min_new_tokens=4), dict(min_length=30), dict(renormalize_logits=True),
    dict(exponential_decay_length_penalty=(1, 1.5)), dict(remove_invalid_values=True), dict(num_beams=2),
    dict(num_return_sequences=2, do_sample=True), dict(top_h=0.5), dict(min_p=0.3), dict(temperature=0.1, top_k=3),
]


@pytest.mark.parametrize("options", CHECKPOINT_OPTIONS, ids=lambda o: ",".join(o))
def test_checkpoint_options_are_not_applied(model, prompts, reference, options):
    """Every processor / strategy option of the model's generation config: the record is bitwise the one made
    with the neutral config (same seed); the processors and num_beams are named in a warning (num_beams used to
    end in a misleading duplicate-expert RouteError). The record's own sampling parameters (temperature, top_k,
    min_p) override the model's silently, as arguments do."""
    ids, am = prompts
    saved = model.generation_config
    model.generation_config = transformers.GenerationConfig(**{**saved.to_dict(), **options})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            record = hf.generate_with_record(model, ids, am, sampling=SAMPLING, max_new_tokens=MAX_NEW, seed=5)
    finally:
        model.generation_config = saved
    assert same_record(record, reference)
    unstated = set(options) - {"do_sample", "temperature", "top_k", "min_p"}
    messages = [str(w.message) for w in caught if issubclass(w.category, MoealignWarning)]
    if not unstated:
        assert not messages
    else:
        assert len(messages) == 1 and all(f"{k}=" in messages[0] for k in unstated)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(repetition_penalty=1.3), "generate option repetition_penalty=1.3 is refused"),
    (dict(num_beams=2), "generate option num_beams=2 is refused"),
    (dict(num_return_sequences=2), "num_return_sequences=2"),
    (dict(no_repeat_ngram_size=3), "no_repeat_ngram_size=3"),
    (dict(typical_p=0.9), "typical_p=0.9"),
    (dict(temperature=0.5), r"temperature=0.5 is refused .* the record states temperature=0.9; pass sampling="),
    (dict(do_sample=False), "do_sample=False"),
    (dict(use_cache=False), "use_cache=False .* generate_with_record sets use_cache=True itself"),
    (dict(logits_processor=[object()]), "logits_processor="),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens=3"),
    (dict(generation_config=transformers.GenerationConfig(num_beams=4)), "generation_config.num_beams=4"),
    (dict(generation_config=transformers.GenerationConfig(suppress_tokens=[3])), r"generation_config.suppress_tokens"),
])
def test_caller_options_that_change_sampling_are_refused(model, prompts, kwargs, fragment):
    ids, am = prompts
    with pytest.raises(ConfigError, match=fragment):
        hf.generate_with_record(model, ids, am, sampling=SAMPLING, max_new_tokens=2, seed=5, **kwargs)
    assert "_get_logits_processor" not in model.__dict__ and model.generation_config.num_beams in (None, 1)


def test_caller_options_that_change_nothing_are_accepted(model, prompts, reference):
    """Negative control of the refusals: the same options at their neutral values give the reference record."""
    ids, am = prompts
    record = hf.generate_with_record(
        model, ids, am, sampling=SAMPLING, max_new_tokens=MAX_NEW, seed=5, repetition_penalty=1.0, num_beams=1,
        top_p=0.9, temperature=0.9, min_p=0.0, logits_processor=None,
        generation_config=transformers.GenerationConfig(top_p=0.9, max_new_tokens=MAX_NEW))
    assert same_record(record, reference)


def test_a_processor_generate_adds_on_its_own_is_refused(model, prompts, monkeypatch):
    """A processor generate() builds that the record does not state (another transformers version, a subclass)
    is refused by its class name; the model is restored."""
    ids, am = prompts
    original = model._get_logits_processor

    def with_penalty(*args, **kwargs):
        processors = original(*args, **kwargs)
        processors.append(transformers.RepetitionPenaltyLogitsProcessor(1.3))
        return processors

    monkeypatch.setattr(model, "_get_logits_processor", with_penalty)
    own = model.generation_config
    with pytest.raises(ConfigError, match=r"logits processors \['RepetitionPenaltyLogitsProcessor'\] that the "
                                          r"record cannot state"):
        hf.generate_with_record(model, ids, am, sampling=SAMPLING, max_new_tokens=2, seed=5)
    assert model._get_logits_processor is with_penalty and model.generation_config is own


# --------------------------------------------------------------------------------------------------
# 2. apply_precision: undo restores the values
# --------------------------------------------------------------------------------------------------


def _state(m):
    return {**{f"p:{k}": v.detach().clone() for k, v in m.named_parameters()},
            **{f"b:{k}": v.detach().clone() for k, v in m.named_buffers()}}


def _equal_state(m, state) -> list[str]:
    """Names of the tensors that differ from ``state`` (value or dtype)."""
    now = _state(m)
    return [k for k in state if not torch.equal(now[k], state[k]) or now[k].dtype != state[k].dtype]


@pytest.fixture
def fresh():
    m, _ = load_model(embedded_model_path(), "fp32")
    return m


@pytest.mark.parametrize("policy", ["bf16", "fp16", "fp16-fp32-router-head", "fp8-e4m3-block"])
def test_precision_undo_restores_every_tensor_bitwise(fresh, prompts, policy):
    ids, _ = prompts
    state = _state(fresh)
    with torch.no_grad():
        ref = fresh(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error", MoealignWarning)
        with apply_precision(fresh, policy):
            with torch.no_grad():
                assert not torch.equal(fresh(ids).logits.float(), ref)
    assert _equal_state(fresh, state) == []
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, ref)


def test_precision_undo_negative_control(fresh):
    """keep_original=False (the memory-saving opt-out): undo casts back, values keep bf16's rounding, and says so."""
    state = _state(fresh)
    handle = apply_precision(fresh, "bf16", keep_original=False)
    with pytest.warns(MoealignWarning, match="keep_original=False: .* keep the rounding of bfloat16"):
        handle.undo()
    assert [k for k in _equal_state(fresh, state) if k.startswith("p:")]
    assert all(p.dtype == torch.float32 for p in fresh.parameters())


def test_fp32_router_holds_the_checkpoints_values(fresh):
    """An fp32 router / LM head in an fp16 policy holds the checkpoint's fp32 weights, not fp16-rounded ones;
    control: the fp16 parts are rounded."""
    state = _state(fresh)
    with apply_precision(fresh, "fp16-fp32-router-head") as handle:
        now = dict(fresh.named_parameters())
        for name, role in handle.roles.items():
            w = now[f"{name}.weight"]
            assert w.dtype == torch.float32 and torch.equal(w, state[f"p:{name}.weight"]), name
        embed = now["model.embed_tokens.weight"]
        assert not torch.equal(embed.float(), state["p:model.embed_tokens.weight"])


def test_precision_undo_keeps_changes_made_after_apply(fresh):
    """A tensor changed in place under the policy (an optimizer step) is cast back, not replaced by the original
    (that would drop the training silently); the others are restored bitwise; a warning names it."""
    state = _state(fresh)
    handle = apply_precision(fresh, "bf16")
    with torch.no_grad():
        fresh.lm_head.weight.add_(1.0)
        trained = fresh.lm_head.weight.detach().float().clone()
    with pytest.warns(MoealignWarning, match=r"1 tensors were changed after it was applied \(first: lm_head.weight\)"):
        handle.undo()
    assert _equal_state(fresh, state) == ["p:lm_head.weight"]
    assert torch.equal(fresh.lm_head.weight, trained)


# --------------------------------------------------------------------------------------------------
# 3. non-finite logits: named, never a NaN log-prob
# --------------------------------------------------------------------------------------------------


def _kept_case():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=g) * 4
    offsets = torch.tensor([0, 3, 6, 9, 12])
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 10, 11], dtype=torch.int32)
    tokens = torch.tensor([2, 4, 9, 11])
    return logits, tokens, offsets, ids


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_logits_are_named(value):
    logits, tokens, offsets, ids = _kept_case()
    logits[2, 5] = value
    for f in (lambda x: kept_logprob(x, tokens, offsets, ids), lambda x: full_logprob(x, tokens)):
        with pytest.raises(RouteError, match=rf"logits row 2 holds {value} at vocabulary id 5"):
            f(logits)


def test_kept_set_of_all_minus_inf_is_named():
    logits, tokens, offsets, ids = _kept_case()
    logits[1, 3:6] = float("-inf")                   # row 1's kept set is {3, 4, 5}
    with pytest.raises(RouteError, match=r"logits row 1 holds -inf at vocabulary id 3"):
        kept_logprob(logits, tokens, offsets, ids)


def test_temperature_overflow_is_named_not_nan():
    """Finite logits whose logits / T overflows float32: the row and the temperature are named (was: NaN)."""
    logits, tokens, offsets, ids = _kept_case()
    for f in (lambda T: kept_logprob(logits, tokens, offsets, ids, temperature=T),
              lambda T: full_logprob(logits, tokens, temperature=T)):
        with pytest.raises(RouteError, match=r"logits row 0 / temperature 1e-40 overflows torch.float32"):
            f(1e-40)
        assert bool(torch.isfinite(f(1e-3)).all())     # control: a small temperature that fits


def test_temperature_overflow_is_named_on_vocab_parallel_logits():
    """The same on the tensor-parallel path (one rank: vocab_parallel_kept_logprob with group=None)."""
    from moealign.routing_replay.vocab_parallel import vocab_parallel_kept_logprob

    logits, tokens, offsets, ids = _kept_case()
    with pytest.raises(RouteError, match=r"logits row 0 / temperature 1e-40 overflows"):
        vocab_parallel_kept_logprob(logits, tokens, (offsets, ids), 0, temperature=1e-40)
    assert bool(torch.isfinite(vocab_parallel_kept_logprob(logits, tokens, (offsets, ids), 0, temperature=1e-3)).all())


def test_rollout_with_nan_logits_names_the_logits(prompts):
    m, _ = load_model(embedded_model_path(), "fp32")
    with torch.no_grad():
        m.lm_head.weight[11] = float("nan")
    ids, am = prompts
    with pytest.raises(EngineError, match=r"logits at generated step 0 hold nan \(batch row 0, vocabulary id 11"):
        hf.generate_with_record(m, ids, am, sampling=SAMPLING, max_new_tokens=2, seed=5)
    assert "_get_logits_processor" not in m.__dict__


# --------------------------------------------------------------------------------------------------
# 4. bad prompts and sampling arguments name the argument
# --------------------------------------------------------------------------------------------------


def _frac(am):
    am = am.float()
    am[0, -1] = 0.5
    return am


@pytest.mark.parametrize("make, error, fragment", [
    (lambda ids, am: dict(input_ids=ids.masked_fill(am == 0, -1)), InputError, r"input_ids\[\d+, \d+\] = -1 is not a token id"),
    (lambda ids, am: dict(input_ids=ids + 10 ** 6), InputError, r"input_ids\[0, 0\] = \d+ is not a token id in \[0, vocab_size=\d+\)"),
    (lambda ids, am: dict(input_ids=ids.float()), InputError, "input_ids must hold integer token ids"),
    (lambda ids, am: dict(input_ids=ids.tolist()), InputError, "input_ids must be a torch.Tensor"),
    (lambda ids, am: dict(attention_mask=_frac(am)), InputError, r"attention_mask must hold only 0 and 1 .* got 0.5 at \[0, \d+\]"),
    (lambda ids, am: dict(attention_mask=am * 0.5), InputError, "attention_mask must hold only 0 and 1"),
    (lambda ids, am: dict(attention_mask=am * 2), InputError, "attention_mask must hold only 0 and 1"),
    (lambda ids, am: dict(attention_mask=None), MoealignError, "attention_mask must be a torch.Tensor"),
    (lambda ids, am: dict(input_ids=ids[:0], attention_mask=am[:0]), InputError, r"holds no prompt \(batch of 0\)"),
    (lambda ids, am: dict(input_ids=ids[:, :0], attention_mask=am[:, :0]), ConfigError, r"prompt rows \[0, 1, 2\] are empty"),
    (lambda ids, am: dict(attention_mask=am.index_fill(0, torch.tensor([1]), 0)), ConfigError, r"prompt rows \[1\] are empty"),
    (lambda ids, am: dict(max_new_tokens=0), ConfigError, "max_new_tokens must be a positive int, got 0"),
    (lambda ids, am: dict(max_new_tokens=-3), ConfigError, "max_new_tokens must be a positive int, got -3"),
    (lambda ids, am: dict(max_new_tokens=2.5), ConfigError, "max_new_tokens must be a positive int, got 2.5"),
    (lambda ids, am: dict(sampling={"temperature": 0.7}), MoealignError, "sampling must be a moealign.record.SamplingParams"),
    (lambda ids, am: dict(seed="1"), ConfigError, r"seed must be an int in \[0, 2\*\*64\), got '1'"),
    (lambda ids, am: dict(seed=2 ** 70), ConfigError, r"seed must be an int in \[0, 2\*\*64\)"),
    (lambda ids, am: dict(eos_token_id=-5), ConfigError, r"eos_token_id must be a token id in \[0, vocab_size=\d+\), got -5"),
    (lambda ids, am: dict(eos_token_id=[0, 10 ** 6]), ConfigError, r"eos_token_id\[1\] must be a token id"),
    (lambda ids, am: dict(pad_token_id=10 ** 6), ConfigError, "pad_token_id must be a token id"),
])
def test_generate_with_record_bad_arguments(model, prompts, make, error, fragment):
    ids, am = prompts
    kwargs = dict(input_ids=ids, attention_mask=am, max_new_tokens=2, seed=0)
    kwargs.update(make(ids, am))
    with pytest.raises(error, match=fragment):
        hf.generate_with_record(model, **kwargs)
    assert "_get_logits_processor" not in model.__dict__


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature="0.7"), "sampling temperature must be a number, got '0.7'"),
    (dict(top_p=None), "sampling top_p must be a number, got None"),
    (dict(top_k=-1), "sampling top_k must be an integer >= 0"),
    (dict(top_k=2.5), "sampling top_k must be an integer >= 0"),
    (dict(min_p=1.5), r"sampling min_p must be in \[0, 1\]"),
    (dict(min_p=-0.1), r"sampling min_p must be in \[0, 1\]"),
    (dict(temperature=0.0), "sampling temperature must be finite and > 0"),
])
def test_sampling_params_name_the_field(kwargs, fragment):
    with pytest.raises(RecordError, match=fragment):
        SamplingParams(**kwargs)


def test_replay_path_bad_tokens_and_masks(model, reference):
    """The replay adapter: batch token ids outside the vocabulary, out-of-range ids in the padding the model
    runs, fractional or weighted attention masks: each refused naming the tensor (were: raw IndexError from the
    embedding, or accepted)."""
    batch = reference.replay_batch("padded", side="right")
    vocab = model.config.vocab_size
    bad_ids = batch.input_ids.masked_fill(batch.attention_mask == 0, vocab + 3)
    routes, route_mask = batch.grid()
    bad = ReplayBatch.padded(routes, input_ids=bad_ids, attention_mask=batch.attention_mask,
                             moe_layers=batch.moe_layers, route_mask=route_mask)
    with hf.replay_routing(model) as replay:
        with pytest.raises(RouteError, match=rf"batch.input_ids\[\d+, \d+\] = {vocab + 3} is not a token id"):
            replay.set_routes(bad)
        replay.set_routes(batch)
        with torch.no_grad():
            with pytest.raises(InputError, match=rf"input_ids\[\d+, \d+\] = {vocab + 3} is not a token id"):
                model(bad_ids, attention_mask=batch.attention_mask, use_cache=False)
            frac = batch.attention_mask.float()
            frac[0, 0] = 0.5
            model(batch.input_ids, attention_mask=frac, use_cache=False)   # checked on the device
            with pytest.raises(InputError, match=r"attention_mask must hold only 0 and 1 .* got 0.5 at \[0, 0\]"):
                replay.check(calls=1)                                       # ... and raised here
            replay.reset_counters()
            model(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)    # control
            replay.check(calls=1)
    with pytest.raises(RouteError, match=r"attention_mask must hold only 0 and 1 .* got 2"):
        ReplayBatch.padded(routes, input_ids=batch.input_ids, attention_mask=batch.attention_mask * 2,
                           moe_layers=batch.moe_layers)


# --------------------------------------------------------------------------------------------------
# 5. replay onto the wrong tokens
# --------------------------------------------------------------------------------------------------


def _forward_replayed_rows(model, batch, input_ids, attention_mask, check_tokens):
    with torch.no_grad(), hf.replay_routing(model, aux_loss="own") as replay:
        replay.set_routes(batch, check_tokens=check_tokens)
        model(input_ids, attention_mask=attention_mask, use_cache=False)
        replay.check(calls=1)


def test_issue_scenario_right_routes_left_batch(model, reference):
    """The issue's scenario: routes laid out for right padding fed with the left-padded batch of the same
    [B, T]. Refused (ReplayError naming how many routed rows hold other tokens). Negative control: with the
    token check off, the same forward is accepted and replays experts recorded for other tokens."""
    right = reference.replay_batch("padded", side="right")
    left = reference.to_padded("left")
    assert tuple(left.input_ids.shape) == tuple(right.input_ids.shape)
    slipped = (right.row_tokens != left.input_ids.reshape(-1)) & right.route_mask
    assert int(slipped.sum()) > 0.1 * right.num_replayed_rows
    with pytest.raises(ReplayError, match=rf"{int(slipped.sum())} of {right.num_replayed_rows} routed rows hold "
                                          rf"other tokens"):
        _forward_replayed_rows(model, right, left.input_ids, left.attention_mask, True)
    _forward_replayed_rows(model, right, left.input_ids, left.attention_mask, False)     # control: goes through
    _forward_replayed_rows(model, right, right.input_ids, right.attention_mask, True)    # control: own batch


def _verl_layout(record, pad):
    """verl's layout: each prompt left-padded to the widest prompt, each response right-padded to the longest."""
    P = max(s.prompt_len for s in record.samples)
    R = max(s.response_len for s in record.samples)
    ids = torch.full((len(record), P + R), pad, dtype=torch.int64)
    am = torch.zeros_like(ids)
    for b, s in enumerate(record.samples):
        ids[b, P - s.prompt_len:P] = s.token_ids[:s.prompt_len]
        ids[b, P:P + s.response_len] = s.response_ids
        am[b, P - s.prompt_len:P + s.response_len] = 1
    return ids, am


def test_verl_layout_slip_is_refused(model, prompts, reference):
    """verl's left-padded prompt + right-padded response against routes laid out for right padding at the same
    [B, T]: refused. verl's layout itself is refused as a ReplayBatch (a padding hole inside a row), so routes
    can only be laid out for it as a packed batch."""
    pad = 1
    # the reference rollout again, with the third response token of sample 1 as EOS: responses of other lengths
    eos = int(reference.samples[1].response_ids[2])
    record = hf.generate_with_record(model, *prompts, sampling=SAMPLING, max_new_tokens=MAX_NEW, seed=5,
                                     eos_token_id=eos)
    assert record.samples[1].response_len == 3
    ids, am = _verl_layout(record, pad)
    assert bool(((am[:, 0] == 0) & (am[:, -1] == 0)).any())             # a row padded on both sides
    B, T = ids.shape
    right = record.to_padded("right", pad)
    width = right.input_ids.shape[1]
    assert width <= T       # verl's layout is at least as wide: pad the right-padded layout to its width
    widen = lambda x, v: torch.cat([x, torch.full((B, T - width, *x.shape[2:]), v, dtype=x.dtype)], 1)  # noqa: E731
    routes = widen(right.routes.to(torch.int64), 0)                     # [B, T, layers, k]
    assert routes.dim() == 4
    batch = ReplayBatch.padded(routes, input_ids=widen(right.input_ids, pad), attention_mask=widen(right.attention_mask, 0),
                               moe_layers=right.moe_layers, route_mask=widen(right.route_mask.reshape(B, width), False))
    assert tuple(batch.input_ids.shape) == tuple(ids.shape)
    with pytest.raises(ReplayError, match="routed rows hold other tokens|routed rows are masked"):
        _forward_replayed_rows(model, batch, ids, am, True)
    with pytest.raises(RouteError, match="neither left- nor right-padded"):
        ReplayBatch.padded(routes, input_ids=ids, attention_mask=am, moe_layers=right.moe_layers)
    _forward_replayed_rows(model, batch, batch.input_ids, batch.attention_mask, True)     # control: own batch
