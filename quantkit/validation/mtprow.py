"""validate's MTP row: the MTP layer (speculative decoding's draft, quantkit.model.mtp) of each
checkpoint run on its own model's last hidden states over the eval windows, as a server runs it.

For a window t_0..t_{T-1} each checkpoint's MTP predicts t_{i+2} at positions i = 0..T-2 from its
main model's h_i and embed(t_{i+1}). Measured: KL(source MTP || this MTP) and top-1 agreement over
those T - 1 positions; each MTP's acceptance, the share of positions whose draft (the MTP's argmax at
i) equals its own main model's greedy token at i + 1, which is what SGLang's and vLLM's speculative
decoding accepts (with the window's tokens as the accepted prefix); and each MTP's top-1 accuracy
against the actual t_{i+2} (positions 0..T-3). Acceptance is per window, so each row carries its
paired difference from the source's (this minus source, SE over windows): a dropped or damaged MTP
layer costs speculative-decoding speed, not quality, and shows there. validation.json's `mtp`; a
model without an MTP layer has `{"layer": None, "note": ...}` and no row anywhere.

The row's KL is mostly the main model's error, not the MTP layer's: the MTP reads the main model's
last hidden state, and on the tiny GLM the decode main model's drift of h moves the MTP's logits
about 100 times as much as the MTP's own INT4 experts do (docs/benchmarks.md, "The MTP layer"). So
each row keeps its per-window KL and top-1 (`windows`) and the KL's standard error over windows:
two checkpoints of one source, validated on the same windows, compare as a paired difference
(quantkit.validation.metrics.paired), never as two point estimates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.model.mtp import embed_name, head_name, mtp_input, mtp_logits, shifted
from quantkit.model.reference import Context
from quantkit.validation.forward import heads
from quantkit.validation.layerstream import streamed_layer
from quantkit.validation.metrics import mean_se, paired, window_kl_top1

if TYPE_CHECKING:
    from quantkit.runtime.distributed import Group


NO_MTP_ROW = "no MTP layer"
_TITLES = {"prefill": "prefill (FP8)", "decode": "decode (INT4)"}
_EXTRAS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def mtp_forward(ckpt: Checkpoint, h_last: torch.Tensor, ids: torch.Tensor, device, dtype, chunk: int = 16,
                group: Group | None = None) -> torch.Tensor:
    """The first MTP layer's logits (B, T - 1, V) for windows `ids` (B, T) whose main-model last
    hidden states are `h_last` (B, T, D); its routed experts streamed `chunk` at a time."""
    a = ckpt.arch
    layer, pre = a.num_hidden_layers, a.layer_prefix(a.num_hidden_layers)
    table = ckpt.get(embed_name(a, layer, ckpt.tensors), dtype)
    h, e = shifted(h_last, ids, table)
    del table
    w = {k: ckpt.get(pre + k, dtype).to(device) for k in _EXTRAS}
    ctx = Context.build(a, h.shape[1], device, dtype)
    x = mtp_input(h, e, w, a, ctx.positions)
    del h, e
    (y,) = streamed_layer(ckpt, layer, [x], [ctx], device, dtype, chunk, group, None)
    return mtp_logits(y, w, ckpt.get(head_name(a, layer, ckpt.tensors), dtype), a)


def _accuracy(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of positions 0..T-3 whose argmax is the actual token two ahead, t_{i+2}."""
    return float((logits[:, :-1].argmax(-1).cpu() == ids[:, 2:].cpu()).float().mean())


def acceptance(logits: torch.Tensor, h_last: torch.Tensor, ckpt: Checkpoint, dtype) -> torch.Tensor:
    """Per window (B,): the share of MTP positions i = 0..T-2 whose draft, argmax of `logits` (B, T - 1, V),
    equals the main model's greedy token at i + 1 (its head on `h_last` (B, T, D))."""
    (main,) = heads(ckpt, [h_last], dtype)
    return (logits.argmax(-1).cpu() == main[:, 1:].argmax(-1).cpu()).double().mean(-1)


def mtp_measure(ckpts: dict[str, Checkpoint], hs: dict[str, torch.Tensor], ids: torch.Tensor, models: list[str],
                device, dtype, chunk: int = 16, group: Group | None = None) -> dict:
    """validation.json's `mtp`: the source's MTP against each model's (rows), on the prompt pass's
    last hidden states `hs` (checkpoint -> (B, T, D))."""
    ref = ckpts["reference"]
    if not ref.arch.num_mtp_layers or ids.shape[1] < 3:
        return {"layer": None, "note": NO_MTP_ROW if not ref.arch.num_mtp_layers else "windows too short for MTP"}
    missing = [m for m in models if not ckpts[m].arch.num_mtp_layers]
    if missing:
        return {"layer": None, "note": f"{NO_MTP_ROW} in {', '.join(missing)}"}
    ref_logits = mtp_forward(ref, hs["reference"], ids, device, dtype, chunk, group)
    ref_acc, ref_accept = _accuracy(ref_logits, ids), acceptance(ref_logits, hs["reference"], ref, dtype)
    rows = {}
    for m in models:
        logits = mtp_forward(ckpts[m], hs[m], ids, device, dtype, chunk, group)
        kl, top1 = window_kl_top1(ref_logits, logits)  # (B,) each: windows are the independent units
        accept = acceptance(logits, hs[m], ckpts[m], dtype)
        delta = paired(accept, ref_accept)
        rows[m] = {"kl": float(kl.mean()), "kl_se": mean_se(kl)[1], "top1": float(top1.mean()),
                   "accuracy": _accuracy(logits, ids), "reference_accuracy": ref_acc,
                   "acceptance": float(accept.mean()), "acceptance_se": mean_se(accept)[1],
                   "acceptance_delta": delta.mean, "acceptance_delta_se": None if delta.n < 2 else delta.se,
                   "windows": {"kl": kl.tolist(), "top1": top1.tolist(), "acceptance": accept.tolist()}}
        del logits
    T = ids.shape[1]
    return {"layer": ref.arch.num_hidden_layers,
            "reference": {"accuracy": ref_acc, "acceptance": float(ref_accept.mean()), "acceptance_se": mean_se(ref_accept)[1],
                          "windows": {"acceptance": ref_accept.tolist()}},
            "rows": rows,
            "measured_on": f"{ids.shape[0]} eval windows: {T - 1} MTP positions per window on each model's own last hidden "
                           f"states; acceptance against its own main model's greedy token one ahead ({T - 1} positions), "
                           f"accuracy against the actual token two ahead ({T - 2} positions)"}


def mtp_markdown(d: dict) -> list[str]:
    """validation.md's MTP section (nothing for a model without an MTP layer)."""
    m = d.get("mtp") or {}
    if not m.get("rows"):
        return []
    ref = m["reference"]
    lines = ["", f"## MTP layer (layer {m['layer']}, speculative decoding's draft)", "",
             f"Measured on {m['measured_on']}. Acceptance: the draft equals the model's own next greedy token (what "
             f"speculative decoding accepts). Source MTP acceptance {_accept(ref)}, accuracy {ref['accuracy']:.4f}.", "",
             "| path | acceptance | Δ vs source ± SE (paired) | KL vs source MTP (nats) | top-1 vs source MTP "
             "| MTP accuracy (t+2) | source MTP accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row, r in m["rows"].items():
        lines.append(f"| {_TITLES.get(row, row)} MTP | {_accept(r)} | {_delta(r)} | {r['kl']:.4g}{_se(r)} | {r['top1']:.4f} "
                     f"| {r['accuracy']:.4f} | {r['reference_accuracy']:.4f} |")
    return lines


def _se(r: dict) -> str:
    """' ± SE' over windows (none for one window, or a row from before SEs were kept)."""
    return f" ± {r['kl_se']:.2g}" if r.get("kl_se") is not None else ""


def _accept(r: dict) -> str:
    """A row's acceptance ± its SE over windows ('—' in a record from before acceptance was measured)."""
    if r.get("acceptance") is None:
        return "—"
    return f"{r['acceptance']:.4f}" + (f" ± {r['acceptance_se']:.2g}" if r.get("acceptance_se") is not None else "")


def _delta(r: dict) -> str:
    if r.get("acceptance_delta") is None:
        return "—"
    return f"{r['acceptance_delta']:+.4f}" + (f" ± {r['acceptance_delta_se']:.2g}" if r.get("acceptance_delta_se") is not None
                                               else "")


def mtp_card(which: str, d: dict) -> tuple[list[str], list[str]]:
    """The card's MTP row for its 'Measured against the source' table, and the lines under it
    (both empty without an MTP layer)."""
    m = d.get("mtp") or {}
    r = (m.get("rows") or {}).get(which)
    if r is None:
        return [], []
    lines = [f"MTP draft accuracy (its top-1 is the actual token two ahead): this checkpoint {r['accuracy']:.4f}, "
             f"the source {r['reference_accuracy']:.4f}."]
    if r.get("acceptance") is not None:
        lines[:0] = [f"MTP acceptance (the draft equals this checkpoint's own next greedy token, what SGLang's and vLLM's "
                     f"speculative decoding accepts): this checkpoint {_accept(r)}, the source {_accept(m['reference'])}; "
                     f"Δ {_delta(r)} (paired over {len(r['windows']['acceptance'])} windows).", ""]
    return ([f"| MTP layer (speculative draft) vs the source's MTP | {r['kl']:.4g}{_se(r)} | {r['top1']:.4f} | — | — | — |"],
            lines)
