"""Replay math: gate weights for forced expert ids, the native top-k they replace, and the aux loss.

Routing replay runs the trainer's router as usual but sends each token to the experts the rollout
engine chose (the recorded ids) instead of its own top-k. The router still produces the gate weights,
computed exactly as the model family computes them but gathered at the forced ids, so the router
keeps its gradient. :func:`select_topk` is the family's native decision; :func:`replay_gate_weights`
the same arithmetic at given ids. The two share every op, so at ``ids == select_topk(...)[1]`` the
weights are bitwise equal.

Scoring families (:class:`RouterScoring`), on router logits ``[tokens, E]``:

* ``"softmax"`` (Qwen2/3-MoE, Mixtral and OLMoE in transformers, Megatron ``moe_router_pre_softmax``):
  ``probs = softmax(logits)`` over all E experts, ``topk(probs, k)``, weights = the chosen probs,
  optionally divided by their sum (``renormalize``, no epsilon, as transformers' ``norm_topk_prob``).
* ``"softmax_topk"`` (Mixtral in vLLM, Megatron without pre-softmax): ``topk(logits, k)``, weights =
  ``softmax`` over the k gathered logits (they already sum to 1; ``renormalize`` divides once more).
* ``"sigmoid"`` (DeepSeek-V3): ``scores = sigmoid(logits)``; selection on ``scores + expert_bias``;
  weights = the chosen *unbiased* scores, optionally divided by ``sum + 1e-20`` (as DeepSeek-V3).

In every family ``expert_bias`` (DeepSeek's ``e_score_correction_bias``) is added to the selection
score only (probs, logits or sigmoid scores), never to the weights; ``scaling_factor`` multiplies the
final weights (DeepSeek's ``routed_scaling_factor``). Group-limited selection (``n_group``,
``topk_group``) splits the E experts into ``n_group`` contiguous groups, ranks the groups (sigmoid: sum
of the two best selection scores in the group, as DeepSeek-V3; softmax families: the best one, as
DeepSeek-V2) and lets only the best ``topk_group`` groups compete. It affects selection only: replay
takes the recorded ids as they are.

With ``weights_in_fp32`` (the default, as the transformers routers) scores are computed in float32
whatever the logits' dtype; weights are returned in ``out_dtype`` (default: the logits' dtype, as
transformers' Qwen3-MoE router casts them back).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._validate import check_float_matrix
from .routes import (
    RouteError,
    check_integer_tensor,
    check_num_experts,
    describe,
    expand_routes,
    validate_routes,
)

__all__ = [
    "SCORES",
    "RouterScoring",
    "expert_bias_update",
    "load_balancing_loss",
    "replay_gate_weights",
    "replay_recorded_gate_weights",
    "replay_topk",
    "select_topk",
]

SCORES = ("softmax", "softmax_topk", "sigmoid")
SIGMOID_RENORM_EPS = 1e-20  # DeepSeek-V3's denominator guard


def _check_pos_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RouteError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise RouteError(f"{what} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class RouterScoring:
    """How one model family turns router logits into a top-k decision and gate weights.

    See the module docstring for the three ``score`` families. ``n_group`` and ``topk_group`` go
    together (both None: no group limit); ``n_group`` must divide the number of experts, which is
    checked when logits arrive.
    """

    score: str = "softmax"
    renormalize: bool = False
    scaling_factor: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    weights_in_fp32: bool = True

    def __post_init__(self):
        if self.score not in SCORES:
            raise RouteError(f"unknown router score {self.score!r}; expected one of {SCORES}")
        if not isinstance(self.renormalize, bool):
            raise RouteError(f"renormalize must be a bool, got {type(self.renormalize).__name__}")
        if not isinstance(self.weights_in_fp32, bool):
            raise RouteError(f"weights_in_fp32 must be a bool, got {type(self.weights_in_fp32).__name__}")
        factor = self.scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
            raise RouteError(f"scaling_factor must be a finite number > 0, got {factor!r}")
        if (self.n_group is None) != (self.topk_group is None):
            raise RouteError(
                f"n_group and topk_group must be given together, got n_group={self.n_group!r}, "
                f"topk_group={self.topk_group!r}"
            )
        if self.n_group is not None:
            _check_pos_int(self.n_group, "n_group")
            _check_pos_int(self.topk_group, "topk_group")
            if self.topk_group > self.n_group:
                raise RouteError(f"topk_group={self.topk_group} > n_group={self.n_group}")

    @property
    def grouped(self) -> bool:
        return self.n_group is not None

    def check(self, num_experts: int, k: int | None = None) -> None:
        """Use-time checks against a router with ``num_experts`` experts choosing ``k``."""
        if not self.grouped:
            return
        if num_experts % self.n_group:
            raise RouteError(f"n_group={self.n_group} does not divide num_experts={num_experts}")
        group_size = num_experts // self.n_group
        if self.score == "sigmoid" and group_size < 2:
            raise RouteError(
                f"sigmoid group ranking sums the top 2 scores of a group, but n_group={self.n_group} leaves "
                f"{group_size} expert per group (num_experts={num_experts})"
            )
        if k is not None and k > self.topk_group * group_size:
            raise RouteError(
                f"k={k} experts cannot be chosen from topk_group={self.topk_group} groups of {group_size} experts"
            )


# ----------------------------------------------------------------------------------------- shared ops


def _check_router_logits(logits, name: str = "logits") -> torch.Tensor:
    return check_float_matrix(logits, name, RouteError, shape="[tokens, num_experts]", empty="has no experts")


def _check_scoring(scoring) -> RouterScoring:
    if not isinstance(scoring, RouterScoring):
        raise RouteError(f"scoring must be a RouterScoring, got {type(scoring).__name__}")
    return scoring


def _scores(logits: torch.Tensor, scoring: RouterScoring) -> torch.Tensor:
    """The per-expert score the family ranks (before bias): probs, logits or sigmoid scores."""
    dtype = torch.float32 if scoring.weights_in_fp32 else logits.dtype  # the router's own score dtype
    if scoring.score == "softmax":
        return F.softmax(logits, dim=-1, dtype=dtype)
    if scoring.score == "softmax_topk":
        return logits.to(dtype)
    return logits.to(dtype).sigmoid()


def _weights_at(
    scores: torch.Tensor, ids: torch.Tensor, scoring: RouterScoring, out_dtype: torch.dtype
) -> torch.Tensor:
    """Gate weights at int64 ``ids`` from :func:`_scores`: the one code path select and replay share."""
    chosen = scores.gather(1, ids)
    if scoring.score == "softmax_topk":
        chosen = F.softmax(chosen, dim=-1)
    if scoring.renormalize:
        denom = chosen.sum(dim=-1, keepdim=True)
        if scoring.score == "sigmoid":
            denom = denom + SIGMOID_RENORM_EPS
        chosen = chosen / denom
    if scoring.scaling_factor != 1.0:
        chosen = chosen * scoring.scaling_factor
    return chosen.to(out_dtype)


def _group_limit(selection: torch.Tensor, scoring: RouterScoring) -> torch.Tensor:
    """``selection`` with the experts outside the best ``topk_group`` groups set to -inf."""
    tokens, num_experts = selection.shape
    grouped = selection.view(tokens, scoring.n_group, num_experts // scoring.n_group)
    if scoring.score == "sigmoid":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best = group_scores.topk(scoring.topk_group, dim=-1).indices
    eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    eligible = eligible.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
    return selection.masked_fill(~eligible, float("-inf"))


# ----------------------------------------------------------------------------------------- public API


def select_topk(
    logits: torch.Tensor,
    k: int,
    scoring: RouterScoring,
    *,
    expert_bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's native routing decision: ``(weights [tokens, k], ids int64 [tokens, k])``.

    Ids come in descending selection-score order (``torch.topk``). ``expert_bias`` ([E]) shifts the
    selection only. ``out_dtype`` defaults to the logits' dtype. For ``RouterScoring()`` this is
    transformers' ``Qwen3MoeTopKRouter`` (softmax in float32, topk, optional renorm, cast back).
    """
    _check_router_logits(logits)
    _check_scoring(scoring)
    num_experts = logits.shape[1]
    k = _check_pos_int(k, "k")
    if k > num_experts:
        raise RouteError(f"k={k} > num_experts={num_experts} (logits shape {tuple(logits.shape)})")
    scoring.check(num_experts, k)
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor) or expert_bias.shape != (num_experts,):
            raise RouteError(
                f"expert_bias must have shape ({num_experts},) to match logits {tuple(logits.shape)}, "
                f"got {describe(expert_bias)}"
            )
        if not expert_bias.is_floating_point():
            raise RouteError(f"expert_bias must be a floating tensor, got dtype {expert_bias.dtype}")
    scores = _scores(logits, scoring)
    ids = _native_ids(scores, k, scoring, expert_bias)
    return _weights_at(scores, ids, scoring, out_dtype or logits.dtype), ids


def _native_ids(scores: torch.Tensor, k: int, scoring: RouterScoring,
                expert_bias: torch.Tensor | None) -> torch.Tensor:
    """The family's own top-k ids from :func:`_scores` (bias and group limit on the selection only)."""
    selection = scores.detach()
    if expert_bias is not None:
        selection = selection + expert_bias.detach().to(device=selection.device, dtype=selection.dtype)
    if scoring.grouped:
        selection = _group_limit(selection, scoring)
    return selection.topk(k, dim=-1).indices


def replay_gate_weights(
    logits: torch.Tensor,
    ids: torch.Tensor,
    scoring: RouterScoring,
    *,
    out_dtype: torch.dtype | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Gate weights ``[tokens, k]`` the family's router computes for the forced ``ids``.

    Differentiable w.r.t. ``logits``. ``ids`` may be any integer dtype (a stored uint8 / int16 table
    included); weights follow ``ids``' slot order. Group limits and expert bias play no part: the forced
    ids are taken as they are. ``validate`` checks the ids (range, distinct per row; a host sync);
    shapes are always checked.
    """
    _check_router_logits(logits)
    _check_scoring(scoring)
    check_integer_tensor(ids, "ids")
    if ids.dim() != 2 or ids.shape[0] != logits.shape[0]:
        raise RouteError(
            f"ids must have shape [tokens, k] with the logits' tokens: ids {tuple(ids.shape)} vs "
            f"logits {tuple(logits.shape)}"
        )
    num_experts = logits.shape[1]
    if validate:
        validate_routes(ids, num_experts, name="ids")
    scoring.check(num_experts)
    ids = expand_routes(ids).to(logits.device)
    return _weights_at(_scores(logits, scoring), ids, scoring, out_dtype or logits.dtype)


def replay_topk(
    logits: torch.Tensor,
    forced: torch.Tensor,
    scoring: RouterScoring,
    *,
    mask: torch.Tensor | None = None,
    expert_bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A replayed router call in the fewest device ops: ``(weights [tokens, k], ids int64 [tokens, k], native)``.

    The hot path of the engine adapters, once per router and forward: the family's scores are computed once;
    ``ids`` are ``forced`` on the rows where ``mask`` (bool ``[tokens]``) is True (every row when ``mask`` is None)
    and the family's own top-k elsewhere (``native``: those own ids, computed from the same scores when ``mask`` is
    given or ``native`` is True, else None); the weights are one gather at ``ids`` plus the family's normalisation,
    bitwise those of :func:`replay_gate_weights` / :func:`select_topk`. Per call: the scores, one gather and the
    normalisation with every row forced (no more ops than the router's own top-k path); ``topk`` and one ``where``
    more with a mask.

    Trusts its inputs (no checks, no host sync): ``forced`` int64 ``[tokens, k]`` on the logits' device with valid,
    distinct ids (a :class:`~moealign.routing_replay.protocol.ReplayBatch` validated them when built, the adapter's
    ``set_routes`` moved them), ``logits`` ``[tokens, E]``, ``expert_bias`` ``[E]``. Callers with unchecked input use
    :func:`replay_gate_weights`.
    """
    scores = _scores(logits, scoring)
    own = None
    if mask is not None or native:
        own = _native_ids(scores, forced.shape[-1], scoring, expert_bias)
    ids = forced if mask is None else torch.where(mask[:, None], forced, own)
    return _weights_at(scores, ids, scoring, out_dtype or logits.dtype), ids, own


def replay_recorded_gate_weights(recorded_weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Recorded gate weights ``[tokens, k]`` as constants (detached) in ``like``'s dtype and device.

    The verification variant of replay: the trainer's experts receive the rollout engine's own weights,
    so any remaining mismatch is outside the router. ``like`` is the tensor the weights replace (the
    router's weights ``[tokens, k]`` or logits ``[tokens, E]``); its first dimension must match.
    Non-finite weights are an error naming the first one.
    """
    if not isinstance(recorded_weights, torch.Tensor):
        raise RouteError(f"recorded_weights must be a torch.Tensor, got {type(recorded_weights).__name__}")
    if not isinstance(like, torch.Tensor):
        raise RouteError(f"like must be a torch.Tensor, got {type(like).__name__}")
    if recorded_weights.dim() != 2 or recorded_weights.shape[1] == 0:
        raise RouteError(f"recorded_weights must have shape [tokens, k], got {tuple(recorded_weights.shape)}")
    if not recorded_weights.is_floating_point():
        raise RouteError(f"recorded_weights must be a floating tensor, got dtype {recorded_weights.dtype}")
    if not like.is_floating_point():
        raise RouteError(f"like must be a floating tensor, got dtype {like.dtype}")
    if like.dim() >= 1 and like.shape[0] != recorded_weights.shape[0]:
        raise RouteError(
            f"recorded_weights {tuple(recorded_weights.shape)} and like {tuple(like.shape)} disagree on tokens"
        )
    bad = ~torch.isfinite(recorded_weights)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise RouteError(
            f"recorded_weights[{index[0]}, {index[1]}] = {float(recorded_weights[index])} is not finite"
        )
    return recorded_weights.detach().to(dtype=like.dtype, device=like.device)


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    ids: Sequence[torch.Tensor] | torch.Tensor,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Switch-Transformer auxiliary loss, counting tokens per expert from the GIVEN (replayed) ids.

    Same arithmetic as transformers' ``load_balancing_loss_func`` (Qwen3-MoE): per layer
    ``probs = softmax(logits)`` (in the logits' dtype, then float32); summed over layers, ``f_e`` = top-k
    assignments to expert e per token row and ``P_e`` = mean router prob of e; the loss is
    ``num_experts * sum_e f_e * P_e``. With ``attention_mask`` ([batch, seq], ``batch * seq == tokens``)
    padded rows count for neither. transformers re-runs ``topk(probs)``; here ``ids[layer]``
    ([tokens, top_k], any integer dtype) says which experts were used. ``ids`` may also be one route
    table ``[tokens, layers, top_k]``. Differentiable w.r.t. the logits (through ``P_e``); returns a
    0-d float32 tensor.
    """
    num_experts = check_num_experts(num_experts)
    top_k = _check_pos_int(top_k, "top_k")
    if isinstance(router_logits, torch.Tensor) or not isinstance(router_logits, Sequence):
        raise RouteError(
            f"router_logits must be a sequence of per-layer tensors, got {type(router_logits).__name__}"
        )
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 3:
            raise RouteError(f"ids as one tensor must be a route table [tokens, layers, k], got {tuple(ids.shape)}")
        ids = ids.unbind(1)
    if len(router_logits) == 0:
        raise RouteError("router_logits is empty (no MoE layer)")
    if len(ids) != len(router_logits):
        raise RouteError(f"router_logits has {len(router_logits)} layers but ids has {len(ids)}")
    device = router_logits[0].device
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    total_rows = 0.0
    flat_mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise RouteError(f"attention_mask must have shape [batch, seq], got {describe(attention_mask)}")
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer, (logits, chosen) in enumerate(zip(router_logits, ids)):
        _check_router_logits(logits, f"router_logits[{layer}]")
        check_integer_tensor(chosen, f"ids[{layer}]")
        if logits.shape[1] != num_experts:
            raise RouteError(f"router_logits[{layer}] has {logits.shape[1]} experts, num_experts={num_experts}")
        if chosen.shape != (logits.shape[0], top_k):
            raise RouteError(
                f"ids[{layer}] must have shape [tokens, top_k] = {(logits.shape[0], top_k)} to match "
                f"router_logits[{layer}] {tuple(logits.shape)}, got {tuple(chosen.shape)}"
            )
        if flat_mask is not None and flat_mask.numel() != logits.shape[0]:
            raise RouteError(
                f"attention_mask {tuple(attention_mask.shape)} covers {flat_mask.numel()} tokens but "
                f"router_logits[{layer}] has {logits.shape[0]}"
            )
        if validate:
            validate_routes(chosen, num_experts, name=f"ids[{layer}]")
        probs = F.softmax(logits.to(device), dim=-1).float()
        flat_ids = chosen.to(device=device, dtype=torch.int64).reshape(-1)
        if flat_mask is None:
            weight = torch.ones(flat_ids.shape, dtype=torch.float32, device=device)
            prob_sum = prob_sum + probs.sum(dim=0)
            total_rows = total_rows + probs.shape[0]
        else:
            weight = flat_mask.repeat_interleave(top_k)
            prob_sum = prob_sum + (probs * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
        counts = torch.zeros(num_experts, dtype=torch.float32, device=device).scatter_add_(0, flat_ids, weight)
        tokens_per_expert = tokens_per_expert + counts
    return (tokens_per_expert / total_rows * (prob_sum / total_rows)).sum() * num_experts


def expert_bias_update(
    expert_bias: torch.Tensor,
    ids: torch.Tensor,
    rate: float,
    *,
    row_mask: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """The auxiliary-loss-free balancing step (DeepSeek-V3; Megatron's ``moe_router_enable_expert_bias``), counting
    the GIVEN ids: ``expert_bias + rate * sign(mean load - load)``, ``load[e]`` = top-k slots of ``ids``
    (``[tokens, k]``, any integer dtype) that go to expert ``e`` (rows where ``row_mask`` is False do not count).

    Under routing replay ``ids`` are the replayed experts, the ones the tokens ran on: the bias moves towards
    balancing the load the trainer actually computed (the rollout engine's choice), not its own top-k, which under
    replay no token reaches. Returns a new tensor in ``expert_bias``' dtype (the bias is not a parameter: no
    gradient); Megatron's ``get_updated_expert_bias`` computes the same from its ``tokens_per_expert``.
    """
    if not isinstance(expert_bias, torch.Tensor) or expert_bias.dim() != 1 or not expert_bias.is_floating_point():
        raise RouteError(f"expert_bias must be a floating tensor [num_experts], got {describe(expert_bias)}")
    rate = float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else float("nan")
    if not math.isfinite(rate) or rate < 0:
        raise RouteError(f"rate must be a finite number >= 0, got {rate!r}")
    check_integer_tensor(ids, "ids")
    if ids.dim() != 2:
        raise RouteError(f"ids must have shape [tokens, k], got {tuple(ids.shape)}")
    num_experts = expert_bias.shape[0]
    if validate:
        validate_routes(ids, num_experts, name="ids")
    flat = expand_routes(ids).to(expert_bias.device).reshape(-1)
    weight = torch.ones(flat.shape, dtype=torch.float32, device=flat.device)
    if row_mask is not None:
        if not isinstance(row_mask, torch.Tensor) or row_mask.shape != (ids.shape[0],):
            raise RouteError(f"row_mask must be a bool tensor [{ids.shape[0]}], got {describe(row_mask)}")
        weight = row_mask.to(device=flat.device, dtype=torch.float32).repeat_interleave(ids.shape[1])
    load = torch.zeros(num_experts, dtype=torch.float32, device=flat.device).scatter_add_(0, flat, weight)
    offset = load.mean() - load
    return (expert_bias.detach().float() + rate * torch.sign(offset)).to(expert_bias.dtype)
