"""Quantization algorithms as tensor functions: GPTQ, AWQ, RTN and the per-expert guard that picks
between them. Tensors in, tensors out: no files, no checkpoints, no configs.
"""
