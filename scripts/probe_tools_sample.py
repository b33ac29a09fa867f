"""The tool-call sample in docs/serving.md section 8: `quantkit probe --tool-task default` against
`transformers serve` on 127.0.0.1 serving the tiny GLM's RTN decode/ as stored, then against the tests'
fake OpenAI-compatible server (tests/probe/test_tools.py's ToolServer: an endpoint that calls tools,
one that answers 400 to `tools=`, one that ignores them). The main prompt set is one short chat, so
the tool prompts are what runs.

    python scripts/probe_tools_sample.py [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).resolve().parents[1] / "tests" / "probe")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/quantkit-probe-tools-sample")
    args = ap.parse_args()

    import torch
    from test_probe import TransformersServe
    from test_tools import PROMPTS, ToolServer

    from quantkit.conversion.pipeline import convert
    from quantkit.errors import QuantkitError
    from quantkit.probe.pipeline import probe

    torch.set_num_threads(2)
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    out = convert("tiny:glm-5.2", root / "glm", method="rtn", validate=False, progress=False).out
    (root / "prompts.json").write_text(json.dumps(PROMPTS))
    runs = [("transformers serve decode/ as stored", lambda: TransformersServe(root, out / "decode"))]
    runs += [(f"fake server, mode {m}", lambda m=m: ToolServer(m, out / "decode")) for m in ("calls", "refuse", "ignore")]
    for name, server in runs:
        print(f"== {name}")
        with server() as srv:
            try:
                r = probe(srv.url, out, model=getattr(srv, "folder", None), prompts=root / "prompts.json", kv_cache_dtype="bf16",
                          device="cpu", tool_task="default")
                print("\n".join(r.lines()))
            except QuantkitError as e:
                print(f"error: {e}")


if __name__ == "__main__":
    main()
