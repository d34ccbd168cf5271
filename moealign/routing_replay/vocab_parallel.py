"""Kept-set (and full) log-prob of the selected token on vocab-parallel logits, shard by shard.

Under tensor parallelism (TP) Megatron's output layer leaves each rank with a slice of the logits,
``[N, V/TP]`` covering vocabulary ids ``[vocab_start, vocab_start + V/TP)`` with
``vocab_start = tp_rank * V/TP``. Gathering the full ``[N, V]`` logits to apply the rollout's
Keep Sampling Mask would cost TP times the memory; instead each rank masks its own slice and the
softmax normaliser is reduced over the TP group, as Megatron's ``vocab_parallel_cross_entropy`` does:

1. each rank divides its slice by the temperature (the rollout computed its kept set and log-prob on
   ``logits / T``) and sets the entries outside the recorded kept sets to ``-inf``: the formula of
   :func:`~moealign.routing_replay.sampling_mask.kept_logprob`, on ``[N, V/TP]`` in row chunks;
2. all-reduce MAX of the per-row maximum over the kept entries (a shift for numerical safety; no
   gradient flows through it, the result does not depend on it);
3. all-reduce SUM of ``(logit[token] - max)`` (non-zero only on the rank owning the token) and of
   ``sum(exp(kept - max))`` (both in one collective);
4. ``log p = picked - log(sum_exp)``: the same number on every rank.

Gradients follow Megatron's TP convention: the loss is replicated on every TP rank, so the SUM
all-reduce passes the incoming gradient through unchanged (like
``reduce_from_tensor_model_parallel_region``), and the gradient w.r.t. a rank's shard is that rank's
part of ``(onehot(token) - softmax over the kept set) / T``.

Bad input raises :class:`~moealign.routing_replay.routes.RouteError` naming the problem. Under a group,
every rank raises, never only one: each rank's local checks (its logits shard, its ``vocab_start``)
and the non-finite-logits check travel in the MAX all-reduce as a flag, so a rank with a bad shard
cannot leave the others waiting forever in a collective.

Usage with Megatron-core (a GPTModel built with ``parallel_output=True``, the default, returns
``[b, s, V/TP]`` logits per rank when no labels are given)::

    from megatron.core import parallel_state as ps
    from moealign.routing_replay.vocab_parallel import vocab_parallel_kept_logprob

    logits = model(input_ids, position_ids, attention_mask)          # [b, s, V/TP]
    local = logits.reshape(-1, logits.shape[-1])[rows]                 # rows that produced the tokens
    start = ps.get_tensor_model_parallel_rank() * local.shape[-1]
    logp = vocab_parallel_kept_logprob(local, tokens, (offsets, ids), start,
                                       group=ps.get_tensor_model_parallel_group(), temperature=T)

``group=None`` (or a group of one) means no tensor parallelism: the shard is the whole vocabulary
(``vocab_start`` 0), ``torch.distributed`` need not be initialised, and the result is
:func:`~moealign.routing_replay.sampling_mask.kept_logprob`'s, bitwise (the same code runs). Pure torch and ``torch.distributed``; no engine import.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._validate import check_float_matrix, compute_dtype
from .routes import RouteError, check_integer_tensor, describe
from .sampling_mask import (
    check_temperature,
    checked_logprob,
    dense_kept_logprob,
    KeptMasks,
    nonfinite_message,
    nonfinite_rows,
    row_chunks,
    scaled_logits,
    check_tokens_in_kept,
)

__all__ = ["vocab_parallel_full_logprob", "vocab_parallel_kept_logprob"]


# ----------------------------------------------------------------------------------------- collectives


class _AllReduceSum(torch.autograd.Function):
    """SUM all-reduce whose backward is the identity (the loss is replicated over the TP group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GroupReduce:
    """MAX / SUM over a process group (or nothing, for ``group=None`` or a group of one)."""

    def __init__(self, group):
        if group is None:
            self.group, self.size, self.rank = None, 1, 0
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RouteError("a process group was given but torch.distributed is not initialised")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise RouteError("this process is not a member of the given process group")

    def max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else _AllReduceSum.apply(x, self.group)


# ----------------------------------------------------------------------------------------- input checks


def _check_shared_inputs(tokens, kept) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Checks that need no vocabulary size (tokens, CSR structure); same outcome on every rank."""
    check_integer_tensor(tokens, "tokens")
    if tokens.dim() != 1:
        raise RouteError(f"tokens must be a 1-D tensor [N], got shape {tuple(tokens.shape)}")
    if kept is None:
        return tokens, None
    if not (isinstance(kept, (tuple, list)) and len(kept) == 2):
        raise RouteError(f"kept must be None (full support) or a pair (offsets, ids), got {describe(kept)}")
    offsets, ids = kept
    check_integer_tensor(offsets, "offsets")
    check_integer_tensor(ids, "ids")
    if offsets.dim() != 1 or offsets.numel() != tokens.numel() + 1:
        raise RouteError(
            f"kept sets have {offsets.numel() - 1 if offsets.dim() == 1 else describe(offsets)} rows "
            f"(offsets shape {tuple(offsets.shape)}) but there are {tokens.numel()} tokens; offsets needs N + 1 entries"
        )
    return tokens, (offsets, ids)


def _check_shard(logits_shard, num_rows: int, vocab_start, expected_start: int | None) -> None:
    check_float_matrix(logits_shard, "logits_shard", RouteError, shape="[N, V/TP] with V/TP >= 1")
    if logits_shard.shape[0] != num_rows:
        raise RouteError(f"logits_shard has {logits_shard.shape[0]} rows but tokens has {num_rows}")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int):
        raise RouteError(f"vocab_start must be an int, got {type(vocab_start).__name__} {vocab_start!r}")
    if expected_start is not None and vocab_start != expected_start:
        raise RouteError(
            f"vocab_start = {vocab_start} but this rank's slice starts at {expected_start} "
            f"(tp_rank * V/TP with V/TP = {logits_shard.shape[1]})"
        )


def _check_kept_ids(tokens: torch.Tensor, kept, vocab_size: int) -> None:
    """Token ids in range; CSR valid; each token inside its own kept set (else its log-prob is -inf)."""
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise RouteError(f"tokens[{row}] = {int(tokens[row])} is not a token id in [0, {vocab_size})")
    if kept is not None:
        check_tokens_in_kept(kept[0], kept[1], tokens, vocab_size=vocab_size)


# ----------------------------------------------------------------------------------------- public API


def vocab_parallel_kept_logprob(
    logits_shard: torch.Tensor,
    tokens: torch.Tensor,
    kept: tuple[torch.Tensor, torch.Tensor] | None,
    vocab_start: int,
    *,
    group=None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-prob ``[N]`` of each selected token under ``logits / T`` restricted to its kept set, TP-sharded.

    ``logits_shard``: this rank's ``[N, V/TP]`` slice, vocabulary ids ``[vocab_start, vocab_start +
    V/TP)``; ``vocab_start`` must be ``tp_rank * V/TP`` (0 for ``group=None``). ``tokens``: ``[N]``
    global ids in ``[0, V)`` with ``V = TP * V/TP``. ``kept``: the recorded CSR kept sets
    ``(offsets int64 [N + 1], ids int32 [nnz])`` over the global vocabulary, or None for the full
    support. ``group``: the tensor-parallel process group (None: no TP, nothing is communicated).

    Returns float32 (float64 for float64 logits), the same values on every rank, differentiable
    w.r.t. ``logits_shard``. The formula of :func:`~moealign.routing_replay.sampling_mask.kept_logprob`
    (``log_softmax`` over the whole row, -inf outside the kept set): with one rank (``group=None`` or a
    group of one) it IS that function's arithmetic, bitwise; with TP > 1 the row's max and sum-exp are
    reduced over the ranks, equal up to floating-point rounding. Two collectives: a MAX all-reduce of
    ``[N + 1]`` (row max and error flag) and a SUM all-reduce of ``[2, N]``.
    """
    temperature = check_temperature(temperature)
    reduce = _GroupReduce(group)
    tokens, kept = _check_shared_inputs(tokens, kept)
    num_rows = tokens.numel()
    expected_start = reduce.rank * logits_shard.shape[1] if (
        isinstance(logits_shard, torch.Tensor) and logits_shard.dim() == 2) else None

    if reduce.size == 1:
        _check_shard(logits_shard, num_rows, vocab_start, expected_start)
        _check_kept_ids(tokens, kept, logits_shard.shape[1])
        bad = nonfinite_rows(logits_shard)
        if bool(bad.any()):
            raise RouteError(nonfinite_message(logits_shard, int(bad.nonzero()[0, 0]), 0, ""))
        tokens = tokens.to(device=logits_shard.device, dtype=torch.int64)
        return checked_logprob(dense_kept_logprob(logits_shard, tokens, kept, temperature), logits_shard, temperature)

    # Every check that could fail on one rank only is caught here and raised after the MAX
    # all-reduce, which carries an error flag: no rank is left waiting in a collective.
    error, local_max, nonfinite, masks = None, None, None, None
    try:
        _check_shard(logits_shard, num_rows, vocab_start, expected_start)
        width = logits_shard.shape[1]
        _check_kept_ids(tokens, kept, width * reduce.size)
        if kept is not None:
            masks = KeptMasks(kept[0], kept[1], logits_shard.device, width, vocab_start, whole=False)
        nonfinite = nonfinite_rows(logits_shard)
        with torch.no_grad():      # the shift: -inf where this slice keeps nothing of the row
            local_max = torch.cat([scaled_logits(logits_shard, r0, r1, temperature, masks).amax(dim=-1)
                                   for r0, r1 in row_chunks(num_rows, width)])
        local_max = torch.where(nonfinite, float("inf"), local_max)
    except RouteError as exc:
        error = exc
    if local_max is not None:
        dtype, device = local_max.dtype, local_max.device
    else:
        dtype = compute_dtype(logits_shard) if isinstance(logits_shard, torch.Tensor) else torch.float32
        device = logits_shard.device if isinstance(logits_shard, torch.Tensor) else torch.device("cpu")
        local_max = torch.full((num_rows,), float("-inf"), dtype=dtype, device=device)
    flag = torch.tensor([0.0 if error is None else reduce.rank + 1.0], dtype=dtype, device=device)
    reduced = reduce.max(torch.cat([local_max, flag]))
    row_max, failed = reduced[:-1], int(reduced[-1])
    if failed:
        if error is not None:
            raise RouteError(f"tensor-parallel rank {reduce.rank}: {error}") from error
        raise RouteError(f"tensor-parallel rank {failed - 1} rejected its input (see its error); "
                         f"this rank (rank {reduce.rank}) stops too")
    bad = torch.isinf(row_max) & (row_max > 0)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        if bool(nonfinite[row]):
            raise RouteError(nonfinite_message(logits_shard, row, vocab_start,
                                                f"tensor-parallel rank {reduce.rank}: "))
        raise RouteError(f"logits row {row} holds NaN or Inf on another tensor-parallel rank's vocabulary slice")

    # log p = (logit[token] / T - max) - log(sum over the kept set of exp(logit / T - max)), summed over ranks
    sum_exp = torch.cat([(scaled_logits(logits_shard, r0, r1, temperature, masks) - row_max[r0:r1, None]).exp().sum(dim=-1)
                         for r0, r1 in row_chunks(num_rows, width)])
    local_token = tokens.to(device=device, dtype=torch.int64) - vocab_start
    owns = (local_token >= 0) & (local_token < width)
    chosen = logits_shard.gather(1, torch.where(owns, local_token, 0)[:, None]).squeeze(1).to(dtype) / temperature
    picked = torch.where(owns, chosen - row_max, torch.zeros((), dtype=dtype, device=device))
    picked, sum_exp = reduce.sum(torch.stack([picked, sum_exp])).unbind(0)
    # a NaN row (logits / T overflowed) is NaN on every rank after the SUM: each rank raises alike
    return checked_logprob(picked - sum_exp.log(), logits_shard, temperature)


def vocab_parallel_full_logprob(
    logits_shard: torch.Tensor,
    tokens: torch.Tensor,
    vocab_start: int,
    *,
    group=None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-prob ``[N]`` of each token under ``log_softmax(logits / T)`` over the whole (sharded) vocabulary."""
    return vocab_parallel_kept_logprob(logits_shard, tokens, None, vocab_start, group=group,
                                       temperature=temperature)
