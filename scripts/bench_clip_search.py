#!/usr/bin/env python
"""CPU time of GPTQ's clip-search observers at real width: the group scales of `observer: mse` and
`observer: hessian` (quantkit.quant.gptq.mse_group_scales) for 2 experts' stacked gate+up at
GLM 5.2's widths (hidden 6144, expert width 2048: W [2, 4096, 6144]), one thread, group 128.

    python scripts/bench_clip_search.py                      # this checkout
    PYTHONPATH=/path/to/older/checkout python scripts/bench_clip_search.py   # another commit's code

Before 676a5bb the search allocated a new W-sized tensor at every step of every candidate; the
search's cost at real width was measured with this script on both sides of that commit.
"""

from __future__ import annotations

import argparse
import time

import torch

from quantkit.quant.gptq import mse_group_scales


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(2, 4096, 6144, generator=g)  # [E, 2 x expert width, hidden]
    d = torch.rand(2, 6144, generator=g)  # a damped diag(H) stand-in, [E, hidden]
    for name, kw in (("mse", {}), ("hessian", {"norm": 2.0, "weight": d})):
        t = time.process_time()
        mse_group_scales(W, 128, **kw)
        print(f"{name:8s} {time.process_time() - t:6.2f} s CPU for 2 experts' gate+up at hidden 6144")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
