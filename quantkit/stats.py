"""Paired comparisons with a standard error: what a quality claim may say about two quantizations.

Per-token KL is heavy-tailed (a handful of argmax flips carry most of it), so the mean KL of two
checkpoints on a small evaluation set can swap order from one set to the next. Comparing them on
the *same* tokens, the per-token difference d = kl_a - kl_b removes the shared difficulty of each
token; its mean and standard error say whether a has lower KL than b on data like this, and by how
much. A claim "a beats b" needs mean(d) + z * se(d) < 0; "a is not worse than b" needs mean(d) <
z * se(d).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Paired", "paired", "token_kl"]


@dataclass(frozen=True)
class Paired:
    mean: float  # mean of a - b
    se: float  # its standard error
    n: int  # paired samples

    def better(self, z: float = 2.0) -> bool:
        """a is lower than b by more than z standard errors."""
        return self.mean + z * self.se < 0

    def not_worse(self, z: float = 2.0) -> bool:
        """a is not higher than b by more than z standard errors."""
        return self.mean < z * self.se

    def __str__(self) -> str:
        return f"{self.mean:+.2e} +- {self.se:.1e} (n={self.n})"


def paired(a: torch.Tensor, b: torch.Tensor) -> Paired:
    """a, b: per-sample values on the same samples (any shape, flattened)."""
    d = (a.double() - b.double()).flatten()
    n = d.numel()
    return Paired(d.mean().item(), (d.std().item() / math.sqrt(n)) if n > 1 else math.inf, n)


def token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-token KL(ref || model) in nats: (..., V) logits -> (...)."""
    ref, lp = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    return (ref.exp() * (ref - lp)).sum(-1)
