"""A checkpoint folder's structure, checked before any tensor is read: the index (which shard holds
which tensor), every shard's safetensors header, and the folder's symlinks.

`read_header` is the only parser of safetensors headers that quantkit's reader and writer use
(the manifest hashes files with its own lenient one); every check raises a one-line
CheckpointError that names the file (and tensor) and what to do.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from quantkit.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")  # never carried as "other files"

DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}

MAX_HEADER = 100 * 2**20  # a longer header length means a corrupt file, not a real header


# ---- safetensors headers ----------------------------------------------------------------------
def data_start(path: Path) -> int:
    """Where a safetensors file's tensor data begin: after the 8-byte length and the JSON header."""
    with open(path, "rb") as fh:
        return 8 + struct.unpack("<Q", fh.read(8))[0]


def read_header(path: Path, remote=None) -> dict:
    """Parse a safetensors header and check the file is as long as the header says.

    With `remote` (a quantkit.hub.source.HubSource) the header comes from two ranged reads of the Hub
    file, so a streamed conversion can plan every layer before downloading any shard.
    """
    try:
        size, n, raw = _header_bytes(path, remote)
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError("header is not valid JSON; the shard is corrupt, re-download it", file=str(path)) from None
    except FileNotFoundError:
        raise CheckpointError("file not found", file=str(path)) from None
    _check_header(header, path, n, size)
    return header


def _header_bytes(path: Path, remote) -> tuple[int, int, bytes]:
    """(file size, header length, the header's JSON bytes), from the local file or from the Hub."""
    if remote is not None:
        name = path.name
        size = remote.files[name].size
        return (size, *_length_and_json(path, size, lambda off, n: remote.read_range(name, off, n)))
    size = path.stat().st_size
    with open(path, "rb") as f:
        return (size, *_length_and_json(path, size, lambda off, n: (f.seek(off), f.read(n))[1]))


def _length_and_json(path: Path, size: int, read) -> tuple[int, bytes]:
    """The 8-byte header length (checked against the file size) and the header bytes, via `read(offset, n)`."""
    raw = read(0, 8) if size >= 8 else b""
    if len(raw) < 8:
        raise CheckpointError("file is shorter than a safetensors header; re-download it", file=str(path))
    (n,) = struct.unpack("<Q", raw)
    if n > min(size - 8, MAX_HEADER):
        raise CheckpointError("header length is past the end of the file; the shard is truncated or corrupt, re-download it", file=str(path))
    return n, read(8, n)


def _check_header(header, path: Path, n: int, size: int) -> None:
    """Every entry well-formed and inside the file; drops `__metadata__` (in place)."""
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


# ---- the index ----------------------------------------------------------------------------------
def read_weight_map(folder: Path, remote=None) -> dict[str, str]:
    """storage name -> shard file, from the index (every entry inside the folder, every shard there:
    on disk, or with `remote` in the Hub listing) or from a single `model.safetensors`."""
    index = folder / INDEX
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError("not a valid index (needs a 'weight_map' object)", file=str(index)) from None
        if not isinstance(wm, dict):
            raise CheckpointError("not a valid index ('weight_map' must be an object)", file=str(index))
        # Lexical check: shards may be symlinks into a download cache (the Hugging Face
        # cache layout), but an index entry may not climb out of the folder.
        root = os.path.abspath(folder)
        for name, f in wm.items():
            p = os.path.normpath(os.path.join(root, f)) if isinstance(f, str) else root
            if p == root or not p.startswith(root.rstrip(os.sep) + os.sep):
                raise CheckpointError(f"index points outside the model folder ({f!r})", file=str(index), tensor=name)
            present = f in remote.files if remote is not None else os.path.isfile(p)
            if not present:
                raise CheckpointError(f"index names missing shard {f!r}; re-download it", file=str(index), tensor=name)
        return dict(wm)
    # A single-file model's weights are not among the small files a streamed source fetches up front:
    # the Hub listing says whether it has one, and its header comes by ranged reads like a shard's.
    single = folder / SINGLE
    if (SINGLE in remote.files) if remote is not None else single.is_file():
        return {name: SINGLE for name in read_header(single, remote)}
    raise CheckpointError(f"no {INDEX} or {SINGLE}; is this a model folder?", file=str(folder))


def check_index_matches_shards(folder: Path, weight_map: dict[str, str], headers: dict[str, dict]) -> None:
    """Every tensor the index names is in its shard, and no shard holds a tensor the index does not list."""
    for name, f in weight_map.items():
        if name not in headers[f]:
            raise CheckpointError(f"the index names tensor {name!r} but the shard does not hold it", file=str(folder / f))
    for f, header in headers.items():
        unlisted = sorted(set(header) - {n for n, g in weight_map.items() if g == f})
        if unlisted:
            raise CheckpointError(f"the shard holds {len(unlisted)} tensor(s) the index does not list ({unlisted[0]!r}...): "
                                  f"the index is stale or damaged; re-download {INDEX}", file=str(folder / f))


# ---- the folder ---------------------------------------------------------------------------------
def check_links(folder: Path) -> None:
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
