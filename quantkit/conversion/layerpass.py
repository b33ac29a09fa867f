"""Calibrated conversion of one decoder layer, streaming the calibration tokens from the store.

`convert` runs every calibration token through the layer being converted. Here no token-sized
tensor exists beyond the two arrays of the activation store (quantkit.conversion.activations): every pass
reads one micro-batch of samples as float32, works on it, and writes it back.

    attention pass   per micro-batch: h += attention(h); x = post_attention_layernorm(h)
                     dense layer: h += MLP(x)
                     MoE layer:   store x; route x (kept: top-k ids and weights, 12 B per slot);
                                  h += shared_expert(x)
    per chunk of routed experts (their count from the budget, quantkit.planner.cost):
      quantize       the recipe's method solves the chunk from the layer's rows (the store's x and
                     the routing as a quantkit.quant.rows.LayerRows: Method.solve), guarded
                     against RTN on rows it was not fitted on; what it reads of them, one
                     micro-batch at a time or gathered, is the method's (quantkit.quant.methods)
      output pass    per micro-batch: h += sum_e w_e * expert_e(x_e) under the decode weights

    probe windows (a method's Method.probe_windows): they have their own small store and take the
    attention and output passes too; the method sees them as LayerRows.probe, never fits on them

So the work space is one micro-batch of tokens plus one chunk of experts (weights and the method's
work), whatever the number of calibration tokens. DSA: for seq_len <= index_topk the
indexer selects every causal key, so attention is dense and no selection is kept; otherwise each
micro-batch's selection is kept for the next (IndexShare) layers, as (B, T, k) indices.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from quantkit.conversion.activations import ActivationStore, LayerRouting, StoreRows
from quantkit.model.kvcache import KVAbsmax
from quantkit.model.moe import mlp, route, shared_expert, swiglu, weighted
from quantkit.model.ops import rms_norm
from quantkit.model.reference import attention
from quantkit.quant.experts import QuantizedWeight
from quantkit.runtime import phases
from quantkit.runtime.machine import return_freed_memory

if TYPE_CHECKING:  # annotations only, as in conversion/stages.py
    from quantkit.quant.methods import Method
    from quantkit.recipe import Recipe
    from quantkit.runtime.distributed import Group

__all__ = ["LayerRouting", "attention_pass", "add_expert_outputs", "convert_experts"]  # LayerRouting: activations'


def attention_pass(store: ActivationStore, w: dict, ctx, layer: int, topks: list, moe: bool,
                   group: Group | None = None) -> LayerRouting | None:
    """The attention half (and a dense layer's MLP, or a MoE layer's shared expert), per micro-batch.

    With several ranks (`group`), each computes only its own micro-batches (Group.owns_batch), then
    x, the routing and the DSA selections are given to every rank (a method may read every
    token), and the KV-cache maxima combined. h stays split until the end of the layer (the
    routed-expert outputs are added by the same owners; conversion shares h then). Every token's
    arithmetic is a single process's, so the bytes are too."""
    a = ctx.arch
    eps = a.rms_norm_eps
    x_arr = store.open_x() if moe else None
    n_batches = sum(1 for _ in store.slices())
    idx: list[Any] = [None] * n_batches  # each micro-batch's (B*T, k) routing, filled below
    wt: list[Any] = [None] * n_batches
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
        if x_arr is not None:  # a MoE layer
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
    if group is not None and group.distributed:  # the other ranks' micro-batches arrive as their own tensors
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


def _tokens(idx_b: torch.Tensor, e: int) -> tuple[torch.Tensor, ...]:
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
        yield i, sl, store.moe_inputs().read(sl).reshape(-1, D), idx_b, wt_b


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


def convert_experts(ckpt, pair, decisions, layer: int, rows: StoreRows | None, recipe: Recipe, group_size: int,
                    method: Method, dtype, dev, bar, chunk: int, group: Group | None = None,
                    shares: dict | None = None) -> list:
    """The routed experts of one MoE layer, `chunk` at a time: loaded (dequantized), quantized when
    decode stores them as new INT4, written to both outputs, and, when calibrating (rows given:
    the store's x and the routing, and the probe windows' when the method asked for them),
    their outputs under the decode weights added to h. Never the whole layer's experts in memory:
    for Kimi K2.6 that would be 17G parameters. Without rows (a data-free method, or an MTP layer)
    the experts get the method's data-free form (quantkit.quant.methods.Method.data_free). What a
    calibrated method reads of the rows, and how, is its own (Method.solve). Returns one
    ExpertRecord per expert.

    With several ranks (`group`, quantkit.runtime.distributed) and rows, each rank first quantizes only
    the experts the partition gives it, the results are exchanged, and then every rank runs the
    same loop as a single process with those experts already quantized: the h update is the
    single-process one, expert by expert in ascending order. `shares`, when a dict, receives each
    rank's experts, their routed tokens and the seconds it spent quantizing them (the balance).
    The probe windows' h is updated like the calibration's, every rank all of it."""
    from quantkit.planner.precision import layer_experts
    from quantkit.quant.experts import PROJS, ExpertRecord, expert_weights

    pre = ckpt.arch.layer_prefix(layer)
    by_expert, int4 = layer_experts(ckpt, decisions, layer)
    experts = sorted(by_expert)
    method = method if rows is not None else method.data_free()
    options = method.options(recipe)  # its own settings: all a method reads of the recipe
    counts = rows.counts.tolist() if rows is not None else [0] * (max(experts, default=-1) + 1)

    def load(part):  # the experts' source weights, dequantized, on the compute device
        with phases.timed("read"):
            return {n[len(pre):]: ckpt.get(n, dtype).to(dev) for e in part for n in by_expert[e]}

    done: dict = {}  # expert -> quantized weights, from the ranks' shares of the work
    records: list = []
    if group is not None and group.distributed and rows is not None and int4:
        done = _quantize_share(group, rows, load, sorted(int4), counts, options, group_size, method, layer,
                               dev, bar, chunk, records, shares, len(experts), ckpt.arch)

    for start in range(0, len(experts), chunk):
        part = experts[start:start + chunk]
        need = [e for e in part if e in int4 and e not in done]
        quantized: dict = {e: done.pop(e) for e in part if e in done}
        if not need and rows is None:  # reused experts pass through; nothing to compute
            ew = {}
        else:  # to quantize, or to compute with (reused experts)
            ew = load([e for e in part if e not in quantized])
        if need:
            bar.update(note=f"layer {layer}: quantizing experts {need[0]}-{need[-1]} of {len(experts)}")
            with phases.timed("quantize"):
                q, recs = method.solve(rows, ew, need, options, group_size, layer)
            quantized.update(q)
            records += recs
        records += [ExpertRecord(layer, e, counts[e], "reused") for e in part if e not in int4]
        with phases.timed("write"):
            for e in part:
                for name in by_expert[e]:
                    pair.write_expert(name, decisions[name], quantized.get(e, {}).get(ckpt.tensors[name].info.proj))
        if rows is not None:
            with phases.timed("experts_out"):
                weights = {e: tuple(quantized[e][p].dequantize(dtype).to(dev) for p in PROJS) if e in quantized
                           else expert_weights(ew, e) for e in part}
                del ew, quantized
                add_expert_outputs(rows.store, rows.routing, weights, group if group is not None and group.distributed else None)
                if rows.probe is not None:
                    add_expert_outputs(rows.probe.store, rows.probe.routing, weights)
                del weights
        else:
            del ew, quantized
        return_freed_memory()  # this chunk's method work, weights and outputs, before the next chunk's
    return sorted(records, key=lambda r: r.expert)


def _quantize_share(group: Group, rows: StoreRows, load, int4: list[int], counts: list[int], options: Any,
                    group_size: int, method: Method, layer: int, dev, bar, chunk: int, records: list,
                    shares: dict | None, n_experts: int, arch) -> dict:
    """Multi-rank: quantize this rank's part of the layer's INT4 experts (quantkit.runtime.distributed.partition
    by routed tokens), `chunk` at a time, then exchange, so that every rank returns every INT4
    expert's quantized weights; `records` receives every rank's ExpertRecords."""
    from quantkit.planner.budgets import expert_fixed_tokens
    from quantkit.runtime import distributed

    distributed.check_same(group, rows.counts, f"layer {layer}: routed-token counts")
    tokens = {e: counts[e] for e in int4}
    owner = distributed.partition(tokens, group.world, expert_fixed_tokens(arch) if method.calibrated else 0.0)
    mine = [e for e in int4 if owner[e] == group.rank]
    quantized, own_records = {}, []
    t0 = time.time()
    for start in range(0, len(mine), chunk):
        part = mine[start:start + chunk]
        bar.update(note=f"layer {layer}: quantizing {len(mine)} of {n_experts} experts on rank {group.rank}")
        ew = load(part)
        with phases.timed("quantize"):
            q, recs = method.solve(rows, ew, part, options, group_size, layer)
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
