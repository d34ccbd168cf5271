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
temperature, as the sampler does. :func:`truncation_mask` is the trainer's own truncated support with
transformers ``generate()`` semantics, for measuring how often it differs from the recorded one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .routes import RouteError, check_integer_tensor, describe

__all__ = [
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


def _check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise RouteError(f"temperature must be a number, got {type(temperature).__name__} {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise RouteError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def _check_logits(logits, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise RouteError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise RouteError(f"{name} must have shape [N, V] with V >= 1, got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise RouteError(f"{name} must be a floating tensor, got dtype {logits.dtype}")
    return logits


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


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


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


def _row_index(offsets: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each CSR entry, entries per row), both int64 on ``device``."""
    counts = offsets.to(device=device, dtype=torch.int64).diff()
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    return rows, counts


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


def kept_mask(offsets: torch.Tensor, ids: torch.Tensor, vocab_size: int, *, validate: bool = True) -> torch.Tensor:
    """The CSR kept sets as a dense ``[N, vocab_size]`` bool mask."""
    if validate:
        validate_kept_sets(offsets, ids, vocab_size)
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
    temperature = _check_temperature(temperature)
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
    scores = logits.to(_compute_dtype(logits))
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


def kept_logprob(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    offsets: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    validate: bool = True,
) -> torch.Tensor:
    """Log-prob ``[N]`` of each token under ``logits / T`` restricted to its recorded kept set.

    ``(logit / T)[token] - logsumexp_{j in kept}(logit / T)[j]``, float32 (float64 stays float64),
    differentiable w.r.t. ``logits``. Only ``[N, max kept]`` logits are gathered, never an [N, V] copy.
    A token outside its kept set is an error naming the row. ``validate`` checks the CSR first.
    """
    _check_logits(logits)
    temperature = _check_temperature(temperature)
    tokens = _check_tokens(tokens, logits)
    num_rows, vocab = logits.shape
    if validate:
        validate_kept_sets(offsets, ids, vocab, num_rows=num_rows)
    elif offsets.numel() != num_rows + 1:
        raise RouteError(f"kept sets have {offsets.numel() - 1} rows but logits {tuple(logits.shape)} has {num_rows}")
    dtype = _compute_dtype(logits)
    if num_rows == 0:
        return logits.new_zeros(0, dtype=dtype)
    device = logits.device
    offsets = offsets.to(device=device, dtype=torch.int64)
    counts = offsets.diff()
    width = int(counts.max())
    slot = torch.arange(width, device=device)
    present = slot < counts[:, None]  # [N, width]
    flat = torch.where(present, offsets[:-1, None] + slot, 0)
    index = ids.to(device=device, dtype=torch.int64)[flat]  # padding slots point at ids[0], then masked
    contains = ((index == tokens[:, None]) & present).any(dim=-1)
    if not bool(contains.all()):
        row = int((~contains).nonzero()[0, 0])
        raise RouteError(
            f"row {row}: token {int(tokens[row])} is not in its kept set ({int(counts[row])} ids)"
        )
    kept = logits.gather(1, index).to(dtype) / temperature
    kept = kept.masked_fill(~present, float("-inf"))
    chosen = logits.gather(1, tokens[:, None]).squeeze(1).to(dtype) / temperature
    return chosen - kept.logsumexp(dim=-1)


def full_logprob(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob ``[N]`` of each token under ``log_softmax(logits / T)`` over the whole vocabulary (fp32)."""
    _check_logits(logits)
    temperature = _check_temperature(temperature)
    tokens = _check_tokens(tokens, logits)
    scaled = logits.to(_compute_dtype(logits)) / temperature
    return F.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)


# ----------------------------------------------------------------------------------------- mismatch


def support_mismatch(offsets: torch.Tensor, ids: torch.Tensor, trainer_mask: torch.Tensor) -> torch.Tensor:
    """Per token ``[N]`` bool: does the recorded kept set differ from the trainer's ``[N, V]`` support?

    Equal sets have equal sizes and every recorded id inside the trainer's mask; no dense copy of the
    recorded sets is built.
    """
    if not isinstance(trainer_mask, torch.Tensor) or trainer_mask.dim() != 2:
        raise RouteError(f"trainer_mask must have shape [N, V], got {describe(trainer_mask)}")
    if trainer_mask.dtype != torch.bool:
        raise RouteError(f"trainer_mask must be a bool tensor, got dtype {trainer_mask.dtype}")
    num_rows, vocab = trainer_mask.shape
    validate_kept_sets(offsets, ids, vocab, num_rows=num_rows)
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
