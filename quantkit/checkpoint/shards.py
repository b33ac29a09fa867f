"""Checkpoint I/O under the names the rest of quantkit (and its tests and scripts) imports.

The code lives in
    quantkit.checkpoint.index     the index, safetensors headers (read_header, DTYPES), the folder's links
    quantkit.checkpoint.expected  what config.json implies: required tensors, expected shapes
    quantkit.checkpoint.reader    Checkpoint: lazy, dequantizing, layer-at-a-time reading (Stored, all_finite)
    quantkit.checkpoint.writer    CheckpointWriter: background-saved parts, renamed into place when whole
and `file_sha256` in quantkit.runtime.files.
"""

from __future__ import annotations

from quantkit.checkpoint.expected import expected_shape, required_layer_tensors
from quantkit.checkpoint.index import DTYPES, INDEX, SINGLE, WEIGHT_FILES, read_header
from quantkit.checkpoint.reader import Checkpoint, Stored, all_finite, iter_layers
from quantkit.checkpoint.writer import CheckpointWriter
from quantkit.runtime.files import file_sha256

__all__ = [
    "DTYPES",
    "INDEX",
    "SINGLE",
    "WEIGHT_FILES",
    "Checkpoint",
    "CheckpointWriter",
    "Stored",
    "all_finite",
    "expected_shape",
    "file_sha256",
    "iter_layers",
    "read_header",
    "required_layer_tensors",
]
