"""How a Linear is computed: on the stored weights alone (`weights`), or as the serving engines compute
it (`engine`). Every Linear of the reference forward goes through `linear`.

    stored as                  weights numerics           engine numerics (vLLM, SGLang, transformers)
    FP8 128x128 blocks         x @ dequant(W)^T           W8A8: x quantized per token in groups of 128
                                                          input columns (e4m3, scale amax/448), then
                                                          dequant(x_q) @ dequant(W)^T
    INT4 groups (experts)      x @ dequant(W)^T           the same: the engines' W4A16 kernels dequantize
                                                          and multiply in the activation dtype
    BF16 / other               x @ W^T                    the same

A third way is transformers' own on a machine without a CUDA GPU (`transformers`, a probe candidate
only; transformers 5.17): a checkpoint in the native FP8 block format (`quant_method: fp8`, GLM-5.2-FP8,
DeepSeek-V3) is dequantized on load (quantizers/quantizer_finegrained_fp8.py: "no GPU or XPU ... dequantizing")
by `Fp8Dequantize._dequantize_one` (integrations/finegrained_fp8.py), which infers the block from the scale
grid (rows // grid rows) instead of reading `weight_block_size`: a partial block (the tiny GLM's 160-row
kv_a_proj_with_mqa, 2 scale rows) is read as two 80-row blocks; activations are not quantized. A
compressed-tensors checkpoint (quantkit's prefill/ and decode/, Kimi's INT4 experts) runs as under
engine numerics: its FP8 Linears fake-quantize the input per token in 128-column groups (W8A8), INT4
experts are dequantized. On a GPU, transformers' finegrained FP8 Linear is W8A8 (Triton/DeepGEMM): engine.

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
PROBE_NUMERICS = (*NUMERICS, "transformers")  # the probe can also compute a candidate as transformers does on a CPU


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


def finegrained_fp8(quantization_config: dict | None) -> bool:
    """A checkpoint in the native FP8 block format (transformers' finegrained FP8 quantizer), not compressed-tensors."""
    return (quantization_config or {}).get("quant_method") == "fp8"


def transformers_cpu_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """An FP8 block weight as transformers 5.17 dequantizes it on load without a GPU: the block inferred
    from the scale grid (block_m = rows // grid rows), q in float32 times its scale. None where transformers
    refuses the shape (rows or columns not a multiple of the grid: "not divisible by scale grid")."""
    rows, cols = q.shape
    sr, sc = scale.shape
    if rows % sr or cols % sc:
        return None
    q4 = q.float().reshape(sr, rows // sr, sc, cols // sc)  # (grid rows, block_m, grid cols, block_n)
    return (q4 * scale.float()[:, None, :, None]).reshape(rows, cols)


def computed_weight(ckpt, name: str, dtype: torch.dtype, device) -> torch.Tensor | W8A8:
    """Tensor `name` of `ckpt` (quantkit.checkpoint.reader.Checkpoint) on `device` as `ckpt.numerics`
    computes it: the one place the forward reads a weight for a Linear."""
    st = ckpt.tensors[name]
    mode = ckpt.numerics
    if mode == "transformers":
        if finegrained_fp8(ckpt.arch.quantization_config) and st.format == "fp8":
            p = st.parts
            w = transformers_cpu_dequantize(ckpt.raw(p["weight"]), ckpt.raw(p.get("weight_scale_inv") or p["weight_scale"]))
            if w is not None:
                return w.to(dtype).to(device)  # dequantized on load: activations stay unquantized
            mode = "weights"
        else:
            mode = "engine"  # compressed-tensors: W8A8 for FP8 Linears, INT4 dequantized
    return as_computed(ckpt.get(name, dtype).to(device), st.format, mode)


def computation(ckpt, numerics: str) -> str:
    """Which computation `numerics` makes of `ckpt`, by the weights' storage alone: two numerics that give the
    same name compute every Linear of it identically (a BF16 checkpoint is `weights` in all of them), so the
    probe computes a candidate once per distinct computation."""
    shapes = [tuple(st.shape) for st in ckpt.tensors.values() if st.format == "fp8"]
    if numerics == "transformers":
        if not finegrained_fp8(ckpt.arch.quantization_config):
            return computation(ckpt, "engine")
        partial = [s for s in shapes if len(s) == 2 and (s[0] % fp8.BLOCK or s[1] % fp8.BLOCK)]
        return "transformers" if partial else "weights"  # whole blocks: the grid's block is the true one
    if numerics == "engine" and any(len(s) == 2 and not fp8.cannot_run(s) for s in shapes):
        return "engine"
    return "weights"


def numerics_record(numerics: str) -> dict:
    """validation.json's `numerics`: how every number in it was computed (the cards quote `line`)."""
    if numerics == "engine":
        line = ("engine numerics: FP8 block Linears W8A8 (activations quantized per token in 128-column groups, "
                "e4m3, float32 scale amax/448, as vLLM/SGLang compute them), INT4 experts W4A16 "
                "(dequantized, multiplied in the activation dtype)")
    elif numerics == "transformers":
        line = ("transformers numerics: as transformers runs the checkpoints as stored on a CPU (native FP8 block "
                "checkpoints dequantized on load with the block inferred from the scale grid, activations unquantized; "
                "compressed-tensors FP8 Linears W8A8, INT4 experts dequantized)")
    else:
        line = "weights numerics: every Linear on its dequantized weights, activations unquantized (no engine computes this)"
    return {"mode": numerics, "line": line}
