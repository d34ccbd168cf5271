"""The deterministic, verifiable reward of ``moealign rl-check``: balanced brackets.

A completion earns 1.0 when it contains at least one bracket and every ``(``, ``[`` and ``{`` it opens is closed by
the matching bracket in order (a stack check over the completion's own text; brackets inside string literals count
too, the check is purely textual), else 0.0. Why this one for the embedded Python-code model: it is a property of
the text alone (no model judges it), it is binary and cheap, and it has a high within-group spread on that model
(measured on 16 default prompts x 4 samples at T = 1, top-p 0.9: mean 0.44, mean within-group std 0.47, the
highest of the candidates tried: ``return`` present 0.30 / 0.28, a line ending in ``:`` 0.63 / 0.33), so
group-relative advantages are non-zero in almost every group; a small policy-gradient step shifts it (the model
learns to close what it opens, or to open nothing it cannot close within the token budget).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["REWARD_NAME", "balanced_brackets", "rewards", "group_advantages"]

REWARD_NAME = "balanced_brackets"
_PAIRS = {")": "(", "]": "[", "}": "{"}


def balanced_brackets(text: str) -> float:
    """1.0 when ``text`` holds a bracket and all its brackets are balanced and properly nested, else 0.0."""
    stack: list[str] = []
    seen = False
    for ch in text:
        if ch in "([{":
            stack.append(ch)
            seen = True
        elif ch in _PAIRS:
            seen = True
            if not stack or stack.pop() != _PAIRS[ch]:
                return 0.0
    return 1.0 if seen and not stack else 0.0


def rewards(texts: Sequence[str]) -> torch.Tensor:
    """float32 ``[len(texts)]``: :func:`balanced_brackets` of each completion."""
    return torch.tensor([balanced_brackets(t) for t in texts], dtype=torch.float32)


def group_advantages(values: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages: ``(r - mean_group) / (std_group + eps)`` over consecutive groups of
    ``group_size`` (a group with one reward value throughout gets 0)."""
    groups = values.reshape(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    return (centered / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)).reshape(-1)
