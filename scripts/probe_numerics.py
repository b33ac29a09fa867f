"""The numbers in docs/serving.md section 8 ("What the last two runs show"): how far transformers'
own CPU forward of the tiny GLM's checkpoints is from quantkit's reference, teacher-forced on
held-out corpus windows (seed 4242, never trained on). About 2 minutes on 2 cores.

    python scripts/probe_numerics.py [--root DIR]

Prints, per served form: argmax agreement with quantkit's forward of the same checkpoint and the
largest difference of the top-1 log-probability; and, for the fp32 source, that difference per
position (exact before the DSA index_topk, 16; apart after it).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).resolve().parents[1] / "tests" / "probe")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/quantkit-probe-numerics")
    args = ap.parse_args()

    import torch
    from test_probe import _fp32_copy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.conversion.pipeline import convert
    from quantkit.synthetic.tiny import corpus, tiny_path
    from quantkit.validation.forward import logits

    torch.set_num_threads(2)
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    src = tiny_path("glm-5.2")
    dec = convert("tiny:glm-5.2", root / "glm", method="rtn", validate=False, progress=False).out / "decode"
    tok = AutoTokenizer.from_pretrained(str(dec))
    words = corpus(2000, seed=4242).split()

    def windows(L: int, n: int) -> torch.Tensor:
        return torch.tensor([tok.encode(" ".join(words[i * L:(i + 1) * L]))[:L] for i in range(n)])

    def compare(name: str, served: Path, ref: Path, ids: torch.Tensor, per_position: bool = False) -> None:
        r = torch.log_softmax(logits(str(ref), ids, device="cpu").float(), -1)  # (B, T, V)
        model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32).eval()
        with torch.no_grad():
            t = torch.log_softmax(model(ids).logits.float(), -1)
        top = r.argmax(-1, keepdim=True)
        d = (t - r).abs().gather(-1, top)[..., 0]  # (B, T): top-1 log-probability difference
        print(f"{name:<44} {ids.shape[0]}x{ids.shape[1]}: argmax agree {float((t.argmax(-1) == r.argmax(-1)).float().mean()):.4f}, "
              f"top-1 logprob max |diff| {float(d.max()):.3f} nats")
        if per_position:
            print("   per position:", " ".join(f"{float(x):.3f}" for x in d.amax(0)))

    short = windows(16, 64)  # dense under DSA (index_topk 16)
    a, b = (logits(str(m), short, device="cpu").argmax(-1) for m in (src, dec))
    print(f"{'for scale: quantkit source vs RTN decode/':<44} 64x16: argmax agree {float((a == b).float().mean()):.4f}")
    compare("FP8 source as stored (transformers CPU FP8)", src, src, short)
    compare("decode/ as stored (compressed-tensors, W8A8)", dec, dec, short)
    compare("source, fp32 copy (oracle dequantization)", _fp32_copy(src, root / "src-f32"), src, windows(32, 24), per_position=True)


if __name__ == "__main__":
    main()
