"""The metrics validate, the guard and the benchmarks report: one KL, one mean with standard error.

Paired comparisons with a standard error: what a quality claim may say about two quantizations.

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

__all__ = ["Paired", "agreement", "kl_terms", "kl_top1", "mean_se", "mean_nll", "paired", "token_kl", "window_kl_top1",
           "window_mean_se"]


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


def mean_se(x: torch.Tensor) -> tuple[float, float | None]:
    """Mean and standard error of independent samples x (any shape, flattened); no SE for one sample."""
    x = x.double().flatten()
    n = x.numel()
    return x.mean().item(), (x.std().item() / math.sqrt(n)) if n > 1 else None


def paired(a: torch.Tensor, b: torch.Tensor) -> Paired:
    """a, b: per-sample values on the same samples (any shape, flattened)."""
    mean, se = mean_se(a.double() - b.double())
    return Paired(mean, math.inf if se is None else se, a.numel())


def window_mean_se(steps: list[torch.Tensor]) -> tuple[float, float | None]:
    """Mean and standard error of per-position values (steps of (B,)), windows as the independent
    units: positions of one window are correlated, so the SE is over per-window means."""
    return mean_se(torch.stack(steps).double().mean(0))  # (T, B) -> (B,)


def kl_terms(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The one KL: p_ref * (log p_ref - log p_model) per vocabulary entry, float64, (..., V) -> (..., V).
    Callers sum it in the order they report (per token, or per sample over all its positions)."""
    ref, lp = ref_logits.double().log_softmax(-1), logits.double().log_softmax(-1)
    return ref.exp() * (ref - lp)


def token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-token KL(ref || model) in nats: (..., V) logits -> (...)."""
    return kl_terms(ref_logits, logits).sum(-1)


def kl_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float, int]:
    """(sum of per-position KL(ref || model), positions whose argmax agrees, positions) over (..., V)
    logits; one sample at a time in float64, so a 160K vocabulary never needs more than (T, V) doubles."""
    ref_logits, logits = ref_logits.reshape(-1, *ref_logits.shape[-2:]), logits.reshape(-1, *logits.shape[-2:])
    kl = agree = 0.0
    for r, m in zip(ref_logits, logits):  # (T, V)
        kl += float(kl_terms(r, m).sum())  # one sum over (T, V), as validation.json has always had it
        agree += float((r.argmax(-1) == m.argmax(-1)).sum())
    return kl, agree, ref_logits.shape[0] * ref_logits.shape[1]


def window_kl_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window (B,): mean KL(ref || model) over its positions and the share of positions whose
    argmax agrees, from (B, T, V) logits, one window at a time in float64 (as kl_top1). Windows are the
    independent units a standard error is taken over (positions of one window are correlated), and
    the same windows under two checkpoints give a paired comparison (`paired`)."""
    kl, top1 = torch.empty(ref_logits.shape[0], dtype=torch.float64), torch.empty(ref_logits.shape[0], dtype=torch.float64)
    for i, (r, m) in enumerate(zip(ref_logits, logits)):  # (T, V)
        kl[i] = kl_terms(r, m).sum(-1).mean()
        top1[i] = (r.argmax(-1) == m.argmax(-1)).double().mean()
    return kl, top1


def mean_nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token negative log-likelihood over the windows (positions 0..T-2 predict 1..T-1)."""
    total = 0.0
    for lg, x in zip(logits, ids):  # (T, V), (T,)
        lp = torch.log_softmax(lg[:-1].double(), -1)
        total -= float(lp.gather(-1, x[1:, None].to(lp.device)).sum())
    return total / (ids.shape[0] * (ids.shape[1] - 1))


def agreement(tokens: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(mean common-prefix fraction, exact-match fraction) of (B, K) continuations."""
    same = (tokens == ref).long()
    prefix = same.cumprod(dim=1).sum(dim=1).double() / tokens.shape[1]  # (B,)
    return float(prefix.mean()), float((prefix == 1).double().mean())
