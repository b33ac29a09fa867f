"""How much of an expert's Hessian its own tokens support: the Ledoit-Wolf shrinkage intensity.

GPTQ trusts the sample second moment S = X^T X / n of a Linear's inputs as if it were the true one.
A routed expert of a real MoE sees n tokens against an input width p (GLM 5.2: p = 6144; a rarely
routed expert can have n < p): S then has rank at most n, its off-diagonal entries are mostly
sampling noise, and GPTQ's error feedback moves rounding error into the directions S says are
quiet, which other inputs excite. A fixed dampening cannot be right for every expert: one with
50 tokens a column needs none, one with 0.1 a column needs nearly all.

Ledoit and Wolf (2004, "A well-conditioned estimator for large-dimensional covariance matrices",
J. Multivariate Anal. 88) give the intensity delta in [0, 1] of the convex combination

    S* = (1 - delta) S + delta mu I,        mu = tr(S) / p

that minimizes the expected Frobenius distance to the true second moment, estimated from the
sample itself, with no constant to tune:

    d^2 = ||S - mu I||_F^2                                  how far S is from the target
    b^2 = 1/n^2 sum_t ||x_t x_t^T - S||_F^2                 the sampling variance of S
        = (sum_t ||x_t||^4 / n - ||S||_F^2) / n             (sum_t x_t x_t^T = n S)
    delta = min(b^2, d^2) / d^2

so it needs one scalar per expert beyond the Hessian, sum_t ||x_t||^4, accumulated with it. Many
tokens per column: b^2 -> 0, delta -> 0, GPTQ as published. Few: delta -> 1, the isotropic target,
whose GPTQ is round-to-nearest (no off-diagonal to feed error through). GPTQ's solution does not
change when H is scaled, so S* is GPTQ's H plus delta / (1 - delta) x mean(diag H) on the
diagonal: an extra dampening, one per expert, on top of gptq.dampening
(quantkit.quant.experts.shrinkage_dampening; gptq.shrinkage: ledoit-wolf).

The estimate treats tokens as independent; tokens of one window are not, so delta is, if
anything, too small. Shapes: C experts, p the Linear's input width.
"""

from __future__ import annotations

import torch

__all__ = ["fourth_moment", "ledoit_wolf", "MAX_DELTA"]

MAX_DELTA = 0.999  # delta = 1 would be an infinite dampening; 0.999 is 999 x mean(diag H), RTN in effect
_ROWS = 512  # rows of H squared at a time (the Frobenius norm without a second (p, p) array)


def fourth_moment(X: torch.Tensor) -> float:
    """sum_t ||x_t||^4 over the rows of X (n, p), in float64: the one statistic beyond X^T X that
    the intensity needs."""
    if X.shape[0] == 0:
        return 0.0
    return float(X.double().square().sum(-1).square().sum())


def _frobenius2(M: torch.Tensor) -> float:
    """||M||_F^2 of one (p, p) matrix in float64, a block of rows at a time."""
    return sum(float(M[r:r + _ROWS].double().square().sum()) for r in range(0, M.shape[0], _ROWS))


def ledoit_wolf(S: torch.Tensor, n: list[float], m4: list[float], scale: float = 1.0) -> torch.Tensor:
    """delta (C,) float64 for each expert's sample second moment scale * S[j] (p, p) = X^T X / n[j],
    given m4[j] = sum_t ||x_t||^4 (`fourth_moment`). An expert with no token, or whose second moment
    is already the target (d^2 = 0), gets MAX_DELTA."""
    p = S.shape[-1]
    out = []
    for j in range(S.shape[0]):
        f2 = _frobenius2(S[j]) * scale * scale  # ||S||_F^2
        mu = float(S[j].diagonal().double().sum()) * scale / p
        d2 = f2 - p * mu * mu  # ||S - mu I||^2 = ||S||^2 - 2 mu tr S + p mu^2, with tr S = p mu
        if n[j] <= 0 or d2 <= 0:
            out.append(MAX_DELTA)
            continue
        b2 = max((m4[j] / n[j] - f2) / n[j], 0.0)
        out.append(min(min(b2, d2) / d2, MAX_DELTA))
    return torch.tensor(out, dtype=torch.float64)

