"""convert's work on the source, in the order quantkit.conversion.pipeline runs it: the calibration
set-up, the tensors outside the decoder layers (with the calibration tokens' embeddings: the first
layer's h), then one decoder layer at a time, while the Prefetcher brings the next layer's bytes close.

Each stage leaves the progress in the job's state, which pipeline saves (quantkit.conversion.resume).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from quantkit.checkpoint.reader import Checkpoint
from quantkit.conversion.activations import ActivationStore, StoreRows
from quantkit.conversion.job import Job
from quantkit.conversion.kvscales import write_kv_scales
from quantkit.conversion.layerpass import LayerRouting, attention_pass, convert_experts
from quantkit.conversion.outputs import PairWriter, compute_weight
from quantkit.conversion.report import expert_entry
from quantkit.model.kvcache import KVAbsmax
from quantkit.model.mtp import embed_name, mtp_input, shifted
from quantkit.model.reference import Context
from quantkit.model.tensors import TensorClass
from quantkit.quant.experts import ExpertRecord
from quantkit.runtime import distributed, faults, phases
from quantkit.runtime.machine import return_freed_memory

if TYPE_CHECKING:
    from quantkit.inputs.tokens import TokenData
    from quantkit.runtime.distributed import Group


@dataclass
class Calibration:
    """The calibration side of a run: the tokens, the store holding their hidden states, the
    reference context (which also measures what the KV cache holds), the DSA selections kept from
    layer to layer, and `split`, the group when several ranks share the micro-batches. An RTN run
    (no tokens) has none of these: store None."""

    tokens: TokenData | None = None  # the calibration tokens (quantkit.inputs.tokens)
    store: ActivationStore | None = None
    ctx: Context | None = None
    topks: list = field(default_factory=list)
    split: Group | None = None
    # the method's probe windows (Method.probe_windows), run through the same quantized layers beside
    # the calibration tokens but never fitted on (a Calibration of their own: store, context, DSA
    # selections; every rank runs all of them, and their context measures no KV cache)
    probe: Calibration | None = None

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.probe is not None:
            self.probe.close()


def start_calibration(job: Job, tokens) -> Calibration:
    """The store for every calibration token's h (sized and placed by the plan: job.cost.store)
    and the context that runs the layers on it."""
    if tokens is None:
        return Calibration()
    arch = job.arch
    ids = tokens.ids
    ctx = Context.build(arch, ids.shape[1], job.dev, job.dtype, kv=KVAbsmax())  # measures what the KV cache holds
    # seq_len <= index_topk: the DSA indexer selects every causal key, so no selection is made or kept
    ctx.dsa_dense = arch.has_dsa and ids.shape[1] <= arch.index_topk
    group = job.group
    work = job.state_dir if group.leader else job.state_dir / f"rank-{group.rank}"  # a disk-backed store's files
    work.mkdir(exist_ok=True)
    N, T = ids.shape
    store = ActivationStore(N, T, arch.hidden_size, job.cost.store, job.dev, work)
    # several ranks: each runs the per-token work (attention, expert outputs) on its own micro-batches
    split = group if group.distributed else None
    mtp_table = embed_name(arch, arch.num_hidden_layers, job.ckpt.tensors)
    if arch.num_mtp_layers and mtp_table == f"{arch.prefix}embed_tokens.weight":  # the MTP reads it again: kept
        job.ckpt.hold(mtp_table)
    return Calibration(tokens, store, ctx, [None] * len(list(store.slices())), split, _probe(job, tokens, work))


def _probe(job: Job, tokens, work) -> Calibration | None:
    """The probe's side (Calibration.probe): the windows the method asks for (Method.probe_windows;
    quantkit.inputs.tokens.probe_ids, seeded by the calibration's seed), a store like the calibration's
    and a context without KV-cache measurement, so the prefill's KV scales are the calibration tokens' alone."""
    from quantkit.inputs.tokens import TokenData, probe_ids

    n = job.method.probe_windows(job.rec)
    if not n or job.cost.probe == 0:  # no expert to quantize (Kimi's reused INT4): nothing to judge
        return None
    arch = job.arch
    ids = probe_ids(tokens.ids, arch.vocab_size, n, job.rec.calibration.seed)
    data = TokenData(ids=ids, spec="probe", sha256=hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
                     source={"kind": "probe", "from": "vocabulary ids the calibration never contains"})
    ctx = Context.build(arch, ids.shape[1], job.dev, job.dtype)
    ctx.dsa_dense = arch.has_dsa and ids.shape[1] <= arch.index_topk
    N, T = ids.shape
    store = ActivationStore(N, T, arch.hidden_size, job.cost.store, job.dev, work, tag="probe-")
    return Calibration(data, store, ctx, [None] * len(list(store.slices())))


def outside_layers(job: Job, pair: PairWriter, calib: Calibration) -> None:
    """Stage 1: the tensors outside the decoder layers (embeddings, final norm, head, vision), and
    h = embed(calibration tokens), the first layer's input."""
    ckpt, arch, state = job.ckpt, job.arch, job.state
    if calib.store is not None:
        table = ckpt.get(f"{arch.prefix}embed_tokens.weight", torch.bfloat16)  # (V, D), exact for a BF16 source
        for side in (calib, calib.probe):
            if side is not None:
                for sl in side.store.slices():
                    side.store.h.write(sl, F.embedding(side.tokens.ids[sl], table).to(job.dev, job.dtype))
        del table
    for name in ckpt.names(layer=None):
        pair.write_shared(name, job.decisions[name])
    pair.flush()
    pair.drain()
    ckpt.release_finished()
    state.next_layer = 0
    state.prefill_parts, state.decode_parts = pair.prefill.num_parts, pair.decode.num_parts


def convert_layer(job: Job, pair: PairWriter, calib: Calibration, bar, layer: int) -> None:
    """Stage 2, one decoder layer: its shared tensors written (their stored form is what the
    calibration computes with), h += attention, its routed experts converted (h += their outputs
    under the decode weights), its parts flushed; its report entries and the progress go into the state."""
    arch, state = job.arch, job.state
    t0 = time.time()
    phases.take()  # this layer's phases only (quantkit.runtime.phases)
    mtp = layer >= arch.num_hidden_layers
    # the first MTP layer is calibrated on what it sees in serving (its input from the last main
    # layer's h); a further one would need the previous MTP layer's output: rounded to nearest
    calibrate = calib.store is not None and layer <= arch.num_hidden_layers
    w = _shared_tensors(job, pair, layer, calibrate)
    routing = kv_stats = probe_routing = None
    if calibrate and mtp:
        mtp_inputs(job, calib, w, layer)
    if calibrate:  # h += attention (+ dense MLP, or shared expert), x and routing kept for the experts
        with phases.timed("attention"):
            routing = attention_pass(calib.store, w, calib.ctx, layer, calib.topks, arch.is_moe(layer), calib.split)
            if calib.probe is not None:  # the probe windows through the same layer, on every rank
                probe = calib.probe
                probe_routing = attention_pass(probe.store, w, probe.ctx, layer, probe.topks, arch.is_moe(layer))
        kv = cast(KVAbsmax, calib.ctx.kv)  # start_calibration's: the maxima it measured
        kv_stats = write_kv_scales(pair, arch.layer_prefix(layer), kv, layer, arch.definition.attention)
        return_freed_memory()  # the attention's micro-batch buffers, before the experts' Hessians
    t_attention = time.time() - t0
    shares: dict = {}  # multi-rank: each rank's part of this layer's experts
    records = (_routed_experts(job, pair, calib, bar, layer, routing, calibrate, mtp, shares, probe_routing)
               if arch.is_moe(layer) else [])
    del routing, probe_routing, w
    if calibrate and calib.split is not None:  # each rank updated its own micro-batches' h: all of it to all
        distributed.share_rows(job.group, calib.store, [calib.store.h], f"layer {layer}: hidden states")
    pair.flush()
    faults.point("layer:written")

    state.experts += [expert_entry(r, job.method) for r in records]
    state.layers.append({"layer": layer, "kind": "mtp" if mtp else ("moe" if arch.is_moe(layer) else "dense"),
                         "seconds": round(time.time() - t0, 3), "attention_seconds": round(t_attention, 3),
                         "calibrated": calibrate and arch.is_moe(layer), "phases": phases.take(),
                         **({"kv_cache": kv_stats} if kv_stats else {}),
                         **({"ranks": shares} if shares else {})})
    state.next_layer = layer + 1
    state.prefill_parts, state.decode_parts = pair.prefill.num_parts, pair.decode.num_parts
    state.differ = pair.differ


def mtp_inputs(job: Job, calib: Calibration, w: dict[str, torch.Tensor], layer: int) -> None:
    """The MTP layer's calibration input, as in serving (quantkit.model.mtp): for every calibration
    sequence, x_i = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)]) over its T - 1 positions, h the
    store's hidden states after the last main layer (the quantized decode model's, as every layer's
    calibration), eh_proj & co. as stored. The store of the main model's h is replaced by one of
    the MTP's (N, T - 1, D) micro-batch by micro-batch (x closed first, so no more than two token
    arrays exist at any time); the context covers T - 1 positions, keeping the KV-cache maxima."""
    arch, old = job.arch, calib.store
    ids = calib.tokens.ids
    N, T, D = old.shape
    table = w.get("embed_tokens.weight")  # the layer's own embedding, else the main model's (vocab x D)
    if table is None:
        name = embed_name(arch, layer, job.ckpt.tensors)
        table = job.ckpt.get(name, torch.bfloat16)
        job.ckpt.unhold(name)  # held since start_calibration (a streamed source deletes its shard after this layer)
    old.close_x()
    new = ActivationStore(N, T - 1, D, old.plan, job.dev, old.folder, tag="mtp-")
    positions = torch.arange(T - 1, device=job.dev)
    for sl in old.slices():
        h, e = shifted(old.h.read(sl), ids[sl], table)
        new.h.write(sl, mtp_input(h, e, w, arch, positions))
        del h, e
    del table
    old.close()
    if calib.probe is not None:  # the MTP layer has no probe (its method runs without one: docs/recipes.md)
        calib.probe.close()
        calib.probe = None
    calib.store = new
    calib.ctx = Context.build(arch, T - 1, job.dev, job.dtype, kv=calib.ctx.kv)
    calib.ctx.dsa_dense = arch.has_dsa and T - 1 <= arch.index_topk
    calib.topks = [None] * len(calib.topks)


def _shared_tensors(job: Job, pair: PairWriter, layer: int, calibrate: bool) -> dict[str, torch.Tensor]:
    """Write the layer's tensors other than the routed experts; returns them as computed with
    (the stored form, dequantized), named within the layer."""
    ckpt, pre = job.ckpt, job.arch.layer_prefix(layer)
    w: dict[str, torch.Tensor] = {}
    for name in ckpt.names(layer):
        klass = ckpt.tensors[name].info.klass
        if klass == TensorClass.ROUTED_EXPERT or (klass == TensorClass.KV_SCALE and calibrate):
            continue  # experts below; a source's KV scales give way to the ones measured here
        parts = pair.write_shared(name, job.decisions[name])
        w[name[len(pre):]] = compute_weight(parts, ckpt.tensors[name], job.dtype).to(job.dev)
    return w


def _routed_experts(job: Job, pair: PairWriter, calib: Calibration, bar, layer: int, routing: LayerRouting | None,
                    calibrate: bool, mtp: bool, shares: dict, probe_routing: LayerRouting | None = None) -> list[ExpertRecord]:
    """A MoE layer's routed experts: calibrated on the routed tokens when the layer was, else the
    method's data-free form (a data-free method itself; RTN for a calibrated method in an MTP layer
    after the first, which has no calibration path)."""
    rec = job.rec
    if calibrate:  # h += routed experts under the decode weights
        probe = StoreRows(calib.probe.store, probe_routing) if probe_routing is not None else None
        return convert_experts(job.ckpt, pair, job.decisions, layer, StoreRows(calib.store, routing, probe), rec, job.G,
                               job.method, job.dtype, job.dev, bar, job.cost.expert_chunk, job.group, shares)
    records = convert_experts(job.ckpt, pair, job.decisions, layer, None, rec, job.G, job.method, job.dtype,
                              job.dev, bar, job.cost.expert_chunk)
    if mtp:
        for r in records:
            if r.method != "reused":
                r.fallback = "mtp-later-layer" if calib.store is not None else "mtp-no-path"
    return records


class Prefetcher:
    """Brings the next layer's bytes close while this one computes, in a background thread: a
    streamed source downloads its shards; a local one has the kernel read them into the page cache
    (Checkpoint.readahead), so that quantkit.planner.cost can count reading as overlapped with compute."""

    def __init__(self, ckpt: Checkpoint):
        from concurrent.futures import ThreadPoolExecutor

        self.ckpt = ckpt
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prefetch")

    def ahead(self, layer: int) -> None:
        if layer >= self.ckpt.arch.num_layers_with_mtp:
            return
        if self.ckpt.remote is None:
            self.pool.submit(self.ckpt.readahead, layer)
            return
        for f in self.ckpt.prefetch(layer):
            self.pool.submit(self._fetch, f)

    def _fetch(self, f: str) -> None:
        if not self.ckpt.consumed(f):  # not released yet
            self.ckpt.remote.fetch(f)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
