"""The one kept-set log-prob: ``moealign.routing_replay.kept_logprob``.

It is the formula the mismatch test's exact-zero result rests on (``log_softmax`` over the whole vocabulary
row of ``logits.float() / T`` with the entries outside the kept set at -inf), bitwise; the vocab-parallel
variant is the same arithmetic at TP = 1; a row's value does not depend on its batch mates under
``batch_invariant_mode``; bad input names the problem.

The negative controls differ by construction, not by what a stock kernel happens to do on this machine: a
reduction whose split point is set by the batch's widest kept set, and a fixed-tree reduction over the
compacted kept set instead of the full row (other terms paired, on data built so the pairing shows).
"""

from __future__ import annotations

import math

import pytest
import torch

from moealign.errors import MoealignError, ReplayError, RouteError
from moealign.precision.batch_invariant import batch_invariant_mode, fixed_tree_sum
from moealign.routing_replay import (
    check_tokens_in_kept,
    full_logprob,
    kept_logprob,
    kept_mask,
    kept_sets_from_logits,
    sampling_mask,
    vocab_parallel_kept_logprob,
)

NEG = float("-inf")


def dense_reference(logits: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor, temperature: float):
    """The mismatch test's formula as it was written there (``_kept_logprob_dense``): kept is [N, V] bool."""
    scores = (logits.float() / temperature).masked_fill(~kept, float("-inf"))
    return torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def widest_gather_reference(logits: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor,
                            temperature: float):
    """The earlier public kept_logprob's shape: the kept logits gathered into ``[N, W]`` with ``W`` the batch's
    widest kept set (-inf padding), then ``logit[token] - logsumexp``, with the sum reduced the way a kernel
    tiled over that width reduces it: two halves of the width (each a fixed tree), added. The split point
    ``ceil(W / 2)`` is set by the batch's widest row: batch-dependent by construction (a row alone is split
    in the middle of its own kept set; beside a wider row all of it lies in the first half)."""
    counts = offsets.diff()
    width = int(counts.max())
    slot = torch.arange(width)
    present = slot < counts[:, None]
    index = ids.long()[torch.where(present, offsets[:-1, None] + slot, 0)]
    kept = (logits.gather(1, index).float() / temperature).masked_fill(~present, NEG)
    top = kept.amax(dim=-1, keepdim=True)
    e = torch.exp(kept - top)
    half = (width + 1) // 2
    total = fixed_tree_sum(e[:, :half]) + fixed_tree_sum(e[:, half:])
    chosen = logits.gather(1, tokens[:, None]).float() / temperature
    return (chosen - top - torch.log(total)[:, None]).squeeze(1)


def make_case(rows: int = 40, vocab: int = 300, seed: int = 0, dtype=torch.float32, sizes=None):
    """Logits, kept sets of very different sizes (1 token .. the whole vocabulary), a token from each."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    if sizes is None:
        sizes = torch.randint(1, vocab + 1, (rows,), generator=g)
        sizes[0], sizes[1], sizes[2] = 1, vocab, 2
    keep = torch.zeros(rows, vocab, dtype=torch.bool)
    for r, k in enumerate(sizes.tolist()):
        keep[r, torch.randperm(vocab, generator=g)[:k]] = True
    offsets, ids = kept_sets_from_logits(torch.zeros(rows, vocab).masked_fill(~keep, NEG))
    tokens = torch.multinomial(keep.float(), 1, generator=g).squeeze(1)
    return logits, tokens, offsets, ids, keep


def row_of(offsets: torch.Tensor, ids: torch.Tensor, r: int):
    lo, hi = int(offsets[r]), int(offsets[r + 1])
    return torch.tensor([0, hi - lo]), ids[lo:hi]


# --------------------------------------------------------------------------------------------------
# the formula, bitwise
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bi", [False, True], ids=["stock", "batch_invariant"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_the_dense_formula_bitwise(dtype, temperature, bi):
    logits, tokens, offsets, ids, keep = make_case(dtype=dtype)
    ours_leaf, ref_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    with batch_invariant_mode(bi):
        ours = kept_logprob(ours_leaf, tokens, offsets, ids, temperature=temperature)
        ref = dense_reference(ref_leaf, tokens, keep, temperature)
        ours.sum().backward()
        ref.sum().backward()
    assert ours.dtype == torch.float32 and ours.shape == (40,)
    assert torch.equal(ours, ref)
    assert torch.equal(ours_leaf.grad, ref_leaf.grad)
    assert bool((ours_leaf.grad[~keep] == 0).all())          # no gradient outside the kept set
    assert bool(torch.isfinite(ours).all()) and ours[0] == 0  # row 0 keeps one token: log 1


def test_dense_formula_negative_control():
    # the comparison above would notice another kept set or another temperature
    logits, tokens, offsets, ids, keep = make_case()
    ours = kept_logprob(logits, tokens, offsets, ids, temperature=0.7)
    assert not torch.equal(ours, dense_reference(logits, tokens, keep, 1.0))
    wider = keep.clone()
    wider[5] = True
    assert not torch.equal(ours, dense_reference(logits, tokens, wider, 0.7))
    assert not torch.equal(ours, full_logprob(logits, tokens, temperature=0.7))


def test_float64_stays_float64():
    logits, tokens, offsets, ids, keep = make_case(dtype=torch.float64)
    ours = kept_logprob(logits, tokens, offsets, ids, temperature=1.3)
    scores = (logits / 1.3).masked_fill(~keep, NEG)
    assert ours.dtype == torch.float64
    assert torch.equal(ours, torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1))


def test_hand_value():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).log()
    offsets, ids = torch.tensor([0, 2]), torch.tensor([1, 3], dtype=torch.int32)
    assert kept_logprob(x, torch.tensor([3]), offsets, ids).item() == pytest.approx(math.log(4 / 6), rel=1e-6)
    assert kept_logprob(x, torch.tensor([3]), offsets, ids, temperature=0.5).item() == \
        pytest.approx(math.log(16 / 20), rel=1e-6)


@pytest.mark.parametrize("bi", [False, True], ids=["stock", "batch_invariant"])
def test_row_chunks_give_the_same_bits(monkeypatch, bi):
    logits, tokens, offsets, ids, keep = make_case(rows=23)
    leaf = logits.clone().requires_grad_()
    with batch_invariant_mode(bi):
        whole = kept_logprob(logits, tokens, offsets, ids, temperature=0.9)
        monkeypatch.setattr(sampling_mask, "CHUNK_ELEMENTS", 4 * logits.shape[1] + 7)   # chunks of 4 rows
        assert len(sampling_mask.row_chunks(*logits.shape)) == 6
        chunked = kept_logprob(leaf, tokens, offsets, ids, temperature=0.9)
        chunked.sum().backward()
        ref_leaf = logits.clone().requires_grad_()
        dense_reference(ref_leaf, tokens, keep, 0.9).sum().backward()
    assert torch.equal(chunked, whole)
    assert torch.equal(leaf.grad, ref_leaf.grad)


def test_empty_batch():
    out = kept_logprob(torch.zeros(0, 7, requires_grad=True), torch.zeros(0, dtype=torch.long),
                       torch.zeros(1, dtype=torch.long), torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0,) and out.dtype == torch.float32


# --------------------------------------------------------------------------------------------------
# the vocab-parallel variant at TP = 1
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bi", [False, True], ids=["stock", "batch_invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_at_tp1_is_bitwise_the_public_function(dtype, bi):
    logits, tokens, offsets, ids, _ = make_case(dtype=dtype, seed=3)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    with batch_invariant_mode(bi):
        public = kept_logprob(a, tokens, offsets, ids, temperature=0.8)
        sharded = vocab_parallel_kept_logprob(b, tokens, (offsets, ids), 0, temperature=0.8)
        public.sum().backward()
        sharded.sum().backward()
    assert torch.equal(public, sharded)
    assert torch.equal(a.grad, b.grad)
    # negative control: a different kept set changes the vocab-parallel value
    other_offsets, other_ids = kept_sets_from_logits(torch.zeros_like(logits, dtype=torch.float32))
    assert not torch.equal(vocab_parallel_kept_logprob(logits, tokens, (other_offsets, other_ids), 0,
                                                       temperature=0.8), public)


def test_megatron_wrapper_at_tp1_is_bitwise_the_public_function():
    pytest.importorskip("megatron.core")
    from moealign.patches import megatron as mg

    logits, tokens, offsets, ids, _ = make_case(seed=4)
    public = kept_logprob(logits, tokens, offsets, ids, temperature=0.6)
    assert torch.equal(mg.kept_logprob(logits, tokens, (offsets, ids), temperature=0.6), public)
    assert torch.equal(mg.kept_logprob(logits, tokens, None, temperature=0.6),
                       full_logprob(logits, tokens, temperature=0.6))


# --------------------------------------------------------------------------------------------------
# batch invariance
# --------------------------------------------------------------------------------------------------


def _short_rows_and_one_wide(rows: int = 96, vocab: int = 256, seed: int = 7):
    """Data built to expose a reduction over the batch's widest kept set: short kept sets (5-12 tokens)
    and one row keeping the whole vocabulary, so that row widens every other row's reduction ~25x."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(5, 13, (rows,), generator=g)
    sizes[-1] = vocab
    return make_case(rows=rows, vocab=vocab, seed=seed, sizes=sizes)


def _select_rows(case, rows):
    """Rows ``rows`` of a case (logits, tokens, offsets, ids), in that order, as a new batch."""
    logits, tokens, offsets, ids = case[:4]
    parts = [row_of(offsets, ids, r)[1] for r in rows]
    new_offsets = torch.tensor([0] + [len(p) for p in parts]).cumsum(0)
    return logits[rows], tokens[rows], new_offsets, torch.cat(parts)


def test_row_alone_equals_row_in_batch_under_batch_invariant_mode():
    case = _short_rows_and_one_wide()
    logits, tokens, offsets, ids, _ = case
    with batch_invariant_mode():
        batch = kept_logprob(logits, tokens, offsets, ids, temperature=0.9)
        for r in range(logits.shape[0]):
            alone = kept_logprob(*_select_rows(case, [r]), temperature=0.9)
            assert torch.equal(alone, batch[r:r + 1]), r
        # other batch mates, another order
        order = [95, 17, 3, 60, 0]
        assert torch.equal(kept_logprob(*_select_rows(case, order), temperature=0.9), batch[order])


def test_negative_control_widest_kept_set_gather_depends_on_the_batch():
    # A reduction over the batch's widest kept set: alone a row's reduction has its own length (5-12) and is
    # split inside the kept set, in this batch it has length 256 and is not. Same data, same mode and the same
    # comparison as the test above: rows change.
    logits, tokens, offsets, ids, _ = _short_rows_and_one_wide()
    with batch_invariant_mode():
        batch = widest_gather_reference(logits, tokens, offsets, ids, 0.9)
        changed = []
        for r in range(logits.shape[0] - 1):
            alone = widest_gather_reference(*_select_rows((logits, tokens, offsets, ids), [r]), 0.9)
            if not torch.equal(alone, batch[r:r + 1]):
                changed.append(r)
        ours = kept_logprob(logits, tokens, offsets, ids, temperature=0.9)
    assert changed, "the widest-kept-set reduction gave every row the same bits alone and in the batch"
    torch.testing.assert_close(batch, ours, rtol=0, atol=1e-5)   # the same number up to rounding


def test_negative_control_compacted_kept_set_is_not_the_rollout_row():
    # Reducing over the kept logits compacted ([e0, e3, e5]) pairs other terms in the sum than the rollout's
    # full row of length V: under batch_invariant_mode's fixed tree (V = 8) the full row sums e0 + (e3 + e5),
    # the compacted one (e0 + e5) + e3. With e3 = e5 = 0.4 ulp(1) the first keeps them, the second rounds
    # both away. Only the full-row formula reproduces the rollout side's bits.
    x = torch.full((1, 8), -3.0)
    x[0, 0] = 0.0                                        # the token, the row's max: e0 = 1
    x[0, 3] = x[0, 5] = math.log(0.4 * 2.0 ** -23)
    offsets, ids = torch.tensor([0, 3]), torch.tensor([0, 3, 5], dtype=torch.int32)
    token = torch.tensor([0])
    with batch_invariant_mode():
        rollout_side = dense_reference(x, token, kept_mask(offsets, ids, 8), 1.0)
        ours = kept_logprob(x, token, offsets, ids)
        compacted = torch.log_softmax(x[:, ids.long()], dim=-1)[:, 0]
    assert torch.equal(ours, rollout_side)
    assert not torch.equal(compacted, rollout_side)
    assert float(rollout_side) < 0 and float(compacted) == 0.0


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------


def test_token_outside_its_kept_set():
    x = torch.zeros(3, 5)
    offsets, ids = torch.tensor([0, 2, 3, 5]), torch.tensor([0, 1, 4, 2, 3], dtype=torch.int32)
    tokens = torch.tensor([1, 3, 2])
    for validate in (True, False):
        with pytest.raises(RouteError, match=r"row 1: token 3 is not in its kept set \(1 ids\); its log-prob would "
                                             r"be -inf"):
            kept_logprob(x, tokens, offsets, ids, validate=validate)
    with pytest.raises(RouteError, match="row 1: token 3 is not in its kept set") as info:
        check_tokens_in_kept(offsets, ids, tokens)
    assert (info.value.row, info.value.token) == (1, 3)
    assert isinstance(info.value, ReplayError) and isinstance(info.value, ValueError)
    assert isinstance(info.value, MoealignError)
    check_tokens_in_kept(offsets, ids, torch.tensor([1, 4, 2]), vocab_size=5)     # every token inside: no error
    with pytest.raises(RouteError, match="row 1: token 3"):
        vocab_parallel_kept_logprob(x, tokens, (offsets, ids), 0)                  # the same check


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_logits(value):
    logits, tokens, offsets, ids, _ = make_case()
    bad = logits.clone()
    bad[6, 123] = value
    with pytest.raises(RouteError, match=rf"logits row 6 holds {value} at vocabulary id 123$"):
        kept_logprob(bad, tokens, offsets, ids)
    with pytest.raises(RouteError, match=rf"logits row 6 holds {value} at vocabulary id 123$"):
        full_logprob(bad, tokens)


@pytest.mark.parametrize("make, message", [
    (lambda x, t, o, i: (x, t[:-1], o, i), r"tokens must have shape \(40,\) to match logits \(40, 300\), got \(39,\)"),
    (lambda x, t, o, i: (x, t[:, None], o, i), r"tokens must have shape \(40,\)"),
    (lambda x, t, o, i: (x, t.float(), o, i), "tokens must be an integer tensor"),
    (lambda x, t, o, i: (x, torch.where(t == t[4], 300, t), o, i), r"tokens\[\d+\] = 300 is not a token id in \[0, 300\)"),
    (lambda x, t, o, i: (x[:-1], t[:-1], o, i), r"kept sets have 40 rows .* but 39 were expected"),
    (lambda x, t, o, i: (x[0], t, o, i), r"logits must have shape \[N, V\] with V >= 1, got \(300,\)"),
    (lambda x, t, o, i: (x[:, :0], t, o, i), r"logits must have shape \[N, V\] with V >= 1, got \(40, 0\)"),
    (lambda x, t, o, i: (x.long(), t, o, i), "logits must be a floating tensor"),
    (lambda x, t, o, i: (x, t, o[:-1], i), r"kept sets have 39 rows .* but 40 were expected"),
    (lambda x, t, o, i: (x, t, o, i.float()), "ids must be an integer tensor"),
])
def test_shape_and_type_errors(make, message):
    logits, tokens, offsets, ids, _ = make_case()
    with pytest.raises(RouteError, match=message):
        kept_logprob(*make(logits, tokens, offsets, ids))


def test_check_tokens_in_kept_shape_errors():
    offsets, ids = torch.tensor([0, 1, 2]), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RouteError, match=r"tokens \(3,\) and kept-set offsets \(3,\) disagree"):
        check_tokens_in_kept(offsets, ids, torch.tensor([0, 1, 2]))
    with pytest.raises(RouteError, match="tokens must be an integer tensor"):
        check_tokens_in_kept(offsets, ids, torch.tensor([0.0, 1.0]))
    with pytest.raises(RouteError, match=r"ids\[1\] = 1 \(row 1\) is not a token id in \[0, 1\)"):
        check_tokens_in_kept(offsets, ids, torch.tensor([0, 1]), vocab_size=1)
