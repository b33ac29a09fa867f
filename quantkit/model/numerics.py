"""How a Linear is computed: on the stored weights alone (`weights`), or as the serving engines compute
it (`engine`). Every Linear of the reference forward goes through `linear`.

    stored as                  weights numerics           engine numerics (vLLM, SGLang, transformers)
    FP8 128x128 blocks         x @ dequant(W)^T           W8A8: x quantized per token in groups of 128
                                                          input columns (e4m3, scale amax/448), then
                                                          dequant(x_q) @ dequant(W)^T
    INT4 groups (experts)      x @ dequant(W)^T           the same: the engines' W4A16 kernels dequantize
                                                          and multiply in the activation dtype
    BF16 / other               x @ W^T                    the same

The engine's FP8 GEMM accumulates q_x . q_w per 128-column block and multiplies by both scales; over
exact products that is dequant(x_q) @ dequant(W)^T, so only float summation order differs. The DSA
indexer's FP8 `wk` is run W8A8 here as SGLang and compressed-tensors do (vLLM upcasts it into its
unquantized fused `wk_weights_proj`), and MLA's kv_b_proj as a Linear (engines absorb it into the
attention for decode; prefill runs it as a Linear).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantkit.formats import fp8

NUMERICS = ("engine", "weights")


@dataclass(frozen=True)
class W8A8:
    """A weight whose Linear quantizes its input on the fly first (an FP8 block layer under engine numerics)."""

    weight: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor] = fp8.quantize_activations


def linear(x: torch.Tensor, w: torch.Tensor | W8A8) -> torch.Tensor:
    if isinstance(w, W8A8):
        return F.linear(w.act(x), w.weight)
    return F.linear(x, w)


def as_computed(w: torch.Tensor, stored: str, numerics: str) -> torch.Tensor | W8A8:
    """The dequantized weight `w` of a tensor stored as `stored` (fp8 / int4 / dense), as `numerics` computes it.
    An FP8 weight no engine can run (input dim not whole 128-groups, fp8.cannot_run: a source's kv_b_proj
    at kv_lora_rank 64, which convert stores BF16) is computed on its weights."""
    if numerics == "engine" and stored == "fp8" and w.dim() == 2 and not fp8.cannot_run(tuple(w.shape)):
        return W8A8(w)
    return w


def numerics_record(numerics: str) -> dict:
    """validation.json's `numerics`: how every number in it was computed (the cards quote `line`)."""
    if numerics == "engine":
        line = ("engine numerics: FP8 block Linears W8A8 (activations quantized per token in 128-column groups, "
                "e4m3, float32 scale amax/448, as vLLM/SGLang compute them), INT4 experts W4A16 "
                "(dequantized, multiplied in the activation dtype)")
    else:
        line = "weights numerics: every Linear on its dequantized weights, activations unquantized (no engine computes this)"
    return {"mode": numerics, "line": line}
