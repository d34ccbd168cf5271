"""Re-scoring a record along the rollout's own decode path (moealign.patches.hf.rollout.rescore_decode): the
record's log-probs and routes reproduced bitwise on a ragged batch with early EOS, the LM-head variants
(one trunk decode, the head applied per variant) equal to a full re-scoring with that head's precision, and under
batch-invariant ops the one-forward re-scoring (rescore_forward) equal to the decode."""

from __future__ import annotations

import pytest
import torch

from moealign.embedded import default_prompts, embedded_model_path
from moealign.mismatch.levers import mixed_policy
from moealign.patches.hf import generate_with_record
from moealign.patches.hf.loading import load_model, load_tokenizer
from moealign.patches.hf.precision import apply_precision
from moealign.errors import ConfigError
from moealign.patches.hf import rollout
from moealign.patches.hf.rollout import rescore_decode, rescore_decode_all, rescore_forward
from moealign.precision.batch_invariant import batch_invariant_mode
from moealign.precision.policy import get_policy
from moealign.record import SamplingParams, concat_kept_sets
from moealign.routing_replay.sampling_mask import kept_logprob

MAX_NEW = 12
SAMPLING = SamplingParams(temperature=0.9, top_p=0.9)


@pytest.fixture(scope="module")
def setup():
    """A bf16 rollout (an fp32 model under the bf16 policy, as the lever runs hold it) of 5 prompts of different
    lengths; the EOS id is a token row 0 samples at step 3 of an EOS-free run, so the batch has responses that end
    early with EOS (at different steps) next to ones that run to ``MAX_NEW``."""
    path = embedded_model_path()
    model = load_model(path, "fp32", "cpu")[0]
    tok = load_tokenizer(path)
    # the default prompts tokenize to one length: cut them to five lengths (left padding in the batch)
    prompts = [p[:n] for p, n in zip(default_prompts(None), (12, 30, 50, 80, 400))]
    enc = tok(prompts, return_tensors="pt", padding=True)
    policy = get_policy("bf16")
    with apply_precision(model, policy, keep_original=True):
        kw = dict(sampling=SAMPLING, max_new_tokens=MAX_NEW, seed=3, pad_token_id=tok.pad_token_id)
        free = generate_with_record(model, enc["input_ids"], enc["attention_mask"], eos_token_id=[], **kw)
        eos = int(free.samples[0].token_ids[free.samples[0].prompt_len + 3])
        record = generate_with_record(model, enc["input_ids"], enc["attention_mask"], eos_token_id=eos, **kw)
    lens = [s.response_len for s in record.samples]
    prompt_lens = [s.prompt_len for s in record.samples]
    assert len(set(prompt_lens)) > 1, prompt_lens                       # ragged prompts (left padding)
    assert min(lens) <= 4 and max(lens) == MAX_NEW and len(set(lens)) > 1, lens   # early EOS and full length
    return dict(model=model, tok=tok, record=record, eos=eos, policy=policy)


def _logprobs(record, logits):
    offsets, ids = concat_kept_sets(record.samples)
    tokens = torch.cat([s.token_ids[s.prompt_len:] for s in record.samples])
    return kept_logprob(torch.cat(logits), tokens, offsets, ids, temperature=SAMPLING.temperature)


def test_rescore_reproduces_the_record_bitwise(setup):
    record, model = setup["record"], setup["model"]
    recorded_lp = torch.cat([s.logprobs for s in record.samples])
    recorded_routes = torch.cat([s.routes.to(torch.int64) for s in record.samples])
    with apply_precision(model, setup["policy"], keep_original=True):
        for max_new in (None, MAX_NEW):             # the longest response, or the rollout's max_new_tokens
            logits, routes = rescore_decode(model, record.samples, pad_token_id=setup["tok"].pad_token_id,
                                            eos_token_id=setup["eos"], max_new_tokens=max_new)
            assert torch.equal(_logprobs(record, logits), recorded_lp)
            assert torch.equal(torch.cat(routes).to(torch.int64), recorded_routes)
    # negative control: the same path with the router in fp32 (one region changed) does not reproduce it
    with apply_precision(model, mixed_policy(setup["policy"], get_policy("fp32"), {"router"}), keep_original=True):
        logits, routes = rescore_decode(model, record.samples, pad_token_id=setup["tok"].pad_token_id,
                                        eos_token_id=setup["eos"])
    assert not torch.equal(_logprobs(record, logits), recorded_lp)


@pytest.mark.parametrize("trunk", [frozenset(), frozenset({"other"})], ids=["bf16-trunk", "fp32-trunk"])
def test_lm_head_variants_equal_full_rescorings(setup, trunk):
    """The head variants of one decode equal separate decodes with the head in that precision (both directions:
    an fp32 head beside a bf16 one), bitwise; routes shared. With an fp32 trunk the fp32 head's input is the
    prefill's non-contiguous last-position view, uncast: aten's matmul rounds it differently for a weight that
    does not require grad (a detached copy) than for the head's parameter, which the variant must follow."""
    record, model, pad, eos = setup["record"], setup["model"], setup["tok"].pad_token_id, setup["eos"]
    head = model.get_output_embeddings()
    w32 = head.weight.detach()
    assert not w32.requires_grad and head.weight.requires_grad
    bf16, fp32 = setup["policy"], get_policy("fp32")
    full = {}
    for aligned in (trunk, trunk | {"lm_head"}):
        with apply_precision(model, mixed_policy(bf16, fp32, aligned), keep_original=True):
            full[aligned] = rescore_decode(model, record.samples, pad_token_id=pad, eos_token_id=eos)
    assert not torch.equal(torch.cat(full[trunk][0]), torch.cat(full[trunk | {"lm_head"}][0]))
    for aligned, other in ((trunk, trunk | {"lm_head"}), (trunk | {"lm_head"}, trunk)):
        dtype = torch.float32 if "lm_head" in other else torch.bfloat16
        with apply_precision(model, mixed_policy(bf16, fp32, aligned), keep_original=True):
            out = rescore_decode_all(model, record.samples, pad_token_id=pad, eos_token_id=eos,
                                     head_variants={"v": (w32.to(dtype), None)})
        for got, want in zip(out.logits, full[aligned][0]):
            assert torch.equal(got, want)
        for got, want in zip(out.head_variants["v"], full[other][0]):
            assert torch.equal(got, want)
        for got, want in zip(out.routes, full[other][1]):
            assert torch.equal(got, want)


def test_forward_equals_the_decode_under_batch_invariant_ops(setup, monkeypatch):
    """Under batch-invariant ops and attention, one full-sequence forward over the decode's layout gives the
    decode's logits, routes and LM-head variant bitwise, on the ragged batch with early EOS (left padding,
    responses of different lengths), with the regions in mixed precision as the lever runs hold them. Negative
    control: the same forward with the positions of an unpadded batch (0, 1, ... per row, not derived from the
    mask) differs on the left-padded rows. Outside batch-invariant ops, or with stock attention, it is refused."""
    record, pad, eos = setup["record"], setup["tok"].pad_token_id, setup["eos"]
    model = load_model(embedded_model_path(), "fp32", "cpu", "bi")[0]
    policy = mixed_policy(setup["policy"], get_policy("fp32"), {"attention"})
    w16 = model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    kw = dict(pad_token_id=pad, eos_token_id=eos, max_new_tokens=MAX_NEW, head_variants={"v": (w16, None)})
    with apply_precision(model, policy, keep_original=True), batch_invariant_mode():
        decode = rescore_decode_all(model, record.samples, **kw)
        forward = rescore_forward(model, record.samples, **kw)
        monkeypatch.setattr(rollout, "_decode_positions", lambda mask: torch.arange(mask.shape[1]).expand_as(mask))
        shifted = rescore_forward(model, record.samples, **kw)
    for name in ("logits", "routes"):
        for got, want in zip(getattr(forward, name), getattr(decode, name)):
            assert torch.equal(got, want), name
            assert not got.is_inference() and not want.is_inference(), name      # callers may update them in place
    for got, want in zip(forward.head_variants["v"], decode.head_variants["v"]):
        assert torch.equal(got, want) and not got.is_inference() and not want.is_inference()
    padded = [b for b, s in enumerate(record.samples) if s.prompt_len < max(x.prompt_len for x in record.samples)]
    assert padded and all(not torch.equal(shifted.logits[b], decode.logits[b]) for b in padded)
    with pytest.raises(ConfigError, match="batch-invariant mode off"):
        rescore_forward(model, record.samples, pad_token_id=pad, eos_token_id=eos)
    with batch_invariant_mode(), pytest.raises(ConfigError, match="attention"):
        rescore_forward(setup["model"], record.samples, pad_token_id=pad, eos_token_id=eos)
