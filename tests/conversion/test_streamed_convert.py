"""convert from an hf:// source over a Hub on loopback: headers by ranged reads, shards fetched as
layers need them and deleted once consumed, output equal to a convert from a local copy."""

from __future__ import annotations

import struct

import pytest
from hub_server import serve_folder

from quantkit.conversion.pipeline import convert
from quantkit.inputs.modelspec import hub_source, open_checkpoint

REPO = "zai-org/GLM-5.2-tiny"


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_glm):
    server = serve_folder(monkeypatch, tmp_path, REPO, tiny_glm)
    yield server
    server.stop()


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_open_reads_headers_without_fetching_shards(hub):
    ck = open_checkpoint(f"hf://{REPO}")
    assert ck.arch.model_type == "glm_moe_dsa" and len(ck.tensors) > 100
    shards = [n for n in hub.content if n.endswith(".safetensors")]
    for n in shards:  # two ranged reads per shard: the 8-byte length, then the JSON header
        header_len = struct.unpack("<Q", hub.content[n][:8])[0]
        assert hub.bytes_by_file[n] == 8 + header_len < len(hub.content[n]), n
        assert not (ck.folder / n).exists()


def test_streamed_convert_with_deletion_equals_local(hub, tiny_glm, tmp_path):
    local = convert(tiny_glm, tmp_path / "local", recipe="tiny-glm-5.2", validate=False, progress=False)
    streamed = convert(f"hf://{REPO}", tmp_path / "streamed", recipe="tiny-glm-5.2", validate=False, progress=False,
                       delete_source_after=True)
    for which in ("prefill", "decode"):
        assert _files(local.out / which) == _files(streamed.out / which), which
    # every shard was fetched once and deleted after use; only small files remain
    snapshot = hub_source(f"hf://{REPO}").local_path("config.json").parent
    assert not list(snapshot.glob("*.safetensors"))
    shards = [n for n in hub.content if n.endswith(".safetensors")]
    for n in shards:  # header read + one download each, nothing fetched twice
        assert hub.bytes_by_file[n] <= len(hub.content[n]) + 8 + struct.unpack("<Q", hub.content[n][:8])[0], (
            n, hub.bytes_by_file[n], len(hub.content[n]))
    r = streamed.report["source"]
    assert r["repo"] == REPO and r["commit"] == hub.commit_sha and len(r["files"]) == len(hub.content)
