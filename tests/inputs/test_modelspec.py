"""Every source layout reads the same through every entry point of quantkit.inputs.modelspec.

The matrix: a model saved sharded (an index and several shards) or as one `model.safetensors` (no
index: how transformers saves anything under ~5 GB), with BF16, FP8 or INT4 weights, opened as a
folder, as `hf://` over a Hub on loopback (at a branch or a tag), and as `hf://` offline from an HF
cache snapshot (blob symlinks, at a branch, a commit or a tag). Every cell must read every tensor as
the folder does, and a conversion from any entry must write the folder's bytes. The single-file
model offline from the HF cache used to fail: its weights were looked for in quantkit's own cache
folder ("no model.safetensors.index.json or model.safetensors; is this a model folder?").
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import small_config, write_random
from hub_server import hf_cache_snapshot, serve_folder
from huggingface_hub import constants as hf_constants
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantkit.checkpoint.index import INDEX, SINGLE
from quantkit.conversion.pipeline import convert
from quantkit.inputs.modelspec import open_checkpoint

REPO = "zai-org/GLM-Layouts-Tiny"
TAG = "v1.0"
LAYOUTS = ("sharded", "single")
FORMATS = ("bf16", "fp8", "int4")
ENTRIES = ("folder", "hub@main", "hub@tag", "hf-cache@main", "hf-cache@commit", "hf-cache@tag")


def _relayout(src, dst, layout: str) -> None:
    """`src` (one shard and an index, as CheckpointWriter wrote it) saved as `layout`: one
    `model.safetensors`, or three shards and an index; config.json copied."""
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        with safe_open(str(f), framework="pt") as h:
            metadata = h.metadata()
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    if layout == "single":
        save_file(tensors, str(dst / SINGLE), metadata=metadata)
        return
    names = sorted(tensors)
    cut = [names[i::3] for i in range(3)]  # interleaved: every layer spans the shards
    weight_map = {}
    for i, part in enumerate(cut):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / shard), metadata=metadata)
        weight_map.update(dict.fromkeys(part, shard))
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """(layout, format) -> a folder: a 3-layer GLM with routed experts in that format."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for fmt in FORMATS:
        written, _ = write_random(root / f"written-{fmt}", small_config("glm"), experts=fmt,
                                  linears="fp8" if fmt == "fp8" else "bf16")
        for layout in LAYOUTS:
            out[layout, fmt] = root / f"{layout}-{fmt}"
            _relayout(written, out[layout, fmt], layout)
    return out


@pytest.fixture
def entry_spec(request, tmp_path, monkeypatch):
    """spec(folder, entry): what a user passes to read `folder` through `entry`, with HF_HOME, the
    HF cache and the quantkit cache private to the test; offline entries see no Hub at all."""
    servers = []

    def spec(folder, entry: str) -> str:
        if entry == "folder":
            return str(folder)
        if entry.startswith("hub@"):
            server = serve_folder(monkeypatch, tmp_path, REPO, folder)
            servers.append(server)
            server.repos[REPO].refs[TAG] = server.commit_sha
            return f"hf://{REPO}@{TAG if entry == 'hub@tag' else 'main'}"
        home = tmp_path / "hf_home"
        monkeypatch.setenv("HF_HOME", str(home))
        monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
        monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "qk"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing answers there
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        commit = hf_cache_snapshot(home / "hub", REPO, folder, tags=(TAG,))
        return f"hf://{REPO}@{ {'hf-cache@main': 'main', 'hf-cache@commit': commit, 'hf-cache@tag': TAG}[entry]}"

    yield spec
    for server in servers:
        server.stop()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reads_the_same_through_every_entry(sources, entry_spec, layout, fmt, entry):
    folder = sources[layout, fmt]
    ref = open_checkpoint(folder)
    ck = open_checkpoint(entry_spec(folder, entry))
    assert ck.weight_map == ref.weight_map and ck.headers == ref.headers
    assert sorted(ck.tensors) == sorted(ref.tensors)
    for name in ck.weight_map:  # the stored bytes, every part of every tensor
        assert torch.equal(ck.raw(name).view(torch.uint8), ref.raw(name).view(torch.uint8)), name
    for name in ("model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.1.self_attn.q_a_proj.weight"):
        assert torch.equal(ck.get(name), ref.get(name)), name  # and dequantized the same way
    ck.close()
    ref.close()


def _tree(out) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes()
            for which in ("prefill", "decode") for p in sorted((out / which).iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def folder_trees(sources, tmp_path_factory):
    """layout -> the files a conversion of its BF16 folder writes (each converted once per module)."""
    trees = {}

    def tree(layout: str) -> dict[str, bytes]:
        if layout not in trees:
            out = tmp_path_factory.mktemp(f"local-{layout}")
            trees[layout] = _tree(convert(sources[layout, "bf16"], out / "out", **CONVERT).out)
        return trees[layout]

    return tree


CONVERT = dict(recipe="tiny-glm-5.2", method="rtn", validate=False, progress=False, device="cpu")


@pytest.mark.parametrize(("layout", "entry"), [("single", e) for e in ENTRIES[1:]] + [("sharded", "hf-cache@main")])
def test_convert_from_hf_writes_the_folders_bytes(sources, folder_trees, entry_spec, tmp_path, layout, entry):
    """The acceptance cell: the single-file model offline from the HF cache converts to the same
    bytes (manifests included) as the same files read as a folder."""
    got = convert(entry_spec(sources[layout, "bf16"], entry), tmp_path / "hf", **CONVERT)
    assert _tree(got.out) == folder_trees(layout)
    assert got.report["source"]["repo"] == REPO
    if entry.startswith("hf-cache"):  # the weights were read where the HF cache holds them, not copied
        assert all(p.is_symlink() for p in (tmp_path / "qk").rglob("*.safetensors"))
