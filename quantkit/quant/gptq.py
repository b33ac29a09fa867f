"""GPTQ: quantize a Linear one weight column at a time, correcting the rest for each rounding error.

The problem. A Linear computes y = x W^T. Round-to-nearest (RTN) replaces W by the closest point
W_hat of the INT4 grid, entry by entry, and ignores the inputs: it minimises ||W - W_hat||, not
the quantity we care about, the output error ||X W^T - X W_hat^T||^2 over calibration inputs X.
Each row of W contributes independently to that error, as (w - w_hat) H (w - w_hat)^T with
H = 2 X^T X [in, in] (`hessian_from_inputs`). When inputs are correlated (they always are) H is
far from diagonal, and an error in one column can be partly cancelled by nudging the others.

The algorithm (Optimal Brain Quantization, Frantar et al. 2022, arXiv:2210.17323). Quantize the
columns left to right. After rounding column i, the error err = (w_i - q_i) / Hinv[i, i] is
pushed onto the columns not yet quantized: W[:, i:] -= err * Hinv[i, i:], where Hinv is the
upper Cholesky factor of H^-1 (paper, section 3.4: the Cholesky rows are exactly the inverse
Hessians of the shrinking "remaining columns" problems, so no matrix is ever re-inverted). The
increase in output error caused by column i is err^2 / 2 per row; their sum is `loss`.
Lazy batch updates: columns are processed in blocks of `block_size`; inside a block the update is
applied column by column (Err1 collects the scaled errors), and the columns after the block get
the whole block's correction at once, W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:], one matmul.
Dampening adds `dampening * mean(diag H)` to the diagonal so H is safely positive definite.
Dead inputs (H[j, j] == 0: the input never fires) get diag 1 and a zero weight column.

Groups. INT4 keeps one scale per `group_size` consecutive inputs of each row, symmetric:
scale = max|w| / ((qmax - qmin) / 2) = max|w| / 7.5, q = clamp(round(w / scale), -8, 7).
As in llm-compressor 0.14 (its observer runs on the original weight before GPTQ), scales are
fixed from the *original* W up front (`static_groups=True`, the default here). With
`static_groups=False` each group's scale is instead recomputed from the error-updated weights
when the group starts, as in the paper's reference code (usually a slightly lower loss, but
scales then depend on H). `actorder=True` quantizes columns in order of decreasing H[j, j] (the
most active inputs first, while there are still many columns left to absorb their error); the
group of a column stays its original one, so the checkpoint format does not change.

The trade-off. GPTQ needs calibration data (H costs in^2 floats per Linear, accumulated over
tokens) and O(in^3) work per matrix, and it fits the weights to that data: it lowers the error on
inputs like the calibration set, not on arbitrary inputs. RTN needs nothing and is exact to
reproduce. Both produce the same storage format (int4 q + bf16 scales), so they can be mixed.

Everything is batched over a leading expert dimension: W [E, out, in] and H [E, in, in] are
quantized together, vectorized over E (the column loop is shared by all experts).
Numerics match llm-compressor 0.14.0.1 (`modifiers/gptq/gptq_quantize.py: quantize_weight`,
`helpers.py: factorize_hessian, apply_activation_ordering`) and compressed-tensors 0.19
(`calculate_qparams`, `quantize`, `dequantize`); see tests/quant/test_gptq.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "HessianError",
    "QuantizedWeight",
    "group_scales",
    "mse_group_scales",
    "quantize_rtn",
    "quantize_rtn_clip",
    "gptq",
    "gptq_shared_h",
    "hessian_from_inputs",
]


class HessianError(ValueError):
    """H + damping is not positive definite (NaN/Inf, or H was not a sum of x x^T).

    llm-compressor silently falls back to RTN for such a matrix; we raise instead, because with
    dampening a genuine x x^T sum can't fail, so a failure means the statistics are broken.
    """


@dataclass
class QuantizedWeight:
    q: torch.Tensor  # int8 [..., out, in], values in [qmin, qmax] ([-8, 7] for 4 bits)
    scale: torch.Tensor  # [..., out, in // group_size], dtype = scale_dtype
    loss: torch.Tensor | None = None  # GPTQ: sum of Losses per matrix, shape [...]; RTN: None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * scale per group, computed in the scale's dtype then cast (as compressed-tensors)."""
        q = self.q.unflatten(-1, (self.scale.shape[-1], -1))  # [..., out, G, group_size]
        W_hat = q.to(self.scale.dtype) * self.scale.unsqueeze(-1)
        return W_hat.flatten(-2).to(dtype)  # [..., out, in]


def _qrange(num_bits: int) -> tuple[float, float]:
    return -(2.0 ** (num_bits - 1)), 2.0 ** (num_bits - 1) - 1  # (-8, 7) for 4 bits


def _check_groups(W: torch.Tensor, group_size: int) -> None:
    if W.ndim < 2 or group_size <= 0 or W.shape[-1] % group_size:
        raise ValueError(f"weight {tuple(W.shape)} does not split in groups of {group_size}")


def group_scales(
    W: torch.Tensor, group_size: int, num_bits: int = 4, scale_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Symmetric per-group scales [..., out, in // group_size], as compressed-tensors computes them.

    calculate_qparams: max(|min|, |max|) / (bit_range / 2) in float32, rounded to scale_dtype,
    then exact zeros (all-zero groups) replaced by finfo(scale_dtype).eps so that w / scale is 0.
    """
    _check_groups(W, group_size)
    Wg = W.float().unflatten(-1, (-1, group_size))  # [..., out, G, group_size]
    amax = Wg.abs().amax(dim=-1)  # [..., out, G]
    qmin, qmax = (torch.tensor(v, device=W.device) for v in _qrange(num_bits))
    scale = amax / ((qmax - qmin).to(amax.dtype) / 2)  # same tensor ops as compressed-tensors
    finfo = torch.finfo(scale_dtype)
    scale = scale.clamp(finfo.min, finfo.max).to(scale_dtype)
    eps = torch.tensor(finfo.eps, dtype=scale_dtype, device=W.device)
    return torch.where(scale == 0, eps, scale)


def mse_group_scales(
    W: torch.Tensor, group_size: int, num_bits: int = 4, scale_dtype: torch.dtype = torch.bfloat16,
    grid: int = 100, max_shrink: float = 0.2, norm: float = 2.4, weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-group scales from a clip-ratio search, as llm-compressor's MSE observer: for each group,
    the range max|w| x r with r in 1, 1 - 1/grid, ... > 1 - max_shrink that minimises
    sum |w - Q(w)|^norm. Distribution-free (no Hessian): it trades one saturated outlier against a
    finer grid for the rest of the group, the same way on any input. Ties keep r = 1 (min-max).
    weight [..., in] (optional): each input column's weight in that sum, shared by the rows of a matrix
    (the "hessian" observer of `gptq` passes the damped diagonal of H)."""
    _check_groups(W, group_size)
    Wg = W.float().unflatten(-1, (-1, group_size))  # [..., out, G, gs]
    if weight is not None:
        weight = weight.float().unsqueeze(-2).unflatten(-1, (-1, group_size))  # [..., 1, G, gs]
    amax = Wg.abs().amax(dim=-1)  # [..., out, G]
    half = (2.0 ** num_bits - 1) / 2  # 7.5 for 4 bits, as group_scales
    finfo = torch.finfo(scale_dtype)

    def candidate(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # clip ratio 1 - i / grid: (scale, error)
        s = (amax * (1 - i / grid) / half).clamp(finfo.min, finfo.max).to(scale_dtype)
        s = torch.where(s == 0, torch.tensor(finfo.eps, dtype=scale_dtype, device=W.device), s)
        sf = s.float().unsqueeze(-1)
        e = _round(Wg, sf, num_bits).mul_(sf).sub_(Wg)  # Q(w) - w, in place: at real width each temporary is W's size
        e = e.square_() if norm == 2 else e.abs_().pow_(norm)
        return s, (e if weight is None else e.mul_(weight)).sum(-1)  # [..., out, G]

    best, best_err = candidate(0)
    for i in range(1, max(1, int(max_shrink * grid))):
        s, err = candidate(i)
        better = err < best_err
        best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


def _round(W: torch.Tensor, scale: torch.Tensor, num_bits: int) -> torch.Tensor:
    """clamp(round(W / scale)) with torch's own type promotion (bf16 W stays bf16), as a float."""
    qmin, qmax = _qrange(num_bits)
    return (W / scale).clamp_(qmin, qmax).round_()


def quantize_rtn(
    W: torch.Tensor, group_size: int, num_bits: int = 4, scale_dtype: torch.dtype = torch.bfloat16
) -> QuantizedWeight:
    """Round-to-nearest with `group_scales`; W [..., out, in] (e.g. [out, in] or [E, out, in])."""
    scale = group_scales(W, group_size, num_bits, scale_dtype)  # [..., out, G]
    Wg = W.unflatten(-1, (scale.shape[-1], group_size))  # [..., out, G, group_size]
    q = _round(Wg, scale.unsqueeze(-1), num_bits).to(W.dtype).to(torch.int8)
    return QuantizedWeight(q=q.flatten(-2), scale=scale)


def quantize_rtn_clip(
    W: torch.Tensor, group_size: int, num_bits: int = 4, scale_dtype: torch.dtype = torch.bfloat16, *,
    grid: int = 100, max_shrink: float = 0.2, norm: float = 3.0,
) -> QuantizedWeight:
    """Round-to-nearest with searched clipping: each group's scale from `mse_group_scales` (the range
    max|w| x r, r in 1, 1 - 1/grid, ... > 1 - max_shrink, with the least sum |w - Q(w)|^norm), then
    rounded as the search scored it (in float32). Data-free, like RTN; r = 1 is RTN's own scale and
    ties keep it, so no group's error in that norm exceeds RTN's, scored as the search scores it
    (q x scale in float32; `dequantize`'s bf16 product can put a group up to ~2% above). Same format
    as RTN and GPTQ."""
    scale = mse_group_scales(W, group_size, num_bits, scale_dtype, grid=grid, max_shrink=max_shrink, norm=norm)
    Wg = W.float().unflatten(-1, (scale.shape[-1], group_size))  # [..., out, G, group_size]
    q = _round(Wg, scale.float().unsqueeze(-1), num_bits).to(torch.int8)
    return QuantizedWeight(q=q.flatten(-2), scale=scale)


def gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    group_size: int,
    num_bits: int = 4,
    *,
    block_size: int = 128,
    dampening: float | torch.Tensor = 0.01,
    actorder: bool = False,
    scale_dtype: torch.dtype = torch.bfloat16,
    static_groups: bool = True,
    consume: bool = False,
    observer: str = "minmax",
) -> QuantizedWeight:
    """GPTQ-quantize W [..., out, in] given H [..., in, in] (any positive multiple of sum x x^T).

    Leading dims are a batch (experts), processed together on W's device in float32.
    static_groups=True (default, = llm-compressor 0.14): scales from the original W up front;
    False: each group's scale from the error-updated W when the group starts (paper's reference).
    loss: sum over rows and columns of err^2 / 2, in the units of H (llm-compressor's "loss").
    consume=True lets gptq work on the caller's float32 W and H in place instead of copying them
    (the caller must not use either afterwards, and should hold no other reference, so that H is
    freed once factored): at real width H and W are the largest things here.
    observer="mse": static group scales from `mse_group_scales` (a clip search) instead of min-max;
    "hessian": the same search weighted by the damped diag(H) (squared error: GPTQ's own objective
    without the off-diagonal terms), so a group's clip is chosen for the inputs the column sees.
    dampening: a float, or a tensor broadcastable to W's batch dims (one per expert: the isotropic
    prior of quantkit.quant.experts.expert_dampening, which grows as an expert's tokens thin).
    Raises HessianError naming the batch indices whose damped H is not positive definite.
    """
    _check_groups(W, group_size)
    *batch, rows, columns = W.shape
    if tuple(H.shape) != (*batch, columns, columns):
        raise ValueError(f"H of shape {tuple(H.shape)} does not match W of shape {tuple(W.shape)}")
    if not static_groups and (actorder or block_size % group_size):
        raise ValueError("static_groups=False needs actorder=False, block_size % group_size == 0")
    device = W.device
    own_w = consume and W.dtype == torch.float32 and W.is_contiguous()
    W = W.reshape(-1, rows, columns).to(torch.float32, copy=not own_w)  # [E, out, in], working copy
    own_h = consume and H.dtype == torch.float32 and H.device == device and H.is_contiguous()
    H = H.reshape(-1, columns, columns).to(device, torch.float32, copy=not own_h)  # [E, in, in]
    E = W.shape[0]
    if isinstance(dampening, torch.Tensor):  # one per batch entry, [E, 1]
        dampening = dampening.to(device, torch.float32).expand(batch).reshape(E, 1)

    # Group scales from the original weights (llm-compressor's observer runs before GPTQ).
    if observer == "mse":
        scale = mse_group_scales(W, group_size, num_bits, scale_dtype)  # [E, out, G]
    elif observer == "hessian":  # the clip search on GPTQ's own objective, diagonal part: d_j (w_j - q_j)^2
        d = torch.diagonal(H, dim1=-2, dim2=-1)  # [E, in]
        d = d + dampening * d.mean(dim=-1, keepdim=True)  # the damped diagonal GPTQ factors below
        scale = mse_group_scales(W, group_size, num_bits, scale_dtype, norm=2.0, weight=d)  # [E, out, G]
    else:
        scale = group_scales(W, group_size, num_bits, scale_dtype)  # [E, out, G]
    # g_idx [E, in]: the group of each column
    g_idx = torch.arange(columns, device=device).expand(E, -1) // group_size

    perm = None
    if actorder:  # most active inputs first; permute W's columns and both axes of H
        perm = torch.argsort(torch.diagonal(H, dim1=-2, dim2=-1), dim=-1, descending=True)  # [E, in]
        for e in range(E):  # in place, one expert at a time: a batched gather would hold a second [E, in, in] H
            W[e] = W[e].index_select(-1, perm[e])  # [out, in]
            H[e] = H[e].index_select(0, perm[e]).index_select(1, perm[e])  # [in, in]
        g_idx = g_idx.gather(-1, perm)

    # Dead inputs never contribute to the output: pin their H diagonal, zero their weights.
    diag = torch.diagonal(H, dim1=-2, dim2=-1)  # [E, in], a view into H
    dead = diag == 0
    diag.masked_fill_(dead, 1.0)
    W.masked_fill_(dead.unsqueeze(-2), 0.0)

    # Hinv = upper Cholesky factor of (H + damp I)^-1.
    if isinstance(dampening, torch.Tensor):
        diag.add_(dampening * diag.mean(dim=-1, keepdim=True))
    else:
        diag.add_((dampening * diag.mean(dim=-1)).unsqueeze(-1))
    # One [E, in, in] matrix alive at a time besides the factor being built (H, then L, then
    # inv(H), then Hinv): at hidden 6144 each is 151 MB per expert.
    try:  # torch checks the factorization itself; no host read of our own on the happy path
        L = torch.linalg.cholesky(H)
    except torch.linalg.LinAlgError:
        bad = torch.linalg.cholesky_ex(H).info.nonzero().flatten().tolist()
        raise HessianError(f"Hessian of batch index {bad} is not positive definite after dampening") from None
    del H, diag
    Hi = torch.cholesky_inverse(L)
    del L
    Hinv = torch.linalg.cholesky(Hi, upper=True)  # [E, in, in]
    del Hi

    Q = torch.zeros(W.shape, dtype=torch.int8, device=device)  # [E, out, in]
    Losses = torch.zeros(E, rows, device=device)  # [E, out]
    # The block is worked on transposed, [E, count, out]: column i of W is then row i, contiguous, so the
    # per-column rounding and the within-block update run over contiguous memory (the [E, out, count]
    # layout made every column op a strided gather: the loop took most of a real-width expert's time
    # on CPU). Every element sees the same float32 operations in the same order as in the paper's
    # layout, so the result is bit for bit the same; Err1 goes back to [E, out, count] (a copy) for the
    # loss and the lazy update, which therefore also run exactly as before.
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        W1 = W[..., i1:i2].transpose(-1, -2).contiguous()  # [E, count, out], working copy
        # S1 [E, count, out]: the scale of each entry of the block
        S1 = scale.gather(-1, g_idx[:, None, i1:i2].expand(-1, rows, -1)).transpose(-1, -2).contiguous()
        Err1 = torch.zeros_like(W1)  # [E, count, out]
        Q1 = torch.empty(W1.shape, dtype=torch.int8, device=device)  # [E, count, out]
        Hinv1 = Hinv[:, i1:i2, i1:i2]  # [E, count, count]

        for i in range(i2 - i1):
            if not static_groups and (i1 + i) % group_size == 0:  # new group: scale from current W
                g = (i1 + i) // group_size
                Wg = W1[:, i : i + group_size].transpose(-1, -2)  # [E, out, group_size]
                scale[..., g] = group_scales(Wg, group_size, num_bits, scale_dtype)[..., 0]
                S1[:, i : i + group_size] = scale[..., g].unsqueeze(-2)
            w = W1[:, i]  # [E, out]
            s = S1[:, i]  # [E, out]
            q = _round(w, s, num_bits)
            w_hat = (q.to(s.dtype) * s).float()  # in the scale dtype, as compressed-tensors
            d = Hinv1[:, i, i]  # [E]
            err = (w - w_hat) / d.unsqueeze(-1)  # [E, out]
            Q1[:, i] = q.to(torch.int8)
            Err1[:, i] = err
            W1[:, i:] -= Hinv1[:, i, i:].unsqueeze(-1) * err.unsqueeze(-2)  # within-block update, [E, count - i, out]

        Q[..., i1:i2] = Q1.transpose(-1, -2)
        Err1 = Err1.transpose(-1, -2).contiguous()  # [E, out, count]
        Losses += torch.sum(Err1.square(), -1) / 2
        # lazy batch update of all the columns after the block: [E, out, count] @ [E, count, rest]
        W[..., i2:] -= torch.bmm(Err1, Hinv[:, i1:i2, i2:])

    if perm is not None:  # back to the original column order
        invperm = torch.argsort(perm, dim=-1)
        Q = Q.gather(-1, invperm.unsqueeze(-2).expand(-1, rows, -1))
    return QuantizedWeight(
        q=Q.reshape(*batch, rows, columns),
        scale=scale.reshape(*batch, rows, -1),
        loss=Losses.sum(dim=-1).reshape(batch),
    )


def gptq_shared_h(Ws: list[torch.Tensor], H: torch.Tensor, group_size: int, **options) -> list[QuantizedWeight]:
    """GPTQ for several weights [..., out_i, in] that see the same inputs, so share H [..., in, in]
    (an expert's gate and up). H is factored once: GPTQ treats rows independently given Hinv, so
    quantizing the row-stacked weight [..., sum(out_i), in] is the same computation as quantizing
    each weight with its own copy of H, without expanding H per weight. `options` go to gptq
    (consume=True to factor H in place)."""
    rows = [W.shape[-2] for W in Ws]
    box = [H]
    del H  # so that with consume=True the factored H is freed inside gptq
    q = gptq(torch.cat(Ws, dim=-2), box.pop(), group_size, **options)  # [..., sum(out_i), in]
    qs, scales = q.q.split(rows, dim=-2), q.scale.split(rows, dim=-2)
    # loss: per weight it would need per-row losses; report the total on the first, 0 on the rest
    losses = [q.loss] + [None if q.loss is None else torch.zeros_like(q.loss)] * (len(Ws) - 1)
    return [QuantizedWeight(a, b, l) for a, b, l in zip(qs, scales, losses)]


def hessian_from_inputs(X: torch.Tensor) -> torch.Tensor:
    """X [n_tokens, in] (or [..., in]) -> H = 2/n X^T X [in, in] in float32; n = 0 gives zeros."""
    X = X.reshape(-1, X.shape[-1]).float()  # [n, in]
    n = X.shape[0]
    if n == 0:
        return torch.zeros(X.shape[-1], X.shape[-1], device=X.device)
    return (X.T @ X) * (2.0 / n)
