"""Where validate's MTP row comes from on the tiny GLM: the main model's drift or the MTP layer's own experts.

    python scripts/mtp_row.py [--calib 8x64] [--windows 32] [--json]

Converts tiny:glm-5.2 twice (GPTQ, RTN; no validation) with the given calibration (samples x tokens),
then on held-out windows of 48 tokens (never seen by training or calibration) measures, per window,
KL to the source's MTP logits of:

    row      each decode checkpoint's MTP on its own main model's last hidden state (validate's MTP row)
    drift    the source's MTP on the decode main model's hidden state (the main model's share)
    alone    the decode MTP on the source's hidden state (the MTP layer's own experts' share)

plus the main model's own KL, each as GPTQ - RTN paired over windows with its standard error
(quantkit.validation.metrics.paired), and the MTP layer's experts as the guard judged them (held-out
error of GPTQ / RTN per expert). Set QUANTKIT_TINY_SEED for another build of the tiny GLM (each CPU
trains its own). docs/benchmarks.md "The MTP layer" quotes its output.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.conversion.pipeline import convert
from quantkit.inputs.tokens import load_tokens
from quantkit.synthetic.tiny import tiny_path, tiny_seed
from quantkit.validation.forward import run
from quantkit.validation.metrics import paired, token_kl
from quantkit.validation.mtprow import mtp_forward

PARTS = ("main", "row", "drift", "alone")


def _last_and_logits(ckpt: Checkpoint, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seen = {}
    L = ckpt.arch.num_hidden_layers
    lg = run(ckpt, ids, device="cpu", on_layer=lambda layer, h: seen.update({layer: h}) if layer == L - 1 else None)
    return seen[L - 1], lg


def measure(calib: tuple[int, int], windows: int, root: Path, recipe: str | None = None) -> dict:
    src = Checkpoint(tiny_path("glm-5.2"))
    ids = load_tokens("synthetic:heldout", tokenizer=src.folder, num_samples=windows, seq_len=48).ids
    h_ref, lg_ref = _last_and_logits(src, ids)
    m_ref = mtp_forward(src, h_ref, ids, "cpu", torch.float32)
    per, experts = {}, []
    for method in ("gptq", "rtn"):
        pair = convert("tiny:glm-5.2", root / method, recipe=recipe, method=method, validate=False, progress=False,
                       device="cpu", num_samples=calib[0], seq_len=calib[1])
        dec = Checkpoint(pair.decode)
        h, lg = _last_and_logits(dec, ids)
        per[method] = {
            "main": token_kl(lg_ref, lg).mean(-1),  # (B,): mean over a window's positions
            "row": token_kl(m_ref, mtp_forward(dec, h, ids, "cpu", torch.float32)).mean(-1),
            "drift": token_kl(m_ref, mtp_forward(src, h, ids, "cpu", torch.float32)).mean(-1),
            "alone": token_kl(m_ref, mtp_forward(dec, h_ref, ids, "cpu", torch.float32)).mean(-1),
        }
        if method == "gptq":
            L = src.arch.num_hidden_layers
            experts = [{"expert": e["expert"], "tokens": e["tokens"], "stored": e["method"],
                        "err_over_rtn": e["err"] / e["err_rtn"] if e.get("err") else None}
                       for e in pair.report["experts"] if e["layer"] == L]
    out = {"seed": tiny_seed(), "recipe": recipe or "tiny-glm-5.2", "calibration": f"{calib[0]}x{calib[1]}", "windows": windows, "mtp_experts": experts}
    for k in PARTS:
        d = paired(per["gptq"][k], per["rtn"][k])
        out[k] = {"gptq": float(per["gptq"][k].mean()), "rtn": float(per["rtn"][k].mean()), "diff": d.mean, "se": d.se,
                  "z": d.mean / d.se}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", default="8x64", help="calibration windows x tokens (tests/model/test_mtp.py: 8x64)")
    ap.add_argument("--windows", type=int, default=32, help="held-out windows of 48 tokens")
    ap.add_argument("--recipe", default=None, help="recipe name or YAML path (default: the model's, tiny-glm-5.2)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    n, t = (int(v) for v in args.calib.split("x"))
    with tempfile.TemporaryDirectory() as d, torch.no_grad():
        out = measure((n, t), args.windows, Path(d), args.recipe)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    ratios = [e["err_over_rtn"] for e in out["mtp_experts"] if e["err_over_rtn"] is not None]
    print(f"tiny GLM seed {out['seed']}, recipe {out['recipe']}, calibration {out['calibration']}, {out['windows']} held-out windows x 48")
    print(f"MTP experts (guard, held-out error GPTQ / RTN): {len(ratios)} judged, "
          f"{min(ratios):.2f}-{max(ratios):.2f}, stored " + ", ".join(sorted({e['stored'] for e in out['mtp_experts']})))
    print("| part | GPTQ KL | RTN KL | GPTQ - RTN | z |")
    print("|---|---:|---:|---:|---:|")
    for k in PARTS:
        r = out[k]
        print(f"| {k} | {r['gptq']:.3g} | {r['rtn']:.3g} | {r['diff']:+.2e} ± {r['se']:.1e} | {r['z']:+.1f} |")


if __name__ == "__main__":
    main()
