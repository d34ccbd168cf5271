"""Validate once (issue 36, item 5): a record's kept sets are checked when the record is built or loaded
(``Sample``), then travel as a trusted ``KeptSets``: scoring a micro-batch re-checks none of them (it used to run
the CSR check four times per micro-batch per side, each with host reads), and gives the same bits as the raw path."""

from __future__ import annotations

import pytest
import torch

import moealign.routing_replay.sampling_mask as sm
from moealign.mismatch.engines import TrainForward
from moealign.mismatch.scoring import SideScores, score_batch
from moealign.record import kept_sets_of
from moealign.routing_replay.sampling_mask import KeptSets, kept_logprob, kept_mask, support_mismatch
from moealign.routing_replay.routes import RouteError
from test_record import make_record


def _forward(record, indices, seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = [record.samples[i] for i in indices]
    tokens = torch.cat([s.token_ids[s.prompt_len:] for s in samples])
    rows = sum(s.token_ids.numel() - 1 for s in samples)
    routes = torch.cat([s.routes.to(torch.int64) for s in samples]) if samples[0].routes is not None else \
        torch.zeros(rows, 1, 1, dtype=torch.int64)
    return TrainForward(logits=torch.randn(tokens.numel(), record.meta.vocab_size, generator=gen), tokens=tokens,
                        routes=routes)


@pytest.fixture
def record():
    return make_record(shapes=[(9, 4), (7, 3)])


def test_scoring_a_micro_batch_checks_no_kept_set_again(record, monkeypatch):
    calls = []
    original = sm.validate_kept_sets
    monkeypatch.setattr(sm, "validate_kept_sets", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(sm, "check_tokens_in_kept", lambda *a, **k: calls.append(2))
    side = SideScores()
    for s in record.samples:                   # one sampling setting per micro-batch
        s.sampling = record.samples[0].sampling
    score_batch(record, [0, 1], _forward(record, [0, 1]), side)
    assert calls == [] and len(side.kept) == 1 and len(side.used_support_mismatch) == 1


def test_trusted_kept_sets_give_the_raw_paths_bits(record):
    samples = record.samples
    kept = kept_sets_of(samples, record.meta.vocab_size)
    fwd = _forward(record, [0, 1], seed=3)
    raw = kept_logprob(fwd.logits, fwd.tokens, kept.offsets, kept.ids, temperature=0.7)
    assert torch.equal(kept_logprob(fwd.logits, fwd.tokens, kept, temperature=0.7), raw)
    assert torch.equal(kept_mask(kept), kept_mask(kept.offsets, kept.ids, record.meta.vocab_size))
    own = fwd.logits > 0
    assert torch.equal(support_mismatch(kept, trainer_mask=own), support_mismatch(kept.offsets, kept.ids, own))
    # negative control: other logits give other bits
    assert not torch.equal(kept_logprob(fwd.logits * 2, fwd.tokens, kept, temperature=0.7), raw)


def test_checked_kept_sets_refuse_bad_csr_and_a_misfit():
    offsets, ids = torch.tensor([0, 2, 3]), torch.tensor([4, 4, 1], dtype=torch.int32)
    with pytest.raises(RouteError, match="more than once"):
        KeptSets.checked(offsets, ids, 8)
    with pytest.raises(RouteError, match="not in its kept set"):
        KeptSets.checked(torch.tensor([0, 1, 2]), torch.tensor([4, 1], dtype=torch.int32), 8,
                         tokens=torch.tensor([4, 2]))
    kept = KeptSets.checked(torch.tensor([0, 1, 2]), torch.tensor([4, 1], dtype=torch.int32), 8,
                            tokens=torch.tensor([4, 1]))
    with pytest.raises(RouteError, match="do not fit"):
        kept_logprob(torch.randn(2, 16), torch.tensor([4, 1]), kept)          # another vocabulary
    with pytest.raises(RouteError, match="not both"):
        kept_mask(kept, torch.tensor([1], dtype=torch.int32))
