"""Keep Sampling Mask on Megatron's vocab-parallel logits (each TP rank masks its own vocabulary slice)."""

from __future__ import annotations

import torch

from .version import megatron_version

# --------------------------------------------------------------------------------------------------
# Keep Sampling Mask on vocab-parallel logits
# --------------------------------------------------------------------------------------------------


def kept_logprob(logits_shard: torch.Tensor, tokens: torch.Tensor, kept, *, temperature: float = 1.0,
                 tp_group=None) -> torch.Tensor:
    """Selected-token log-prob under the recorded kept sets, on this TP rank's vocab-parallel logits.

    ``logits_shard`` ``[N, V/TP]`` (a GPTModel built with ``parallel_output=True`` returns them),
    ``tokens`` ``[N]``, ``kept`` the CSR ``(offsets, ids)`` of the rows (``None``: full vocabulary). Each rank
    masks its own vocabulary slice ``[rank*V/TP, (rank+1)*V/TP)``; max and sum-exp are all-reduced over the
    tensor-parallel group (``parallel_state``'s unless given). Differentiable; equal on every TP rank.
    :func:`moealign.routing_replay.vocab_parallel.vocab_parallel_kept_logprob` does the work: at TP = 1 the
    result is :func:`moealign.routing_replay.kept_logprob`'s, bitwise.
    """
    megatron_version()
    from megatron.core import parallel_state as ps

    from ...routing_replay.vocab_parallel import vocab_parallel_kept_logprob

    if tp_group is None and ps.model_parallel_is_initialized():
        tp_group = ps.get_tensor_model_parallel_group()
    size = tp_group.size() if tp_group is not None else 1
    rank = tp_group.rank() if tp_group is not None else 0
    group = tp_group if size > 1 else None
    start = rank * logits_shard.shape[-1]
    return vocab_parallel_kept_logprob(logits_shard, tokens, kept, start, group=group, temperature=temperature)
