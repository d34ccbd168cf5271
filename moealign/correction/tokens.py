"""The per-block view of a batch that every correction module reads.

A block is a run of whole rows of the (B, T) inputs. Padding is neutralised once here: log-probs and
the log-ratio are 0 outside the mask, so modules may rely on it (a per-token statistic that is 0 at
log-ratio 0 needs no further masking).

Padding is zeroed by multiplying with the 0/1 mask. That is exact for finite values; NaN/Inf written
into padding would survive it, so the pipeline flags every row whose log-ratio is not finite and, when
the flagged values turn out to sit in padding only, zeroes the padding with ``torch.where`` and runs the
pass again (see ``pipeline.run_plan``). The common case pays for no ``where``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._masked import PAD_FILL, SAFETY_BOUND, ne


@dataclass
class TokenView:
    old: torch.Tensor  # training-engine log-probs (compute dtype), 0 at padding
    rollout: torch.Tensor  # rollout-engine log-probs (compute dtype), 0 at padding
    maskf: torch.Tensor  # 0/1 validity as the compute dtype
    log_ratio: torch.Tensor  # old - rollout, 0 at padding, unclamped
    clamped: torch.Tensor  # log_ratio clamped to [-20, 20]
    n: torch.Tensor  # (b,) valid tokens per row
    row_log_ratio: torch.Tensor  # (b,) sum of the unclamped log-ratio per row
    mask_error: torch.Tensor | None = None  # (b,) sum |mask - (mask != 0)|: > 0 or NaN for a non-0/1 mask
    k3: torch.Tensor | None = None  # r - 1 - log r on the clamped log-ratio (set by the off-policy pass)
    _pad_fill: torch.Tensor | None = None

    @property
    def pads(self) -> torch.Tensor:
        """(b,) padding entries per row."""
        return self.maskf.shape[-1] - self.n

    @property
    def pad_fill(self) -> torch.Tensor:
        """(1 - mask) * 1e30: add it before a row min (subtract before a row max) to skip padding."""
        if self._pad_fill is None:
            self._pad_fill = (1.0 - self.maskf).mul_(PAD_FILL)
        return self._pad_fill

    @classmethod
    def build(cls, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> "TokenView":
        mask_error = None
        if mask.dtype == torch.bool:
            maskf = mask.to(dtype)
        else:
            maskf = ne(mask, 0, dtype)
            # entries other than 0/1 (NaN included) differ from their own "!= 0"
            mask_error = ne(mask if mask.is_floating_point() else mask.to(dtype), maskf, dtype).sum(dim=-1)
        old = old.to(dtype) * maskf
        rollout = rollout.to(dtype) * maskf
        log_ratio = old - rollout
        return cls(
            old=old,
            rollout=rollout,
            maskf=maskf,
            log_ratio=log_ratio,
            clamped=log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND),
            n=maskf.sum(dim=-1),
            row_log_ratio=log_ratio.sum(dim=-1),
            mask_error=mask_error,
        )
