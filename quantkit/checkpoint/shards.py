"""Checkpoint I/O: lazy reading of sharded safetensors, one layer at a time, and atomic writing.

Reading never holds the model: shard headers are parsed up front (so a bad index or a truncated
shard fails before any work), tensors are read (positioned reads, no memory map) only when asked
for, and a layer's tensors come out dequantized from whatever the source stores:

    dense   BF16 / FP16 / FP32 `weight`
    fp8     DeepSeek-native `weight` (float8_e4m3fn) + `weight_scale_inv` (128x128 multipliers)
    int4    compressed-tensors `weight_packed` + `weight_scale` + `weight_shape` (+ `weight_zero_point`)

Writing goes to `<out>.partial/` and is renamed to `<out>/` only when complete, so a folder under
its final name is always a whole checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file

from quantkit.errors import CheckpointError, OutputError
from quantkit.formats import fp8, int4
from quantkit.model.arch import ModelArch, load_arch
from quantkit.model.tensors import QUANT_SUFFIXES, TensorClass, TensorInfo, classify
from quantkit.runtime import faults

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")  # never carried as "other files"

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}


def _data_start(path: Path) -> int:
    """Where a safetensors file's tensor data begin: after the 8-byte length and the JSON header."""
    with open(path, "rb") as fh:
        return 8 + struct.unpack("<Q", fh.read(8))[0]


class _Shard:
    """One open safetensors file, read with positioned reads (os.preadv) into memory that belongs to
    the tensor and is freed with it. Not a memory map: a map keeps every page a layer touched
    resident (and counted in RSS) until the file closes, which made peak RSS grow with the layers
    and the shard size instead of the work. Thread-safe (no shared file position)."""

    MAX_READ = 1 << 30  # Linux returns at most ~2 GiB per read call

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.start = _data_start(path)

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


def read_header(path: Path, remote=None) -> dict:
    """Parse a safetensors header and check the file is as long as the header says.

    With `remote` (a quantkit.hub.download.HubSource) the header comes from two ranged reads of the Hub
    file, so a streamed conversion can plan every layer before downloading any shard.
    """
    try:
        if remote is not None:
            name = path.name
            size = remote.files[name].size
            read = lambda off, n: remote.read_range(name, off, n)  # noqa: E731
        else:
            size = path.stat().st_size
            f = open(path, "rb")
            read = lambda off, n: (f.seek(off), f.read(n))[1]  # noqa: E731
        try:
            raw = read(0, 8) if size >= 8 else b""
            if len(raw) < 8:
                raise CheckpointError("file is shorter than a safetensors header; re-download it", file=str(path))
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 * 2**20):
                raise CheckpointError("header length is past the end of the file; the shard is truncated or corrupt, re-download it", file=str(path))
            header = json.loads(read(8, n))
        finally:
            if remote is None:
                f.close()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError("header is not valid JSON; the shard is corrupt, re-download it", file=str(path)) from None
    except FileNotFoundError:
        raise CheckpointError("file not found", file=str(path)) from None
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object; the shard is corrupt, re-download it", file=str(path))
    header.pop("__metadata__", None)
    for name, v in header.items():
        if not _entry_ok(v):
            raise CheckpointError(
                "header entry is malformed (dtype, shape and data_offsets disagree); the shard is corrupt, re-download it",
                file=str(path), tensor=name,
            )
    if header:
        last, v = max(header.items(), key=lambda kv: kv[1]["data_offsets"][1])
        end = v["data_offsets"][1]
        if 8 + n + end > size:
            raise CheckpointError(
                f"truncated: tensors need {8 + n + end} bytes, file has {size}; re-download it", file=str(path), tensor=last
            )
    return header


def _entry_ok(v) -> bool:
    """A header entry is {dtype, shape, data_offsets} with as many bytes as dtype x shape needs."""
    try:
        dtype, shape, (begin, end) = v["dtype"], v["shape"], v["data_offsets"]
        numel = 1
        for d in shape:
            if not isinstance(d, int) or d < 0:
                return False
            numel *= d
        return (
            dtype in DTYPES and isinstance(begin, int) and isinstance(end, int)
            and 0 <= begin <= end and end - begin == numel * DTYPES[dtype].itemsize
        )
    except (TypeError, KeyError, ValueError):
        return False


class Checkpoint:
    """A model folder opened for streaming: index validated, tensors classified, nothing loaded."""

    def __init__(self, folder: str | Path, *, check_finite: bool = True, remote=None, release_consumed: bool = False,
                 complete: bool = True):
        """`remote`: a quantkit.hub.download.HubSource; shards are then fetched when first needed (and,
        with `release_consumed`, deleted once every tensor in them has been read). `complete`:
        require every tensor the architecture needs (False only to read a partial folder)."""
        self.remote = remote
        if remote is not None:
            folder = remote.local_path("config.json").parent
            for name in remote.files:  # config, index, tokenizer, ...: everything but weights
                if not name.endswith(WEIGHT_FILES):
                    remote.fetch(name)
        self.folder = Path(folder)
        if remote is None:
            _check_links(self.folder)
        self.arch: ModelArch = load_arch(self.folder)
        self.check_finite = check_finite
        self.release_consumed = release_consumed
        self._handles: dict[str, object] = {}
        self.bytes_read = 0  # stored bytes read from the files so far (validate reports it)
        self._keep: dict[str, tuple] = {}  # storage name -> (layer, device) it is kept with once read (`keep`)
        self._keep_groups: dict[tuple, list[str]] = {}  # (layer, device) -> its storage names not read yet
        self._kept: dict[str, torch.Tensor] = {}
        self.weight_map = self._weight_map()  # storage name -> file name
        self.headers = {f: read_header(self.folder / f, remote) for f in sorted(set(self.weight_map.values()))}
        self._unread: dict[str, set[str]] = defaultdict(set)  # file -> storage names not read yet
        for name, f in self.weight_map.items():
            self._unread[f].add(name)
        for name, f in self.weight_map.items():
            if name not in self.headers[f]:
                raise CheckpointError(f"the index names tensor {name!r} but the shard does not hold it", file=str(self.folder / f))
        for f, header in self.headers.items():
            unlisted = sorted(set(header) - {n for n, g in self.weight_map.items() if g == f})
            if unlisted:
                raise CheckpointError(f"the shard holds {len(unlisted)} tensor(s) the index does not list ({unlisted[0]!r}...): "
                                      f"the index is stale or damaged; re-download {INDEX}", file=str(self.folder / f))
        self.tensors: dict[str, Stored] = self._group()
        self._by_layer: dict[int | None, list[str]] = defaultdict(list)
        for name, st in self.tensors.items():
            self._by_layer[st.info.layer].append(name)
        if complete:
            self._check_complete()

    # ---- index -------------------------------------------------------------------------------
    def _weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError("not a valid index (needs a 'weight_map' object)", file=str(index)) from None
            if not isinstance(wm, dict):
                raise CheckpointError("not a valid index ('weight_map' must be an object)", file=str(index))
            # Lexical check: shards may be symlinks into a download cache (the Hugging Face
            # cache layout), but an index entry may not climb out of the folder.
            root = os.path.abspath(self.folder)
            for name, f in wm.items():
                p = os.path.normpath(os.path.join(root, f)) if isinstance(f, str) else root
                if p == root or not p.startswith(root.rstrip(os.sep) + os.sep):
                    raise CheckpointError(f"index points outside the model folder ({f!r})", file=str(index), tensor=name)
                present = f in self.remote.files if self.remote is not None else os.path.isfile(p)
                if not present:
                    raise CheckpointError(f"index names missing shard {f!r}; re-download it", file=str(index), tensor=name)
            return dict(wm)
        single = self.folder / SINGLE
        if single.is_file():
            return {name: SINGLE for name in read_header(single)}
        raise CheckpointError(f"no {INDEX} or {SINGLE}; is this a model folder?", file=str(self.folder))

    def _group(self) -> dict[str, Stored]:
        """Group storage names into logical tensors and decide each one's format."""
        parts: dict[str, dict[str, str]] = defaultdict(dict)
        for name in self.weight_map:
            head, _, leaf = name.rpartition(".")
            if leaf in QUANT_SUFFIXES or leaf == "weight":
                parts[f"{head}.weight"][leaf] = name
            else:
                parts[name][leaf] = name
        out = {}
        for logical, p in sorted(parts.items()):
            file = str(self._file(next(iter(p.values()))))
            try:
                info = classify(logical, self.arch)
            except CheckpointError as e:  # classify knows names, not files: add the shard
                err = CheckpointError(str(e), file=file)
                err.tensor = e.tensor
                raise err from None
            hdr = lambda n: self.headers[self.weight_map[n]][n]  # noqa: E731
            if "weight_packed" in p:
                missing = {"weight_scale", "weight_shape"} - p.keys()
                if missing:
                    raise CheckpointError(f"pack-quantized tensor lacks {sorted(missing)}", file=file, tensor=logical)
                # from the header (8 values per int32 word), so opening reads no tensor data;
                # `get` checks it against the stored weight_shape
                rows, words = hdr(p["weight_packed"])["shape"]
                shape = (rows, words * 8)
                out[logical] = Stored(info, "int4", p, hdr(p["weight_packed"])["dtype"], shape)
            elif "weight" in p and hdr(p["weight"])["dtype"].startswith("F8") and ("weight_scale_inv" in p or "weight_scale" in p):
                # DeepSeek names the block multiplier `weight_scale_inv`, compressed-tensors `weight_scale`
                out[logical] = Stored(info, "fp8", p, hdr(p["weight"])["dtype"], tuple(hdr(p["weight"])["shape"]))
            elif len(p) == 1:
                ((leaf, storage),) = p.items()
                out[logical] = Stored(info, "dense", p, hdr(storage)["dtype"], tuple(hdr(storage)["shape"]))
            else:
                raise CheckpointError(f"unexpected storage parts {sorted(p)} for one tensor", file=file, tensor=logical)
            expected = expected_shape(info, self.arch)
            if expected is not None and out[logical].shape != expected:
                raise CheckpointError(
                    f"shape {out[logical].shape} contradicts config.json (expected {expected})", file=file, tensor=logical
                )
        return out

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
            self._unread[f].discard(s)
            self._kept[s] = self._shard(f).read(s, self.headers[f][s], into=block[at:at + n]).to(group[1])
            self.bytes_read += n
            at += -(-n // 64) * 64

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
                    starts[f] = _data_start(self.folder / f)
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
        if self.check_finite and w.is_floating_point() and not torch.isfinite(w).all():
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


def required_layer_tensors(a: ModelArch, layer: int) -> list[str]:
    """Logical names (relative to the layer prefix) every decoder layer of this architecture holds."""
    req = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    req += [f"self_attn.{p}.weight" for p in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                               "kv_a_layernorm", "kv_b_proj", "o_proj")]
    projs = ("gate_proj", "up_proj", "down_proj")
    if a.is_moe(layer):
        req.append("mlp.gate.weight")
        req += [f"mlp.experts.{e}.{p}.weight" for e in range(a.n_routed_experts) for p in projs]
        if a.n_shared_experts:
            req += [f"mlp.shared_experts.{p}.weight" for p in projs]
    else:
        req += [f"mlp.{p}.weight" for p in projs]
    return req


def _check_links(folder: Path) -> None:
    """A symlink in a local model folder may only point inside it, or, for a Hugging Face cache
    snapshot (snapshots/<commit>/), into that repo's blobs/; anything else would be read, and
    carried into both outputs, from outside what the user named."""
    root = os.path.realpath(folder)
    allowed = [root]
    if Path(folder).resolve().parent.name == "snapshots":
        allowed.append(os.path.realpath(Path(folder).resolve().parent.parent / "blobs"))
    for p in Path(folder).rglob("*"):
        if p.is_symlink():
            target = os.path.realpath(p)
            if not any(target == r or target.startswith(r.rstrip(os.sep) + os.sep) for r in allowed):
                raise CheckpointError(f"is a symlink to {target}, outside the model folder; refusing to follow it: "
                                      "copy the file into the folder or remove the link", file=str(p))


def expected_shape(info: TensorInfo, a: ModelArch) -> tuple[int, ...] | None:
    """The [out, in] a config implies for a projection, the length of a norm; None where the
    config does not say."""
    h, k = a.hidden_size, a.kv_lora_rank
    if info.klass == TensorClass.NORM:
        return {"q_a_layernorm": (a.q_lora_rank,), "kv_a_layernorm": (k,)}.get(info.name.rsplit(".", 2)[-2], (h,))
    if info.klass == TensorClass.MTP and info.name.endswith(("enorm.weight", "hnorm.weight", "shared_head.norm.weight")):
        return (h,)
    if info.klass == TensorClass.MTP and info.proj == "eh_proj":
        return (h, 2 * h)  # [embedding; hidden] -> hidden
    if info.klass == TensorClass.INDEXER and info.proj is None:  # k_norm weight and bias
        return (a.index_head_dim,)
    if info.klass in (TensorClass.ROUTED_EXPERT, TensorClass.SHARED_EXPERT, TensorClass.DENSE_MLP):
        inter = {
            TensorClass.ROUTED_EXPERT: a.moe_intermediate_size,
            TensorClass.SHARED_EXPERT: a.moe_intermediate_size * a.n_shared_experts,
            TensorClass.DENSE_MLP: a.intermediate_size,
        }[info.klass]
        return (h, inter) if info.proj == "down_proj" else (inter, h)
    if info.klass == TensorClass.ATTENTION and info.name.endswith(".weight"):
        n = a.num_attention_heads
        return {
            "q_a_proj": (a.q_lora_rank, h),
            "q_b_proj": (n * a.qk_head_dim, a.q_lora_rank),
            "kv_a_proj_with_mqa": (k + a.qk_rope_head_dim, h),
            "kv_b_proj": (n * (a.qk_nope_head_dim + a.v_head_dim), k),
            "o_proj": (h, n * a.v_head_dim),
        }.get(info.proj)
    if info.klass == TensorClass.ROUTER:
        return (a.n_routed_experts, h) if info.name.endswith(".weight") else (a.n_routed_experts,)
    if info.klass == TensorClass.INDEXER and info.proj is not None:
        return {
            "wq_b": (a.index_n_heads * a.index_head_dim, a.q_lora_rank),
            "wk": (a.index_head_dim, h),
            "weights_proj": (a.index_n_heads, h),
        }[info.proj]
    if info.klass == TensorClass.EMBEDDING or info.klass == TensorClass.HEAD:
        return (a.vocab_size, h)
    return None


class CheckpointWriter:
    """Writes a sharded safetensors checkpoint into `<out>.partial/`, renamed to `<out>` on finish.

    Shards are cut at `flush()` (the converter flushes after every layer, which makes a resumed
    run write exactly the shards an uninterrupted one would) or when a buffer passes
    `max_shard_bytes`. Shard names get their final `-of-N` only in `finish()`.

    `owns(i)`, when given, says whether this process writes part i: in a multi-rank convert every
    rank adds the same tensors in the same order, so all agree on where parts are cut and what
    they are named, and each saves only the parts it owns (quantkit.runtime.distributed).

    A cut part is saved by a background thread while the caller computes the next one (a
    converter's writing then overlaps its compute instead of adding to it: 1.2 TB for GLM 5.2 is
    10 minutes at 2 GB/s); at most `MAX_PENDING` parts wait or are being saved, so memory stays
    bounded. `drain()` returns once every cut part is on disk (and raises a failed save's error):
    call it before recording progress that names the parts. A part is saved as `.tmp` and renamed,
    so a crash never leaves a part that looks whole but is not.
    """

    MAX_PENDING = 1

    def __init__(self, out: str | Path, *, max_shard_bytes: int = 5 * 2**30, digits: int = 5, resume: bool = False,
                 owns: Callable[[int], bool] | None = None):
        self.out = Path(out)
        self.tmp = self.out.with_name(self.out.name + ".partial")
        self.max_shard_bytes = max_shard_bytes
        self.digits = digits
        if self.out.exists():
            raise OutputError(f"{self.out}: already exists; remove it or choose another --out")
        if self.tmp.exists() and not resume:
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._parts = sorted(p.name for p in self.tmp.glob("part-*.safetensors"))
        self.owns = owns
        self.written = 0  # parts this process saved
        self._saver = None  # a one-thread executor, started with the first save
        self._pending: list = []  # futures of the saves not known to be done, oldest first

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buf:
            raise ValueError(f"tensor {name} added twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self._buf[name] = tensor.detach().to("cpu").contiguous()  # host memory (the plan's `writer`), not the GPU's
        self._buf_bytes += nbytes

    def flush(self) -> None:
        """Cut a part of what was added and hand it to the saving thread (see the class docstring)."""
        if not self._buf:
            return
        name = f"part-{len(self._parts):06d}.safetensors"
        if self.owns is None or self.owns(len(self._parts)):
            self._settle(self.MAX_PENDING - 1)  # room for one more; a failed save raises here
            if self._saver is None:
                from concurrent.futures import ThreadPoolExecutor

                self._saver = ThreadPoolExecutor(1, thread_name_prefix=f"save-{self.out.name}")
            self._pending.append(self._saver.submit(self._save, dict(sorted(self._buf.items())), name))
            self.written += 1
        self._parts.append(name)
        self._buf, self._buf_bytes = {}, 0

    def _save(self, tensors: dict[str, torch.Tensor], name: str) -> None:
        tmp = self.tmp / (name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        faults.point("flush:tmp")
        os.replace(tmp, self.tmp / name)

    def _settle(self, keep: int) -> None:
        """Wait until at most `keep` saves are pending, oldest first; re-raise a failed one's error."""
        while self._pending and (len(self._pending) > keep or self._pending[0].done()):
            self._pending.pop(0).result()

    def drain(self) -> None:
        """Every part cut so far is on disk under its part name."""
        self._settle(0)

    @property
    def num_parts(self) -> int:
        return len(self._parts)

    @property
    def parts(self) -> list[str]:
        """The part files written so far, in order (quantkit.checkpoint.finish names them model-*-of-N)."""
        return list(self._parts)

    def adopt_parts(self, n: int) -> None:
        """Resume, on a rank other than the one that truncated: the first n parts are the written
        ones (names only: the files are whoever wrote them)."""
        self._parts = [f"part-{i:06d}.safetensors" for i in range(n)]

    def truncate_parts(self, n: int) -> None:
        """Resume: drop the parts written after the last saved state, and anything else a crash
        left in the folder: a part's `.tmp`, and the temporary file safetensors writes a part
        through (`.tmpXXXXXX`) when the crash came mid-save."""
        keep = set(self._parts[:n])
        for stale in self.tmp.iterdir():
            if stale.name not in keep:
                stale.unlink()
        self._parts = self._parts[:n]

    def finish(self, config: dict, *, files: list[Path] = (), extra: dict[str, str] | None = None) -> Path:
        """Write config, index and carried files, name the shards, and rename into place."""
        self.flush()
        self.drain()
        n = len(self._parts)
        weight_map, total = {}, 0
        for i, part in enumerate(self._parts):
            final = f"model-{i + 1:0{self.digits}d}-of-{n:0{self.digits}d}.safetensors"
            header = read_header(self.tmp / part)
            for t, v in header.items():
                weight_map[t] = final
                total += v["data_offsets"][1] - v["data_offsets"][0]
            os.replace(self.tmp / part, self.tmp / final)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (self.tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in files:
            shutil.copy2(f, self.tmp / f.name)
        for name, text in (extra or {}).items():
            (self.tmp / name).write_text(text)
        os.replace(self.tmp, self.out)
        return self.out


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 16 MiB chunks (source identity, data identity)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def iter_layers(ckpt: Checkpoint) -> Iterator[int]:
    return iter(range(ckpt.arch.num_layers_with_mtp))
