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


def dequantize_fp8_tf(q, scale_inv):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, scale_inv, torch.float32)


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
        elif k + "_scale_inv" in raw:
            out[k] = dequantize_fp8_tf(v, raw[k + "_scale_inv"]).float()
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
