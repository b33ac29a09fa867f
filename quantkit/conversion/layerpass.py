"""Calibrated conversion of one decoder layer, streaming the calibration tokens from the store.

`convert` runs every calibration token through the layer being converted. Here no token-sized
tensor exists beyond the two arrays of the activation store (quantkit.conversion.activations): every pass
reads one micro-batch of samples as float32, works on it, and writes it back.

    attention pass   per micro-batch: h += attention(h); x = post_attention_layernorm(h)
                     dense layer: h += MLP(x)
                     MoE layer:   store x; route x (kept: top-k ids and weights, 12 B per slot);
                                  h += shared_expert(x)
    per chunk of routed experts (their count from the budget, quantkit.conversion.cost):
      Hessians       per micro-batch, each expert's fit tokens (quantkit.quant.experts' policy: every
                     HOLDOUT-th routed token is held out): H_e += x_e^T x_e (gate and up share it);
                     a starved expert with fallback all_tokens uses the layer's fit tokens; the
                     held-out rows are kept for the guard
      GPTQ           gate and up as one row-stacked weight against one factored H_e
      down Hessians  per micro-batch: z = silu(x_e gate_hat^T) * (x_e up_hat^T), Hd_e += z^T z
      GPTQ           down
      guard          each expert's held-out output error vs RTN's; the lower is stored
      output pass    per micro-batch: h += sum_e w_e * expert_e(x_e) under the decode weights

    gptq.low_dampening: the probe windows have their own small store and take the attention and
    output passes too (never the Hessians); GPTQ runs at both dampenings in one batched call, and
    the guard admits the low one where its error on the expert's probe tokens is <= RTN's

So the work space is one micro-batch of tokens plus one chunk of experts (weights, Hessians and
the GPTQ work), whatever the number of calibration tokens. DSA: for seq_len <= index_topk the
indexer selects every causal key, so attention is dense and no selection is kept; otherwise each
micro-batch's selection is kept for the next (IndexShare) layers, as (B, T, k) indices.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from quantkit.conversion.activations import ActivationStore
from quantkit.model.kvcache import KVAbsmax
from quantkit.model.moe import mlp, route, shared_expert, swiglu, weighted
from quantkit.model.ops import rms_norm
from quantkit.model.reference import attention
from quantkit.quant.experts import HOLDOUT, is_heldout, is_heldout_window, run_gptq, starved
from quantkit.quant.gptq import QuantizedWeight
from quantkit.runtime.machine import return_freed_memory

if TYPE_CHECKING:  # annotations only, as in conversion/stages.py
    from quantkit.recipe import Recipe
    from quantkit.runtime.distributed import Group


class LayerRouting:
    """Top-k expert ids (int16) and weights (float32) of every calibration token, (N*T, k)."""

    def __init__(self, idx: list[torch.Tensor], weight: list[torch.Tensor], tokens_per_batch: list[int], n_experts: int):
        self.idx = idx[0] if len(idx) == 1 else torch.cat(idx)  # one list entry: the layer's whole buffer, no copy
        self.weight = weight[0] if len(weight) == 1 else torch.cat(weight)
        self.starts = [0]
        for n in tokens_per_batch:
            self.starts.append(self.starts[-1] + n)
        flat = self.idx.flatten().long()  # counts without a data-dependent shape (bincount's is)
        self.counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.idx[a:b], self.weight[a:b]


def attention_pass(store: ActivationStore, w: dict, ctx, layer: int, topks: list, moe: bool,
                   group: Group | None = None) -> LayerRouting | None:
    """The attention half (and a dense layer's MLP, or a MoE layer's shared expert), per micro-batch.

    With several ranks (`group`), each computes only its own micro-batches (Group.owns_batch), then
    x, the routing and the DSA selections are given to every rank (the experts' Hessians need all
    tokens), and the KV-cache maxima combined. h stays split until the end of the layer (the
    routed-expert outputs are added by the same owners; conversion shares h then). Every token's
    arithmetic is a single process's, so the bytes are too."""
    a = ctx.arch
    eps = a.rms_norm_eps
    x_arr = store.open_x() if moe else None
    n_batches = sum(1 for _ in store.slices())
    idx, wt = [None] * n_batches, [None] * n_batches
    small = torch.int16 if a.n_routed_experts < 2**15 else torch.int32
    if moe:  # the whole layer's routing, allocated before the loop: (N*T, k) each
        # per-micro-batch tensors kept to the end would sit between the freed temporaries of every
        # micro-batch and pin them in glibc's heap (at 512 x 512 tokens the RSS grew 500 MB over one pass)
        n, k = store.shape[0] * store.shape[1], a.num_experts_per_tok
        idx_all = torch.empty(n, k, dtype=small, device=store.compute)
        wt_all = torch.empty(n, k, dtype=torch.float32, device=store.compute)
    fresh = None
    for i, sl in enumerate(store.slices()):
        if group is not None and not group.owns_batch(i):
            continue
        hb = store.h.read(sl)  # (B, T, D) float32
        ctx.topk = topks[i]
        hb += attention(rms_norm(hb, w["input_layernorm.weight"], eps), w, ctx, layer)
        if ctx.topk is not None and ctx.topk is not topks[i]:  # this layer's DSA indexer selected anew
            if fresh is None:  # one (N, T, k) buffer for the layer's selections, for the same reason as the routing's
                fresh = torch.empty((store.shape[0], *ctx.topk.shape[1:]), dtype=ctx.topk.dtype, device=ctx.topk.device)
            topks[i] = fresh[sl].copy_(ctx.topk)
        xb = rms_norm(hb, w["post_attention_layernorm.weight"], eps)
        if moe:
            x_arr.write(sl, xb)
            ti, tw = route(xb.reshape(-1, xb.shape[-1]), w, a)  # (B*T, k)
            rows = slice(sl.start * store.shape[1], sl.stop * store.shape[1])
            idx[i], wt[i] = idx_all[rows].copy_(ti), wt_all[rows].copy_(tw)
            del ti, tw
            if (shared := shared_expert(xb, w, a)) is not None:
                hb += shared
        else:
            hb += mlp(xb, w, "mlp.")
        store.h.write(sl, hb)
        del hb, xb
    split = group is not None and group.distributed
    if split:  # the other ranks' micro-batches arrive as their own tensors
        _share_attention(group, store, ctx, layer, topks, idx, wt, moe)
    if not moe:
        return None
    # single process: every entry is a view of idx_all / wt_all, in order, so the buffers are the routing
    return LayerRouting(idx if split else [idx_all], wt if split else [wt_all], [len(t) for t in idx], a.n_routed_experts)


def _share_attention(group: Group, store: ActivationStore, ctx, layer: int, topks: list, idx: list, wt: list,
                     moe: bool) -> None:
    """After a split attention pass: every rank gets every micro-batch's x, routing and DSA
    selection (in place in `topks`, `idx`, `wt`), and the layer's KV-cache maxima over all tokens.
    The selections are only needed by their owner's next layers, but the resume state (rank 0)
    keeps them all, and a resumed run may have another number of ranks."""
    from quantkit.runtime import distributed

    dev = store.compute
    topks[:] = distributed.share_list(group, topks, dev, f"layer {layer}: DSA selections")
    if moe:
        distributed.share_rows(group, store, [store.x], f"layer {layer}: MoE inputs")
        idx[:] = distributed.share_list(group, idx, dev, f"layer {layer}: routed experts")
        wt[:] = distributed.share_list(group, wt, dev, f"layer {layer}: routing weights")
    if isinstance(ctx.kv, KVAbsmax):
        distributed.max_kv(group, ctx.kv, layer)


def _tokens(idx_b: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token rows, top-k slot) of the micro-batch's tokens routed to expert e."""
    return (idx_b == e).nonzero(as_tuple=True)


def _passes(store: ActivationStore, routing: LayerRouting, group: Group | None = None):
    """(micro-batch index, slice, x as float32 (B*T, D), top-k ids, top-k weights) in order; with
    `group`, only the micro-batches that rank owns."""
    D = store.shape[-1]
    for i, sl in enumerate(store.slices()):
        if group is not None and not group.owns_batch(i):
            continue
        idx_b, wt_b = routing.batch(i)
        yield i, sl, store.x.read(sl).reshape(-1, D), idx_b, wt_b


def _rows(idx_b: torch.Tensor, e: int, seen: int, start: int, use_all: bool,
          window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit rows, held-out rows) of this micro-batch for expert e, by quantkit.quant.experts' one policy:
    every HOLDOUT-th entry of the expert's routed-token list (or, with use_all, of the layer's
    token list) is held out; with window = seq_len > 0 (gptq.holdout: window), every token of every
    HOLDOUT-th calibration window instead. `seen`: the expert's routed tokens in earlier
    micro-batches; `start`: the micro-batch's first token in the layer."""
    if use_all:
        rows = torch.arange(len(idx_b), device=idx_b.device)
        pos = start + rows
    else:
        rows = _tokens(idx_b, e)[0]
        pos = seen + torch.arange(len(rows), device=rows.device)
    held = is_heldout_window(start + rows, window) if window else is_heldout(pos)
    return rows[~held], rows[held]


def _gate_norms(routing: LayerRouting, run: list[int], weighting: str) -> list[float]:
    """Per expert, the mean over its routed tokens of the token weight that hessian_weighting gives
    (router weight, or its square), so that weighted tokens count as many tokens in all: the
    prior's and dampening's relative sizes do not change with the weighting."""
    out = []
    for e in run:
        w = routing.weight[routing.idx == e].double()
        w = w.square() if weighting == "gate2" else w
        out.append(float(w.mean()) if len(w) and float(w.mean()) > 0 else 1.0)
    return out


def expert_hessians(store: ActivationStore, routing: LayerRouting, run: list[int], all_tokens: set[int],
                    inputs=None, held: dict | None = None, prior: int = 0, window: int = 0,
                    weighting: str = "none", fit_rows: list | None = None) -> torch.Tensor:
    """H_e = 2/n_e sum x x^T [len(run), in, in] over each expert's fit tokens (the layer's fit
    tokens for the experts in `all_tokens`), accumulated one micro-batch at a time; held-out tokens
    never enter. `inputs(j, x_e)` maps an expert's input rows to the rows of the Linear whose Hessian
    this is (default: x itself). `held`, when a dict, receives each expert's held-out input rows
    (the guard's data: 1/HOLDOUT of its routed tokens).

    prior = p > 0 (gptq.prior_tokens): H_e = (n_e H_e + p H_all) / (n_e + p), H_all the Hessian of
    the same Linear over every fit token of the layer: an expert with few routed tokens is pulled
    towards the layer's statistics, one with many keeps its own. Accumulated in place (the layer's
    fit-token count is known up front), so no second (C, in, in) array.

    window = seq_len > 0: hold out by calibration window (gptq.holdout: window; `_rows`).
    weighting (gptq.hessian_weighting): "gate" weights each routed token's x x^T by its router
    weight for the expert (MoEQuant's affinity-guided Hessian), "gate2" by that weight squared (the
    factor the token's expert-output error has in the layer output); each divided by the expert's
    mean of it (`_gate_norms`). Experts fitted on every token (`all_tokens`) stay unweighted.
    `fit_rows`, when a list, receives each expert's fit-token count (gptq.width_prior's n)."""
    H = None
    N = routing.starts[-1]
    if not prior:
        n_all = 0
    elif window:
        n_all = N - (N // window) // HOLDOUT * window
    else:
        n_all = N - N // HOLDOUT
    w_all = prior / max(n_all, 1)
    n = torch.zeros(len(run), dtype=torch.float64)
    rows = [0] * len(run)
    seen = {e: 0 for e in run}
    parts: dict[int, list] = {e: [] for e in run}
    norms = _gate_norms(routing, run, weighting) if weighting != "none" else None
    for i, _, xb, idx_b, wt_b in _passes(store, routing):
        start = routing.starts[i]
        for j, e in enumerate(run):
            fit, out = _rows(idx_b, e, seen[e], start, e in all_tokens, window)
            if held is not None:  # the guard judges on the expert's own held-out routed tokens
                routed_out = _rows(idx_b, e, seen[e], start, False, window)[1] if e in all_tokens else out
                if len(routed_out):
                    parts[e].append(xb[routed_out])
            seen[e] += int((idx_b == e).sum())
            xe = xb[fit]
            rows[j] += len(xe)
            if inputs is not None:
                xe = inputs(j, xe)
            if H is None:
                H = torch.zeros(len(run), xe.shape[-1], xe.shape[-1], device=xb.device)
            if norms is not None and e not in all_tokens:
                c = (wt_b * (idx_b == e)).sum(-1)[fit].to(xe.dtype)  # each fit token's router weight for e
                c = (c.square() if weighting == "gate2" else c) / norms[j]
                if len(xe):
                    H[j].addmm_((xe * c[:, None]).T, xe)
                n[j] += float(c.sum())
            else:
                if len(xe):
                    H[j].addmm_(xe.T, xe)
                n[j] += len(xe)
            if prior and e not in all_tokens:
                xa = xb[_rows(idx_b, e, seen[e], start, True, window)[0]]
                xa = inputs(j, xa) if inputs is not None else xa
                H[j].addmm_(xa.T, xa, alpha=w_all)
        del xb
    for j, e in enumerate(run):
        H[j] *= 2.0 / max(float(n[j]) + (prior if e not in all_tokens else 0), 1.0)
    if held is not None:
        for e in run:
            held[e] = torch.cat(parts[e]) if parts[e] else None
    if fit_rows is not None:
        fit_rows[:] = rows
    return H


def _layer_heldout(store: ActivationStore, window: int = 0) -> torch.Tensor:
    """Every held-out token of the layer (the guard's data for an expert with none of its own)."""
    D = store.shape[-1]
    rows = []
    for i, sl in enumerate(store.slices()):
        xb = store.x.read(sl).reshape(-1, D)
        start = sl.start * store.shape[1]
        pos = start + torch.arange(len(xb), device=xb.device)
        rows.append(xb[is_heldout_window(pos, window) if window else is_heldout(pos)])
    return torch.cat(rows)


def _probe_rows(probe: tuple, experts: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The probe's MoE inputs for this layer, whole ((P T, D) float32: a few windows), and the rows
    the probe's routing sends each of `experts`."""
    store, routing = probe
    D = store.shape[-1]
    x = torch.cat([store.x.read(sl).reshape(-1, D) for sl in store.slices()])
    return x, {e: (routing.idx == e).any(-1).nonzero(as_tuple=True)[0] for e in experts}


def _expert_q(qgu: QuantizedWeight, qd: QuantizedWeight, j: int, I: int) -> dict[str, QuantizedWeight]:
    """Expert j of a chunk's GPTQ results: gate and up are the row-stacked gate/up's halves."""
    return {"gate_proj": QuantizedWeight(qgu.q[j, :I], qgu.scale[j, :I]),
            "up_proj": QuantizedWeight(qgu.q[j, I:], qgu.scale[j, I:]),
            "down_proj": QuantizedWeight(qd.q[j], qd.scale[j])}


def gptq_experts(store: ActivationStore, routing: LayerRouting, ew: dict[str, torch.Tensor], experts: list[int],
                 recipe: Recipe, group_size: int, layer: int, probe: tuple | None = None):
    """GPTQ for a chunk of routed experts from streamed Hessians, with quantkit.quant.experts' policy:
    fit on the non-held-out tokens, starved experts take gptq.fallback, and each expert is kept
    only if its held-out output error beats RTN's (guard_against_rtn). Same contract as
    conversion.quantize_experts followed by the guard. With `probe` ((probe store, its routing):
    gptq.low_dampening) each expert is also quantized at the low dampening, on the same Hessians
    (down's from the gate/up at gptq.dampening), and the guard admits it by its probe error."""
    from quantkit.quant.experts import ExpertRecord, guard_against_rtn, low_dampening, prior_of, probe_inputs, rtn_expert

    g = recipe.gptq
    counts = routing.counts
    window = store.shape[1] if getattr(g, "holdout", "position") == "window" else 0
    weighting = getattr(g, "hessian_weighting", "none")
    if window:  # starved: too few routed tokens outside the held-out windows
        N = routing.starts[-1]
        fit = ~is_heldout_window(torch.arange(N, device=routing.idx.device), window)
        flat = routing.idx[fit].flatten().long()
        fit_counts = torch.zeros_like(counts).scatter_add_(0, flat, torch.ones_like(flat))
        hungry = {e for e in experts if int(fit_counts[e]) < max(g.min_tokens, 1)}
    else:
        hungry = {e for e in experts if starved(int(counts[e]), g)}
    records, quantized = {}, {}
    for e in experts:
        if e in hungry and g.fallback == "rtn":
            quantized[e] = rtn_expert(ew, e, group_size)
            records[e] = ExpertRecord(layer, e, int(counts[e]), "rtn", fallback="rtn")
    run = [e for e in experts if e not in quantized]
    if run:
        all_tokens = hungry & set(run)
        I, Wgu_width = ew[f"mlp.experts.{run[0]}.gate_proj.weight"].shape
        # gate and up: one Hessian per expert, shared; the weights stacked by rows [C, 2I, D]
        held: dict = {}
        n_fit: list = []
        H = expert_hessians(store, routing, run, all_tokens, held=held, prior=g.prior_tokens, window=window,
                            weighting=weighting, fit_rows=n_fit)
        Wgu = torch.stack([torch.cat([ew[f"mlp.experts.{e}.gate_proj.weight"],
                                      ew[f"mlp.experts.{e}.up_proj.weight"]]) for e in run]).float()
        low = low_dampening(g) if probe is not None else None
        box = [H]
        del H
        if low is not None:  # both dampenings in one call (run_gptq stacks them)
            qgu, qgu_low = run_gptq(Wgu, box.pop(), group_size, g, layer, run, fit_tokens=n_fit, low=low)
        else:
            qgu = run_gptq(Wgu, box.pop(), group_size, g, layer, run, consume=True, fit_tokens=n_fit)
        del Wgu
        gu_hat = QuantizedWeight(qgu.q, qgu.scale).dequantize(torch.float32)  # [C, 2I, D]

        def z(j, xe):  # down's input under the quantized gate/up
            return F.silu(xe @ gu_hat[j, :I].T) * (xe @ gu_hat[j, I:].T)

        Hd = expert_hessians(store, routing, run, all_tokens, inputs=z, prior=g.prior_tokens, window=window,
                             weighting=weighting)
        del gu_hat
        Wd = torch.stack([ew[f"mlp.experts.{e}.down_proj.weight"] for e in run]).float()  # [C, D, I]
        box = [Hd]
        del Hd
        if low is not None:
            qd, qd_low = run_gptq(Wd, box.pop(), group_size, g, layer, run, fit_tokens=n_fit, low=low)
            x_probe, probe_tokens = _probe_rows(probe, run)
        else:
            qd = run_gptq(Wd, box.pop(), group_size, g, layer, run, consume=True, fit_tokens=n_fit)
        del Wd
        layer_held = None
        for j, e in enumerate(run):
            q = _expert_q(qgu, qd, j, I)
            r = ExpertRecord(layer, e, int(counts[e]), "gptq", "all_tokens" if e in hungry else None,
                             float(qgu.loss[j] + qd.loss[j]), prior=prior_of(g, n_fit[j], Wgu_width))
            x_held = held.get(e)
            if x_held is None:  # no held-out routed token: every held-out token of the layer
                layer_held = _layer_heldout(store, window) if layer_held is None else layer_held
                x_held = layer_held
            quantized[e] = guard_against_rtn(
                x_held, ew, e, q, group_size, r, low=None if low is None else _expert_q(qgu_low, qd_low, j, I),
                x_probe=None if low is None else probe_inputs(x_probe, probe_tokens[e]))
            records[e] = r
        del held, layer_held
    return quantized, [records[e] for e in sorted(records)]


def add_expert_outputs(store: ActivationStore, routing: LayerRouting, weights: dict[int, tuple], group: Group | None = None) -> None:
    """h += router weight * expert(x) for the given experts (weights: e -> (gate, up, down)), per
    micro-batch; with several ranks (`group`) only this rank's micro-batches (their h is shared at
    the end of the layer)."""
    D = store.shape[-1]
    for i, sl, xb, idx_b, wt_b in _passes(store, routing, group):
        hb = store.h.read(sl)
        flat = hb.view(-1, D)
        for e, we in weights.items():
            tok, slot = _tokens(idx_b, e)
            if len(tok):
                flat.index_add_(0, tok, weighted(swiglu(xb[tok], *we), wt_b[tok, slot]))
        store.h.write(sl, hb)
        del hb, xb


def convert_experts(ckpt, pair, decisions, layer: int, store: ActivationStore | None, routing: LayerRouting | None,
                    recipe: Recipe, group_size: int, method: str, dtype, dev, bar, chunk: int, group: Group | None = None,
                    shares: dict | None = None, probe: tuple | None = None) -> list:
    """The routed experts of one MoE layer, `chunk` at a time: loaded (dequantized), quantized when
    decode stores them as new INT4, written to both outputs, and, when calibrating (store given),
    their outputs under the decode weights added to h. Never the whole layer's experts in memory:
    for Kimi K2.6 that would be 17G parameters. Without a store (a data-free method, or an MTP layer)
    the experts get the method's data-free form (quantkit.quant.methods.Method.data_free). What a
    calibrated method gets is its `inputs`: GPTQ's Hessians stream from the store (gptq_experts);
    AWQ's search gathers the layer's inputs (budgeted by quantkit.conversion.cost). Returns one
    ExpertRecord per expert.

    With several ranks (`group`, quantkit.runtime.distributed) and a store, each rank first quantizes only
    the experts the partition gives it, the results are exchanged, and then every rank runs the
    same loop as a single process with those experts already quantized: the h update is the
    single-process one, expert by expert in ascending order. `shares`, when a dict, receives each
    rank's experts, their routed tokens and the seconds it spent quantizing them (the balance).
    `probe`, with gptq.low_dampening: (the probe windows' store, their routing), quantkit.quant.experts'
    "Probe"; their h is updated like the calibration's, every rank all of it."""
    from quantkit.conversion.precision import layer_experts
    from quantkit.quant.experts import PROJS, ExpertRecord, expert_weights
    from quantkit.quant.methods import method_for

    pre = ckpt.arch.layer_prefix(layer)
    by_expert, int4 = layer_experts(ckpt, decisions, layer)
    experts = sorted(by_expert)
    method = method if store is not None else method_for(method).data_free().name
    counts = routing.counts.tolist() if routing is not None else [0] * (max(experts, default=-1) + 1)

    def load(part):  # the experts' source weights, dequantized, on the compute device
        return {n[len(pre):]: ckpt.get(n, dtype).to(dev) for e in part for n in by_expert[e]}

    done: dict = {}  # expert -> quantized weights, from the ranks' shares of the work
    records: list = []
    if group is not None and group.distributed and store is not None and int4:
        done = _quantize_share(group, store, routing, load, sorted(int4), counts, recipe, group_size, method, layer,
                               dev, bar, chunk, records, shares, len(experts), ckpt.arch, probe)

    for start in range(0, len(experts), chunk):
        part = experts[start:start + chunk]
        need = [e for e in part if e in int4 and e not in done]
        quantized: dict = {e: done.pop(e) for e in part if e in done}
        if not need and store is None:  # reused experts pass through; nothing to compute
            ew = {}
        else:  # to quantize, or to compute with (reused experts)
            ew = load([e for e in part if e not in quantized])
        if need:
            bar.update(note=f"layer {layer}: quantizing experts {need[0]}-{need[-1]} of {len(experts)}")
            q, recs = _quantize_chunk(store, routing, ew, need, recipe, group_size, method, layer, dev, probe)
            quantized.update(q)
            records += recs
        records += [ExpertRecord(layer, e, counts[e], "reused") for e in part if e not in int4]
        for e in part:
            for name in by_expert[e]:
                pair.write_expert(name, decisions[name], quantized.get(e, {}).get(ckpt.tensors[name].info.proj))
        if store is not None:
            weights = {e: tuple(quantized[e][p].dequantize(dtype).to(dev) for p in PROJS) if e in quantized
                       else expert_weights(ew, e) for e in part}
            del ew, quantized
            add_expert_outputs(store, routing, weights, group if group is not None and group.distributed else None)
            if probe is not None:
                add_expert_outputs(*probe, weights)
            del weights
        else:
            del ew, quantized
        return_freed_memory()  # this chunk's Hessians, weights and outputs, before the next chunk's
    return sorted(records, key=lambda r: r.expert)


def _quantize_share(group: Group, store: ActivationStore, routing: LayerRouting, load, int4: list[int], counts: list[int],
                    recipe: Recipe, group_size: int, method: str, layer: int, dev, bar, chunk: int, records: list,
                    shares: dict | None, n_experts: int, arch, probe: tuple | None = None) -> dict:
    """Multi-rank: quantize this rank's part of the layer's INT4 experts (quantkit.runtime.distributed.partition
    by routed tokens), `chunk` at a time, then exchange, so that every rank returns every INT4
    expert's quantized weights; `records` receives every rank's ExpertRecords."""
    from quantkit.planner.budgets import expert_fixed_tokens
    from quantkit.quant.methods import method_for
    from quantkit.runtime import distributed

    distributed.check_same(group, routing.counts, f"layer {layer}: routed-token counts")
    tokens = {e: counts[e] for e in int4}
    owner = distributed.partition(tokens, group.world, expert_fixed_tokens(arch) if method_for(method).calibrated else 0.0)
    mine = [e for e in int4 if owner[e] == group.rank]
    quantized, own_records = {}, []
    t0 = time.time()
    for start in range(0, len(mine), chunk):
        part = mine[start:start + chunk]
        bar.update(note=f"layer {layer}: quantizing {len(mine)} of {n_experts} experts on rank {group.rank}")
        ew = load(part)
        q, recs = _quantize_chunk(store, routing, ew, part, recipe, group_size, method, layer, dev, probe)
        for r in recs:
            r.rank = group.rank
        quantized.update(q)
        own_records += recs
        del ew, q
    took = time.time() - t0
    done = distributed.exchange_experts(group, owner, quantized, dev, QuantizedWeight)
    records += distributed.exchange_records(group, own_records)
    if shares is not None:
        shares["experts"] = [sum(1 for r in owner.values() if r == k) for k in range(group.world)]
        shares["tokens"] = [sum(tokens[e] for e, r in owner.items() if r == k) for k in range(group.world)]
        shares["seconds"] = [round(t, 3) for t in group.all_gather_object(took, "exchanging timings")]
    return done


def _quantize_chunk(store: ActivationStore | None, routing: LayerRouting | None, ew: dict, need: list[int], recipe: Recipe,
                    group_size: int, method: str, layer: int, dev, probe: tuple | None = None) -> tuple[dict, list]:
    """Quantize the experts `need` (their source weights in `ew`) by `method`, with the inputs the
    registered method asks for (quantkit.quant.methods.Inputs); calibrated ones pass the held-out
    guard (never worse than RTN, quantkit.quant.experts), which with `probe` may admit their
    gptq.low_dampening results."""
    from quantkit.quant.experts import guard_experts
    from quantkit.quant.methods import Inputs, method_for

    m = method_for(method)
    if m.inputs is Inputs.HESSIANS:
        return gptq_experts(store, routing, ew, need, recipe, group_size, layer, probe)
    if m.inputs is Inputs.NONE:
        return m.quantize(ew, need, recipe, group_size, layer)
    # Inputs.LAYER (AWQ's search): the per-expert inputs, gathered (budgeted by quantkit.conversion.cost)
    D = store.shape[-1]
    x = torch.cat([store.x.read(sl).reshape(-1, D) for sl in store.slices()])
    idx = routing.idx.to(dev)
    tokens = {e: (idx == e).any(-1).nonzero(as_tuple=True)[0] for e in need}
    alternatives: dict = {}
    quantized, recs = m.quantize(ew, need, recipe, group_size, layer, x=x, tokens=tokens, alternatives=alternatives,
                                 low=probe is not None)
    guard_experts(recs, quantized, x, tokens, ew, group_size, alternatives,
                  _probe_rows(probe, need) if probe is not None else None)
    return quantized, recs
