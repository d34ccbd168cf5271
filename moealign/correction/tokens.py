"""The per-block view of a batch that every correction module reads.

A block is a run of whole rows of the (B, T) inputs. Padding is neutralised once here: log-probs and the
log-ratio are 0 outside the mask, so NaN/Inf written into padding by an engine never reaches a weight or
a metric. Modules rely on that: a per-token statistic that is 0 at log-ratio 0 needs no further masking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._masked import SAFETY_BOUND


@dataclass
class TokenView:
    old: torch.Tensor  # training-engine log-probs (compute dtype), 0 at padding
    rollout: torch.Tensor  # rollout-engine log-probs (compute dtype), 0 at padding
    valid: torch.Tensor  # bool (b, T)
    maskf: torch.Tensor  # valid as the compute dtype
    log_ratio: torch.Tensor  # old - rollout, 0 at padding, unclamped
    clamped: torch.Tensor  # log_ratio clamped to [-20, 20]
    n: torch.Tensor  # (b,) valid tokens per row
    row_log_ratio: torch.Tensor  # (b,) sum of the unclamped log-ratio per row
    k3: torch.Tensor | None = None  # r - 1 - log r on the clamped log-ratio (set by the off-policy pass)

    @property
    def pads(self) -> torch.Tensor:
        """(b,) padding entries per row."""
        return self.valid.shape[-1] - self.n

    @classmethod
    def build(cls, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> "TokenView":
        if mask.dtype == torch.bool:
            valid, maskf = mask, mask.to(dtype)
        else:
            valid = mask != 0
            # a 0/1 float mask is its own float view (other values are rejected by the pipeline's check)
            maskf = mask if mask.dtype == dtype else valid.to(dtype)
        old = torch.where(valid, old.to(dtype), 0.0)
        rollout = torch.where(valid, rollout.to(dtype), 0.0)
        log_ratio = old - rollout
        return cls(
            old=old,
            rollout=rollout,
            valid=valid,
            maskf=maskf,
            log_ratio=log_ratio,
            clamped=log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND),
            n=maskf.sum(dim=-1),
            row_log_ratio=log_ratio.sum(dim=-1),
        )
