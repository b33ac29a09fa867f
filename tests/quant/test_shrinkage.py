"""The Ledoit-Wolf intensity (quantkit.quant.shrinkage) against the estimator written out as in the
paper, one outer product per token, and against scikit-learn's where it is installed; and what it
does to GPTQ: none with many tokens a column, RTN in effect with very few."""

from __future__ import annotations

import pytest
import torch

from quantkit.quant.experts import run_gptq, shrinkage_dampening
from quantkit.quant.gptq import hessian_from_inputs, quantize_rtn
from quantkit.quant.shrinkage import MAX_DELTA, fourth_moment, ledoit_wolf
from quantkit.recipe import load_recipe


def _paper(X: torch.Tensor) -> float:
    """Ledoit and Wolf (2004), Lemma 3.2-3.4 with the second moment (the inputs are not centred)."""
    X = X.double()
    n, p = X.shape
    S = X.T @ X / n
    mu = torch.trace(S) / p
    d2 = ((S - mu * torch.eye(p, dtype=X.dtype)) ** 2).sum()
    b2 = sum(((torch.outer(x, x) - S) ** 2).sum() for x in X) / n**2
    return float(min(b2, d2) / d2)


def _heavy(n: int, p: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, p, generator=g)
    X[:, : p // 16] *= 4  # a few heavy input columns: the second moment is far from isotropic
    return X


@pytest.mark.parametrize(("n", "p"), [(8, 32), (40, 32), (400, 32)])
def test_the_intensity_is_the_papers_estimator(n, p):
    X = _heavy(n, p, seed=n)
    S = X.T.double() @ X.double() / n
    got = ledoit_wolf(S[None].float(), [n], [fourth_moment(X)])
    assert float(got[0]) == pytest.approx(_paper(X), rel=1e-4)
    # GPTQ's H = 2 S gives the same intensity at scale 0.5
    H = hessian_from_inputs(X)[None]
    assert float(ledoit_wolf(H, [n], [fourth_moment(X)], scale=0.5)[0]) == pytest.approx(_paper(X), rel=1e-4)


def test_the_intensity_is_scikit_learns():
    sk = pytest.importorskip("sklearn.covariance")
    X = _heavy(50, 64, seed=3).double()
    _, want = sk.ledoit_wolf(X.numpy(), assume_centered=True)
    S = X.T @ X / 50
    assert float(ledoit_wolf(S[None], [50], [fourth_moment(X)])[0]) == pytest.approx(want, rel=1e-6)


def test_the_intensity_falls_as_tokens_per_column_grow():
    deltas = [float(ledoit_wolf((X.T @ X / len(X))[None], [len(X)], [fourth_moment(X)])[0])
              for X in (_heavy(n, 64, seed=n) for n in (4, 16, 64, 256, 4096))]
    assert deltas == sorted(deltas, reverse=True)
    assert deltas[0] > 0.5 and deltas[-1] < 0.05
    # an expert that saw no token gets the isotropic target
    assert float(ledoit_wolf(torch.zeros(1, 4, 4), [0], [0.0])[0]) == MAX_DELTA


def test_shrinkage_off_adds_nothing_and_on_is_rtn_at_very_few_tokens():
    rec = load_recipe("tiny-glm-5.2")
    X = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))  # 4 tokens against 128 inputs: rank 4
    H = hessian_from_inputs(X)[None]
    assert shrinkage_dampening(rec.gptq, H, [4], [fourth_moment(X)]) is None  # the shipped recipe: off
    g = rec.gptq.model_copy(update={"shrinkage": "ledoit-wolf", "observer": "minmax", "actorder": False})
    shrunk: list = []
    extra = shrinkage_dampening(g, H, [4], [fourth_moment(X)], shrunk)
    assert shrunk[0] > 0.5 and float(extra[0]) == pytest.approx(shrunk[0] / (1 - shrunk[0]))
    W = torch.randn(1, 16, 128, generator=torch.Generator().manual_seed(1))
    q = run_gptq(W, H.clone(), 32, g, 1, [0], fit_tokens=[4], fourth=[fourth_moment(X)])
    q0 = run_gptq(W, H.clone(), 32, g.model_copy(update={"shrinkage": "none"}), 1, [0], fit_tokens=[4])
    rtn = quantize_rtn(W, 32)
    # judged on other inputs from the same (isotropic) distribution: GPTQ fitted to 4 tokens moves
    # error into the 124 directions it never saw; the shrunk one does much less
    Xo = torch.randn(512, 128, generator=torch.Generator().manual_seed(2))

    def err(qw):
        return float(((Xo @ (qw.dequantize(torch.float32)[0] - W[0]).T) ** 2).mean())

    assert err(q) < err(q0)
    assert err(q) < 1.1 * err(rtn)


def test_the_recipe_refuses_shrinkage_with_weighted_or_prior_hessians():
    from quantkit.quant.methods import METHODS

    rec = load_recipe("tiny-glm-5.2")
    rec.gptq.shrinkage = "ledoit-wolf"
    assert METHODS["gptq"].recipe_problems(rec) == []
    rec.gptq.hessian_weighting = "gate"
    assert any("gptq.shrinkage" in p for p in METHODS["gptq"].recipe_problems(rec))
