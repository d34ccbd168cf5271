"""Routing replay and sampling-mask replay (pure torch, any device, no engine imports).

Conventions:

* **Route rows.** Route row ``i`` is the decision a router took when token ``i`` was the input (for a
  generated token: the step that consumed it, not the step that produced it). A route table is
  ``[tokens, layers, k]``: for each token and MoE layer the ``k`` distinct expert ids chosen. Slot order
  matters for gate weights (replayed slot by slot) and not for the expert set (flip metrics ignore
  it). Tables are stored as uint8 (<= 256 experts) or int16 (<= 32767), see :func:`route_dtype`, and
  widened with :func:`expand_routes`.
* **Replay.** :func:`replay_gate_weights` computes the family's gate weights (:class:`RouterScoring`)
  at the forced ids, differentiable w.r.t. the router logits; at the router's own choice it is
  bitwise equal to :func:`select_topk`. :func:`replay_recorded_gate_weights` instead replays the
  rollout engine's recorded weights as constants. :func:`load_balancing_loss` counts expert load from
  the replayed ids.
* **Kept sets (CSR).** The sampler's support per generated token is stored as ``offsets`` int64
  ``[N + 1]`` and ``ids`` int32 ``[nnz]``; row ``i`` is ``ids[offsets[i]:offsets[i + 1]]``.
  :func:`kept_logprob` is the log-prob over that support (``log_softmax`` over the whole vocabulary row,
  -inf outside the kept set: the rollout side's formula, bitwise); :func:`check_tokens_in_kept` the
  check that each token lies in its kept set; :func:`truncation_mask` the trainer's own support with
  transformers ``generate()`` semantics; :func:`support_mismatch` compares the two.
  :func:`vocab_parallel_kept_logprob` computes it on tensor-parallel vocabulary shards (each rank
  masks its own slice; max and sum-exp reduced over the TP group; bitwise :func:`kept_logprob` at TP 1).

Every bad input raises :class:`RouteError` (a ``ValueError``) naming the tensor, row and value.
"""

from .flips import RouteFlipMetrics, route_flip_metrics
from .gates import (
    SCORES,
    RouterScoring,
    load_balancing_loss,
    replay_gate_weights,
    replay_recorded_gate_weights,
    select_topk,
)
from .routes import (
    RouteError,
    compact_routes,
    expand_routes,
    route_dtype,
    validate_routes,
)
from .sampling_mask import (
    check_tokens_in_kept,
    full_logprob,
    kept_logprob,
    kept_mask,
    kept_sets_from_logits,
    support_mismatch,
    support_mismatch_rate,
    truncation_mask,
    validate_kept_sets,
)
from .verify import LayerVerifyReport, ReplayVerifier, VerifyReport, expected_ids, expected_map
from .vocab_parallel import vocab_parallel_full_logprob, vocab_parallel_kept_logprob

__all__ = [
    "SCORES",
    "LayerVerifyReport",
    "ReplayVerifier",
    "RouteError",
    "RouteFlipMetrics",
    "RouterScoring",
    "check_tokens_in_kept",
    "compact_routes",
    "expand_routes",
    "full_logprob",
    "kept_logprob",
    "kept_mask",
    "kept_sets_from_logits",
    "load_balancing_loss",
    "replay_gate_weights",
    "replay_recorded_gate_weights",
    "route_dtype",
    "route_flip_metrics",
    "select_topk",
    "support_mismatch",
    "support_mismatch_rate",
    "truncation_mask",
    "validate_kept_sets",
    "VerifyReport",
    "expected_ids",
    "expected_map",
    "vocab_parallel_full_logprob",
    "vocab_parallel_kept_logprob",
    "validate_routes",
]

