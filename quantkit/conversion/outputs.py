"""convert's two outputs: who owns the folder, whether the disk can hold them, the writers of
`prefill/` and `decode/` (one pair, shared by every rank), and their quantization configs.

A tensor both outputs store identically is computed and hashed once (PairWriter). A disk too
small for the pair is refused before any layer runs, and a disk that fills up anyway ends the
run with one line naming the folder (the layers done are kept for --resume).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.writer import CheckpointWriter
from quantkit.conversion.job import Job
from quantkit.conversion.kvscales import kv_cache_scheme
from quantkit.errors import OutputError
from quantkit.formats import fp8, int4
from quantkit.planner.precision import (
    BF16,
    FP8,
    PASS,
    REUSE_INT4,
    Decision,
    decode_quantization_config,
    predicted_bytes,
    prefill_quantization_config,
    set_quantization_config,
    stored_as,
)
from quantkit.quant.gptq import QuantizedWeight
from quantkit.runtime.units import decimal_bytes

logger = logging.getLogger("quantkit")


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

    def write_shared(self, name: str, d: Decision) -> dict[str, torch.Tensor]:
        """A tensor both outputs hold identically; returns its stored parts (`compute_weight` makes them
        the value compute runs with)."""
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

    def written(self) -> int:
        """The parts this process saved, both outputs (none when only the finish was left)."""
        return self.prefill.written + self.decode.written if self.prefill is not None else 0

    def flush(self) -> None:
        self.prefill.flush()
        self.decode.flush()

    def drain(self) -> None:
        """Both outputs' cut parts are on disk (quantkit.checkpoint.writer.CheckpointWriter saves in the background)."""
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


# ---- the folder and its disk ----------------------------------------------------------------------
def owned_output(fn):
    """convert's guard: the device is resolved before any folder exists, `out` has one owner
    (quantkit.checkpoint.outlock), and a full disk is a one-line error naming the folder."""

    @functools.wraps(fn)
    def wrapper(model, out, *args, device: str = "auto", **kwargs):
        from quantkit.checkpoint.outlock import acquire, unusable
        from quantkit.runtime.device import resolve_device
        from quantkit.runtime.distributed import from_env

        resolve_device(device)
        out = Path(out)
        refuse_source_as_out(model, out)
        if not from_env().leader:  # a multi-rank convert: rank 0 owns the folder for all
            return fn(model, out, *args, device=device, **kwargs)
        made = not out.exists()
        lock = acquire(out, "convert")
        if lock.took_over:
            logger.warning("%s: took over the lock of a run that died (pid %s on %s)", out,
                           lock.took_over.get("pid"), lock.took_over.get("host"))
        try:
            return fn(model, out, *args, device=device, **kwargs)
        except Exception as e:
            if isinstance(e, OSError) and e.errno in _UNWRITABLE and str(e.filename or "").startswith(str(out)):
                raise unusable(out, e, "convert") from None
            if (code := write_errno(e)) in (errno.EFBIG, errno.EIO):
                raise _write_failed(out, e, code) from None
            if not disk_full(e):
                raise
            free = shutil.disk_usage(out).free
            need = _NEEDS.get(str(out))
            needed = f", and this run needed about {_size(need)} when it started" if need else ""
            raise OutputError(f"{out}: disk full while writing ({_size(free)} free there{needed}); free space, then "
                              "rerun with --resume to continue") from None
        finally:
            lock.release()
            if made:
                _remove_if_empty(out)  # a run refused before its first write leaves no empty --out behind

    return wrapper


def refuse_source_as_out(model, out: Path) -> None:
    """--out must not be the source folder or inside it: the outputs, the lock and the resume state
    would be written among the weights being read (and a later run would read them as the model's)."""
    src = Path(str(model))
    if not src.is_dir():
        return  # tiny:, hf:// (their folders are quantkit's and the Hub cache's)
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents:
        where = "is the source folder" if o == s else f"is inside the source folder {src}"
        raise OutputError(f"{out}: --out {where}; choose a folder outside the model")


_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST)


def _remove_if_empty(out: Path) -> None:
    try:
        out.rmdir()  # only succeeds when empty
    except OSError:
        pass


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


def write_errno(e: BaseException) -> int | None:
    """The errno of a failed write: an OSError's, or the one safetensors' writer puts in its message."""
    if isinstance(e, OSError):
        return e.errno
    import re

    from safetensors import SafetensorError

    found = re.findall(r"(?:os error|code:) ?(\d+)", str(e)) if isinstance(e, SafetensorError) else []
    return int(found[0]) if found else None


def _write_failed(out: Path, e: BaseException, code: int) -> OutputError:
    """A write that failed for another reason than a full disk, as one line: what the system said,
    the file when known, and the fix; the completed layers are kept."""
    where = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
    why = os.strerror(code)
    fix = ("a file size limit (ulimit -f) or the filesystem's largest file is below what this run writes: raise it "
           "or choose another --out" if code == errno.EFBIG else "check the disk (dmesg names the device)")
    return OutputError(f"{out}: writing failed: {why} (errno {code}){where}; {fix}, then rerun with --resume to "
                       "continue (the completed layers are kept)")


def _size(n: float) -> str:
    return decimal_bytes(n, digits=1, gb_from=1e9, bytes_below=1e6)


def check_disk(ckpt, decisions, out: Path, G: int, free: int | None = None, extra: int = 0) -> None:
    """Refuse a run that cannot fit: the predicted pair plus `extra` (the resume state at its peak:
    two copies of h in its stored dtype, the saved one and the next, and the store when
    disk-backed), less what an interrupted run already wrote (its parts and its saved h)."""
    written = sum(p.stat().st_size for w in ("prefill", "decode") for p in (out / f"{w}.partial").glob("part-*"))
    written += sum(p.stat().st_size for p in (out / ".quantkit-convert").glob("*hidden.*.bin"))
    need = sum(predicted_bytes(ckpt, decisions, G)) - written + extra
    _NEEDS[str(out)] = need
    free = shutil.disk_usage(out).free if free is None else free
    if need > free:
        raise OutputError(f"{out}: the pair needs about {_size(need)} more, only {_size(free)} free there; "
                          "free space or choose another --out")


def refuse_existing(out: Path, state_dir: Path, finishing: bool) -> None:
    """A finished output is never overwritten; only an interrupted finish (--resume) may find one in place."""
    for final in (out / "prefill", out / "decode"):
        if final.exists() and not finishing:
            hint = " (an interrupted convert is there: add --resume to complete it)" if (state_dir / "state.json").is_file() else ""
            raise OutputError(f"{final}: already exists{hint}; remove it or choose another --out")


# ---- the writers ----------------------------------------------------------------------------------
def shard_digits(ckpt: Checkpoint) -> int:
    """Keep the source's shard-name style (Kimi: six digits, GLM: five), from the index's names
    (a streamed source has not downloaded its shards yet)."""
    for f in sorted(set(ckpt.weight_map.values())):
        if "-of-" in f:
            return len(f.rsplit("-of-", 1)[1].split(".")[0])
    return 5


def open_pair(job: Job, out: Path, digits: int, *, resume: bool, finishing: bool) -> PairWriter:
    """Both outputs' writers, continuing from the parts the state names (none when only the finish
    is left). Rank 0 checks the disk and clears or truncates the `.partial` folders; then every
    other rank adopts what is there."""
    group, state, shard_bytes = job.group, job.state, job.cost.shard_bytes
    if finishing:
        return _pair(job.ckpt, None, None, state)
    # several ranks: all add the same tensors, so all cut the same parts; part i of prefill is
    # saved by rank i % world, of decode by rank (i + 1) % world (a layer's two parts, two ranks)
    owns = [(lambda i, k=k: (i + k) % group.world == group.rank) if group.distributed else None for k in (0, 1)]
    if group.leader:
        check_disk(job.ckpt, job.decisions, out, job.G, extra=job.cost.disk["resume_state"])
        wp = CheckpointWriter(out / "prefill", digits=digits, resume=resume, max_shard_bytes=shard_bytes, owns=owns[0])
        wd = CheckpointWriter(out / "decode", digits=digits, resume=resume, max_shard_bytes=shard_bytes, owns=owns[1])
        wp.truncate_parts(state.prefill_parts)
        wd.truncate_parts(state.decode_parts)
    group.barrier("opening the outputs")  # rank 0 has cleared or truncated them
    if not group.leader:
        wp = CheckpointWriter(out / "prefill", digits=digits, resume=True, max_shard_bytes=shard_bytes, owns=owns[0])
        wd = CheckpointWriter(out / "decode", digits=digits, resume=True, max_shard_bytes=shard_bytes, owns=owns[1])
        wp.adopt_parts(state.prefill_parts)
        wd.adopt_parts(state.decode_parts)
    return _pair(job.ckpt, wp, wd, state)


def _pair(ckpt: Checkpoint, wp: CheckpointWriter | None, wd: CheckpointWriter | None, state) -> PairWriter:
    pair = PairWriter(ckpt, wp, wd)
    pair.differ = list(state.differ)  # the tensors stored differently so far (the report counts them)
    return pair


def close_pair(pair: PairWriter) -> dict[str, list[str]] | None:
    """Every rank flushes its (empty, after the last layer) writers, so that all agree on the parts,
    and waits for its saves; returns each output's parts in order (None when only the finish was left)."""
    if pair.prefill is None:
        return None
    pair.flush()
    pair.drain()
    return {"prefill": pair.prefill.parts, "decode": pair.decode.parts}


def output_configs(job: Job) -> dict[str, dict]:
    """Each output's config.json: the source's, with its quantization_config (and decode's FP8 KV
    cache scheme, when this run measured the cache's scales)."""
    ckpt, decisions, arch, block = job.ckpt, job.decisions, job.arch, job.rec.prefill.fp8_block
    prefill_cfg = set_quantization_config(arch.raw, arch, prefill_quantization_config(ckpt, decisions, block))
    decode_qc = decode_quantization_config(ckpt, decisions, job.G, block)
    if any("kv_cache" in lay for lay in job.state.layers) and not arch.has_dsa:
        # prefill's `fp8` config reads the same tensors unasked; DSA models get none (quantkit.model.kvcache)
        decode_qc["kv_cache_scheme"] = kv_cache_scheme()
    decode_cfg = set_quantization_config(arch.raw, arch, decode_qc)
    return {"prefill": prefill_cfg, "decode": decode_cfg}
