"""quantkit.hub.download against a local fake Hub (tests/hub_server.py); no internet."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import socket

import huggingface_hub
import pytest
from huggingface_hub import constants as hf_constants

from quantkit.hub.download import ChecksumError, HubError, HubSource, PullResult, parse_hf_id, pull

try:
    from hub_server import FakeHub, hf_cache_snapshot
except ImportError:  # tests/ imported as a package
    from tests.hub_server import FakeHub, hf_cache_snapshot

REPO = "moonshot-fake/Kimi-Tiny"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
CHUNK = 64 * 1024
FAKE_TOKEN = "hf_FAKEtokenDoNotPrint1234567890abcdef"


def _content(seed: int = 0) -> dict[str, bytes]:
    rnd = random.Random(seed)
    s1 = rnd.randbytes(1_500_000)
    s2 = rnd.randbytes(2_600_000)
    index = {"metadata": {"total_size": len(s1) + len(s2)}, "weight_map": {"a": SHARD1, "b": SHARD2}}
    return {
        "config.json": json.dumps({"model_type": "kimi_k2", "seed": seed}).encode(),
        "generation_config.json": b'{"do_sample": true}\n',
        "model.safetensors.index.json": json.dumps(index).encode(),
        SHARD1: s1,
        SHARD2: s2,
    }


@pytest.fixture(autouse=True)
def _no_internet(monkeypatch):
    """Any connection that is not to the loopback interface fails the test."""
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost") and self.family != socket.AF_UNIX:
            raise AssertionError(f"test tried to reach the network: {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private HF_HOME / cache / token location per test; nothing leaks between tests or from the user."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(hf_constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    # http_get writes in DOWNLOAD_CHUNK_SIZE (10 MB) pieces; whatever is buffered when a connection dies is lost.
    # Small chunks make the resume offsets in these MB-sized tests predictable.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    return tmp_path


@pytest.fixture
def hub(env):
    server = FakeHub().start()
    repo = server.add_repo(REPO)
    server.content = _content()
    server.commit_sha = repo.commit(server.content)
    yield server
    server.stop()


def _check_out(out, content, names=None):
    for name in names or content:
        assert (out / name).read_bytes() == content[name], name
    # nothing partial under a final name, all bookkeeping tucked away
    stray = [p for p in out.rglob("*") if p.is_file() and ".cache" not in p.parts and p.relative_to(out).as_posix() not in content]
    assert stray == []


def _resolve_gets(server, name=None):
    return [r for r in server.requests if r.method == "GET" and "/resolve/" in r.path and (name is None or r.path.endswith(name))]


# 1 ------------------------------------------------------------------------------------------------------------
def test_full_pull(hub, env):
    out = env / "out"
    res = pull(REPO, out, endpoint=hub.url, progress=False, max_workers=4)
    assert isinstance(res, PullResult)
    assert res.repo_id == REPO and res.commit == hub.commit_sha
    assert res.files == sorted(hub.content)
    assert res.bytes == sum(map(len, hub.content.values())) == res.downloaded == hub.bytes_served
    assert res.seconds > 0
    _check_out(out, hub.content)
    # pinned: every file was resolved at the commit sha, never at "main"
    assert all(f"/resolve/{hub.commit_sha}/" in r.path for r in _resolve_gets(hub))
    # sha256 of the LFS files was recorded as verified
    marker = json.loads((out / ".cache/quantkit/verified" / (SHARD1 + ".json")).read_text())
    assert marker["sha256"] == hashlib.sha256(hub.content[SHARD1]).hexdigest()
    # no xet traffic
    assert not [r for r in hub.requests if "xet" in r.path]

    # a second run transfers nothing
    hub.reset_counters()
    res2 = pull(f"hf://{REPO}", out, endpoint=hub.url, progress=False)
    assert res2.downloaded == 0 and hub.bytes_served == 0 and res2.files == res.files


def test_pull_via_hf_endpoint_env_and_existing_unverified_file(hub, env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    out = env / "out"
    out.mkdir()
    (out / SHARD1).write_bytes(b"\0" * len(hub.content[SHARD1]))  # right size, wrong bytes, no marker
    (out / "config.json").write_bytes(hub.content["config.json"])  # right bytes, no marker: kept
    res = pull(REPO, out, progress=False)
    _check_out(out, hub.content)
    assert hub.bytes_by_file[SHARD1] == len(hub.content[SHARD1])
    assert hub.bytes_by_file.get("config.json", 0) == 0
    assert res.downloaded == hub.bytes_served


# 2 ------------------------------------------------------------------------------------------------------------
def test_interrupted_pull_resumes_with_range(hub, env):
    out = env / "out"
    cut = 600_000
    kept = cut // CHUNK * CHUNK  # bytes that reached the disk before the drop
    hub.inject(SHARD1, "drop", after=cut)  # connection dies mid-file ...
    hub.inject(SHARD1, "status", status=500)  # ... and the in-run retry fails too: the run is interrupted
    with pytest.raises(HubError) as ei:
        pull(REPO, out, endpoint=hub.url, progress=False)
    msg = str(ei.value)
    assert SHARD1 in msg and REPO in msg and "fix:" in msg and "\n" not in msg
    assert not (out / SHARD1).exists()  # nothing under the final name
    partials = list((out / ".cache/quantkit/incomplete").glob(SHARD1 + ".*.incomplete"))
    assert len(partials) == 1 and partials[0].stat().st_size == kept > 0
    for name in hub.content:  # the other files completed
        if name != SHARD1:
            assert (out / name).read_bytes() == hub.content[name]

    hub.reset_counters()
    res = pull(REPO, out, endpoint=hub.url, progress=False)
    _check_out(out, hub.content)
    full = len(hub.content[SHARD1])
    assert hub.bytes_served == full - kept < full  # only the missing tail
    assert res.downloaded == full - kept
    assert [r.range for r in _resolve_gets(hub)] == [f"bytes={kept}-"]
    assert not list((out / ".cache/quantkit/incomplete").rglob("*.incomplete"))


def test_dropped_connection_resumes_within_the_run(hub, env):
    out = env / "out"
    cut = 1_000_000
    kept = cut // CHUNK * CHUNK
    hub.inject(SHARD2, "drop", after=cut)
    pull(REPO, out, endpoint=hub.url, progress=False, include=[SHARD2])
    _check_out(out, hub.content, [SHARD2])
    # resumed with a Range at what had reached the disk, not restarted
    assert hub.bytes_by_file[SHARD2] == cut + len(hub.content[SHARD2]) - kept
    assert [r.range for r in _resolve_gets(hub, SHARD2)] == [None, f"bytes={kept}-"]


# 3 ------------------------------------------------------------------------------------------------------------
def test_checksum_mismatch(hub, env):
    out = env / "out"
    hub.corrupt(SHARD2)
    with pytest.raises(ChecksumError) as ei:
        pull(REPO, out, endpoint=hub.url, progress=False)
    e = ei.value
    expected = hashlib.sha256(hub.content[SHARD2]).hexdigest()
    assert e.filename == SHARD2 and e.expected == expected and e.actual != expected
    msg = str(e)
    assert SHARD2 in msg and expected in msg and e.actual in msg and REPO in msg and "fix:" in msg and "\n" not in msg
    assert isinstance(e, HubError)
    assert not (out / SHARD2).exists()
    assert not list(out.rglob(SHARD2 + "*.incomplete"))  # the bad bytes are gone, not resumed later
    assert (out / SHARD1).read_bytes() == hub.content[SHARD1]

    hub.corrupt(SHARD2, on=False)
    hub.reset_counters()
    pull(REPO, out, endpoint=hub.url, progress=False)
    _check_out(out, hub.content)
    assert hub.bytes_served == len(hub.content[SHARD2])


def test_checksum_mismatch_small_file_uses_git_blob_id(hub, env):
    hub.corrupt("config.json")
    with pytest.raises(ChecksumError, match="config.json.*git-sha1"):
        pull(REPO, env / "out", endpoint=hub.url, progress=False, include=["config.json"])
    assert not (env / "out" / "config.json").exists()


# 4 ------------------------------------------------------------------------------------------------------------
def test_include_patterns(hub, env):
    res = pull(REPO, env / "a", endpoint=hub.url, progress=False, include=["*.json"])
    assert res.files == ["config.json", "generation_config.json", "model.safetensors.index.json"]
    assert not (env / "a" / SHARD1).exists() and not (env / "a" / SHARD2).exists()
    assert hub.bytes_by_file.get(SHARD1, 0) == hub.bytes_by_file.get(SHARD2, 0) == 0

    res = pull(REPO, env / "b", endpoint=hub.url, progress=False, include=["model-0000[1]*", "config.json"])
    assert res.files == ["config.json", SHARD1]
    _check_out(env / "b", hub.content, res.files)

    with pytest.raises(HubError, match="no file matches"):
        pull(REPO, env / "c", endpoint=hub.url, progress=False, include=["*.gguf"])


def test_revision_pinned_to_commit(hub, env):
    repo = hub.repos[REPO]
    old_sha, old = hub.commit_sha, hub.content
    new = _content(seed=1)
    new_sha = repo.commit(new)  # main moves on
    repo.refs["v1"] = old_sha
    assert new_sha != old_sha

    res = pull(REPO, env / "old", revision=old_sha, endpoint=hub.url, progress=False)
    assert res.commit == old_sha
    _check_out(env / "old", old)
    res = pull(f"{REPO}@v1", env / "tag", endpoint=hub.url, progress=False, include=["config.json"])
    assert res.commit == old_sha and (env / "tag/config.json").read_bytes() == old["config.json"]
    res = pull(f"hf://{REPO}", env / "new", endpoint=hub.url, progress=False)
    assert res.commit == new_sha
    _check_out(env / "new", new)

    # re-pulling the old commit over the new tree replaces exactly the changed files
    hub.reset_counters()
    pull(REPO, env / "new", revision=old_sha, endpoint=hub.url, progress=False)
    _check_out(env / "new", old)
    assert all(f"/resolve/{old_sha}/" in r.path for r in _resolve_gets(hub))

    with pytest.raises(HubError, match="revision 'nope' not found"):
        pull(REPO, env / "x", revision="nope", endpoint=hub.url, progress=False)
    with pytest.raises(HubError, match="repository not found"):
        pull("nobody/nothing", env / "x", endpoint=hub.url, progress=False)


def test_parse_hf_id():
    assert parse_hf_id("hf://moonshotai/Kimi-K2.6@main") == ("moonshotai/Kimi-K2.6", "main")
    assert parse_hf_id("zai-org/GLM-5.2@0123456789abcdef0123456789abcdef01234567") == (
        "zai-org/GLM-5.2",
        "0123456789abcdef0123456789abcdef01234567",
    )
    assert parse_hf_id("org/repo") == ("org/repo", None)
    assert parse_hf_id("org/repo@refs/pr/3") == ("org/repo", "refs/pr/3")
    for bad in ("org/repo@", "hf://", "a/b/c", "no-slash", "org/re po"):
        with pytest.raises(HubError):
            parse_hf_id(bad)


def test_offline_with_nothing_local(hub, env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError) as ei:
        pull(REPO, env / "out", endpoint=hub.url, progress=False)
    msg = str(ei.value)
    assert "HF_HUB_OFFLINE" in msg and REPO in msg and "missing" in msg and "fix:" in msg and "\n" not in msg
    with pytest.raises(HubError, match="HF_HUB_OFFLINE"):
        HubSource(REPO, cache_dir=env / "qk", endpoint=hub.url)
    assert hub.requests == []


def test_offline_uses_complete_local_files_and_names_missing(hub, env, monkeypatch):
    out = env / "out"
    pull(REPO, out, endpoint=hub.url, progress=False)
    hub.reset_counters()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = pull(REPO, out, endpoint=hub.url, progress=False)
    assert res.commit == hub.commit_sha and res.downloaded == 0
    (out / SHARD2).unlink()
    with pytest.raises(HubError) as ei:
        pull(REPO, out, endpoint=hub.url, progress=False)
    assert SHARD2 in str(ei.value) and SHARD1 not in str(ei.value) and "HF_HUB_OFFLINE" in str(ei.value)
    assert hub.requests == []


def test_offline_uses_hf_cache(hub, env, monkeypatch):
    cache = env / "hf_home" / "hub"
    for name in hub.content:  # a cache as left by `hf download` / transformers
        huggingface_hub.hf_hub_download(REPO, name, cache_dir=cache, endpoint=hub.url)
    hub.reset_counters()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = pull(REPO, env / "out", endpoint=hub.url, progress=False)
    assert res.commit == hub.commit_sha and res.downloaded == 0
    _check_out(env / "out", hub.content)

    # HubSource with no listing of its own falls back to the HF cache snapshot, uses files in place,
    # and release() leaves the HF cache alone
    src = HubSource(REPO, cache_dir=env / "qk", endpoint=hub.url)
    assert src.commit == hub.commit_sha and set(src.files) == set(hub.content)
    p = src.fetch(SHARD1)
    assert cache in p.parents and p.read_bytes() == hub.content[SHARD1]
    src.release(SHARD1)
    assert p.exists()
    assert hub.requests == []


# 5 ------------------------------------------------------------------------------------------------------------
def test_hubsource_fetch_release(hub, env, monkeypatch):
    qk = env / "qk"
    src = HubSource(f"hf://{REPO}", cache_dir=qk, endpoint=hub.url)
    assert src.repo_id == REPO and src.revision == "main" and src.commit == hub.commit_sha
    assert set(src.files) == set(hub.content)
    f1 = src.files[SHARD1]
    assert f1.size == len(hub.content[SHARD1]) and f1.sha256 == hashlib.sha256(hub.content[SHARD1]).hexdigest()
    assert src.files["config.json"].sha256 is None

    p = src.fetch(SHARD1)
    assert p.read_bytes() == hub.content[SHARD1]
    assert dict(hub.bytes_by_file) == {SHARD1: len(hub.content[SHARD1])}  # only that file
    assert src.fetch(SHARD1) == p and hub.bytes_by_file[SHARD1] == len(hub.content[SHARD1])  # no refetch
    src.release(SHARD1)
    assert not p.exists()
    assert src.fetch("config.json").read_bytes() == hub.content["config.json"]

    hub.corrupt(SHARD2)
    with pytest.raises(ChecksumError, match=SHARD2):
        src.fetch(SHARD2)
    assert not src.local_path(SHARD2).exists()
    with pytest.raises(HubError, match="no file 'nope.bin'"):
        src.fetch("nope.bin")

    # offline: the pinned listing is remembered; what is local works, what is not is named
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.reset_counters()
    off = HubSource(REPO, cache_dir=qk, endpoint=hub.url)
    assert off.commit == hub.commit_sha and off.files == src.files
    assert off.fetch("config.json").read_bytes() == hub.content["config.json"]
    with pytest.raises(HubError, match=f"{SHARD1}.*HF_HUB_OFFLINE"):
        off.fetch(SHARD1)
    assert hub.requests == []


def test_hubsource_resumes_partial_fetch(hub, env):
    src = HubSource(REPO, cache_dir=env / "qk", endpoint=hub.url)
    hub.inject(SHARD1, "drop", after=8 * CHUNK)
    hub.inject(SHARD1, "status", status=503)
    with pytest.raises(HubError, match=SHARD1):
        src.fetch(SHARD1)
    assert not src.local_path(SHARD1).exists()
    hub.reset_counters()
    assert src.fetch(SHARD1).read_bytes() == hub.content[SHARD1]
    assert hub.bytes_served == len(hub.content[SHARD1]) - 8 * CHUNK


# 6 ------------------------------------------------------------------------------------------------------------
def test_token_used_but_never_printed(env, monkeypatch, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    with FakeHub(lfs_redirect=True, required_token=FAKE_TOKEN) as server:
        content = _content()
        server.add_repo(REPO).commit(content)
        monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)  # picked up by huggingface_hub
        res = pull(REPO, env / "out", endpoint=server.url, progress=True)
        _check_out(env / "out", content)
        hub_reqs = [r for r in server.requests if not r.path.startswith("/cdn/")]
        cdn_reqs = [r for r in server.requests if r.path.startswith("/cdn/")]
        assert hub_reqs and all(r.authorization == f"Bearer {FAKE_TOKEN}" for r in hub_reqs)
        assert cdn_reqs and all(r.authorization is None for r in cdn_reqs)  # not leaked to the storage host
        src = HubSource(REPO, cache_dir=env / "qk", endpoint=server.url)
        src.fetch(SHARD1)
        print(res, src, src.files[SHARD1])

        # explicit bad token: clear error, token not echoed
        bad = "hf_WRONGtokenDoNotPrint0987654321"
        with pytest.raises(HubError) as ei:
            pull(REPO, env / "out2", endpoint=server.url, token=bad, progress=True)
        assert "401" in str(ei.value) and bad not in str(ei.value) and bad not in repr(ei.value)
        monkeypatch.delenv("HF_TOKEN")
        with pytest.raises(HubError, match="HF_TOKEN"):
            pull(REPO, env / "out3", endpoint=server.url, progress=False)
    captured = capsys.readouterr()
    for text in (captured.out, captured.err, caplog.text):
        assert FAKE_TOKEN not in text and bad not in text
    assert REPO in captured.out  # we did capture something


# an hf:// source found only in the local HF cache, offline -------------------------------------------------
def test_hf_cache_snapshot_converts_offline_end_to_end(env, monkeypatch, tiny_glm):
    """An hf:// source found only in the HF cache (offline): every file, config.json included, is read
    from where it was found. config.json used to be looked for in quantkit's own cache folder ("not found")."""
    from typer.testing import CliRunner

    from quantkit.cli import app

    repo = "zai-org/GLM-Cache-Tiny"
    cache = env / "hf_home" / "hub"
    commit = hf_cache_snapshot(cache, repo, tiny_glm)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("QUANTKIT_CACHE", str(env / "qk"))
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", f"hf://{repo}@main", "--json"])
    assert res.exit_code == 0, res.output
    out = env / "out"
    res = runner.invoke(app, ["convert", f"hf://{repo}@main", "--out", str(out), "--recipe", "tiny-glm-5.2",
                              "--num-samples", "16", "--device", "cpu", "--no-validate", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "convert-report.json").read_text())
    assert report["source"]["commit"] == commit and report["source"]["repo"] == repo
    # the reference: the recorded hf:// source, offline. 2 x 32 tokens after 16 calibration windows say
    # nothing about quality (the recipe's gates are for its own calibration and eval sizes, and this build's
    # KL at this size depends on the CPU that trained the tiny model), so the gate here is only that every
    # row was measured against that source
    gate = env / "any.yaml"
    gate.write_text("kl_max: 1.0e+9\n")
    res = runner.invoke(app, ["validate", str(out), "--num-samples", "2", "--seq-len", "32", "--gen-tokens", "1",
                              "--device", "cpu", "--gate", str(gate), "--json"])
    assert res.exit_code == 0, res.output
    validation = json.loads((out / "validation.json").read_text())
    assert validation["passed"] and not any("differs from the source" in n for n in validation.get("notes", [])), validation.get("notes")
    # the bytes are those of a convert from the folder itself, and the HF cache is untouched
    from quantkit.conversion.pipeline import convert

    local = convert(tiny_glm, env / "local", recipe="tiny-glm-5.2", num_samples=16, validate=False, progress=False,
                    device="cpu")
    for which in ("prefill", "decode"):
        for p in sorted((local.out / which).glob("*.safetensors")):
            assert (out / which / p.name).read_bytes() == p.read_bytes(), (which, p.name)
    blobs = cache / ("models--" + repo.replace("/", "--")) / "blobs"
    assert len(list(blobs.iterdir())) == len([p for p in tiny_glm.iterdir() if p.is_file()])
