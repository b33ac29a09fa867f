"""Damaged checkpoints, for the bad-input tests (tests/checkpoint/test_checkpoint.py, tests/test_cli.py).

Each builder makes a damaged copy of a small valid checkpoint and returns
(folder, error type, file the message must name, tensor it must name or None, tensor to get() or None).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch
from conftest import small_config
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.checkpoint.index import INDEX
from quantkit.checkpoint.writer import CheckpointWriter
from quantkit.errors import CheckpointError, ConfigError
from quantkit.model.arch import arch_from_config
from quantkit.synthetic.tiny import init_weights


def header_of(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


SHARD = "model-00001-of-00002.safetensors"


def base(tmp: Path) -> Path:
    cfg = small_config("deepseek_v3")
    t = init_weights(arch_from_config(cfg), torch.Generator().manual_seed(1))
    w = CheckpointWriter(tmp / "ok")
    for k, v in sorted(t.items(), key=lambda kv: (kv[0].startswith("model.layers.2."), kv[0])):
        if k == "model.layers.2.input_layernorm.weight":
            w.flush()  # two shards: everything before layer 2, then layer 2
        w.add(k, v.to(torch.bfloat16))
    return w.finish(cfg)


def _copy(tmp: Path, name: str) -> Path:
    src = tmp / "ok"
    if not src.exists():
        base(tmp)
    dst = tmp / name
    shutil.copytree(src, dst)
    return dst


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n, h = header_of(path)
    hb = json.dumps(edit(h)).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


def index_of(folder: Path) -> tuple[Path, dict]:
    return folder / INDEX, json.loads((folder / INDEX).read_text())


def bad_truncated(tmp):
    d = _copy(tmp, "truncated")
    f = d / SHARD
    _, h = header_of(f)
    last = max(h, key=lambda k: h[k]["data_offsets"][1] if k != "__metadata__" else -1)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    return d, CheckpointError, f, last, None


def bad_corrupt_header(tmp):
    d = _copy(tmp, "corrupt")
    f = d / SHARD
    raw = bytearray(f.read_bytes())
    raw[8:24] = b"\x00\xff garbage \xfe\x01!!"
    f.write_bytes(bytes(raw))
    return d, CheckpointError, f, None, None


def bad_header_entry(tmp):
    """Valid JSON, but one entry's dtype does not fit its byte range (F32 needs twice the bytes)."""
    d = _copy(tmp, "entry")
    f = d / SHARD
    name = "model.layers.0.self_attn.o_proj.weight"

    def edit(h):
        h[name]["dtype"] = "F32"
        return h

    _rewrite_header(f, edit)
    return d, CheckpointError, f, name, None


def bad_header_not_object(tmp):
    d = _copy(tmp, "not_object")
    f = d / SHARD
    _rewrite_header(f, lambda h: [sorted(h)])
    return d, CheckpointError, f, None, None


def bad_missing_shard(tmp):
    d = _copy(tmp, "missing")
    path, idx = index_of(d)
    name = "model.layers.0.self_attn.o_proj.weight"
    idx["weight_map"][name] = "model-00009-of-00009.safetensors"
    path.write_text(json.dumps(idx))
    return d, CheckpointError, path, name, None


def bad_outside(tmp):
    d = _copy(tmp, "outside")
    shutil.copy(d / SHARD, tmp / "x.safetensors")  # the file exists: only its place is wrong
    path, idx = index_of(d)
    name = "model.layers.0.self_attn.o_proj.weight"
    idx["weight_map"][name] = "../x.safetensors"
    path.write_text(json.dumps(idx))
    return d, CheckpointError, path, name, None


def bad_shape(tmp):
    d = _copy(tmp, "shape")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 64  # the experts were written with 128
    (d / "config.json").write_text(json.dumps(cfg))
    return d, CheckpointError, d / SHARD, "model.layers.1.mlp.experts.0.down_proj.weight", None


def _poison(tmp, label, value):
    d = _copy(tmp, label)
    f = d / "model-00002-of-00002.safetensors"
    name = "model.layers.2.mlp.experts.5.gate_proj.weight"
    with safe_open(str(f), framework="pt") as h:
        t = {k: h.get_tensor(k) for k in h.keys()}
    t[name][3, 7] = value
    save_file(t, str(f), metadata={"format": "pt"})
    return d, CheckpointError, f, name, name


def bad_nan(tmp):
    return _poison(tmp, "nan", float("nan"))


def bad_inf(tmp):
    return _poison(tmp, "inf", float("-inf"))


def bad_model_type(tmp):
    d = _copy(tmp, "model_type")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    return d, ConfigError, d / "config.json", None, None


def bad_unclassifiable(tmp):
    d = _copy(tmp, "unclassifiable")
    f = d / SHARD
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    with safe_open(str(f), framework="pt") as h:
        t = {k: h.get_tensor(k) for k in h.keys()}
    t[name] = torch.ones(8)
    save_file(t, str(f), metadata={"format": "pt"})
    path, idx = index_of(d)
    idx["weight_map"][name] = SHARD
    path.write_text(json.dumps(idx))
    return d, CheckpointError, f, name, None


def bad_no_config(tmp):
    d = _copy(tmp, "no_config")
    (d / "config.json").unlink()
    return d, ConfigError, d / "config.json", None, None


BAD = {
    "truncated": bad_truncated, "corrupt_header": bad_corrupt_header, "header_entry": bad_header_entry,
    "header_not_object": bad_header_not_object,
    "missing_shard": bad_missing_shard, "outside": bad_outside, "shape": bad_shape, "nan": bad_nan, "inf": bad_inf,
    "model_type": bad_model_type, "unclassifiable": bad_unclassifiable, "no_config": bad_no_config,
}
