"""Keep Sampling Mask: the token set the rollout sampler could draw from, recorded and replayed.

After temperature / top-k / top-p / min-p the sampler draws from a truncated support (the *kept
set*). Recording that set per generated token lets the trainer compute its log-prob over the same
support instead of the full vocabulary, which removes the truncation mismatch between the two engines.

Storage is CSR, one row per generated token:

* ``offsets`` int64 ``[N + 1]``: ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == len(ids)``;
* ``ids`` int32 ``[nnz]``: row ``i`` holds ``ids[offsets[i]:offsets[i + 1]]``, distinct token ids in
  ``[0, V)``, at least one per row. :func:`kept_sets_from_logits` writes them sorted ascending; readers
  do not rely on the order.

Log-probs are computed in float32 (float64 stays float64) after dividing the logits by the
temperature, as the sampler does. :func:`kept_logprob` is the one kept-set log-prob: ``log_softmax`` over
the whole vocabulary row with the entries outside the kept set at ``-inf``, the formula and row length the
rollout side records its log-probs with, so the two agree bitwise on equal logits (the vocab-parallel
:func:`~moealign.routing_replay.vocab_parallel.vocab_parallel_kept_logprob` is the same function on TP
shards). :func:`check_tokens_in_kept` is the one "each token lies in its kept set" check.
:func:`truncation_mask` is the trainer's own truncated support with transformers ``generate()``
semantics, for measuring how often it differs from the recorded one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._validate import check_float_matrix, compute_dtype
from .routes import RouteError, check_integer_tensor, describe

__all__ = [
    "KeptSets",
    "CHUNK_ELEMENTS",
    "check_tokens_in_kept",
    "full_logprob",
    "kept_logprob",
    "kept_mask",
    "kept_sets_from_logits",
    "support_mismatch",
    "support_mismatch_rate",
    "truncation_mask",
    "validate_kept_sets",
]


# ----------------------------------------------------------------------------------------- checks


def _check_vocab_size(vocab_size) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise RouteError(f"vocab_size must be an int, got {type(vocab_size).__name__} {vocab_size!r}")
    if vocab_size < 1:
        raise RouteError(f"vocab_size must be >= 1, got {vocab_size}")
    return vocab_size


def check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise RouteError(f"temperature must be a number, got {type(temperature).__name__} {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise RouteError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def _check_logits(logits, name: str = "logits") -> torch.Tensor:
    return check_float_matrix(logits, name, RouteError, shape="[N, V] with V >= 1")


def _check_no_nan(logits: torch.Tensor, name: str) -> None:
    nan = torch.isnan(logits)
    if bool(nan.any()):
        row, col = (int(i) for i in nan.nonzero()[0])
        raise RouteError(f"{name}[{row}, {col}] is NaN")


def _check_tokens(tokens, logits: torch.Tensor) -> torch.Tensor:
    check_integer_tensor(tokens, "tokens")
    if tokens.shape != (logits.shape[0],):
        raise RouteError(
            f"tokens must have shape ({logits.shape[0]},) to match logits {tuple(logits.shape)}, "
            f"got {tuple(tokens.shape)}"
        )
    vocab = logits.shape[1]
    bad = (tokens < 0) | (tokens >= vocab)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise RouteError(f"tokens[{row}] = {int(tokens[row])} is not a token id in [0, {vocab})")
    return tokens.to(device=logits.device, dtype=torch.int64)


def validate_kept_sets(
    offsets: torch.Tensor, ids: torch.Tensor, vocab_size: int, num_rows: int | None = None
) -> None:
    """Check CSR kept sets; raise :class:`RouteError` naming the first problem.

    Offsets: a 1-D integer tensor starting at 0, non-decreasing, ending at ``len(ids)``, with
    ``num_rows + 1`` entries when ``num_rows`` is given. Ids: a 1-D integer tensor of token ids in
    ``[0, vocab_size)``. Rows: non-empty, no id twice. Vectorised (one sort of ``row * V + id``).
    """
    vocab_size = _check_vocab_size(vocab_size)
    check_integer_tensor(offsets, "offsets")
    check_integer_tensor(ids, "ids")
    if offsets.dim() != 1 or offsets.numel() == 0:
        raise RouteError(f"offsets must be a 1-D tensor of N + 1 entries, got shape {tuple(offsets.shape)}")
    if ids.dim() != 1:
        raise RouteError(f"ids must be a 1-D tensor, got shape {tuple(ids.shape)}")
    rows = offsets.numel() - 1
    if num_rows is not None and rows != num_rows:
        raise RouteError(
            f"kept sets have {rows} rows (offsets has {offsets.numel()} entries) but {num_rows} were expected"
        )
    offsets = offsets.to(torch.int64)
    first = int(offsets[0])
    if first != 0:
        raise RouteError(f"offsets[0] must be 0, got {first}")
    counts = offsets.diff()
    decreasing = counts < 0
    if bool(decreasing.any()):
        i = int(decreasing.nonzero()[0, 0])
        raise RouteError(
            f"offsets decrease at row {i}: offsets[{i}] = {int(offsets[i])} > offsets[{i + 1}] = {int(offsets[i + 1])}"
        )
    last = int(offsets[-1])
    if last != ids.numel():
        raise RouteError(f"offsets[-1] = {last} but ids has {ids.numel()} entries")
    empty = counts == 0
    if bool(empty.any()):
        raise RouteError(f"kept set of row {int(empty.nonzero()[0, 0])} is empty")
    if ids.numel() == 0:
        return
    row_of = torch.repeat_interleave(torch.arange(rows, device=offsets.device), counts.to(offsets.device))
    ids64 = ids.to(device=offsets.device, dtype=torch.int64)
    bad = (ids64 < 0) | (ids64 >= vocab_size)
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        raise RouteError(f"ids[{j}] = {int(ids64[j])} (row {int(row_of[j])}) is not a token id in [0, {vocab_size})")
    keys = (row_of * vocab_size + ids64).sort().values
    repeated = keys[1:] == keys[:-1]
    if bool(repeated.any()):
        key = int(keys[1:][repeated][0])
        raise RouteError(f"kept set of row {key // vocab_size} holds token {key % vocab_size} more than once")


@dataclass(frozen=True)
class KeptSets:
    """CSR kept sets ``(offsets, ids)`` over a vocabulary of ``vocab_size``, checked once: the functions of this
    module that take one (:func:`kept_mask`, :func:`kept_logprob`, :func:`support_mismatch`) trust it and check
    nothing more (no host read per call).

    Build one with :meth:`checked` (runs :func:`validate_kept_sets`, and :func:`check_tokens_in_kept` when
    ``tokens`` are given), or with :meth:`trusted` where the sets were checked when their data entered (a record's
    samples are, when the record is built or loaded: ``moealign.record.layouts.kept_sets_of``). The rows belong to
    the tokens they were checked with: each token lies in its own row's set.
    """

    offsets: torch.Tensor
    ids: torch.Tensor
    vocab_size: int

    @classmethod
    def checked(cls, offsets: torch.Tensor, ids: torch.Tensor, vocab_size: int, *,
                tokens: torch.Tensor | None = None) -> "KeptSets":
        validate_kept_sets(offsets, ids, vocab_size, num_rows=None if tokens is None else tokens.numel())
        if tokens is not None:
            check_tokens_in_kept(offsets, ids, tokens)
        return cls(offsets, ids, int(vocab_size))

    @classmethod
    def trusted(cls, offsets: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> "KeptSets":
        """Kept sets already checked where they entered (the caller's word): nothing is checked."""
        return cls(offsets, ids, int(vocab_size))

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    def to(self, device) -> "KeptSets":
        return KeptSets(self.offsets.to(device), self.ids.to(device), self.vocab_size)


def _kept(offsets, ids, vocab_size: int, num_rows: int | None, validate: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                         bool]:
    """``(offsets, ids, trusted)`` of either form: a :class:`KeptSets` (its vocabulary and row count must match;
    nothing else is checked) or raw CSR tensors (validated unless ``validate`` is False)."""
    if isinstance(offsets, KeptSets):
        kept = offsets
        if ids is not None:
            raise RouteError("pass either a KeptSets or (offsets, ids), not both")
        if kept.vocab_size != vocab_size or (num_rows is not None and kept.num_rows != num_rows):
            raise RouteError(f"kept sets of {kept.num_rows} rows over a vocabulary of {kept.vocab_size} do not fit "
                             f"{num_rows} rows over {vocab_size}")
        return kept.offsets, kept.ids, True
    if validate:
        validate_kept_sets(offsets, ids, vocab_size, num_rows=num_rows)
    return offsets, ids, False


def _row_index(offsets: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each CSR entry, entries per row), both int64 on ``device``."""
    counts = offsets.to(device=device, dtype=torch.int64).diff()
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    return rows, counts


def check_tokens_in_kept(offsets: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor, *,
                         vocab_size: int | None = None) -> None:
    """Raise :class:`RouteError` naming the first row whose token is not in its own kept set.

    ``tokens`` ``[N]`` (any integer dtype), one per CSR row of ``(offsets, ids)``. A token outside its
    kept set has log-prob -inf under the Keep Sampling Mask: the record and the logits disagree. With
    ``vocab_size`` the CSR is validated first (:func:`validate_kept_sets`); without it the caller has
    done so. The error carries ``.row`` and ``.token`` (ints) for callers that word it their own way.
    Vectorised over the ``nnz`` entries (no ``[N, V]`` mask), one host sync.
    """
    check_integer_tensor(tokens, "tokens")
    check_integer_tensor(offsets, "offsets")
    check_integer_tensor(ids, "ids")
    if tokens.dim() != 1 or offsets.dim() != 1 or offsets.numel() != tokens.numel() + 1:
        raise RouteError(f"tokens {tuple(tokens.shape)} and kept-set offsets {tuple(offsets.shape)} disagree: "
                         f"offsets needs one entry more than there are tokens")
    if vocab_size is not None:
        validate_kept_sets(offsets, ids, vocab_size, num_rows=tokens.numel())
    device = ids.device
    rows, counts = _row_index(offsets, device)
    hit = ids.to(torch.int64) == tokens.to(device=device, dtype=torch.int64)[rows]
    found = torch.zeros(counts.numel(), dtype=torch.int64, device=device).index_add_(0, rows, hit.to(torch.int64))
    missing = found == 0
    if bool(missing.any()):
        row = int(missing.nonzero()[0, 0])
        token = int(tokens[row])
        error = RouteError(f"row {row}: token {token} is not in its kept set ({int(counts[row])} ids); "
                           f"its log-prob would be -inf")
        error.row, error.token = row, token
        raise error


# ----------------------------------------------------------------------------------------- kept sets


def kept_sets_from_logits(processed_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR kept sets from the sampler's processed logits ``[N, V]`` (filtered entries are -inf).

    Returns ``(offsets int64 [N + 1], ids int32 [nnz])``, ids ascending per row. NaN, +inf and rows
    with no finite entry are errors.
    """
    _check_logits(processed_logits, "processed_logits")
    _check_no_nan(processed_logits, "processed_logits")
    pos_inf = processed_logits == float("inf")
    if bool(pos_inf.any()):
        row, col = (int(i) for i in pos_inf.nonzero()[0])
        raise RouteError(f"processed_logits[{row}, {col}] is +inf (filtered entries must be -inf)")
    kept = processed_logits > float("-inf")
    counts = kept.sum(dim=-1)
    empty = counts == 0
    if bool(empty.any()):
        raise RouteError(f"processed_logits row {int(empty.nonzero()[0, 0])} keeps no token (all -inf)")
    offsets = torch.zeros(kept.shape[0] + 1, dtype=torch.int64, device=kept.device)
    offsets[1:] = counts.cumsum(dim=0)
    ids = kept.nonzero()[:, 1].to(torch.int32)  # row-major: ascending within each row
    return offsets, ids


def kept_mask(offsets: torch.Tensor | KeptSets, ids: torch.Tensor | None = None, vocab_size: int | None = None, *,
              validate: bool = True) -> torch.Tensor:
    """The CSR kept sets as a dense ``[N, vocab_size]`` bool mask (``kept_mask(kept_sets)`` for a :class:`KeptSets`)."""
    if isinstance(offsets, KeptSets):
        vocab_size = offsets.vocab_size if vocab_size is None else vocab_size
    offsets, ids, _ = _kept(offsets, ids, vocab_size, None, validate)
    rows, counts = _row_index(offsets, ids.device)
    mask = torch.zeros(counts.numel(), vocab_size, dtype=torch.bool, device=ids.device)
    mask[rows, ids.to(torch.int64)] = True
    return mask


# ----------------------------------------------------------------------------------------- truncation


def truncation_mask(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """The support ``[N, V]`` bool that transformers' ``generate()`` would sample from.

    Same order and rules as its warpers (with ``min_tokens_to_keep=1``), computed in float32 (float64
    stays float64): temperature; top-k keeps logits >= the k-th largest (ties kept); top-p sorts
    ascending, drops tokens whose cumulative prob is <= ``1 - top_p`` and always keeps the best; min-p
    drops tokens whose prob (over what is left) is < ``min_p`` times the largest. ``top_k`` 0 / None,
    ``top_p`` 1 / None and ``min_p`` 0 / None are off. Entries already -inf in ``logits`` are not kept.
    """
    _check_logits(logits)
    temperature = check_temperature(temperature)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise RouteError(f"top_k must be an int >= 0 (0 or None: off), got {top_k!r}")
    for name, value in (("top_p", top_p), ("min_p", min_p)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RouteError(f"{name} must be a number or None, got {type(value).__name__} {value!r}")
    if top_p is not None and not (0 < top_p <= 1):
        raise RouteError(f"top_p must be in (0, 1] (1 or None: off), got {top_p!r}")
    if min_p is not None and not (0 <= min_p <= 1):
        raise RouteError(f"min_p must be in [0, 1] (0 or None: off), got {min_p!r}")
    _check_no_nan(logits, "logits")

    neg_inf = float("-inf")
    scores = logits.to(compute_dtype(logits))
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, neg_inf)
    if top_p is not None and top_p < 1.0:
        ascending, order = scores.sort(dim=-1, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, neg_inf)
    if min_p:
        probs = scores.softmax(dim=-1)
        drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
        drop.scatter_(-1, probs.topk(1, dim=-1).indices, False)
        scores = scores.masked_fill(drop, neg_inf)
    return scores > neg_inf


# ----------------------------------------------------------------------------------------- log-probs

#: Row chunks of the dense formula hold at most this many ``[rows, V]`` entries (256 MiB in float32), so the
#: kept-set mask and the masked copy stay bounded for any batch; smaller inputs are one chunk.
CHUNK_ELEMENTS = 1 << 26


def row_chunks(num_rows: int, width: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    return [(r, min(r + step, num_rows)) for r in range(0, num_rows, step)] or [(0, 0)]


class KeptMasks:
    """Dense ``[rows, width]`` bool masks of CSR kept sets, one row chunk at a time, over the vocabulary slice
    ``[vocab_start, vocab_start + width)`` (the whole vocabulary: ``vocab_start=0, width=V``)."""

    def __init__(self, offsets: torch.Tensor, ids: torch.Tensor, device: torch.device, width: int,
                 vocab_start: int = 0, whole: bool = True):
        self.bounds = offsets.detach().to(device="cpu", dtype=torch.int64)   # chunk bounds as host ints
        self.rows, _ = _row_index(offsets, device)
        self.cols = ids.to(device=device, dtype=torch.int64) - vocab_start
        self.width, self.whole, self.device = width, whole, device

    def __call__(self, r0: int, r1: int) -> torch.Tensor:
        lo, hi = int(self.bounds[r0]), int(self.bounds[r1])
        rows, cols = self.rows[lo:hi] - r0, self.cols[lo:hi]
        if not self.whole:                       # a vocabulary slice: keep the ids that fall in it
            here = (cols >= 0) & (cols < self.width)
            rows, cols = rows[here], cols[here]
        mask = torch.zeros(r1 - r0, self.width, dtype=torch.bool, device=self.device)
        mask[rows, cols] = True
        return mask


def scaled_logits(logits: torch.Tensor, r0: int, r1: int, temperature: float, masks: KeptMasks | None) -> torch.Tensor:
    """Rows ``[r0, r1)`` of ``logits / T`` in the compute dtype, ``-inf`` outside the kept sets."""
    scores = logits[r0:r1].to(compute_dtype(logits)) / temperature
    return scores if masks is None else scores.masked_fill(~masks(r0, r1), float("-inf"))


def dense_kept_logprob(logits: torch.Tensor, tokens: torch.Tensor, kept, temperature: float) -> torch.Tensor:
    """THE kept-set log-prob: ``log_softmax`` over the whole row of ``logits / T`` with -inf outside the kept set.

    ``kept``: checked CSR ``(offsets, ids)``, or None for the full vocabulary. ``tokens`` int64 on the logits'
    device. Row chunks (:data:`CHUNK_ELEMENTS`) give the same bits as one call: every op is per row.
    """
    num_rows, vocab = logits.shape
    masks = None if kept is None else KeptMasks(kept[0], kept[1], logits.device, vocab)
    out = [torch.log_softmax(scaled_logits(logits, r0, r1, temperature, masks), dim=-1)
           .gather(1, tokens[r0:r1, None]).squeeze(1) for r0, r1 in row_chunks(num_rows, vocab)]
    return out[0] if len(out) == 1 else torch.cat(out)


def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the row holds NaN or +-inf (row chunks, no ``[N, V]`` temporary)."""
    return torch.cat([~torch.isfinite(x[r0:r1]).all(dim=-1) for r0, r1 in row_chunks(x.shape[0], x.shape[1])])


def nonfinite_message(x: torch.Tensor, row: int, vocab_start: int = 0, shard: str | None = None) -> str:
    """Names the first non-finite entry of ``x[row]`` by its vocabulary id (and its place in the shard, with
    ``shard`` the prefix naming the rank: ``""`` or ``"tensor-parallel rank 1: "``)."""
    col = int((~torch.isfinite(x[row])).nonzero()[0, 0])
    where = "" if shard is None else f" ({shard}logits_shard[{row}, {col}])"
    return f"logits row {row} holds {float(x[row, col])} at vocabulary id {vocab_start + col}{where}"


def _check_finite(logits: torch.Tensor) -> None:
    bad = nonfinite_rows(logits)
    if bool(bad.any()):
        raise RouteError(nonfinite_message(logits, int(bad.nonzero()[0, 0])))


def checked_logprob(logp: torch.Tensor, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logp`` unless a row came out NaN: finite logits whose ``logits / temperature`` overflows the compute dtype
    (a temperature far below 1); the error names the row, its largest logit and the temperature. One check of
    the ``[N]`` result, no pass over the logits."""
    nan = torch.isnan(logp.detach())
    if logp.numel() and bool(nan.any()):
        row = int(nan.nonzero()[0, 0])
        top = float(logits[row].detach().abs().max())
        raise RouteError(f"logits row {row} / temperature {temperature!r} overflows {compute_dtype(logits)} (largest "
                         f"|logit| {top:.6g}): the temperature is too small for these logits")
    return logp


def kept_logprob(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    offsets: torch.Tensor | KeptSets,
    ids: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    validate: bool = True,
) -> torch.Tensor:
    """Log-prob ``[N]`` of each token under ``logits / T`` restricted to its recorded kept set (``offsets`` may be a
    :class:`KeptSets`: trusted, so neither the CSR nor the tokens' membership is checked again).

    Exactly ``log_softmax((logits.float() / T).masked_fill(~kept, -inf), dim=-1)[token]``, with ``kept`` the
    ``[N, V]`` mask of the CSR kept sets ``(offsets, ids)``: the reduction runs over the whole vocabulary
    row (length V whatever the kept set's size), the formula and row length the rollout side uses for its
    recorded log-probs (``patches.hf.rollout``). So the two agree bitwise on equal logits, and a row's value
    does not depend on its batch mates (a fixed tree under ``batch_invariant_mode``). float32 (float64
    logits stay float64), differentiable w.r.t. ``logits`` (the gradient is 0 outside the kept set).

    Memory: the mask and the masked copy are built in row chunks of at most :data:`CHUNK_ELEMENTS`
    entries; with autograd ``log_softmax`` keeps its ``[N, V]`` output, as a full-vocabulary log-prob does.

    Errors (:class:`RouteError`): a token outside its kept set (naming the row), NaN or +-inf logits
    (naming row and vocabulary id; so a kept set whose logits are all -inf is refused too), a temperature so
    small that ``logits / T`` overflows (naming the row), shapes that disagree, bad CSR (``validate`` checks it
    first; without it only the row count is checked). On tensor-parallel vocabulary shards use
    :func:`~moealign.routing_replay.vocab_parallel.vocab_parallel_kept_logprob` (bitwise this at TP = 1).
    """
    _check_logits(logits)
    temperature = check_temperature(temperature)
    tokens = _check_tokens(tokens, logits)
    num_rows, vocab = logits.shape
    offsets, ids, trusted = _kept(offsets, ids, vocab, num_rows, validate)
    if offsets.numel() != num_rows + 1:
        raise RouteError(f"kept sets have {offsets.numel() - 1} rows but logits {tuple(logits.shape)} has {num_rows}")
    if not trusted:
        check_tokens_in_kept(offsets, ids, tokens)
    _check_finite(logits)
    return checked_logprob(dense_kept_logprob(logits, tokens, (offsets, ids), temperature), logits, temperature)


def full_logprob(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob ``[N]`` of each token under ``log_softmax(logits / T)`` over the whole vocabulary (fp32).

    :func:`kept_logprob` with every token kept (no mask); NaN or +-inf logits are an error.
    """
    _check_logits(logits)
    temperature = check_temperature(temperature)
    tokens = _check_tokens(tokens, logits)
    _check_finite(logits)
    return checked_logprob(dense_kept_logprob(logits, tokens, None, temperature), logits, temperature)


# ----------------------------------------------------------------------------------------- mismatch


def support_mismatch(offsets: torch.Tensor | KeptSets, ids: torch.Tensor | None = None,
                     trainer_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per token ``[N]`` bool: does the recorded kept set differ from the trainer's ``[N, V]`` support?

    Equal sets have equal sizes and every recorded id inside the trainer's mask; no dense copy of the
    recorded sets is built. ``support_mismatch(kept_sets, trainer_mask=mask)`` with a :class:`KeptSets`
    (trusted).
    """
    if not isinstance(trainer_mask, torch.Tensor) or trainer_mask.dim() != 2:
        raise RouteError(f"trainer_mask must have shape [N, V], got {describe(trainer_mask)}")
    if trainer_mask.dtype != torch.bool:
        raise RouteError(f"trainer_mask must be a bool tensor, got dtype {trainer_mask.dtype}")
    num_rows, vocab = trainer_mask.shape
    offsets, ids, _ = _kept(offsets, ids, vocab, num_rows, True)
    device = trainer_mask.device
    rows, counts = _row_index(offsets, device)
    inside = trainer_mask[rows, ids.to(device=device, dtype=torch.int64)]
    inside_per_row = torch.zeros(num_rows, dtype=torch.int64, device=device).index_add_(0, rows, inside.to(torch.int64))
    return (inside_per_row != counts) | (trainer_mask.sum(dim=-1) != counts)


def support_mismatch_rate(offsets: torch.Tensor, ids: torch.Tensor, trainer_mask: torch.Tensor) -> float:
    """Fraction of tokens whose recorded kept set differs from the trainer's support."""
    mismatch = support_mismatch(offsets, ids, trainer_mask)
    if mismatch.numel() == 0:
        raise RouteError("no token to compare (the kept sets have 0 rows)")
    return float(mismatch.double().mean())
