#!/usr/bin/env python
"""Build (or find) the real-shape synthetic checkpoints and print their folders and sizes.

    python scripts/build_realshape.py              # both: realshape:glm-5.2, realshape:kimi-k2.6
    python scripts/build_realshape.py glm-5.2

Cached under QUANTKIT_CACHE (default ~/.cache/quantkit)/realshape; see quantkit/synthetic/realshape.py.
"""

from __future__ import annotations

import argparse
import time

from quantkit.synthetic.realshape import REALSHAPE_NAMES, realshape_path


def main(names: list[str]) -> None:
    for name in names or REALSHAPE_NAMES:
        t0 = time.time()
        folder = realshape_path(name)
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        print(f"realshape:{name}  {folder}  {size / 1e9:.3f} GB  ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"any of {', '.join(REALSHAPE_NAMES)} (default: all)")
    main(ap.parse_args().names)
