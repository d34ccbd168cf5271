"""Full-vocabulary comparison of two next-token distributions, per position, in bounded memory.

The sampled token's log-prob shows only one entry of each distribution; two engines can agree on it and still
disagree on the rest of the vocabulary (the tokens the next rollout will sample). :func:`full_vocab_kl` gives,
per position, ``KL(p || q) = sum_v p_v (log p_v - log q_v)`` with ``p = softmax(p_logits / T)`` (the rollout
engine's distribution, what was sampled from) and ``q = softmax(q_logits / T)`` (the trainer's), computed in
float32 row chunks: at most ``chunk_elements`` entries of each side are expanded at a time, so a 150k-entry
vocabulary costs a few chunks, not an ``[N, V]`` float32 copy of each side.
"""

from __future__ import annotations

import torch

from ..errors import InputError as CorrectionInputError

__all__ = ["full_vocab_kl", "CHUNK_ELEMENTS"]

#: Entries (rows x vocabulary) of each side expanded at once.
CHUNK_ELEMENTS = 1 << 22


def full_vocab_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, *, temperature: float = 1.0,
                  chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``[N]`` float32 ``KL(softmax(p_logits / T) || softmax(q_logits / T))`` per row of the ``[N, V]`` logits.

    Exact zero where the two rows are equal. The chunk size bounds memory only: with several intra-op threads
    torch may split a row's sum differently for another chunk size, so values can differ in the last bits.
    Errors (:class:`~moealign.errors.InputError`): shapes that
    differ or are not 2-D, an empty vocabulary, NaN / +inf logits, a row that is -inf everywhere (-inf entries are allowed: a masked token; one
    that ``p`` gives mass to and ``q`` masks makes that row's KL +inf, as it is), a temperature that is not > 0.
    """
    if not isinstance(p_logits, torch.Tensor) or not isinstance(q_logits, torch.Tensor):
        raise CorrectionInputError("full_vocab_kl takes two logits tensors")
    if p_logits.dim() != 2 or p_logits.shape != q_logits.shape:
        raise CorrectionInputError(f"full_vocab_kl: logits must be two [N, V] tensors of one shape, got "
                                   f"{tuple(p_logits.shape)} and {tuple(q_logits.shape)}")
    if p_logits.shape[1] == 0:
        raise CorrectionInputError("full_vocab_kl: the vocabulary is empty")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0 \
            or temperature == float("inf"):
        raise CorrectionInputError(f"full_vocab_kl: temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise CorrectionInputError(f"full_vocab_kl: chunk_elements must be a positive int, got {chunk_elements!r}")
    N, V = p_logits.shape
    rows = max(1, chunk_elements // V)
    out = torch.empty(N, dtype=torch.float32, device=p_logits.device)
    for lo in range(0, N, rows):
        p = p_logits[lo:lo + rows].float() / temperature
        q = q_logits[lo:lo + rows].to(p.device).float() / temperature
        for name, x in (("p_logits", p), ("q_logits", q)):
            bad = torch.isnan(x) | (x == float("inf"))
            if bool(bad.any()):
                r, v = (int(i) for i in bad.nonzero()[0])
                raise CorrectionInputError(f"full_vocab_kl: {name} row {lo + r} holds {float(x[r, v])} at vocabulary "
                                           f"id {v}")
            empty = ~(x > float("-inf")).any(dim=-1)
            if bool(empty.any()):
                r = int(empty.nonzero()[0])
                raise CorrectionInputError(f"full_vocab_kl: {name} row {lo + r} is -inf everywhere: no distribution "
                                           f"to compare (every token masked)")
        logp = torch.log_softmax(p, dim=-1)
        logq = torch.log_softmax(q, dim=-1)
        prob = logp.exp()
        terms = torch.where(prob > 0, prob * (logp - logq), torch.zeros((), dtype=prob.dtype, device=prob.device))
        out[lo:lo + rows] = terms.sum(dim=-1).clamp_min(0.0)
    return out
