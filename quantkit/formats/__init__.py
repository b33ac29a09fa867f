"""Storage formats: pure functions from tensors to stored tensors and back.

- `int4`: compressed-tensors `pack-quantized` (what vLLM's and SGLang's Marlin MoE kernels load).
- `fp8`: DeepSeek-native FP8 e4m3 with 128x128 block multipliers (`weight_scale_inv`).
"""
