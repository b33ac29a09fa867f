"""What `--decode-rest bf16` costs on the tiny models: validate's rows for both decode layouts.

    python scripts/decode_rest_cost.py OUT_DIR

Converts tiny:glm-5.2 and tiny:kimi-k2.6 twice (default recipe; `decode_rest="bf16"`), validates each
pair with the recipe's settings and prints KL / top-1 / greedy agreement per row plus the
shared-tensor counts (docs/serving.md, "--decode-rest bf16").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import quantkit


def main(out: Path) -> None:
    print("| model | decode rest | row | KL | top-1 | greedy | shared identical / differ |")
    print("|---|---|---|---|---|---|---|")
    for spec in ("tiny:glm-5.2", "tiny:kimi-k2.6"):
        for rest in ("prefill", "bf16"):
            name = f"{spec.split(':')[1]}-{rest}"
            res = quantkit.convert(spec, out / name, decode_rest=rest, validate=True, progress=False)
            rows = res.validation.data["rows"]
            st = res.report["shared_tensors"]
            for row in ("decode", "cross_phase"):
                m = rows[row]["metrics"]
                print(f"| {spec} | {rest} | {row} | {m['kl']:.2e} | {m['top1']:.3f} | {m['greedy_agree']:.3f} "
                      f"| {st['identical']} / {st['differ']} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder for the four convert outputs")
    main(ap.parse_args().out)
