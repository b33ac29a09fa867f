"""Checkpoints on disk: lazy sharded safetensors reading, background writing, manifest and verify,
the one-owner output lock and the crash-proof finish. Knows tensors and names, not quantization.
"""
