"""The sample in docs/serving.md section 8: `transformers serve` on 127.0.0.1 serving the tiny GLM's
source and RTN decode/ (fp32 copies made by the test oracle), then decode/ and the FP8 source as
stored, each probed with a prompt set on which quantkit's source and decode part (chosen here, as
tests/probe/test_probe.py chooses it). About 6 minutes on 2 cores.

    python scripts/probe_sample.py [--root DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).resolve().parents[1] / "tests" / "probe")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/quantkit-probe-sample")
    args = ap.parse_args()

    import torch
    from test_probe import TransformersServe, _fp32_copy, _parting_prompts

    from quantkit.conversion.pipeline import convert
    from quantkit.probe.pipeline import probe
    from quantkit.synthetic.tiny import tiny_path

    torch.set_num_threads(2)
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    src = tiny_path("glm-5.2")
    out = convert("tiny:glm-5.2", root / "glm", method="rtn", validate=False, progress=False).out
    prompts = _parting_prompts(out, src, root)
    print(prompts.read_text())
    for name, folder in (("source (fp32 copy)", _fp32_copy(src, root / "source")),
                         ("decode/ (fp32 copy)", _fp32_copy(out / "decode", root / "decode")),
                         ("decode/ as stored", out / "decode"), ("the FP8 source as stored", src)):
        with TransformersServe(root, folder) as srv:
            r = probe(srv.url, out, model=srv.folder, prompts=prompts, kv_cache_dtype="bf16", device="cpu", concurrency=2)
        print(f"== transformers serve {name}")
        print("\n".join(r.lines()))


if __name__ == "__main__":
    main()
