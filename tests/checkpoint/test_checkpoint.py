"""Checkpoint reading and writing: layouts, laziness, dequantization, bad input, atomic output.

Expected values are computed without quantkit's reader: files are read with safetensors (or
raw bytes) directly, INT4 is dequantized with compressed-tensors and FP8 block by block.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from bad_checkpoints import BAD, base, header_of, index_of
from conftest import small_config, write_random
from oracle import dequantize_fp8_blocks, dequantize_int4_ct, read_raw
from safetensors import safe_open
from safetensors.torch import save_file

import quantkit.checkpoint.reader as ckmod
from quantkit.checkpoint.index import INDEX
from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.writer import CheckpointWriter
from quantkit.errors import CheckpointError, OutputError
from quantkit.model.arch import arch_from_config
from quantkit.synthetic.tiny import init_weights


def stored_bytes(path: Path, name: str) -> bytes:
    n, h = header_of(path)
    b, e = h[name]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(8 + n + b)
        return f.read(e - b)


def expected_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """Logical tensors of a write_random folder as float32, dequantized by upstream code."""
    raw = read_raw(folder)
    out = {}
    for k, v in raw.items():
        if k.endswith("weight_packed"):
            base = k[: -len("weight_packed")]
            out[base + "weight"] = dequantize_int4_ct(v, raw[base + "weight_scale"], raw[base + "weight_shape"], 32).float()
        elif k.endswith(("weight_scale", "weight_shape", "weight_scale_inv")):
            continue
        elif k + "_scale_inv" in raw:
            out[k] = dequantize_fp8_blocks(v, raw[k + "_scale_inv"])
        else:
            out[k] = v.float()
    return out


@pytest.fixture(scope="module")
def ds_weights() -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = small_config("deepseek_v3")
    return cfg, init_weights(arch_from_config(cfg), torch.Generator().manual_seed(0))


# ---- layouts ------------------------------------------------------------------------------------
def test_single_file_and_sharded_read_the_same(tmp_path, ds_weights):
    cfg, t = ds_weights
    single = tmp_path / "single"
    single.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, str(single / "model.safetensors"))
    (single / "config.json").write_text(json.dumps(cfg))

    sharded = tmp_path / "sharded"
    w = CheckpointWriter(sharded, max_shard_bytes=200_000)
    for k, v in sorted(t.items()):
        w.add(k, v.to(torch.bfloat16))
    w.finish(cfg)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 3 and (sharded / INDEX).is_file()

    a, b = Checkpoint(single), Checkpoint(sharded)
    assert list(a.headers) == ["model.safetensors"] and len(b.headers) == len(files)
    assert a.names() == b.names() == sorted(t)
    for name in a.names():
        expected = t[name].to(torch.bfloat16).float()
        assert torch.equal(a.get(name), expected), name
        assert torch.equal(b.get(name), expected), name


def test_layer_spanning_two_shards(tmp_path, ds_weights):
    cfg, t = ds_weights
    arch = arch_from_config(cfg)
    pre = arch.layer_prefix(1)
    layer1 = sorted(k for k in t if k.startswith(pre))
    w = CheckpointWriter(tmp_path / "m")
    for k in sorted(k for k in t if not k.startswith(pre)):
        w.add(k, t[k].to(torch.bfloat16))
    half = len(layer1) // 2
    for k in layer1[:half]:
        w.add(k, t[k].to(torch.bfloat16))
    w.flush()  # cut the shard in the middle of layer 1
    for k in layer1[half:]:
        w.add(k, t[k].to(torch.bfloat16))
    folder = w.finish(cfg)

    wm = json.loads((folder / INDEX).read_text())["weight_map"]
    assert len({wm[k] for k in layer1}) == 2
    ckpt = Checkpoint(folder)
    got = ckpt.layer(1)
    assert sorted(pre + k for k in got) == layer1
    for k, v in got.items():
        assert torch.equal(v, t[pre + k].to(torch.bfloat16).float()), k


# ---- dequantization -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "fp32", "fp8", "int4"])
def test_get_dequantizes_like_upstream(tmp_path, ds_weights, fmt):
    """Routed experts (and, for fp8, every Linear) in `fmt`; get() equals upstream dequantization."""
    cfg, t = ds_weights
    folder, _ = write_random(tmp_path / fmt, cfg, experts=fmt, linears="fp8" if fmt == "fp8" else "bf16", tensors=t)
    ckpt = Checkpoint(folder)
    expected = expected_dequantized(folder)
    assert sorted(expected) == ckpt.names()
    formats = {ckpt.tensors[n].format for n in ckpt.names()}
    assert formats == {"bf16": {"dense"}, "fp32": {"dense"}, "fp8": {"dense", "fp8"}, "int4": {"dense", "int4"}}[fmt]
    for name in ckpt.names():
        got = ckpt.get(name)
        assert got.dtype == torch.float32
        assert torch.equal(got, expected[name]), name
        # close to the generated weights (the storage is lossy but not wrong)
        err = (got - t[name]).abs().max() / t[name].abs().max().clamp(min=1e-12)
        assert err < {"bf16": 1e-2, "fp32": 1e-7, "fp8": 0.07, "int4": 0.2}[fmt] or ".mlp.experts." not in name, name
    expert = f"{ckpt.arch.prefix}layers.1.mlp.experts.3.down_proj.weight"
    assert ckpt.get(expert, torch.bfloat16).dtype == torch.bfloat16
    if fmt == "int4":  # dequantization happens in the scale's dtype (bf16), as compressed-tensors does
        st = ckpt.tensors[expert]
        ref = dequantize_int4_ct(ckpt.raw(st.parts["weight_packed"]), ckpt.raw(st.parts["weight_scale"]),
                                 ckpt.raw(st.parts["weight_shape"]), 32)
        assert ref.dtype == torch.bfloat16 and torch.equal(ckpt.get(expert, torch.bfloat16), ref)


def test_get_reads_asymmetric_int4(tmp_path, ds_weights):
    """An INT4 weight with packed zero points reads as compressed-tensors decompresses it."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from quantkit.planner.inspection import storage_format

    cfg, t = ds_weights
    name = "model.layers.1.mlp.experts.2.down_proj.weight"  # [128, 128]: 4 groups of 32
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-8, 8, (128, 128), generator=g, dtype=torch.int8)
    zp = torch.randint(-8, 8, (128, 4), generator=g, dtype=torch.int8)
    scale = (torch.rand(128, 4, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    stored = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([128, 128], dtype=torch.int32),
              "weight_zero_point": pack_to_int32(zp, 4, packed_dim=0)}
    w = CheckpointWriter(tmp_path / "asym")
    for k, v in t.items():
        if k != name:
            w.add(k, v.to(torch.bfloat16))
    for suffix, v in stored.items():
        w.add(name[: -len("weight")] + suffix, v)
    ckpt = Checkpoint(w.finish(cfg))
    assert ckpt.tensors[name].format == "int4" and storage_format(ckpt.tensors[name], ckpt) == "int4-g32-asym"
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
    theirs = PackedQuantizationCompressor.decompress(dict(stored), QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    assert torch.equal(ckpt.get(name, torch.bfloat16), theirs)
    assert torch.equal(ckpt.get(name), theirs.float())


def test_get_reads_fp16(tmp_path, ds_weights):
    cfg, t = ds_weights
    w = CheckpointWriter(tmp_path / "fp16")
    for k, v in t.items():
        w.add(k, v.to(torch.float16))
    ckpt = Checkpoint(w.finish(cfg))
    assert {st.dtype for st in ckpt.tensors.values()} == {"F16"}
    for name in ckpt.names():
        assert torch.equal(ckpt.get(name), t[name].half().float())


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_raw_returns_bytes_as_stored(tmp_path, ds_weights, fmt):
    cfg, t = ds_weights
    folder, _ = write_random(tmp_path / fmt, cfg, experts=fmt, linears=fmt, tensors=t)
    ckpt = Checkpoint(folder)
    raw_dtypes = set()
    for name, file in ckpt.weight_map.items():
        x = ckpt.raw(name)
        _, h = header_of(folder / file)
        assert ckmod.DTYPES[h[name]["dtype"]] == x.dtype and list(x.shape) == h[name]["shape"]
        assert x.contiguous().view(torch.uint8).numpy().tobytes() == stored_bytes(folder / file, name), name
        raw_dtypes.add(x.dtype)
    assert {torch.int32, torch.bfloat16} <= raw_dtypes if fmt == "int4" else {torch.float8_e4m3fn, torch.float32} <= raw_dtypes


# ---- laziness -----------------------------------------------------------------------------------
class SpyOpen:
    """Wraps quantkit.checkpoint.reader's shard reader and records every tensor read."""

    def __init__(self):
        self.reads: list[str] = []

    def __call__(self, path):
        shard = _REAL_SHARD(path)
        spy = self

        class Handle:
            def read(self, name, entry):
                spy.reads.append(name)
                return shard.read(name, entry)

            def close(self):
                shard.close()

        return Handle()


_REAL_SHARD = ckmod._Shard


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_open_reads_no_tensor_data(tmp_path, ds_weights, monkeypatch, fmt):
    cfg, t = ds_weights
    folder, _ = write_random(tmp_path / fmt, cfg, experts=fmt, tensors=t)
    spy = SpyOpen()
    monkeypatch.setattr(ckmod, "_Shard", spy)
    ckpt = Checkpoint(folder)
    # nothing is read, not even INT4's weight_shape (the logical shape comes from the headers;
    # `get` checks it against weight_shape), so a streamed source plans before any download
    assert spy.reads == []
    spy.reads.clear()
    name = f"{ckpt.arch.prefix}layers.2.mlp.experts.0.up_proj.weight"
    ckpt.get(name)
    assert spy.reads and all(r.startswith(name[: -len("weight")]) for r in spy.reads)  # the spy sees reads


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_open_does_not_load_a_large_shard(tmp_path):
    """A 256 MiB embedding (a sparse file, so writing it is free): opening adds almost nothing to
    RSS; materialising it adds the whole tensor (so the measurement can see a load)."""
    cfg = small_config("deepseek_v3", vocab_size=131072, hidden_size=1024)
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    name = "model.embed_tokens.weight"
    nbytes = 131072 * 1024 * 2
    header = json.dumps({name: {"dtype": "BF16", "shape": [131072, 1024], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)
    before = _rss()
    ckpt = Checkpoint(folder, complete=False)  # only the embedding: a partial folder
    opened = _rss()
    assert opened - before < 32 * 2**20, f"opening grew RSS by {(opened - before) / 2**20:.0f} MiB"
    x = ckpt.raw(name).clone()
    assert _rss() - opened > nbytes // 2
    assert x.shape == (131072, 1024)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_read_tensor_leaves_nothing_resident(tmp_path):
    """Two 256 MiB tensors in one open shard: reading, using and dropping the second leaves RSS
    where the first left it. A memory map would keep the second's pages too, until the file
    closes; that is what made peak RSS grow with depth and shard size."""
    cfg = small_config("deepseek_v3", vocab_size=131072, hidden_size=1024)
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    nbytes = 131072 * 1024 * 2
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    header = json.dumps({n: {"dtype": "BF16", "shape": [131072, 1024], "data_offsets": [i * nbytes, (i + 1) * nbytes]}
                         for i, n in enumerate(names)}).encode()
    header += b" " * (-len(header) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2 * nbytes)
    ckpt = Checkpoint(folder, complete=False)
    assert float(ckpt.get(names[0]).sum()) == 0
    first = _rss()
    assert float(ckpt.get(names[1]).sum()) == 0
    assert _rss() - first < 32 * 2**20, f"{(_rss() - first) / 2**20:.0f} MiB of the second tensor still resident"


# ---- bad input (the builders: tests/bad_checkpoints.py) ------------------------------------------
def test_the_base_of_bad_cases_is_good(tmp_path):
    ckpt = Checkpoint(base(tmp_path))
    assert len(ckpt.headers) == 2
    for name in ckpt.names(2):
        ckpt.get(name)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_naming_file_and_tensor(tmp_path, case):
    folder, exc, file, tensor, get = BAD[case](tmp_path)
    if get is not None:
        ckpt = Checkpoint(folder)  # lazy: the damage is found when the tensor is read
        with pytest.raises(exc) as info:
            ckpt.get(get)
        assert torch.isnan(Checkpoint(folder, check_finite=False).get(get)).any() or case != "nan"
    else:
        with pytest.raises(exc) as info:
            Checkpoint(folder)
    msg = str(info.value)
    assert "\n" not in msg and msg.strip() == msg
    assert str(file) in msg, msg
    if tensor is not None:
        assert tensor in msg, msg
        if isinstance(info.value, CheckpointError):
            assert info.value.tensor == tensor


def test_expert_beyond_config_is_an_error(tmp_path, ds_weights):
    cfg, t = ds_weights
    t = dict(t)
    name = "model.layers.1.mlp.experts.8.up_proj.weight"  # n_routed_experts is 8
    t[name] = t["model.layers.1.mlp.experts.7.up_proj.weight"]
    folder, _ = write_random(tmp_path / "m", cfg, tensors=t)
    with pytest.raises(CheckpointError, match=r"expert 8") as info:
        Checkpoint(folder)
    assert info.value.tensor == name and "model-00001-of-00001.safetensors" in str(info.value)


def test_index_entries_may_be_symlinks(tmp_path, ds_weights):
    """Shards symlinked into a blob store (the Hugging Face cache layout) are inside the folder."""
    cfg, t = ds_weights
    src, _ = write_random(tmp_path / "blobs", cfg, tensors=t)
    snap = tmp_path / "snapshots" / "abc"
    snap.mkdir(parents=True)
    for f in src.iterdir():
        (snap / f.name).symlink_to(Path("../..") / "blobs" / f.name)
    assert Checkpoint(snap).names() == sorted(t)


# ---- writer -------------------------------------------------------------------------------------
def _tensors(n: int, numel: int = 250) -> dict[str, torch.Tensor]:
    return {f"t.{i:02d}": torch.full((numel,), float(i)) for i in range(n)}  # 1000 bytes each


def test_writer_is_atomic(tmp_path):
    out = tmp_path / "out"
    w = CheckpointWriter(out, max_shard_bytes=2500)
    for k, v in _tensors(5).items():
        w.add(k, v)
        assert not out.exists()
    w.flush()
    assert not out.exists() and (tmp_path / "out.partial").is_dir()
    assert list((tmp_path / "out.partial").glob("part-*.safetensors"))
    assert w.finish({"model_type": "x"}, extra={"README.md": "hi"}) == out
    assert out.is_dir() and not (tmp_path / "out.partial").exists()
    assert json.loads((out / "config.json").read_text()) == {"model_type": "x"}
    assert (out / "README.md").read_text() == "hi"
    assert not list(out.glob("part-*")) and not list(out.glob("*.tmp"))


@pytest.mark.parametrize("digits", [5, 6])
def test_writer_shard_names_index_and_split(tmp_path, digits):
    t = _tensors(7)
    out = tmp_path / "out"
    w = CheckpointWriter(out, max_shard_bytes=2500, digits=digits)
    for k, v in t.items():
        w.add(k, v)
    w.finish({})
    names = sorted(p.name for p in out.glob("*.safetensors"))
    # 1000-byte tensors under a 2500-byte limit: two per shard, 4 shards
    expected = [f"model-{i:0{digits}d}-of-{4:0{digits}d}.safetensors" for i in range(1, 5)]
    assert names == expected
    assert names[0] == ("model-00001-of-00004.safetensors" if digits == 5 else "model-000001-of-000004.safetensors")
    idx = json.loads((out / INDEX).read_text())
    assert idx["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in t.values()) == 7000
    assert idx["metadata"]["total_size"] == sum(
        (out / f).stat().st_size - 8 - header_of(out / f)[0] for f in names
    )
    assert sorted(idx["weight_map"]) == sorted(t)
    for k, f in idx["weight_map"].items():
        with safe_open(str(out / f), framework="pt") as h:
            assert torch.equal(h.get_tensor(k), t[k])
    for f in names:
        assert sum(1 for k in idx["weight_map"] if idx["weight_map"][k] == f) <= 2


def test_writer_puts_an_oversized_tensor_alone(tmp_path):
    w = CheckpointWriter(tmp_path / "out", max_shard_bytes=1500)
    w.add("a", torch.zeros(100))  # 400 B
    w.add("big", torch.zeros(1000))  # 4000 B > limit
    w.add("c", torch.zeros(100))
    w.finish({})
    wm = json.loads((tmp_path / "out" / INDEX).read_text())["weight_map"]
    assert len(set(wm.values())) == 3 and len({wm["a"], wm["big"], wm["c"]}) == 3


def test_writer_refuses_existing_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="already exists"):
        CheckpointWriter(out)
    assert (out / "keep.txt").read_text() == "mine" and not (tmp_path / "out.partial").exists()


def test_writer_clears_a_stale_partial_unless_resuming(tmp_path):
    stale = tmp_path / "out.partial"
    stale.mkdir()
    (stale / "part-000000.safetensors").write_bytes(b"junk")
    w = CheckpointWriter(tmp_path / "out", resume=True)
    assert w.num_parts == 1
    CheckpointWriter(tmp_path / "out")
    assert not (stale / "part-000000.safetensors").exists()


def test_writer_rejects_a_tensor_added_twice(tmp_path):
    w = CheckpointWriter(tmp_path / "out")
    w.add("a", torch.zeros(2))
    with pytest.raises(ValueError):
        w.add("a", torch.zeros(2))


def test_written_checkpoint_reads_back(tmp_path, ds_weights):
    cfg, t = ds_weights
    folder, _ = write_random(tmp_path / "m", cfg, experts="int4", linears="fp8", tensors=t)
    ckpt = Checkpoint(folder)
    assert math.isclose(
        sum(ckpt.storage_bytes(n) for n in ckpt.names()),
        json.loads((folder / INDEX).read_text())["metadata"]["total_size"],
    )


def test_readahead_requests_exactly_a_layers_stored_bytes(tiny_glm):
    """convert reads the next layer ahead (conversion.Prefetcher); quantkit.planner.cost counts the read as
    overlapped on the strength of it, so it must cover the layer's bytes, where they are, no more."""
    ckpt = Checkpoint(tiny_glm)
    for layer in (0, 1):
        spans = ckpt.spans(layer)
        stored = [s for n in ckpt.names(layer) for s in ckpt.tensors[n].parts.values()]
        assert len(spans) == len(stored)
        for (f, start, length), s in zip(spans, stored):  # the bytes at each span are the tensor's
            with open(tiny_glm / f, "rb") as fh:
                fh.seek(start)
                assert fh.read(length) == ckpt.raw(s).contiguous().view(torch.uint8).numpy().tobytes(), s
        assert ckpt.readahead(layer) == sum(length for _, _, length in spans) == sum(
            ckpt.storage_bytes(n) for n in ckpt.names(layer)) > 0


def test_a_shard_is_consumed_once_every_tensor_in_it_is_read(tiny_glm):
    """Checkpoint.consumed: the prefetcher of a streamed source (conversion.stages) skips a shard whose
    tensors have all been read, since release_finished may already have dropped it."""
    ckpt = Checkpoint(tiny_glm)
    f = ckpt.weight_map[next(iter(ckpt.tensors[ckpt.names(0)[0]].parts.values()))]
    inside = [n for n in ckpt.names() if any(ckpt.weight_map[s] == f for s in ckpt.tensors[n].parts.values())]
    assert not ckpt.consumed(f)
    for n in inside:
        ckpt.get(n)
    assert ckpt.consumed(f) and f in ckpt.release_finished()


def test_kept_tensors_are_read_once_as_stored_and_handed_out_as_copies(tiny_glm):
    """Checkpoint.keep (validate's resident weights): a kept layer is read from the file once, into
    one block, and every get after that dequantizes the kept bytes: the same values as reading the
    file; a caller that writes into what it got does not change what the next get returns."""
    from quantkit.checkpoint.index import DTYPES

    plain, kept = Checkpoint(tiny_glm), Checkpoint(tiny_glm)
    names = kept.names(1)
    assert kept.keep(names) == sum(kept.storage_bytes(n) for n in names)
    for _ in range(3):
        for n in names:
            assert torch.equal(kept.get(n), plain.get(n)), n
    assert kept.bytes_read == sum(kept.storage_bytes(n) for n in names)  # once, not three times
    dense = next(n for n in names if kept.tensors[n].format == "dense")
    kept.get(dense, DTYPES[kept.tensors[dense].dtype]).fill_(7)  # its stored dtype: no conversion copies it
    assert torch.equal(kept.get(dense), plain.get(dense))
    kept.close()  # stops keeping: the file is read again
    before = kept.bytes_read
    kept.get(names[0])
    assert kept.bytes_read > before


def test_resume_clears_what_a_crash_left_in_the_partial_folder(tmp_path):
    """A crash mid-save (parts are saved in the background) leaves safetensors' own temporary file
    (`.tmpXXXXXX`) or a part's `.tmp`, and parts after the last saved state: resume keeps exactly
    the first n parts, or the stray file would end up in the finished checkpoint and its manifest."""
    w = CheckpointWriter(tmp_path / "m", max_shard_bytes=1)
    for i in range(3):
        w.add(f"t{i}", torch.full((4,), float(i)))
    w.flush()
    w.drain()
    for stray in (".tmpsarFdM", "part-000003.safetensors.tmp"):
        (w.tmp / stray).write_bytes(b"half")
    again = CheckpointWriter(tmp_path / "m", resume=True)
    again.truncate_parts(2)
    assert sorted(p.name for p in again.tmp.iterdir()) == ["part-000000.safetensors", "part-000001.safetensors"]
    assert again.parts == ["part-000000.safetensors", "part-000001.safetensors"]


def test_a_kept_int4_shape_stays_on_the_host(tiny_kimi):
    """Kept on an accelerator, a packed INT4 tensor's weight_shape stays on the host: `get` reads it
    as Python ints, which from device memory would be one device sync per tensor per pass. (The
    meta device stands in for CUDA here: placement only, no values.)"""
    ck = Checkpoint(tiny_kimi)
    name = next(n for n in ck.names() if ck.tensors[n].format == "int4")
    ck.keep([name], "meta")
    parts = ck.tensors[name].parts
    assert ck._raw(parts["weight_packed"]).device.type == "meta"
    assert ck._raw(parts["weight_shape"]).device.type == "cpu"


@pytest.mark.parametrize("with_scale", [False, True], ids=["weight renamed", "weight and scale renamed"])
def test_a_renamed_fp8_expert_weight_names_the_missing_weight_and_the_unknown_name(tmp_path, with_scale):
    """A misspelt tensor name: `experts.2.up_proj.weight` renamed `uq_proj` used to be reported as the
    scale's shape contradicting config.json; the error must name the missing weight and the unknown one."""
    cfg = small_config("deepseek_v3")
    folder, _ = write_random(tmp_path / "src", cfg, experts="fp8")
    old, new = "model.layers.1.mlp.experts.2.up_proj.", "model.layers.1.mlp.experts.2.uq_proj."
    (shard,) = folder.glob("*.safetensors")
    with safe_open(str(shard), framework="pt") as h:
        t = {k: h.get_tensor(k) for k in h.keys()}
    renamed = ["weight"] + (["weight_scale_inv"] if with_scale else [])
    for leaf in renamed:
        t[new + leaf] = t.pop(old + leaf)
    save_file(t, str(shard), metadata={"format": "pt"})
    path, idx = index_of(folder)
    for leaf in renamed:
        idx["weight_map"][new + leaf] = idx["weight_map"].pop(old + leaf)
    path.write_text(json.dumps(idx))
    with pytest.raises(CheckpointError) as info:
        Checkpoint(folder)
    msg = str(info.value)
    assert "\n" not in msg and "contradicts" not in msg, msg
    assert old + "weight" in msg and new + "weight" in msg and str(shard) in msg, msg


@pytest.mark.parametrize("family", ["glm", "kimi_k25"])
def test_declared_mtp_layers_the_shards_lack_are_dropped_from_the_arch_and_its_config(tmp_path, family):
    """Declared MTP layers missing from the shards, for the other families: GLM (its own model_type) and Kimi K2.6 (the field
    inside text_config). The layer is dropped and the carried config says 0."""
    from quantkit.model.arch import without_mtp

    if family == "glm":
        cfg = small_config("glm", num_nextn_predict_layers=0)
        folder, _ = write_random(tmp_path / "m", cfg)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["num_nextn_predict_layers"] = 1
        (folder / "config.json").write_text(json.dumps(cfg))
        ckpt = Checkpoint(folder)
        assert ckpt.absent_mtp_layers == 1 and ckpt.arch.num_mtp_layers == 0
        assert ckpt.arch.raw["num_nextn_predict_layers"] == 0
    else:
        kimi = arch_from_config(json.loads((Path(__file__).parents[2] / "quantkit/model/presets/kimi-k2.6.json").read_text()))
        kimi.raw["text_config"]["num_nextn_predict_layers"] = 1
        dropped = without_mtp(arch_from_config(kimi.raw))
        assert dropped.num_mtp_layers == 0 and dropped.raw["text_config"]["num_nextn_predict_layers"] == 0
