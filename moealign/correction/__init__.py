"""Rollout correction (pure torch, any device): IS weights, rejection sampling, metrics, presets, losses.

verl-compatible entry point::

    from moealign.correction import compute_rollout_correction_and_rejection_mask
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob, rollout_log_prob, response_mask,
        rollout_is="sequence", rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001")
    metrics.to_floats()   # one host transfer
"""

from .config import PRESETS, RolloutCorrectionConfig
from .losses import (
    AGG_MODES,
    agg_loss,
    bypass_policy_loss,
    deepseek_offpolicy_sequence_mask,
    ppo_clip_loss,
    reinforce_loss,
)
from .metrics import PREFIX, CorrectionMetrics, to_slime_names
from .pipeline import (
    compute_agreement_metrics,
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from .thresholds import IS_LEVELS, IS_MODES, RS_MODES

__all__ = [
    "AGG_MODES",
    "IS_LEVELS",
    "IS_MODES",
    "PREFIX",
    "PRESETS",
    "RS_MODES",
    "CorrectionMetrics",
    "RolloutCorrectionConfig",
    "agg_loss",
    "bypass_policy_loss",
    "compute_agreement_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "deepseek_offpolicy_sequence_mask",
    "ppo_clip_loss",
    "reinforce_loss",
    "to_slime_names",
]
