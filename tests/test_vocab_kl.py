"""Full-vocabulary KL per position in bounded memory (moealign.correction.vocab_kl.full_vocab_kl)."""

from __future__ import annotations

import pytest
import torch

from moealign.correction.vocab_kl import CHUNK_ELEMENTS, full_vocab_kl
from moealign.errors import InputError


def _logits(n, v, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


def _reference(p, q, t=1.0):
    lp = torch.log_softmax(p.double() / t, -1)
    lq = torch.log_softmax(q.double() / t, -1)
    # kl_div(input=log q, target=log p, log_target=True) = sum p (log p - log q)
    return torch.nn.functional.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)


def test_matches_float64_reference():
    p, q = _logits(13, 257, 0), _logits(13, 257, 1)
    got = full_vocab_kl(p, q)
    assert got.dtype == torch.float32 and got.shape == (13,)
    ref = _reference(p, q)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    # negative control: the reverse KL is a different number
    assert not torch.allclose(got.double(), _reference(q, p), rtol=1e-3, atol=1e-5)


def test_identical_rows_exact_zero():
    p = _logits(9, 101, 2)
    q = p.clone()
    q[4] += torch.linspace(-1, 1, 101)      # one row differs
    got = full_vocab_kl(p, q)
    keep = torch.ones(9, dtype=torch.bool)
    keep[4] = False
    assert torch.equal(got[keep], torch.zeros(8))
    assert got[4] > 0                                    # negative control
    assert torch.equal(full_vocab_kl(p, p.clone()), torch.zeros(9))


def test_chunking_changes_nothing_but_rounding():
    # the chunk size bounds memory; a row's sum may be split differently for another chunk shape (torch's
    # reduction kernels choose by shape and CPU), so values agree to float32 rounding, not necessarily bitwise
    n, v = 37, 211
    p, q = _logits(n, v, 3), _logits(n, v, 4)
    ref = full_vocab_kl(p, q)
    for chunk in (1, v, 7 * v, v + 1, CHUNK_ELEMENTS, n * v * 3):
        torch.testing.assert_close(full_vocab_kl(p, q, chunk_elements=chunk), ref, rtol=1e-6, atol=1e-7)
    # negative control: a slightly different input is far outside that tolerance
    q2 = q.clone()
    q2[5] *= 1.1
    assert not torch.allclose(full_vocab_kl(p, q2, chunk_elements=v), ref, rtol=1e-4, atol=1e-5)


def test_temperature_applied():
    p, q = _logits(8, 64, 5), _logits(8, 64, 6)
    for t in (0.5, 2.0, 3):
        got = full_vocab_kl(p, q, temperature=t)
        assert torch.equal(got, full_vocab_kl(p / t, q / t))
        torch.testing.assert_close(got.double(), _reference(p, q, t), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(full_vocab_kl(p, q, temperature=2.0), full_vocab_kl(p, q))


def test_shared_masked_entries_are_fine():
    p, q = _logits(6, 50, 7), _logits(6, 50, 8)
    p[:, 10:20] = float("-inf")
    q[:, 10:20] = float("-inf")
    got = full_vocab_kl(p, q)
    assert torch.isfinite(got).all()
    ref = _reference(torch.cat([p[:, :10], p[:, 20:]], 1), torch.cat([q[:, :10], q[:, 20:]], 1))
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    # identical rows with masks: still exactly zero
    assert torch.equal(full_vocab_kl(p, p.clone()), torch.zeros(6))


def test_q_masks_token_p_gives_mass_is_inf():
    p, q = _logits(4, 30, 9), _logits(4, 30, 10)
    q[2, 5] = float("-inf")
    got = full_vocab_kl(p, q)
    assert got[2] == float("inf")
    assert torch.isfinite(got[[0, 1, 3]]).all()
    # the other way round (p masks, q does not) is finite: p gives that token no mass
    assert torch.isfinite(full_vocab_kl(q, p)).all()


@pytest.mark.parametrize("p,q", [
    (torch.zeros(3, 5), torch.zeros(3, 6)),
    (torch.zeros(3, 5), torch.zeros(4, 5)),
    (torch.zeros(5), torch.zeros(5)),
    (torch.zeros(2, 3, 5), torch.zeros(2, 3, 5)),
    (torch.zeros(3, 0), torch.zeros(3, 0)),
])
def test_shape_errors(p, q):
    with pytest.raises(InputError):
        full_vocab_kl(p, q)


def test_empty_vocab_message():
    with pytest.raises(InputError, match="empty"):
        full_vocab_kl(torch.zeros(3, 0), torch.zeros(3, 0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("side", ["p", "q"])
def test_nan_and_pos_inf_refused(bad, side):
    p, q = _logits(5, 20, 11), _logits(5, 20, 12)
    (p if side == "p" else q)[3, 7] = bad
    with pytest.raises(InputError, match=f"{side}_logits row 3") as info:
        full_vocab_kl(p, q, chunk_elements=20)
    assert "vocabulary id 7" in str(info.value)


@pytest.mark.parametrize("t", [0, 0.0, -1, -1.0, float("inf"), float("nan"), True, False, "1", None])
def test_bad_temperature(t):
    p = _logits(2, 4, 13)
    with pytest.raises(InputError, match="temperature"):
        full_vocab_kl(p, p, temperature=t)


@pytest.mark.parametrize("c", [0, -5, 1.5, "10", None])
def test_bad_chunk_elements(c):
    p = _logits(2, 4, 14)
    with pytest.raises(InputError, match="chunk_elements"):
        full_vocab_kl(p, p, chunk_elements=c)


def test_not_tensors():
    with pytest.raises(InputError):
        full_vocab_kl([[0.0, 1.0]], torch.zeros(1, 2))


def test_large_vocab_chunked_equals_unchunked():
    n, v = 64, 50000
    p, q = _logits(n, v, 15, scale=2.0), _logits(n, v, 16, scale=2.0)
    one_row = full_vocab_kl(p, q, chunk_elements=v)         # one row at a time
    whole = full_vocab_kl(p, q, chunk_elements=n * v)        # everything at once
    torch.testing.assert_close(one_row, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(full_vocab_kl(p, q), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(whole.double(), _reference(p, q), rtol=1e-4, atol=1e-5)
    q2 = q.clone()
    q2[0] *= 1.1
    assert not torch.allclose(full_vocab_kl(p, q2, chunk_elements=v), one_row, rtol=1e-4, atol=1e-5)  # control


def test_bfloat16_input_computed_in_float32():
    p, q = _logits(4, 40, 17).bfloat16(), _logits(4, 40, 18).bfloat16()
    got = full_vocab_kl(p, q)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(p.float(), q.float()), rtol=1e-5, atol=1e-6)


def test_fully_masked_row_is_an_error_not_nan():
    p, q = _logits(3, 8, 19), _logits(3, 8, 20)
    p[1] = float("-inf")
    with pytest.raises(InputError):
        out = full_vocab_kl(p, q)
        assert not torch.isnan(out).any(), out
