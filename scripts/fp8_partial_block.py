"""transformers' FP8 block dequantization on partial blocks (docs/formats.md, "transformers and partial FP8 blocks").

DeepSeek-native FP8 stores one multiplier per 128x128 block with a ceil-sized grid, so a projection
whose rows are not a multiple of 128 ends in a partial block (GLM-5.2's kv_a_proj_with_mqa: 576 rows,
a 5 x 48 grid). transformers' `Fp8Dequantize._dequantize_one` (integrations/finegrained_fp8.py; used on
CPU and with `dequantize=True`) infers the block as rows // grid_rows instead of reading
`weight_block_size`. This prints what it does to such tensors next to quantkit's block-128 dequant.

    python scripts/fp8_partial_block.py
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from quantkit.formats import fp8


def main() -> None:
    print(f"transformers {transformers.__version__}")
    gen = torch.Generator().manual_seed(0)
    for shape, what in (((576, 6144), "GLM-5.2 kv_a_proj_with_mqa"), ((576, 7168), "Kimi K2.6 kv_a_proj_with_mqa"),
                        ((160, 256), "tiny GLM kv_a_proj_with_mqa")):
        q, s = fp8.quantize(torch.randn(shape, generator=gen))
        ref = fp8.dequantize(q, s)
        try:
            got = Fp8Dequantize._dequantize_one(None, q, s, torch.float32)  # self is only used for FP4
        except ValueError as e:
            print(f"{what} {list(shape)}, grid {list(s.shape)}: raises ValueError: {e}")
            continue
        rel = ((got - ref).norm() / ref.norm()).item()
        print(f"{what} {list(shape)}, grid {list(s.shape)}: no error, relative error {rel:.3g} vs 128x128 blocks")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
