"""The upstream oracle: transformers' own DeepSeek-V3 and GLM-MoE-DSA models on the same weights.

Weights are read here with safetensors directly (not quantkit's reader) and dequantized with
compressed-tensors' own unpacking (INT4) and transformers' own FP8 block dequantization, so a bug
in quantkit's formats cannot cancel out in the comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def read_raw(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def dequantize_int4_ct(packed, scale, shape, group_size):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    q = unpack_from_int32(packed, 4, torch.Size(shape.tolist()))
    return dequantize(x_q=q, scale=scale, zero_point=None, args=args)


def dequantize_fp8_blocks(q, scale_inv, block=128):
    """w[i, j] = q[i, j] * s[i // 128, j // 128], block by block.

    Not transformers' `Fp8Dequantize`: on CPU it infers the block from the scale grid
    (rows // grid_rows), which is wrong when a projection's rows are not a multiple of 128, e.g.
    MLA's kv_a_proj_with_mqa (kv_lora + rope rows: 576 in the real models, 160 in the tiny GLM)."""
    w = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            w[rows, cols] = q[rows, cols].float() * scale_inv[i, j].float()
    return w


def dequantized_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    raw = read_raw(folder)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    group = None
    if (qc := text.get("quantization_config")) and qc.get("quant_method") == "compressed-tensors":
        group = qc["config_groups"]["group_0"]["weights"]["group_size"]
    out = {}
    for k, v in raw.items():
        if k.endswith("weight_packed"):
            base = k[: -len("weight_packed")]
            out[base + "weight"] = dequantize_int4_ct(v, raw[base + "weight_scale"], raw[base + "weight_shape"], group).float()
        elif k.endswith("weight_scale_inv"):
            continue
        elif k.endswith(("weight_scale", "weight_shape")) and k[: k.rfind(".")] + ".weight_packed" in raw:
            continue
        elif k.endswith("weight_scale") and raw[k[: -len("_scale")]].dtype == torch.float8_e4m3fn:
            continue  # compressed-tensors' name for the same FP8 block multiplier
        elif v.dtype == torch.float8_e4m3fn:
            scale = raw[k + "_scale_inv"] if k + "_scale_inv" in raw else raw[k + "_scale"]
            out[k] = dequantize_fp8_blocks(v, scale)
        else:
            out[k] = v.float()
    return out


def transformers_model(folder: Path, tmp: Path):
    """transformers' CausalLM for the text model of `folder`, fp32 eager, on dequantized weights."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(folder) / "config.json").read_text())
    sd = dequantized_state_dict(folder)
    if cfg["model_type"] == "kimi_k25":  # the text model is DeepSeek-V3 under `language_model.`
        cfg = dict(cfg["text_config"], model_type="deepseek_v3")
        sd = {k[len("language_model."):]: v for k, v in sd.items() if k.startswith("language_model.")}
    elif cfg["model_type"] == "kimi_k2":
        cfg = dict(cfg, model_type="deepseek_v3")
    cfg.pop("quantization_config", None)
    n = cfg["num_hidden_layers"]
    sd = {k: v for k, v in sd.items() if not _layer_at_least(k, n)}  # MTP layers: transformers drops them
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _layer_at_least(name: str, n: int) -> bool:
    parts = name.split(".")
    return "layers" in parts and int(parts[parts.index("layers") + 1]) >= n
