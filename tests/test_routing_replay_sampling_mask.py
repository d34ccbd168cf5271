"""Keep Sampling Mask: CSR kept sets, transformers-exact truncation, restricted log-probs, mismatch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moealign.routing_replay import (
    RouteError,
    full_logprob,
    kept_logprob,
    kept_mask,
    kept_sets_from_logits,
    support_mismatch,
    support_mismatch_rate,
    truncation_mask,
    validate_kept_sets,
)

NEG = float("-inf")


def peaked_logits(rows=48, vocab=300, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 2.5
    x[::3, 7] += 12.0  # some rows dominated by one token
    x[1::5] = x[1::5].round()  # rows with many exact ties
    return x.to(dtype)


def random_kept(rows, vocab, g, p=0.3):
    keep = torch.rand(rows, vocab, generator=g) < p
    keep[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)] = True
    return keep


# ----------------------------------------------------------------------------------------- CSR


def test_kept_sets_from_logits_hand_values():
    x = torch.tensor([[1.0, NEG, 2.0, NEG], [NEG, NEG, NEG, 0.5], [0.0, 0.0, 0.0, 0.0]])
    offsets, ids = kept_sets_from_logits(x)
    assert offsets.dtype == torch.int64 and ids.dtype == torch.int32
    assert offsets.tolist() == [0, 2, 3, 7]
    assert ids.tolist() == [0, 2, 3, 0, 1, 2, 3]
    assert torch.equal(kept_mask(offsets, ids, 4), torch.isfinite(x))


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 10), vocab=st.integers(1, 40))
@settings(max_examples=30, deadline=None)
def test_kept_sets_round_trip(seed, rows, vocab):
    g = torch.Generator().manual_seed(seed)
    keep = random_kept(rows, vocab, g)
    x = torch.randn(rows, vocab, generator=g).masked_fill(~keep, NEG)
    offsets, ids = kept_sets_from_logits(x)
    validate_kept_sets(offsets, ids, vocab, num_rows=rows)
    assert torch.equal(kept_mask(offsets, ids, vocab), keep)
    for r in range(rows):  # ascending per row
        row = ids[offsets[r]:offsets[r + 1]].tolist()
        assert row == sorted(row) == keep[r].nonzero().flatten().tolist()


def test_kept_mask_does_not_need_sorted_rows():
    offsets = torch.tensor([0, 3, 4])
    ids = torch.tensor([4, 0, 2, 1], dtype=torch.int32)
    expected = torch.tensor([[1, 0, 1, 0, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(kept_mask(offsets, ids, 5), expected)


@pytest.mark.parametrize("offsets, ids, num_rows, fragment", [
    (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2], dtype=torch.int32), None, r"offsets\[0\] must be 0, got 1"),
    (torch.tensor([0, 2, 1, 3]), torch.tensor([0, 1, 2], dtype=torch.int32), None,
     r"offsets decrease at row 1: offsets\[1\] = 2 > offsets\[2\] = 1"),
    (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2], dtype=torch.int32), None, r"offsets\[-1\] = 2 but ids has 3 entries"),
    (torch.tensor([0, 1, 3]), torch.tensor([0, 1, 5], dtype=torch.int32), None,
     r"ids\[2\] = 5 \(row 1\) is not a token id in \[0, 5\)"),
    (torch.tensor([0, 1, 3]), torch.tensor([0, -1, 2], dtype=torch.int32), None, r"ids\[1\] = -1 \(row 1\)"),
    (torch.tensor([0, 1, 1, 3]), torch.tensor([0, 1, 2], dtype=torch.int32), None, "kept set of row 1 is empty"),
    (torch.tensor([0, 1, 4]), torch.tensor([0, 3, 1, 3], dtype=torch.int32), None,
     "kept set of row 1 holds token 3 more than once"),
    (torch.tensor([0, 1, 3]), torch.tensor([0, 1, 2], dtype=torch.int32), 3, "kept sets have 2 rows .* but 3 were expected"),
    (torch.tensor([0.0, 1.0]), torch.tensor([0], dtype=torch.int32), None, "offsets must be an integer tensor"),
    (torch.tensor([0, 1]), torch.tensor([0.0]), None, "ids must be an integer tensor"),
    (torch.tensor([[0, 1]]), torch.tensor([0], dtype=torch.int32), None, "offsets must be a 1-D tensor"),
    (torch.tensor([0, 1]), torch.tensor([[0]], dtype=torch.int32), None, "ids must be a 1-D tensor"),
])
def test_validate_kept_sets_errors(offsets, ids, num_rows, fragment):
    with pytest.raises(RouteError, match=fragment):
        validate_kept_sets(offsets, ids, 5, num_rows=num_rows)
    if num_rows is None:
        with pytest.raises(RouteError, match=fragment):
            kept_mask(offsets, ids, 5)


def test_validate_kept_sets_accepts_shared_ids_across_rows():
    validate_kept_sets(torch.tensor([0, 2, 4]), torch.tensor([1, 3, 1, 3], dtype=torch.int32), 5, num_rows=2)


@pytest.mark.parametrize("x, fragment", [
    (torch.tensor([[0.0, NEG], [NEG, NEG]]), "processed_logits row 1 keeps no token"),
    (torch.tensor([[0.0, float("nan")]]), r"processed_logits\[0, 1\] is NaN"),
    (torch.tensor([[0.0, 1.0], [float("inf"), 0.0]]), r"processed_logits\[1, 0\] is \+inf"),
    (torch.tensor([0.0, 1.0]), r"shape \[N, V\]"),
    (torch.tensor([[0, 1]]), "floating tensor"),
])
def test_kept_sets_from_logits_errors(x, fragment):
    with pytest.raises(RouteError, match=fragment):
        kept_sets_from_logits(x)


# ----------------------------------------------------------------------------------------- truncation


def hf_support(logits, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """transformers' own warpers, in generate()'s order, on a float32 copy."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = []
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        chain.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if min_p is not None:
        chain.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    scores = logits.float().clone()
    input_ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    for warper in chain:
        scores = warper(input_ids, scores)
    return torch.isfinite(scores)


@pytest.mark.parametrize("params", [
    dict(),
    dict(temperature=0.7),
    dict(top_k=1),
    dict(top_k=20),
    dict(top_k=1000),
    dict(top_p=0.9),
    dict(top_p=0.3),
    dict(top_p=1e-9),  # 1 - top_p rounds to 1.0 in float32: only the keep-the-best rule keeps a token
    dict(min_p=0.05),
    dict(min_p=0.5),
    dict(temperature=1.3, top_k=50, top_p=0.95),
    dict(temperature=0.6, top_k=20, top_p=0.8, min_p=0.02),
    dict(temperature=2.0, top_p=0.7, min_p=0.1),
    dict(temperature=0.5, top_k=5, min_p=0.3),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_truncation_mask_matches_transformers_warpers(params, seed):
    x = peaked_logits(seed=seed)
    ours = truncation_mask(x, **params)
    theirs = hf_support(x, **params)
    assert ours.dtype == torch.bool
    assert torch.equal(ours, theirs)


def test_truncation_mask_negative_control():
    x = peaked_logits()
    assert not torch.equal(truncation_mask(x, top_p=0.9), hf_support(x, top_p=0.8))
    assert not torch.equal(truncation_mask(x, top_k=20, temperature=0.5, min_p=0.1), hf_support(x, top_k=20, min_p=0.1))


def test_truncation_mask_bf16_input_is_upcast():
    x = peaked_logits(dtype=torch.bfloat16)
    assert torch.equal(truncation_mask(x, top_p=0.9, min_p=0.05), hf_support(x.float(), top_p=0.9, min_p=0.05))


def test_truncation_mask_hand_values():
    x = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # cumulative ascending probs 0.05, 0.2, 0.5, 1.0: top-p 0.7 drops those <= 0.3
    assert truncation_mask(x, top_p=0.7).tolist() == [[True, True, False, False]]
    assert truncation_mask(x, top_k=3).tolist() == [[True, True, True, False]]
    assert truncation_mask(x, top_k=0).tolist() == [[True] * 4]
    # min-p 0.5: keep prob >= 0.25
    assert truncation_mask(x, min_p=0.5).tolist() == [[True, True, False, False]]
    # temperature 2 flattens: probs ~ sqrt(p) -> 0.387 / 0.707 > 0.5
    assert truncation_mask(x, temperature=2.0, min_p=0.5).tolist() == [[True, True, True, False]]
    # the best token always survives
    assert truncation_mask(x, top_p=1e-6).tolist() == [[True, False, False, False]]
    assert truncation_mask(x, top_p=1e-9).tolist() == [[True, False, False, False]]
    assert truncation_mask(x, min_p=1.0).tolist() == [[True, False, False, False]]
    # top-k keeps ties with the k-th value
    ties = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert truncation_mask(ties, top_k=1).tolist() == [[False, True, True, False]]
    # entries that arrive as -inf stay out
    assert truncation_mask(torch.tensor([[0.0, NEG, 1.0]])).tolist() == [[True, False, True]]


@pytest.mark.parametrize("kw, fragment", [
    (dict(temperature=0.0), "temperature must be a finite number > 0, got 0.0"),
    (dict(temperature=-1.0), "temperature must be a finite number > 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number > 0"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(top_k=2.5), "top_k must be an int >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.1), r"min_p must be in \[0, 1\]"),
    (dict(top_p="0.9"), "top_p must be a number or None"),
])
def test_truncation_mask_param_errors(kw, fragment):
    with pytest.raises(RouteError, match=fragment):
        truncation_mask(torch.randn(2, 5), **kw)


def test_truncation_mask_rejects_nan():
    x = torch.zeros(2, 3)
    x[1, 2] = float("nan")
    with pytest.raises(RouteError, match=r"logits\[1, 2\] is NaN"):
        truncation_mask(x)


# ----------------------------------------------------------------------------------------- log-probs


def test_kept_logprob_hand_value():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).log()
    offsets, ids = torch.tensor([0, 2]), torch.tensor([1, 3], dtype=torch.int32)
    assert kept_logprob(x, torch.tensor([3]), offsets, ids).item() == pytest.approx(math.log(4 / 6), rel=1e-6)
    assert kept_logprob(x, torch.tensor([1]), offsets, ids).item() == pytest.approx(math.log(2 / 6), rel=1e-6)
    # temperature 0.5 squares the probabilities: 16 / (4 + 16)
    lp = kept_logprob(x, torch.tensor([3]), offsets, ids, temperature=0.5)
    assert lp.item() == pytest.approx(math.log(16 / 20), rel=1e-6)
    assert full_logprob(x, torch.tensor([3])).item() == pytest.approx(math.log(4 / 10), rel=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_logprob_equals_masked_log_softmax(temperature):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 64, generator=g) * 3
    keep = random_kept(40, 64, g, p=0.2)
    tokens = torch.multinomial(keep.float(), 1, generator=g).squeeze(1)
    offsets, ids = kept_sets_from_logits(x.masked_fill(~keep, NEG))
    ours = kept_logprob(x, tokens, offsets, ids, temperature=temperature)
    ref = torch.log_softmax((x / temperature).masked_fill(~keep, NEG), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert ours.dtype == torch.float32 and ours.shape == (40,)
    assert torch.allclose(ours, ref, atol=1e-5)
    # negative control: the full-vocabulary log-prob is lower wherever a token was truncated away
    full = full_logprob(x, tokens, temperature=temperature)
    truncated = keep.sum(-1) < 64
    assert (ours[truncated] > full[truncated]).all()


def test_kept_logprob_over_whole_vocab_is_full_logprob():
    x = peaked_logits(rows=16, vocab=50, dtype=torch.float64)
    tokens = torch.randint(50, (16,), generator=torch.Generator().manual_seed(2))
    offsets, ids = kept_sets_from_logits(torch.zeros(16, 50))
    ours = kept_logprob(x, tokens, offsets, ids, temperature=1.3)
    assert ours.dtype == torch.float64
    ref = torch.log_softmax(x / 1.3, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(full_logprob(x, tokens, temperature=1.3), ref, rtol=1e-12, atol=1e-12)


def test_kept_logprob_gradient_stays_in_the_kept_set():
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(8, 20, generator=g)).to(torch.bfloat16).requires_grad_(True)
    keep = random_kept(8, 20, g, p=0.4)
    tokens = torch.multinomial(keep.float(), 1, generator=g).squeeze(1)
    offsets, ids = kept_sets_from_logits(torch.zeros(8, 20).masked_fill(~keep, NEG))
    lp = kept_logprob(x, tokens, offsets, ids)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    grad = x.grad.float()
    assert torch.isfinite(grad).all()
    assert (grad[~keep] == 0).all()
    assert (grad[keep & (keep.sum(-1, keepdim=True) > 1)] != 0).any()


def test_kept_logprob_token_outside_its_set():
    x = torch.zeros(3, 5)
    offsets, ids = torch.tensor([0, 2, 3, 5]), torch.tensor([0, 1, 4, 2, 3], dtype=torch.int32)
    with pytest.raises(RouteError, match="row 1: token 3 is not in its kept set"):
        kept_logprob(x, torch.tensor([1, 3, 2]), offsets, ids)


@pytest.mark.parametrize("tokens, offsets, fragment", [
    (torch.tensor([0, 1]), torch.tensor([0, 1, 2, 3]), r"tokens must have shape \(3,\)"),
    (torch.tensor([0, 5, 1]), torch.tensor([0, 1, 2, 3]), r"tokens\[1\] = 5 is not a token id in \[0, 5\)"),
    (torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 1, 2, 3]), "tokens must be an integer tensor"),
    (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 3]), "kept sets have 2 rows .* but 3 were expected"),
])
def test_kept_logprob_errors(tokens, offsets, fragment):
    ids = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RouteError, match=fragment):
        kept_logprob(torch.zeros(3, 5), tokens, offsets, ids)


def test_logprob_temperature_errors():
    with pytest.raises(RouteError, match="temperature must be a finite number > 0"):
        full_logprob(torch.zeros(1, 3), torch.tensor([0]), temperature=0)
    with pytest.raises(RouteError, match="temperature must be a finite number > 0"):
        kept_logprob(torch.zeros(1, 3), torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0]), temperature=-1.0)


# ----------------------------------------------------------------------------------------- mismatch


def test_support_mismatch_hand_values():
    offsets = torch.tensor([0, 2, 3, 5])
    ids = torch.tensor([0, 2, 1, 3, 4], dtype=torch.int32)
    trainer = torch.tensor([
        [1, 0, 1, 0, 0],  # same set
        [0, 1, 1, 0, 0],  # superset
        [0, 0, 0, 1, 0],  # subset
    ], dtype=torch.bool)
    assert support_mismatch(offsets, ids, trainer).tolist() == [False, True, True]
    assert support_mismatch_rate(offsets, ids, trainer) == pytest.approx(2 / 3)
    trainer[1, 2] = False
    trainer[2, 4] = True
    assert support_mismatch_rate(offsets, ids, trainer) == 0.0


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 12), vocab=st.integers(1, 30))
@settings(max_examples=30, deadline=None)
def test_support_mismatch_matches_dense_comparison(seed, rows, vocab):
    g = torch.Generator().manual_seed(seed)
    recorded = random_kept(rows, vocab, g)
    trainer = torch.where(torch.rand(rows, 1, generator=g) < 0.5, recorded, random_kept(rows, vocab, g))
    offsets, ids = kept_sets_from_logits(torch.zeros(rows, vocab).masked_fill(~recorded, NEG))
    assert torch.equal(support_mismatch(offsets, ids, trainer), (recorded != trainer).any(dim=-1))


def test_truncation_support_of_itself_never_mismatches():
    x = peaked_logits()
    trainer = truncation_mask(x, temperature=0.8, top_p=0.9)
    offsets, ids = kept_sets_from_logits(x.masked_fill(~trainer, NEG))
    assert support_mismatch_rate(offsets, ids, trainer) == 0.0
    assert support_mismatch_rate(offsets, ids, truncation_mask(x, temperature=0.8, top_p=0.5)) > 0.0


@pytest.mark.parametrize("trainer, fragment", [
    (torch.ones(2, 4, dtype=torch.int64), "trainer_mask must be a bool tensor"),
    (torch.ones(4, dtype=torch.bool), r"trainer_mask must have shape \[N, V\]"),
    (torch.ones(3, 4, dtype=torch.bool), "kept sets have 2 rows .* but 3 were expected"),
    (torch.ones(2, 2, dtype=torch.bool), r"ids\[1\] = 3 \(row 1\) is not a token id in \[0, 2\)"),
])
def test_support_mismatch_errors(trainer, fragment):
    with pytest.raises(RouteError, match=fragment):
        support_mismatch(torch.tensor([0, 1, 2]), torch.tensor([0, 3], dtype=torch.int32), trainer)


def test_support_mismatch_rate_needs_rows():
    with pytest.raises(RouteError, match="0 rows"):
        support_mismatch_rate(torch.tensor([0]), torch.tensor([], dtype=torch.int32), torch.zeros(0, 4, dtype=torch.bool))
