"""validate's long-context rows for DSA models: windows longer than the indexer's `index_topk`.

Below `index_topk` visible tokens DeepSeek Sparse Attention selects every token, so it equals dense
attention, and a broken or badly quantized lightning indexer changes no number measured on shorter
windows (the real GLM recipe validates at 512 tokens, its `index_topk` is 2048). These rows run a few
eval windows of `long_len` tokens (default 2 x index_topk, at most the model's max positions) through
the source and every checkpoint, in lockstep with the same streaming forward as the prompt pass
(quantkit.validation.forward.step, the reference's own indexer), and measure over the query positions
that see more than `index_topk` tokens, the only ones where the indexer decides anything:

    kl, top1           KL(source || checkpoint) and argmax agreement of the logits there
    indexer_overlap    per indexer-owning layer, the mean fraction of the source indexer's top-k
                       positions the checkpoint's indexer also selects; the row's value is the mean over
                       layers, `indexer_overlap_layers` the curve, `indexer_overlap_worst` its minimum

The rows live under validation.json's `long_context` (not `rows`: their per-layer curve is an
overlap, not a hidden-state error) and answer to the gates like any row (`indexer_overlap_min`,
`long_context_decode.kl_max`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.validation.forward import Stream, heads, step
from quantkit.validation.metrics import kl_top1

if TYPE_CHECKING:
    from quantkit.model.kvcache import KVCache
    from quantkit.runtime.distributed import Group

__all__ = ["long_card", "long_context", "long_markdown"]

def long_context(ckpts: dict[str, Checkpoint], ids: torch.Tensor, device, dtype, chunk: int = 16, group: Group | None = None,
                 owners: dict[int, dict[int, int]] | None = None, kv: KVCache | None = None) -> dict:
    """validation.json's `long_context`: one row per checkpoint over the (B, L) windows `ids`, each
    measured against the reference on the positions past index_topk. `kv` (quantkit.model.kvcache.KVCache,
    a pair only) adds `long_context_decode_kv`: decode/ with its index keys scored as the FP8 cache stores
    them (a prefill attends to its fresh latent, so in this pass the cache changes only the indexer's keys)."""
    arch = ckpts["reference"].arch
    topk = arch.index_topk
    # one window at a time: a window's activations (every stream's hidden states, one stream's attention)
    # are GBs at real width, and validate's budget counts one window (quantkit.planner.budgets.long_pass_bytes)
    sums: dict[str, list[float]] = {}  # row -> [KL past topk, top-1 agreements, positions, KL within, positions within]
    per_layer: dict[str, list[list[float]]] = {}
    for b in range(ids.shape[0]):
        window = ids[b:b + 1]
        streams = {m: Stream(m, m, None, ids=window) for m in ckpts}
        if kv is not None and "decode" in ckpts:
            streams["decode_kv"] = Stream("decode_kv", "decode", None, ids=window, kv=kv)
        models = [m for m in streams if m != "reference"]
        hits: dict[str, list[float]] = {m: [] for m in models}

        def on_layer(layer, hs, streams=streams, models=models, hits=hits, T=window.shape[1]):
            if not arch.indexer_layers[layer]:
                return  # IndexShare: this layer reuses the last selection
            ref = streams["reference"].ctx.topk[:, topk:]  # (1, T - topk, k): queries that see > topk tokens
            chosen = torch.zeros(*ref.shape[:2], T, dtype=torch.bool, device=ref.device).scatter_(-1, ref, True)
            for m in models:
                hits[m].append(float(chosen.gather(-1, streams[m].ctx.topk[:, topk:]).float().mean()))

        step(ckpts, list(streams.values()), device, dtype, on_layer, chunk=chunk, group=group, owners=owners)
        (ref_logits,) = heads(ckpts["reference"], [streams["reference"].h], dtype)
        for m in models:
            (logits,) = heads(ckpts[streams[m].model], [streams[m].h], dtype)
            kl, agree, n = kl_top1(ref_logits[:, topk:], logits[:, topk:])
            kl_in, _, n_in = kl_top1(ref_logits[:, :topk], logits[:, :topk])
            acc = sums.setdefault(m, [0.0] * 5)
            for i, v in enumerate((kl, agree, n, kl_in, n_in)):
                acc[i] += float(v)
            per_layer.setdefault(m, []).append(hits[m])
        del streams, ref_logits
    rows = {}
    for m, (kl_sum, agree_sum, count, kl_in_sum, count_in) in sums.items():
        layers = [sum(col) / len(col) for col in zip(*per_layer[m])]  # each layer's overlap, mean over windows
        rows[f"long_context_{m}"] = {
            "metrics": {"kl": kl_sum / count, "top1": agree_sum / count, "indexer_overlap": sum(layers) / len(layers)},
            "indexer_overlap_layers": dict(zip([i for i, own in enumerate(arch.indexer_layers) if own], layers)),
            "indexer_overlap_worst": min(layers),
            "kl_within_topk": kl_in_sum / count_in,
            "measured_on": f"{ids.shape[0]} x {ids.shape[1]} tokens, positions {topk}..{ids.shape[1] - 1} (past index_topk)",
        }
    return {"index_topk": topk, "num_samples": int(ids.shape[0]), "seq_len": int(ids.shape[1]), "rows": rows}


def long_markdown(d: dict) -> list[str]:
    """validation.md's long-context section (nothing for a model without a DSA indexer)."""
    lc = d.get("long_context")
    if not lc:
        return []
    lines = ["", f"## Long context (past the DSA window, index_topk {lc['index_topk']})", "",
             f"{lc['num_samples']} eval windows of {lc['seq_len']} tokens; KL and top-1 over the positions that see more "
             "than index_topk tokens (below it DSA selects every token and equals dense attention); indexer overlap: "
             "the fraction of the source indexer's selected positions each checkpoint's indexer also selects.", "",
             "| path | KL past index_topk | KL within | top-1 | indexer overlap (mean) | worst layer | per layer |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for row, r in lc["rows"].items():
        m = r["metrics"]
        per = ", ".join(f"{i}: {v:.3f}" for i, v in r["indexer_overlap_layers"].items())
        lines.append(f"| {row.removeprefix('long_context_')} | {m['kl']:.4g} | {r['kl_within_topk']:.4g} | {m['top1']:.4f} "
                     f"| {m['indexer_overlap']:.4f} | {r['indexer_overlap_worst']:.4f} | {per} |")
    return lines


def long_card(which: str, d: dict) -> list[str]:
    """The model card's long-context row for its 'Measured against the source' table (nothing without one)."""
    lc = d.get("long_context") or {}
    r = (lc.get("rows") or {}).get(f"long_context_{which}")
    if r is None:
        return []
    m = r["metrics"]
    return [f"| long context: {lc['num_samples']} x {lc['seq_len']} tokens, positions past the DSA window (index_topk "
            f"{lc['index_topk']}); indexer overlap {m['indexer_overlap']:.3f} (worst layer {r['indexer_overlap_worst']:.3f}) "
            f"| {m['kl']:.4g} | {m['top1']:.4f} | — | — | — |"]
