"""`quantkit convert`: one streaming pass from a source checkpoint to the prefill/decode pair.

The conversion loop, one decoder layer at a time (peak memory: one layer plus the calibration
activations, whatever the depth):

    h = embed(calibration tokens)
    for each layer:
        load the layer from the shards (dequantized on the fly)
        decide each tensor's storage in both outputs (quantkit.conversion.precision)
        run attention with the weights both outputs will hold          h += attention(h)
        MoE layers: route the normed h's tokens; per routed expert, build GPTQ Hessians from the tokens the
                    router actually sends it (gate and up share one; down's from the quantized
                    gate/up's output); starved experts take the recipe's fallback, counted
        quantize the experts (batched), write both outputs' tensors, flush a shard per layer
        h += MoE/MLP output computed with the *decode* weights
        save h and the progress (so --resume restarts exactly here)

Calibration choice: each layer is calibrated on the hidden states the quantized decode model
produces at that point (errors of earlier layers included), as GPTQ's sequential mode does; the
attention weights are the shared (FP8) ones both pools run.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from quantkit import __version__
from quantkit.checkpoint.shards import Checkpoint, CheckpointWriter, file_sha256
from quantkit.conversion.kvscales import kv_cache_report, kv_cache_scheme, write_kv_scales
from quantkit.conversion.layerpass import attention_pass, convert_experts
from quantkit.conversion.precision import (
    BF16,
    FP8,
    INT4,
    PASS,
    REUSE_INT4,
    Decision,
    decide,
    decode_quantization_config,
    precision_summary,
    predicted_bytes,
    prefill_quantization_config,
    set_quantization_config,
    source_int4_group,
    stored_as,
)
from quantkit.errors import ConfigError, OutputError
from quantkit.formats import fp8, int4
from quantkit.model.kvcache import KVAbsmax
from quantkit.model.reference import Context
from quantkit.model.tensors import TensorClass
from quantkit.quant.experts import (
    HOLDOUT,
    ExpertRecord,
)
from quantkit.quant.gptq import QuantizedWeight
from quantkit.runtime import distributed, faults
from quantkit.runtime.machine import peak_rss
from quantkit.runtime.progress import LayerProgress, rich_html

STATE_DIR = ".quantkit-convert"


@dataclass
class ConvertResult:
    """What `convert` made; `report` is convert-report.json."""

    out: Path
    prefill: Path
    decode: Path
    report: dict[str, Any]
    validation: Any = None  # quantkit.validation.pipeline.ValidationResult when convert ran validate
    rank: int = 0  # a multi-rank convert's other ranks (> 0) return an empty report: rank 0 has the real one

    def to_json(self) -> dict[str, Any]:
        return self.report

    def table(self):
        from rich.table import Table

        r = self.report
        t = Table(title=f"quantkit convert: {r['source']['spec']} -> {self.out}")
        t.add_column("")
        t.add_column("prefill")
        t.add_column("decode")
        for cls in sorted(set(r["outputs"]["prefill"]["precision"]) | set(r["outputs"]["decode"]["precision"])):
            t.add_row(cls, r["outputs"]["prefill"]["precision"].get(cls, ""), r["outputs"]["decode"]["precision"].get(cls, ""))
        t.add_row("size", _gb(r["outputs"]["prefill"]["bytes"]), _gb(r["outputs"]["decode"]["bytes"]), style="bold")
        e = r["experts_summary"]
        methods = ", ".join(f"{e[m]} {m.upper() if m != 'reused' else m}" for m in ("gptq", "awq", "rtn", "reused") if e.get(m))
        t.caption = (
            f"{e['total']} routed experts: {methods}; {e['fallbacks']} fallbacks; "
            f"{r['seconds']:.1f}s, peak RSS {_gb(r['peak_rss_bytes'])}"
        )
        return t

    def _repr_html_(self) -> str:
        return rich_html(self.table())


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


# ---- writing -----------------------------------------------------------------------------------
class PairWriter:
    """Writes a tensor to both outputs (or one), deduplicating FP8/BF16 work shared by both."""

    def __init__(self, ckpt: Checkpoint, prefill: CheckpointWriter, decode: CheckpointWriter):
        self.ckpt, self.prefill, self.decode = ckpt, prefill, decode
        self.differ: list[str] = []

    def stored(self, name: str, action: str, *, scale_name: str) -> dict[str, torch.Tensor]:
        """The stored tensors for `action` on source tensor `name` (suffix -> tensor)."""
        st = self.ckpt.tensors[name]
        if action in (PASS, REUSE_INT4):
            return {s.rpartition(".")[2]: self.ckpt.raw(s) for s in st.parts.values()}
        if action == FP8:
            q, s = fp8.quantize(self.ckpt.get(name, torch.float32))
            return {"weight": q, scale_name: s}
        if action == BF16:
            return {"weight": self.ckpt.get(name, torch.bfloat16)}
        raise ValueError(action)

    def write_shared(self, name: str, d: Decision) -> torch.Tensor | None:
        """A tensor both outputs hold identically; returns its dequantized value for compute."""
        base = name.rpartition(".")[0] + "." if name.endswith(".weight") else None
        if d.decode != d.prefill and stored_as(d.decode, self.ckpt.tensors[name]) != stored_as(d.prefill, self.ckpt.tensors[name]):
            # decode.rest: bf16: each output its own bytes; the decode model's are what calibration computes with
            for suffix, t in self.stored(name, d.prefill, scale_name="weight_scale_inv").items():
                self.prefill.add(base + suffix if base else name, t)
            parts = self.stored(name, d.decode, scale_name="weight_scale")
            for suffix, t in parts.items():
                self.decode.add(base + suffix if base else name, t)
            self.differ.append(name)
            return parts
        parts = self.stored(name, d.prefill, scale_name="weight_scale_inv")
        for suffix, t in parts.items():
            key = base + suffix if base else name
            self.prefill.add(key, t)
            # compressed-tensors calls the FP8 block multiplier `weight_scale`
            dsuffix = "weight_scale" if suffix == "weight_scale_inv" else suffix
            self.decode.add(base + dsuffix if base else name, t)
        return parts

    def write_expert(self, name: str, d: Decision, q: QuantizedWeight | None) -> None:
        base = name[: -len("weight")]
        for suffix, t in self.stored(name, d.prefill, scale_name="weight_scale_inv").items():
            self.prefill.add(base + suffix, t)
        if d.decode == REUSE_INT4:
            parts = self.stored(name, REUSE_INT4, scale_name="")
        else:
            parts = int4.store(q.q, q.scale)
        for suffix, t in parts.items():
            self.decode.add(base + suffix, t)
        self.differ.append(name)

    def flush(self) -> None:
        self.prefill.flush()
        self.decode.flush()

    def drain(self) -> None:
        """Both outputs' cut parts are on disk (quantkit.checkpoint.shards.CheckpointWriter saves in the background)."""
        self.prefill.drain()
        self.decode.drain()


def compute_weight(parts: dict[str, torch.Tensor], st, dtype) -> torch.Tensor:
    """The value a loader computes with for the stored parts of one tensor."""
    if "weight_scale_inv" in parts:
        return fp8.dequantize(parts["weight"], parts["weight_scale_inv"]).to(dtype)
    if "weight_packed" in parts:
        return int4.dequantize(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]).to(dtype)
    (t,) = parts.values()
    return t.to(dtype)


# ---- resume ------------------------------------------------------------------------------------
@dataclass
class State:
    fingerprint: str
    next_layer: int = -1  # -1: the non-layer tensors are not written yet
    prefill_parts: int = 0
    decode_parts: int = 0
    experts: list[dict] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)


def _save_state(folder: Path, state: State, store, topks: list) -> None:
    """Progress after a layer, written atomically. The hidden states (the largest thing here: tokens
    x hidden, in the store's dtype) go to disk as raw bytes a sample at a time, one copy (the next
    layer's replaces it); the DSA selections (only kept when seq_len > index_topk) as safetensors."""
    # The files are named by the layer they precede and only state.json names them, so a crash
    # between any two of these writes leaves state.json and its hidden states agreeing.
    tag = state.next_layer
    if store is not None:
        store.h.save(folder / f"hidden.{tag}.bin")
        state_h = {"shape": list(store.shape), "dtype": str(store.plan.dtype), "file": f"hidden.{tag}.bin"}
        topk = {f"topk.{i}": t.cpu().contiguous() for i, t in enumerate(topks) if t is not None}
        if topk:
            save_file(topk, str(folder / "topk.tmp"))
            os.replace(folder / "topk.tmp", folder / f"topk.{tag}.safetensors")
            state_h["topk"] = f"topk.{tag}.safetensors"
        faults.point("state:hidden")
    else:
        state_h = None
    (folder / "state.tmp").write_text(json.dumps(vars(state) | {"hidden": state_h}))
    os.replace(folder / "state.tmp", folder / "state.json")
    keep = set((state_h or {}).get(k) for k in ("file", "topk"))
    for old in [*folder.glob("hidden.*.bin"), *folder.glob("topk.*.safetensors")]:
        if old.name not in keep:
            old.unlink()
    faults.point("state:saved")


def _load_hidden(folder: Path, n_topks: int, store, dev) -> list:
    meta = json.loads((folder / "state.json").read_text())["hidden"]
    if meta["dtype"] != str(store.plan.dtype) or meta["shape"] != list(store.shape):
        raise OutputError(f"{folder}: the interrupted run kept its hidden states as {meta['dtype']}, this run would "
                          f"use {store.plan.dtype}; resume with the same --max-host-memory / --max-gpu-memory")
    store.h.load(folder / meta["file"])
    topk = load_file(str(folder / meta["topk"])) if meta.get("topk") else {}
    return [topk[f"topk.{i}"].to(dev) if f"topk.{i}" in topk else None for i in range(n_topks)]


# ---- the conversion ----------------------------------------------------------------------------
logger = logging.getLogger("quantkit")


def _owned_output(fn):
    """convert's guard: the device is resolved before any folder exists, `out` has one owner
    (quantkit.checkpoint.outlock), and a full disk is a one-line error naming the folder."""

    @functools.wraps(fn)
    def wrapper(model, out, *args, device: str = "auto", **kwargs):
        from quantkit.checkpoint.outlock import acquire
        from quantkit.model.reference import resolve_device
        from quantkit.runtime.distributed import from_env

        resolve_device(device)
        out = Path(out)
        if not from_env().leader:  # a multi-rank convert: rank 0 owns the folder for all
            return fn(model, out, *args, device=device, **kwargs)
        lock = acquire(out, "convert")
        if lock.took_over:
            logger.warning("%s: took over the lock of a run that died (pid %s on %s)", out,
                           lock.took_over.get("pid"), lock.took_over.get("host"))
        try:
            return fn(model, out, *args, device=device, **kwargs)
        except Exception as e:
            if not disk_full(e):
                raise
            free = shutil.disk_usage(out).free
            need = _NEEDS.get(str(out))
            needed = f", and this run needed about {_size(need)} when it started" if need else ""
            raise OutputError(f"{out}: disk full while writing ({_size(free)} free there{needed}); free space, then "
                              "rerun with --resume to continue") from None
        finally:
            lock.release()

    return wrapper


_NEEDS: dict[str, int] = {}  # out -> bytes the disk precheck predicted (for the disk-full message)


def disk_full(e: BaseException) -> bool:
    """ENOSPC, from Python's I/O or from safetensors' writer (which reports it in its message)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    import re

    from safetensors import SafetensorError

    # e.g. "Error while serializing: I/O error: No space left on device (os error 28)"
    codes = {str(errno.ENOSPC), str(errno.EDQUOT)}
    return isinstance(e, SafetensorError) and any(m in codes for m in re.findall(r"(?:os error|code:) ?(\d+)", str(e)))


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{int(n)} bytes"


@_owned_output
def convert(
    model: str | Path,
    out: str | Path,
    *,
    recipe: str | Path | None = None,
    method: str | None = None,
    calib: str | None = None,
    num_samples: int | None = None,
    seq_len: int | None = None,
    group_size: int | None = None,
    decode_rest: str | None = None,
    device: str = "auto",
    resume: bool = False,
    validate: bool = True,
    progress: bool = True,
    trust_remote_code: bool = False,
    delete_source_after: bool = False,
    allow_unverified: bool = False,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    max_host_memory: int | str | None = None,
    max_gpu_memory: int | str | None = None,
    activation_dtype: str | None = None,
) -> ConvertResult:
    """Convert `model` into `out/prefill` (FP8) and `out/decode` (INT4 experts), with a report.

    Args:
        model: a folder, `hf://org/repo@rev`, or `tiny:kimi-k2.6` / `tiny:glm-5.2`.
        out: output folder; `prefill/`, `decode/` and `convert-report.json` appear when complete.
        recipe: a recipe file or name (default: the model family's recipe); the keyword options
            below override its fields when given.
        decode_rest: "bf16" stores everything but the routed experts BF16 in decode (Kimi's official
            INT4 look; recipe `decode.rest`); default "prefill": the prefill checkpoint's bytes.
        resume: continue an interrupted run from its last completed layer (byte-identical result).
        validate: run `quantkit.validate` on the pair afterwards.
        delete_source_after: with an `hf://` source, delete each downloaded shard once every
            tensor in it has been consumed (local disk then holds a few shards at a time).
        allow_unverified: with an `hf://` source, accept files the Hub lists without a checksum
            (size only); the report lists them.
        max_host_memory, max_gpu_memory: budgets in bytes or "8GB"-style strings (default: the
            machine's available memory, the device's total); quantkit.conversion.cost sizes the activation
            store, micro-batches and expert chunks to keep to them, prints the prediction, and
            refuses to start when even the smallest settings don't fit.
        activation_dtype: force the calibration hidden states' dtype, "float32" or "bfloat16"
            (default: float32 when the budget holds it; docs/benchmarks.md gives bfloat16's KL cost).

    Example:
        >>> res = quantkit.convert("tiny:glm-5.2", "out/glm")
        >>> res.report["experts_summary"]
    """
    from quantkit.inputs.modelspec import open_checkpoint
    from quantkit.inputs.tokens import load_tokens
    from quantkit.model.reference import resolve_device
    from quantkit.recipe import default_recipe, load_recipe, recipe_overrides

    t_start = time.time()
    out = Path(out)
    ckpt = open_checkpoint(model, release_consumed=delete_source_after, allow_unverified=allow_unverified)
    src_path = ckpt.folder
    arch = ckpt.arch
    rec = load_recipe(recipe) if recipe is not None else default_recipe(str(model), arch)
    rec = recipe_overrides(rec, method=method, group_size=group_size, num_samples=num_samples, seq_len=seq_len, calib=calib,
                           decode_rest=decode_rest)
    G = rec.group_size
    dev = resolve_device(device)
    # torchrun: join the other ranks (quantkit.runtime.distributed); a plain run is SINGLE and this is a no-op
    group, dev = distributed.init(dev)
    if group.distributed and delete_source_after:
        raise ConfigError("--delete-source-after: ranks share the source's files; with several ranks pull the model "
                          "first (quantkit pull) and convert the local folder")
    distributed.check_shared_folder(group, out)  # several nodes: --out must be one folder for all
    progress = progress and group.leader

    # decisions for every tensor, up front (a dry run of the whole conversion)
    source_group = source_int4_group(arch)
    decisions = {n: decide(st, rec, G, source_group) for n, st in ckpt.tensors.items()}
    needs_calibration = rec.method != "rtn" and any(
        d.decode == INT4 and not ckpt.tensors[n].info.mtp for n, d in decisions.items()
    )
    # the FP8 KV cache's scales are measured on the calibration tokens too (quantkit.model.kvcache): with a
    # calibrated method, a source whose experts are all reused (Kimi's INT4) still gets its pass;
    # an RTN convert reads no data and carries no KV scales (engines then run the cache at 1.0)
    needs_calibration = needs_calibration or rec.method != "rtn"

    state_dir = out / STATE_DIR
    from quantkit.checkpoint.finish import finish_pair, journal

    if group.leader:
        shutil.rmtree(out / (STATE_DIR + ".done"), ignore_errors=True)  # a finished run's state, left by a crash
    if resume and (out / "convert-report.json").is_file() and not state_dir.exists():
        report = json.loads((out / "convert-report.json").read_text())  # the interrupted run had finished
        result = _done(ConvertResult(out, out / "prefill", out / "decode", report), validate, device, progress)
        distributed.close(group)
        return result
    finishing = resume and journal(state_dir) is not None  # the layers are done; only the finish is left
    for final in (out / "prefill", out / "decode"):
        if final.exists() and not finishing:
            hint = " (an interrupted convert is there: add --resume to complete it)" if (state_dir / "state.json").is_file() else ""
            raise OutputError(f"{final}: already exists{hint}; remove it or choose another --out")
    tokens = None
    if needs_calibration:
        tokens = load_tokens(rec.calibration.dataset, tokenizer=src_path, num_samples=rec.calibration.num_samples,
                             seq_len=rec.calibration.seq_len, seed=rec.calibration.seed, trust_remote_code=trust_remote_code)
    source_files = _source_identity(ckpt)
    fingerprint = hashlib.sha256(json.dumps(
        [source_files, rec.model_dump(mode="json"), tokens.sha256 if tokens else None, __version__]).encode()).hexdigest()

    out.mkdir(parents=True, exist_ok=True)
    state = State(fingerprint)
    if resume and (state_dir / "state.json").is_file():
        saved = json.loads((state_dir / "state.json").read_text())
        saved.pop("hidden", None)
        state = State(**saved)
        if state.fingerprint != fingerprint:
            raise OutputError(f"{state_dir}: the interrupted run used another source, recipe or calibration; "
                              "rerun without --resume (or restore them)")
    elif state_dir.exists() and group.leader:
        if not resume:
            shutil.rmtree(state_dir)
    if group.leader:
        state_dir.mkdir(exist_ok=True)
    group.barrier("starting")  # every rank has read the state rank 0 will overwrite, and sees its folder
    from quantkit.conversion.cost import plan_convert, quantized_fraction

    cost = plan_convert(arch, method=rec.method, group_size=G, num_samples=rec.calibration.num_samples,
                        seq_len=rec.calibration.seq_len, calibrate=needs_calibration, device=dev.type,
                        max_host_memory=max_host_memory, max_gpu_memory=max_gpu_memory,
                        source_bytes=sum(ckpt.storage_bytes(n) for n in ckpt.tensors),
                        output_bytes=predicted_bytes(ckpt, decisions, G), max_shard_bytes=max_shard_bytes,
                        validate=rec.validate if validate else None, activation_dtype=activation_dtype,
                        quantized=quantized_fraction(ckpt, decisions), nproc=group.world)
    if mb := os.environ.get("QUANTKIT_MICRO_BATCH"):
        # debug knob: fewer samples per micro-batch than the budget allows, so that a small test run has
        # several micro-batches (the ranks' token split, docs/distributed.md); changes the float sums' order
        cost.store.micro_batch = max(1, int(mb))
    if progress:
        from rich.console import Console

        Console(stderr=True).print(cost.summary(), highlight=False)
    if not cost.fits:
        raise OutputError(cost.reason)
    max_shard_bytes = cost.shard_bytes

    digits = _shard_digits(ckpt)
    wp = wd = None
    if not finishing:
        # several ranks: all add the same tensors, so all cut the same parts; part i of prefill is
        # saved by rank i % world, of decode by rank (i + 1) % world (a layer's two parts, two ranks)
        owns = [(lambda i, k=k: (i + k) % group.world == group.rank) if group.distributed else None for k in (0, 1)]
        if group.leader:
            check_disk(ckpt, decisions, out, G, extra=cost.disk["resume_state"])
            wp = CheckpointWriter(out / "prefill", digits=digits, resume=resume, max_shard_bytes=max_shard_bytes, owns=owns[0])
            wd = CheckpointWriter(out / "decode", digits=digits, resume=resume, max_shard_bytes=max_shard_bytes, owns=owns[1])
            wp.truncate_parts(state.prefill_parts)
            wd.truncate_parts(state.decode_parts)
        group.barrier("opening the outputs")  # rank 0 has cleared or truncated them
        if not group.leader:
            wp = CheckpointWriter(out / "prefill", digits=digits, resume=True, max_shard_bytes=max_shard_bytes, owns=owns[0])
            wd = CheckpointWriter(out / "decode", digits=digits, resume=True, max_shard_bytes=max_shard_bytes, owns=owns[1])
            wp.adopt_parts(state.prefill_parts)
            wd.adopt_parts(state.decode_parts)
    pair = PairWriter(ckpt, wp, wd)
    pair.differ = list(state.differ)

    n_layers = arch.num_layers_with_mtp
    bar = LayerProgress(progress, n_layers, "layers")
    store = None
    ctx = None
    topks: list = []
    if tokens is not None:
        from quantkit.conversion.activations import ActivationStore

        ids = tokens.ids
        ctx = Context.build(arch, ids.shape[1], dev, dtype, kv=KVAbsmax())  # measures what the KV cache holds
        # seq_len <= index_topk: the DSA indexer selects every causal key, so no selection is made or kept
        ctx.dsa_dense = arch.has_dsa and ids.shape[1] <= arch.index_topk
        work = state_dir if group.leader else state_dir / f"rank-{group.rank}"  # a disk-backed store's files
        work.mkdir(exist_ok=True)
        store = ActivationStore(*ids.shape, arch.hidden_size, cost.store, dev, work)
        topks = [None] * len(list(store.slices()))
    # several ranks: each runs the per-token work (attention, expert outputs) on its own micro-batches
    split = group if group.distributed and store is not None else None

    state_every = int(os.environ.get("QUANTKIT_STATE_EVERY", cost.state_every))  # debug knob: the resume tests
    with bar:
        # 1. tensors outside the decoder layers: embeddings, final norm, head, vision
        if state.next_layer == -1:
            if tokens is not None:
                table = ckpt.get(f"{arch.prefix}embed_tokens.weight", torch.bfloat16)  # (V, D), exact for a BF16 source
                for sl in store.slices():
                    store.h.write(sl, F.embedding(ids[sl], table).to(dev, dtype))
                del table
            for name in ckpt.names(layer=None):
                pair.write_shared(name, decisions[name])
            pair.flush()
            pair.drain()
            ckpt.release_finished()
            state.next_layer = 0
            state.prefill_parts, state.decode_parts = wp.num_parts, wd.num_parts
            group.barrier("after the embeddings")
            if group.leader:
                _save_state(state_dir, state, store, topks)
        elif tokens is not None:
            topks = _load_hidden(state_dir, len(topks), store, dev)
        bar.update(state.next_layer)

        # 2. the decoder layers, one at a time (a streamed source fetches the next layer's shards meanwhile)
        fetcher = Prefetcher(ckpt)
        for layer in range(state.next_layer, n_layers):
            fetcher.ahead(layer + 1)
            t0 = time.time()
            pre = arch.layer_prefix(layer)
            mtp = layer >= arch.num_hidden_layers
            w: dict[str, torch.Tensor] = {}

            # shared tensors first: their stored form is also what we compute with
            calibrate = store is not None and not mtp
            for name in ckpt.names(layer):
                klass = ckpt.tensors[name].info.klass
                if klass == TensorClass.ROUTED_EXPERT or (klass == TensorClass.KV_SCALE and calibrate):
                    continue  # experts below; a source's KV scales give way to the ones measured here
                parts = pair.write_shared(name, decisions[name])
                w[name[len(pre):]] = compute_weight(parts, ckpt.tensors[name], dtype).to(dev)

            routing = None
            kv_stats = None
            if calibrate:  # h += attention (+ dense MLP, or shared expert), x and routing kept for the experts
                routing = attention_pass(store, w, ctx, layer, topks, arch.is_moe(layer), split)
                kv_stats = write_kv_scales(pair, pre, ctx.kv, layer)
            t_attention = time.time() - t0
            records: list[ExpertRecord] = []
            shares: dict = {}  # multi-rank: each rank's part of this layer's experts
            if arch.is_moe(layer) and calibrate:  # h += routed experts under the decode weights
                records = convert_experts(ckpt, pair, decisions, layer, store, routing, rec, G, rec.method,
                                          dtype, dev, bar, cost.expert_chunk, group, shares)
                del routing
            elif arch.is_moe(layer):  # no calibration (RTN, or an MTP layer): round to nearest
                records = convert_experts(ckpt, pair, decisions, layer, None, None, rec, G, "rtn", dtype, dev,
                                          bar, cost.expert_chunk)
                if mtp:
                    for r in records:
                        if r.method != "reused":
                            r.fallback = "mtp: no calibration path (RTN)"
            if calibrate and split is not None:  # each rank updated its own micro-batches' h: all of it to all
                distributed.share_rows(group, store, [store.h], f"layer {layer}: hidden states")
            pair.flush()
            faults.point("layer:written")

            state.experts += [_record(r) for r in records]
            state.layers.append({"layer": layer, "kind": "mtp" if mtp else ("moe" if arch.is_moe(layer) else "dense"),
                                 "seconds": round(time.time() - t0, 3), "attention_seconds": round(t_attention, 3),
                                 "calibrated": calibrate and arch.is_moe(layer),
                                 **({"kv_cache": kv_stats} if kv_stats else {}),
                                 **({"ranks": shares} if shares else {})})
            state.next_layer = layer + 1
            state.prefill_parts, state.decode_parts = wp.num_parts, wd.num_parts
            state.differ = pair.differ
            # The resume state holds every calibration token's h (26 GB at GLM 5.2's shipped recipe),
            # so it is saved every `state_every` layers (the plan's: at most STATE_OVERHEAD of the run)
            # and after the last; a crash redoes the layers since, whose parts resume drops. It names
            # every part so far, so each rank's must be on disk first.
            if (layer + 1) % state_every == 0 or layer == n_layers - 1:
                pair.drain()
                group.barrier(f"end of layer {layer}")  # a dead rank stops the others here at the latest
                if group.leader:
                    _save_state(state_dir, state, store, topks)
            else:
                group.barrier(f"end of layer {layer}")
            del w
            ckpt.release_finished()
            bar.update(layer + 1)
            if delay := float(os.environ.get("QUANTKIT_CONVERT_LAYER_DELAY", 0)):
                time.sleep(delay)  # debug knob: widens the window for crash/resume tests
        fetcher.close()

    # 3. configs, carried files, rename into place: journaled in the state folder so that --resume
    #    completes an interrupted finish from any step (quantkit.checkpoint.finish); the report comes last
    block = rec.prefill.fp8_block
    prefill_cfg = set_quantization_config(arch.raw, arch, prefill_quantization_config(ckpt, decisions, block))
    decode_qc = decode_quantization_config(ckpt, decisions, G, block)
    if any("kv_cache" in lay for lay in state.layers) and not arch.has_dsa:
        # prefill's `fp8` config reads the same tensors unasked; DSA models get none (quantkit.model.kvcache)
        decode_qc["kv_cache_scheme"] = kv_cache_scheme()
    decode_cfg = set_quantization_config(arch.raw, arch, decode_qc)
    carried = ckpt.other_files()
    parts = None
    if store is not None:
        store.close()
    if wp is not None:
        pair.flush()  # (empty after the last layer) every rank, so that all agree on the parts
        pair.drain()
        parts = {"prefill": wp.parts, "decode": wd.parts}
    # every rank has written its parts and is done with the state folder (rank 0 finishes alone)
    used = group.all_gather_object({"peak_rss": peak_rss(), "parts": wp.written + wd.written if wp else 0},
                                   "before the finish")
    budgets = {"max_host_memory": max_host_memory, "max_gpu_memory": max_gpu_memory}
    if not group.leader:
        result = ConvertResult(out, out / "prefill", out / "decode", {}, rank=group.rank)
        if validate:  # every rank validates, with its share of the experts, once rank 0 has finished the output
            group.barrier("waiting for rank 0 to finish the output")
            result = _done(result, validate, device, False, budgets)
        distributed.close(group)
        return result
    report = finish_pair(
        out, state_dir, parts, digits, {"prefill": prefill_cfg, "decode": decode_cfg}, carried, set(state.differ),
        lambda manifests: _report(model, src_path, source_files, rec, tokens, state, ckpt, decisions, out, t_start, G,
                                  block, manifests) | {"kv_cache": kv_cache_report(state.layers), "cost": cost.to_json(),
                                                       "distributed": _distributed_report(group, state, used)},
    )
    if validate:
        group.barrier("waiting for the other ranks to validate")
    result = _done(ConvertResult(out, out / "prefill", out / "decode", report), validate, device, progress, budgets)
    distributed.close(group)
    return result


def _record(r: ExpertRecord) -> dict:
    """An expert's report entry; `rank` (who quantized it) only in a multi-rank convert."""
    return {k: v for k, v in vars(r).items() if k != "rank" or v is not None}


def _distributed_report(group, state: State, used: list[dict]) -> dict:
    """The job's shape, each rank's share of the experts over all layers, the parts it wrote (this
    run) and its peak RSS (quantkit.runtime.distributed)."""
    if not group.distributed:
        return {"world": 1}
    shares = [lay["ranks"] for lay in state.layers if "ranks" in lay]
    world = max([group.world] + [len(s["experts"]) for s in shares])  # a resumed run may have had more ranks
    experts, tokens, seconds = [0] * world, [0] * world, [0.0] * world
    for share in shares:
        for r, (n, t, sec) in enumerate(zip(share["experts"], share["tokens"], share["seconds"])):
            experts[r] += n
            tokens[r] += t
            seconds[r] += sec
    return {"world": group.world, "backend": group.backend, "experts_per_rank": experts, "tokens_per_rank": tokens,
            "quantize_seconds_per_rank": [round(s, 3) for s in seconds],
            "parts_written_per_rank": [u["parts"] for u in used],
            "peak_rss_bytes_per_rank": [u["peak_rss"] for u in used],
            "redundant": "every rank runs attention, routing and the routed outputs for all calibration tokens, "
                         "and computes every stored tensor; each writes the parts it owns"}


def _done(result: ConvertResult, validate: bool, device, progress, budgets: dict | None = None) -> ConvertResult:
    if validate:
        from quantkit.validation.pipeline import validate as run_validate

        result.validation = run_validate(result.out, device=device, progress=progress, **(budgets or {}))
    return result


def _source_identity(ckpt: Checkpoint) -> dict[str, str]:
    """sha256 per source file: from the Hub's LFS metadata for a streamed source (git blob id for
    small files), hashed locally otherwise."""
    if ckpt.remote is not None:
        return {name: rf.sha256 or f"git-blob:{rf.blob_id}" for name, rf in sorted(ckpt.remote.files.items())}
    return {p.name: file_sha256(p) for p in sorted(ckpt.folder.iterdir()) if p.is_file()}


class Prefetcher:
    """Brings the next layer's bytes close while this one computes, in a background thread: a
    streamed source downloads its shards; a local one has the kernel read them into the page cache
    (Checkpoint.readahead), so that quantkit.conversion.cost can count reading as overlapped with compute."""

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
        if self.ckpt._unread[f]:  # not consumed (and so not released) yet
            self.ckpt.remote.fetch(f)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _shard_digits(ckpt: Checkpoint) -> int:
    """Keep the source's shard-name style (Kimi: six digits, GLM: five), from the index's names
    (a streamed source has not downloaded its shards yet)."""
    for f in sorted(set(ckpt.weight_map.values())):
        if "-of-" in f:
            return len(f.rsplit("-of-", 1)[1].split(".")[0])
    return 5


def check_disk(ckpt, decisions, out: Path, G: int, free: int | None = None, extra: int = 0) -> None:
    """Refuse a run that cannot fit: the predicted pair, less what an interrupted run already wrote,
    plus `extra` (the resume state: one copy of h in its stored dtype, and the store when disk-backed)."""
    written = sum(p.stat().st_size for w in ("prefill", "decode") for p in (out / f"{w}.partial").glob("part-*"))
    need = sum(predicted_bytes(ckpt, decisions, G)) - written + extra
    _NEEDS[str(out)] = need
    free = shutil.disk_usage(out).free if free is None else free
    if need > free:
        raise OutputError(f"{out}: the pair needs about {_size(need)} more, only {_size(free)} free there; "
                          "free space or choose another --out")


def _report(model, src_path, source_files, rec, tokens, state: State, ckpt, decisions, out: Path, t_start, G, block,
            manifests: dict[str, str] | None = None) -> dict:
    experts = state.experts
    counts = {m: sum(1 for e in experts if e["method"] == m) for m in ("gptq", "awq", "rtn", "reused")}
    fallbacks = [e for e in experts if e["fallback"]]
    sizes = {which: sum(p.stat().st_size for p in (out / which).glob("*.safetensors")) for which in ("prefill", "decode")}
    differ = sorted(state.differ)
    return {
        "quantkit_version": __version__,
        "source": {"spec": str(model), "path": str(Path(src_path).resolve()), "model_type": ckpt.arch.model_type,
                   "repo": ckpt.remote.repo_id if ckpt.remote else None,
                   "revision": ckpt.remote.revision if ckpt.remote else None,
                   "commit": ckpt.remote.commit if ckpt.remote else None,
                   "unverified_files": ckpt.remote.unverified if ckpt.remote else [],
                   "files": source_files},
        "recipe": rec.model_dump(mode="json"),
        "method": rec.method,
        "group_size": G,
        "calibration": None if tokens is None else {
            "spec": tokens.spec, "num_samples": int(tokens.ids.shape[0]), "seq_len": int(tokens.ids.shape[1]),
            "tokens": int(tokens.ids.numel()), "sha256": tokens.sha256, "source": tokens.source,
        },
        "calibration_choice": "each layer calibrated on the hidden states of the quantized decode model (sequential)",
        "layers": state.layers,
        "experts": experts,
        "experts_summary": {"total": len(experts), **counts, "fallbacks": len(fallbacks),
                            "starved": sum(1 for e in experts if e["fallback"] == "all_tokens" or e["fallback"] == "rtn"),
                            "guarded": sum(1 for e in experts if e.get("heldout")),
                            "guard_kept_rtn": sum(1 for e in experts if e.get("guard") == "rtn"),
                            "awq_kept_s1": sum(1 for e in experts if e.get("guard") == "awq-s1")},
        "guard": "each calibrated expert is compared with RTN on its held-out routed tokens (every "
                 f"{HOLDOUT}th calibration token, never fitted on); the lower output error is stored",
        "outputs": {
            "prefill": {"path": "prefill", "bytes": sizes["prefill"], "manifest_sha256": (manifests or {}).get("prefill"),
                        "precision": precision_summary(ckpt, decisions, "prefill", G, block)},
            "decode": {"path": "decode", "bytes": sizes["decode"], "manifest_sha256": (manifests or {}).get("decode"),
                       "precision": precision_summary(ckpt, decisions, "decode", G, block)},
        },
        "shared_tensors": {
            "identical": len(ckpt.tensors) - len(differ),
            "differ": len(differ),
            "differ_classes": sorted({ckpt.tensors[n].info.klass.value for n in differ}),
            "renamed": "FP8 block multipliers are `weight_scale_inv` in prefill (DeepSeek layout) and "
                       "`weight_scale` in decode (compressed-tensors); the bytes are identical",
        },
        "decisions": {n: {"prefill": d.prefill, "decode": d.decode, **({"why": d.why} if d.why else {})}
                      for n, d in decisions.items() if d.prefill != PASS or d.decode != PASS or d.why},
        "seconds": round(time.time() - t_start, 3),
        "peak_rss_bytes": peak_rss(),
    }
