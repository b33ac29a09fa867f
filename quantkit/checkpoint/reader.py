"""Reading a checkpoint: lazy, one layer at a time, dequantized from whatever the source stores.

Reading never holds the model: shard headers are parsed up front (so a bad index or a truncated
shard fails before any work, quantkit.checkpoint.index), tensors are read (positioned reads, no
memory map) only when asked for, and a layer's tensors come out dequantized:

    dense   BF16 / FP16 / FP32 `weight`
    fp8     DeepSeek-native `weight` (float8_e4m3fn) + `weight_scale_inv` (128x128 multipliers)
    int4    compressed-tensors `weight_packed` + `weight_scale` + `weight_shape` (+ `weight_zero_point`)

A streamed source (a quantkit.hub.source.HubSource) has its small files fetched when the
checkpoint is opened and each shard when a tensor in it is first read.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from quantkit.checkpoint.expected import expected_shape, missing_beside, required_layer_tensors
from quantkit.checkpoint.index import (
    DTYPES,
    INDEX,
    SINGLE,
    WEIGHT_FILES,
    check_index_matches_shards,
    check_links,
    data_start,
    read_header,
    read_weight_map,
)
from quantkit.errors import CheckpointError
from quantkit.formats import fp8, int4
from quantkit.model.arch import ModelArch, load_arch, without_mtp
from quantkit.model.tensors import QUANT_SUFFIXES, TensorClass, TensorInfo, classify


class _Shard:
    """One open safetensors file, read with positioned reads (os.preadv) into memory that belongs to
    the tensor and is freed with it. Not a memory map: a map keeps every page a layer touched
    resident (and counted in RSS) until the file closes, which made peak RSS grow with the layers
    and the shard size instead of the work. Thread-safe (no shared file position)."""

    MAX_READ = 1 << 30  # Linux returns at most ~2 GiB per read call

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.start = data_start(path)

    def read(self, name: str, entry: dict, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor a header entry {dtype, shape, data_offsets} describes (checked by read_header),
        in memory of its own, or in `into` (uint8, its size; Checkpoint.keep packs a layer in one block)."""
        begin, end = entry["data_offsets"]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        buf = bytearray(end - begin) if into is None else into.numpy()
        view, done = memoryview(buf).cast("B"), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:done + self.MAX_READ]], self.start + begin + done)
            if n <= 0:
                raise CheckpointError(f"ends {len(view) - done} bytes early; the shard is truncated, re-download it",
                                      file=str(self.path), tensor=name)
            done += n
        raw = torch.frombuffer(buf, dtype=torch.uint8) if into is None else into
        return raw.view(dtype).reshape(shape)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


@dataclass(frozen=True)
class Stored:
    """One logical tensor as it sits on disk."""

    info: TensorInfo
    format: str  # "dense" | "fp8" | "int4"
    parts: dict[str, str]  # storage suffix ("weight", "weight_scale", ...) -> full storage name
    dtype: str  # safetensors dtype of the main part
    shape: tuple[int, ...]  # logical (dequantized) shape

    @property
    def name(self) -> str:
        return self.info.name


def fetch_small_files(remote) -> Path:
    """Fetch a streamed source's config, index, tokenizer, ...: every file but the weights (which
    the checkpoint fetches shard by shard when first read). Returns the folder they are in."""
    folder = remote.local_path("config.json").parent
    for name in remote.files:
        if not name.endswith(WEIGHT_FILES):
            remote.fetch(name)
    return folder


def _finite(w: torch.Tensor) -> bool:
    """No NaN and no Inf in `w`: min and max in one pass (NaN propagates into both, +-Inf shows in one),
    without isfinite's bool tensor of w's size (at real width that was a quarter of validate's time)."""
    lo, hi = torch.aminmax(w)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


class Checkpoint:
    """A model folder opened for streaming: index validated, tensors classified, nothing loaded."""

    def __init__(self, folder: str | Path, *, check_finite: bool = True, remote=None, release_consumed: bool = False,
                 complete: bool = True):
        """`remote`: a quantkit.hub.source.HubSource (`folder` is then ignored: None); shards are
        fetched when first needed (and, with `release_consumed`, deleted once every tensor in them
        has been read). `complete`: require every tensor the architecture needs (False only to
        read a partial folder)."""
        self.remote = remote
        if remote is not None:
            folder = fetch_small_files(remote)
        self.folder = Path(folder)
        if remote is None:
            check_links(self.folder)
        self.arch: ModelArch = load_arch(self.folder)
        self.check_finite = check_finite
        # how the forward computes this checkpoint's Linears (quantkit.model.numerics): "weights" on the
        # dequantized weights, "engine" as vLLM/SGLang do (FP8 block layers W8A8); validate sets it
        self.numerics = "weights"
        self.release_consumed = release_consumed
        self._handles: dict[str, object] = {}
        self.bytes_read = 0  # stored bytes read from the files so far (validate reports it)
        self._keep: dict[str, tuple] = {}  # storage name -> (layer, device) it is kept with once read (`keep`)
        self._keep_groups: dict[tuple, list[str]] = {}  # (layer, device) -> its storage names not read yet
        self._kept: dict[str, torch.Tensor] = {}
        self.weight_map = read_weight_map(self.folder, remote)  # storage name -> file name
        self.headers = {f: read_header(self.folder / f, remote) for f in sorted(set(self.weight_map.values()))}
        self._unread: dict[str, set[str]] = defaultdict(set)  # file -> storage names not read yet
        for name, f in self.weight_map.items():
            self._unread[f].add(name)
        self._held: set[str] = set()  # storage names that count as unread until released (hold)
        check_index_matches_shards(self.folder, self.weight_map, self.headers)
        self.tensors: dict[str, Stored] = self._group()
        self._by_layer: dict[int | None, list[str]] = defaultdict(list)
        for name, st in self.tensors.items():
            self._by_layer[st.info.layer].append(name)
        self.absent_mtp_layers = self._drop_absent_mtp()
        if complete:
            self._check_complete()

    # ---- tensors -----------------------------------------------------------------------------
    def _group(self) -> dict[str, Stored]:
        """Group storage names into logical tensors and decide each one's format."""
        parts: dict[str, dict[str, str]] = defaultdict(dict)
        for name in self.weight_map:
            head, _, leaf = name.rpartition(".")
            if leaf in QUANT_SUFFIXES or leaf == "weight":
                parts[f"{head}.weight"][leaf] = name
            else:
                parts[name][leaf] = name
        self._refuse_renamed(parts)
        out = {}
        for logical, p in sorted(parts.items()):
            file = str(self._file(next(iter(p.values()))))
            try:
                info = classify(logical, self.arch)
            except CheckpointError as e:  # classify knows names, not files: add the shard
                err = CheckpointError(str(e), file=file)
                err.tensor = e.tensor
                raise err from None
            out[logical] = self._stored(logical, info, p, file)
            expected = expected_shape(info, self.arch)
            if expected is not None and out[logical].shape != expected:
                raise CheckpointError(
                    f"shape {out[logical].shape} contradicts config.json (expected {expected})", file=file, tensor=logical
                )
        return out

    def _refuse_renamed(self, parts: dict[str, dict[str, str]]) -> None:
        """A renamed tensor (`experts.2.up_proj.weight` saved as `uq_proj.weight`) is named as what
        it is: a required weight missing beside a name no rule covers. Left to the later checks, a
        scale without its weight read as a dense tensor of the scale's shape ("shape (1, 1)
        contradicts config.json"), which sends the user after the wrong tensor."""
        weights = {"weight", "weight_packed"}
        orphans = sorted(n for n, p in parts.items() if not weights & p.keys() and set(p) <= set(QUANT_SUFFIXES))
        unknown = []
        for n in sorted(parts):
            try:
                classify(n, self.arch)
            except CheckpointError:
                unknown.append(n)
        present = {n for n, p in parts.items() if weights & p.keys() or not set(p) <= set(QUANT_SUFFIXES)}
        for n in unknown:
            missing = missing_beside(self.arch, n, present)
            if missing:
                raise CheckpointError(
                    f"{missing[0]} is missing, and the shards hold {n}, a name no rule covers, instead: the tensor "
                    "was renamed; restore its name (or re-download the shard)",
                    file=str(self._file(next(iter(parts[n].values())))), tensor=missing[0])
        if orphans:
            n = orphans[0]
            raise CheckpointError(
                f"the shards hold {sorted(parts[n])} of {n} but not the weight itself: the checkpoint is incomplete "
                "or the weight was renamed; re-download it", file=str(self._file(next(iter(parts[n].values())))), tensor=n)

    def _entry(self, storage: str) -> dict:
        """The header entry {dtype, shape, data_offsets} of one stored tensor."""
        return self.headers[self.weight_map[storage]][storage]

    def _stored(self, logical: str, info: TensorInfo, p: dict[str, str], file: str) -> Stored:
        """One logical tensor's format and logical shape, from its storage parts' header entries."""
        hdr = self._entry
        if "weight_packed" in p:
            missing = {"weight_scale", "weight_shape"} - p.keys()
            if missing:
                raise CheckpointError(f"pack-quantized tensor lacks {sorted(missing)}", file=file, tensor=logical)
            # from the header (8 values per int32 word), so opening reads no tensor data;
            # `get` checks it against the stored weight_shape
            rows, words = hdr(p["weight_packed"])["shape"]
            shape = (rows, words * 8)
            return Stored(info, "int4", p, hdr(p["weight_packed"])["dtype"], shape)
        if "weight" in p and hdr(p["weight"])["dtype"].startswith("F8") and ("weight_scale_inv" in p or "weight_scale" in p):
            # DeepSeek names the block multiplier `weight_scale_inv`, compressed-tensors `weight_scale`
            return Stored(info, "fp8", p, hdr(p["weight"])["dtype"], tuple(hdr(p["weight"])["shape"]))
        if len(p) == 1:
            ((leaf, storage),) = p.items()
            return Stored(info, "dense", p, hdr(storage)["dtype"], tuple(hdr(storage)["shape"]))
        raise CheckpointError(f"unexpected storage parts {sorted(p)} for one tensor", file=file, tensor=logical)

    def _drop_absent_mtp(self) -> int:
        """MTP layers config.json declares but the shards hold no tensor of (transformers'
        save_pretrained of a DeepSeek-V3 model writes num_nextn_predict_layers: 1 and no MTP
        tensors): the checkpoint is read without them, and the count is returned for the report
        and the cards. A layer held in part is still refused (`_check_complete`)."""
        a = self.arch
        held = [layer for layer in self._by_layer if layer is not None and layer >= a.num_hidden_layers]
        if not a.num_mtp_layers or held:
            return 0
        self.arch = without_mtp(a)
        return a.num_mtp_layers

    def _check_complete(self) -> None:
        """Every tensor the architecture needs is there (a one-line error here, not a KeyError
        halfway through a conversion); a layer with no tensors at all means the config's layer count
        does not match the weights."""
        a = self.arch
        where = str(self.folder / (INDEX if (self.folder / INDEX).is_file() else SINGLE))
        by_layer = {layer: {n[len(a.layer_prefix(layer)):] for n in names} for layer, names in self._by_layer.items() if layer is not None}
        for layer in range(a.num_layers_with_mtp):
            have = by_layer.get(layer, set())
            if not have:
                raise CheckpointError(
                    f"config.json says {a.num_hidden_layers} decoder layers + {a.num_mtp_layers} MTP, but the shards hold no "
                    f"tensor of layer {layer}: the config does not match these weights; use the config.json that came with them",
                    file=where)
            for rel in required_layer_tensors(a, layer):
                if rel not in have:
                    raise CheckpointError("required tensor is missing from the index and the shards; the checkpoint is "
                                          "incomplete, re-download it", file=where, tensor=a.layer_prefix(layer) + rel)
        top = [f"{a.prefix}embed_tokens.weight", f"{a.prefix}norm.weight"] + ([] if a.tie_word_embeddings else [a.head_name])
        for name in top:
            if name not in self.tensors:
                raise CheckpointError("required tensor is missing from the index and the shards; the checkpoint is "
                                      "incomplete, re-download it", file=where, tensor=name)

    # ---- access ------------------------------------------------------------------------------
    def _file(self, storage: str) -> Path:
        return self.folder / self.weight_map[storage]

    def _shard(self, f: str) -> _Shard:
        h = self._handles.get(f)
        if h is None:
            if self.remote is not None:
                self.remote.fetch(f)
            h = self._handles[f] = _Shard(self.folder / f)
        return h

    def _raw(self, storage: str) -> torch.Tensor:
        kept = self._kept.get(storage)
        if kept is not None:
            return kept
        if storage in self._keep:
            self._read_kept(self._keep[storage])
            return self._kept[storage]
        f = self.weight_map[storage]
        if storage not in self._held:
            self._unread[f].discard(storage)
        t = self._shard(f).read(storage, self.headers[f][storage])
        self.bytes_read += t.nbytes
        return t

    def keep(self, names, device: torch.device | str = "cpu") -> int:
        """Keep these logical tensors in memory on `device` from their first read on, as stored
        (FP8 + block scales, packed INT4 + group scales, BF16: what an engine holds), so that later
        `get`s dequantize from memory instead of reading the file again. Validate keeps a rank's
        share of the checkpoints this way when it fits (greedy decoding runs every layer once per
        token). A layer's kept tensors are read together into one block: kept among the transient
        dequantized copies one by one, they fragmented the heap to twice their size in RSS.
        Returns the bytes that will be kept."""
        names = list(names)
        for n in names:
            for suffix, s in self.tensors[n].parts.items():
                # `get` reads a packed tensor's weight_shape as Python ints: on the host, that is no
                # device sync per use
                group = (self.tensors[n].info.layer, torch.device("cpu" if suffix == "weight_shape" else device))
                self._keep[s] = group
                self._keep_groups.setdefault(group, []).append(s)
        return sum(self.storage_bytes(n) for n in names)

    def _read_kept(self, group: tuple) -> None:
        """Read every kept, not yet read tensor of one (layer, device) into one block (64-byte
        aligned slices, so each can be viewed as its dtype) and keep them."""
        storages = [s for s in self._keep_groups.pop(group) if s not in self._kept]
        spans = [self.headers[self.weight_map[s]][s]["data_offsets"] for s in storages]
        sizes = [end - begin for begin, end in spans]
        block = torch.empty(sum(-(-n // 64) * 64 for n in sizes), dtype=torch.uint8)
        at = 0
        for s, n in zip(storages, sizes):
            f = self.weight_map[s]
            if s not in self._held:
                self._unread[f].discard(s)
            self._kept[s] = self._shard(f).read(s, self.headers[f][s], into=block[at:at + n]).to(group[1])
            self.bytes_read += n
            at += -(-n // 64) * 64

    def hold(self, name: str) -> None:
        """Count the logical tensor `name` as unread until `unhold`, however often it is read: its shard
        stays open (and a streamed source's local copy undeleted) for a later reader. convert holds the
        embedding table for the MTP layer's calibration, which reads it again after the last main layer."""
        self._held.update(self.tensors[name].parts.values())

    def unhold(self, name: str) -> None:
        """The last read of a held tensor is done: its shard can be released once the rest of it is read."""
        for s in self.tensors[name].parts.values():
            if s in self._held:
                self._held.discard(s)
                self._unread[self.weight_map[s]].discard(s)

    def consumed(self, f: str) -> bool:
        """Every tensor stored in shard file `f` has been read (held ones released): the file is done
        with, so a prefetcher has nothing to fetch for it (it may already be released)."""
        return not self._unread.get(f)

    def release_finished(self) -> list[str]:
        """Close every shard all of whose tensors have been read, and with a streamed source and
        `release_consumed`, delete its local copy. The converter calls it between layers (so
        re-reads within a layer stay local): an open memory map keeps the pages it touched
        resident, which would make peak RSS grow with depth."""
        done = [f for f, unread in self._unread.items() if not unread and f in self._handles]
        for f in done:
            self._handles.pop(f).close()
            if self.release_consumed and self.remote is not None:
                self.remote.release(f)
        return done

    def spans(self, layer: int) -> list[tuple[str, int, int]]:
        """(file, byte offset in the file, length) of every stored tensor of a layer."""
        out, starts = [], {}
        for n in self.names(layer):
            for s in self.tensors[n].parts.values():
                f = self.weight_map[s]
                if f not in starts:
                    starts[f] = data_start(self.folder / f)
                b, e = self.headers[f][s]["data_offsets"]
                out.append((f, starts[f] + b, e - b))
        return out

    def readahead(self, layer: int) -> int:
        """Ask the kernel to read a local layer's stored bytes into the page cache now
        (posix_fadvise WILLNEED: asynchronous, nothing mapped, so no RSS), so that reading the next
        layer overlaps computing this one. Returns the bytes requested (0 where unsupported)."""
        if self.remote is not None or not hasattr(os, "posix_fadvise"):
            return 0
        total = 0
        for f, start, length in self.spans(layer):
            fd = os.open(self.folder / f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
            total += length
        return total

    def prefetch(self, layer: int) -> list[str]:
        """Shard files a layer needs (for a streamed source, fetch them ahead in a thread)."""
        return sorted({self.weight_map[s] for n in self.names(layer) for s in self.tensors[n].parts.values()})

    def raw(self, storage: str) -> torch.Tensor:
        """A stored tensor exactly as on disk (for byte-for-byte pass-through), checked for NaN/Inf:
        what is passed through is written as is, so this is its only check."""
        t = self._raw(storage)
        if self.check_finite and not all_finite(t):
            raise CheckpointError("contains NaN or Inf; the source checkpoint is damaged, re-download this shard",
                                  file=str(self._file(storage)), tensor=storage)
        return t

    def names(self, layer: int | None = ..., klass: TensorClass | None = None) -> list[str]:
        """Logical names, optionally of one layer (None: outside any layer) and/or one class."""
        names = sorted(self.tensors) if layer is ... else sorted(self._by_layer.get(layer, []))
        return [n for n in names if klass is None or self.tensors[n].info.klass == klass]

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One logical tensor, dequantized and cast to `dtype`, checked for shape and NaN/Inf."""
        st = self.tensors.get(name)
        if st is None:
            raise CheckpointError("tensor not in checkpoint", file=str(self.folder), tensor=name)
        p = st.parts
        if st.format == "int4":
            zp = self._raw(p["weight_zero_point"]) if "weight_zero_point" in p else None
            shape = tuple(int(x) for x in self._raw(p["weight_shape"]).tolist())
            if len(shape) != 2 or shape[0] != st.shape[0] or not st.shape[1] - 8 < shape[1] <= st.shape[1]:
                raise CheckpointError(f"weight_shape {shape} does not fit weight_packed {st.shape[0]}x{st.shape[1] // 8}",
                                      file=str(self._file(p["weight_shape"])), tensor=name)
            try:
                w = int4.dequantize(self._raw(p["weight_packed"]), self._raw(p["weight_scale"]), shape, zp)
            except (ValueError, RuntimeError) as e:
                raise CheckpointError(f"cannot unpack INT4 ({e})", file=str(self._file(p["weight_packed"])), tensor=name) from None
        elif st.format == "fp8":
            try:
                w = fp8.dequantize(self._raw(p["weight"]), self._raw(p.get("weight_scale_inv") or p["weight_scale"]))
            except ValueError as e:
                raise CheckpointError(str(e), file=str(self._file(p["weight"])), tensor=name) from None
        else:
            (storage,) = p.values()
            w = self._raw(storage)
            if storage in self._kept:  # the caller owns what it gets: never the kept tensor itself
                w = w.clone()
        self._check(st, w)
        return w.to(dtype)

    def _check(self, st: Stored, w: torch.Tensor) -> None:
        expected = expected_shape(st.info, self.arch)
        file = str(self._file(next(iter(st.parts.values()))))
        if expected is not None and tuple(w.shape) != expected:
            raise CheckpointError(f"shape {tuple(w.shape)} contradicts config.json (expected {expected})", file=file, tensor=st.name)
        if self.check_finite and w.is_floating_point() and w.numel() and not _finite(w):
            raise CheckpointError("contains NaN or Inf; the source checkpoint is damaged", file=file, tensor=st.name)

    def layer(self, layer: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """All tensors of one decoder layer, dequantized, keyed relative to the layer prefix."""
        pre = self.arch.layer_prefix(layer)
        return {n[len(pre):]: self.get(n, dtype) for n in self.names(layer)}

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()
        self._kept.clear()  # and stop keeping: a later read reads the file again
        self._keep.clear()
        self._keep_groups.clear()

    def other_files(self) -> list[Path]:
        """Files to carry over verbatim: tokenizer, chat template, generation config, code, ..."""
        skip = {INDEX, "config.json"}
        return sorted(
            p for p in self.folder.iterdir()
            if p.is_file() and p.name not in skip and not p.name.endswith(WEIGHT_FILES) and not p.name.startswith(".")
        )

    def storage_bytes(self, name: str) -> int:
        st = self.tensors[name]
        total = 0
        for s in st.parts.values():
            off = self.headers[self.weight_map[s]][s]["data_offsets"]
            total += off[1] - off[0]
        return total


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf, in chunks (no full-size temporary). FP8 by bit pattern (torch has no isfinite
    for it): e4m3fn has no Inf and NaN is S.1111.111; e5m2 Inf/NaN have the exponent all ones."""
    if not t.is_floating_point():
        return True
    flat = t.reshape(-1)  # a view of a contiguous stored tensor
    for chunk in flat.split(1 << 24):
        if t.dtype == torch.float8_e4m3fn:
            bad = ((chunk.view(torch.uint8) & 0x7F) == 0x7F).any()
        elif t.dtype == torch.float8_e5m2:
            bad = ((chunk.view(torch.uint8) & 0x7C) == 0x7C).any()
        else:
            bad = ~torch.isfinite(chunk).all()
        if bad:
            return False
    return True


def iter_layers(ckpt: Checkpoint) -> Iterator[int]:
    return iter(range(ckpt.arch.num_layers_with_mtp))
