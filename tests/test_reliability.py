"""Reliability: nothing lost, nothing forged.

- a crash at every write step of convert (the finish included), then --resume: byte-identical;
- SIGKILLs at random times on the tiny model, then --resume: byte-identical;
- a table of bad inputs: each a one-line quantkit error with a fix, no traceback, no output folder;
- one owner per output folder (a live lock refuses, a dead one is taken over and reported);
- disk full, Ctrl-C, the disk precheck: one line, saying what to do;
- flipped bytes, added or removed files, a swapped manifest: found by verify, named by file and tensor.

Every test adds its rows to MATRIX; run with QUANTKIT_RELIABILITY_TABLE=<file> to get the table that
docs/reliability.md shows.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import small_config, write_random
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from quantkit.checkpoint.manifest import MANIFEST, REPORT, atomic_write_text, verify
from quantkit.cli import app
from quantkit.conversion.outputs import check_disk, disk_full
from quantkit.conversion.pipeline import convert
from quantkit.errors import IntegrityError, OutputError
from quantkit.runtime import faults

runner = CliRunner()
MATRIX: list[tuple[str, str, int, str]] = []  # (area, case, tries, result)
SHARD = "model-00001-of-00001.safetensors"


def record(area: str, case: str, tries: int, ok: bool, detail: str = "") -> None:
    MATRIX.append((area, case, tries, ("held" if ok else "FAILED") + (f": {detail}" if detail else "")))


@pytest.fixture(scope="module", autouse=True)
def _matrix_table():
    yield
    rows = ["| area | case | tries | result |", "|---|---|---:|---|"]
    rows += [f"| {a} | {c} | {n} | {r} |" for a, c, n, r in MATRIX]
    table = "\n".join(rows) + "\n"
    if path := os.environ.get("QUANTKIT_RELIABILITY_TABLE"):
        with open(path, "a") as f:
            f.write(table)
    print("\n" + table)


@pytest.fixture(autouse=True)
def _no_fault_env(monkeypatch):
    for var in ("QUANTKIT_FAULT", "QUANTKIT_FAULT_LOG"):
        monkeypatch.delenv(var, raising=False)
    faults.reset()


@pytest.fixture(scope="module")
def src(tmp_path_factory, tiny_glm) -> Path:
    """A 3-layer + MTP GLM checkpoint in the real FP8 format, with a tokenizer and carried files."""
    root = tmp_path_factory.mktemp("rel")
    folder, _ = write_random(root / "src", small_config("glm"), linears="fp8", experts="fp8")
    for f in tiny_glm.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, folder / f.name)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# source\n")
    return folder


def _convert(src, out, **kw):
    faults.reset()
    return convert(src, out, method=kw.pop("method", "rtn"), validate=False, progress=False, **kw)


@pytest.fixture(scope="module")
def whole(src, tmp_path_factory) -> tuple[Path, list[str]]:
    """An uninterrupted RTN convert, and every crash point it passed (in order)."""
    root = tmp_path_factory.mktemp("whole")
    log = root / "points.log"
    os.environ["QUANTKIT_FAULT_LOG"] = str(log)
    try:
        _convert(src, root / "out")
    finally:
        del os.environ["QUANTKIT_FAULT_LOG"]
    return root / "out", log.read_text().split()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _same_pair(a: Path, b: Path) -> bool:
    return all(_files(a / w) == _files(b / w) for w in ("prefill", "decode"))


def _never_looks_complete(out: Path) -> None:
    """After a crash: no report => verify fails; a folder under its final name is whole."""
    if not out.exists():  # killed before it made anything
        return
    if not (out / REPORT).exists():
        assert not verify(out).ok
    for which in ("prefill", "decode"):
        if (out / which).exists():
            assert verify(out / which).ok, verify(out / which).problems


def _crash_then_resume(src, out, point, monkeypatch, *, resume: bool = False, **kw) -> None:
    """Crash at `point` (a fresh run, or with resume=True a resumed one), then resume to the end."""
    monkeypatch.setenv("QUANTKIT_FAULT", f"{point}:raise")
    with pytest.raises(faults.InjectedFault):
        _convert(src, out, resume=resume, **kw)
    monkeypatch.delenv("QUANTKIT_FAULT")
    _never_looks_complete(out)
    _convert(src, out, resume=True, **kw)


# ---- crash at each write step, then resume ------------------------------------------------------------------
def _points(log: list[str]) -> list[str]:
    """Every finish step, and the first and last time of each step of the layer loop."""
    first, last = {}, {}
    for p in log:
        name = p.split("#")[0]
        first.setdefault(name, p)
        last[name] = p
    picked = [p for p in log if p.startswith("finish:") and not p.startswith("finish:rename")]
    picked += [p for p in log if p.startswith("finish:rename")][::5]
    picked += sorted({first[n] for n in first if not n.startswith("finish:")} | {last[n] for n in last if not n.startswith("finish:")})
    return picked


SMOKE = ["flush:tmp#3", "state:saved#2", "finish:staged:decode#1", "finish:replace#1"]


@pytest.mark.parametrize("point", SMOKE)
def test_crash_at_a_write_step_then_resume_is_byte_identical(src, whole, point, tmp_path, monkeypatch):
    out, log = whole
    assert point in log
    _crash_then_resume(src, tmp_path / "o", point, monkeypatch)
    assert _same_pair(tmp_path / "o", out)
    assert verify(tmp_path / "o").ok and not (tmp_path / "o" / ".quantkit-convert").exists()


@pytest.mark.slow
def test_crash_at_every_write_step_then_resume_is_byte_identical(src, whole, tmp_path, monkeypatch):
    out, log = whole
    points = _points(log)
    assert {p.split("#")[0] for p in log} <= {p.split("#")[0] for p in points}  # every kind of step is tried
    # the finish steps start from one copy of a run whose layers are all done (the last state save)
    last_save = [p for p in log if p.startswith("state:saved")][-1]
    layers_done = tmp_path / "layers-done"
    monkeypatch.setenv("QUANTKIT_FAULT", f"{last_save}:raise")
    with pytest.raises(faults.InjectedFault):
        _convert(src, layers_done)
    monkeypatch.delenv("QUANTKIT_FAULT")
    bad = []
    for i, point in enumerate(points):
        o = tmp_path / str(i)
        if point.startswith("finish:"):
            shutil.copytree(layers_done, o)
            _crash_then_resume(src, o, point, monkeypatch, resume=True)
        else:
            _crash_then_resume(src, o, point, monkeypatch)
        if not (_same_pair(o, out) and verify(o).ok):
            bad.append(point)
        shutil.rmtree(o)
    record("crash + --resume (in-process, every write step)", f"{len(points)} steps of {len(log)} passed by a run, "
           "finish included", len(points), not bad, f"{len(points) - len(bad)}/{len(points)} byte-identical")
    assert not bad


@pytest.mark.slow
def test_sigkill_at_finish_steps_then_resume_is_byte_identical(src, whole, tmp_path):
    """SIGKILL (nothing unwinds) at a chain of points, each in the resumed run of the previous kill."""
    out = tmp_path / "o"
    chain = ["state:saved#3", "finish:rename#3", "finish:replace#1", "finish:report#1", None]
    codes = []
    for k, point in enumerate(chain):
        env = {k2: v for k2, v in os.environ.items() if not k2.startswith("QUANTKIT_FAULT")}
        if point:
            env["QUANTKIT_FAULT"] = point  # kill
        args = ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--json"] + (["--resume"] if k else [])
        codes.append(subprocess.run(_cli(*args), capture_output=True, env=env).returncode)
        if point:
            _never_looks_complete(out)
    ok = codes == [-signal.SIGKILL] * 4 + [0] and _same_pair(out, whole[0]) and verify(out).ok
    record("SIGKILL at chosen steps (subprocess)", "mid-layers, then mid-rename, between the two renames, after the "
           "report, each in the previous run's resume", len(chain) - 1, ok)
    assert ok, codes


@pytest.mark.slow
def test_crash_while_calibrating_then_resume_is_byte_identical(src, tmp_path, monkeypatch):
    """GPTQ: the saved hidden states and state.json agree after a crash between their writes."""
    kw = dict(method="gptq", calib="synthetic:train", num_samples=4, seq_len=16)
    ref = _convert(src, tmp_path / "ref", **kw).out
    _crash_then_resume(src, tmp_path / "o", "state:hidden#3", monkeypatch, **kw)
    same = _same_pair(tmp_path / "o", ref)
    record("crash + --resume (GPTQ)", "between the hidden states and state.json", 1, same)
    assert same


@pytest.mark.parametrize("point", ["state:hidden#3", "layer:written#3"])
def test_crash_with_a_probe_then_resume_is_byte_identical(src, tmp_path, monkeypatch, point):
    """gptq.low_dampening: the probe windows' hidden states are saved and restored with the
    calibration's (probe-hidden.N.bin), so a resumed run makes the same choices, byte for byte."""
    import yaml

    from quantkit.recipe import load_recipe

    rec = load_recipe("tiny-glm-5.2").to_dict()
    rec["gptq"].update({"dampening": 0.1, "low_dampening": 0.01})
    (tmp_path / "low.yaml").write_text(yaml.safe_dump(rec))
    kw = dict(recipe=tmp_path / "low.yaml", method="gptq", calib="synthetic:train", num_samples=4, seq_len=16)
    ref = _convert(src, tmp_path / "ref", **kw)
    assert ref.report["experts_summary"]["probe_judged"] > 0
    monkeypatch.setenv("QUANTKIT_FAULT", f"{point}:raise")
    with pytest.raises(faults.InjectedFault):
        _convert(src, tmp_path / "o", **kw)
    assert any((tmp_path / "o" / ".quantkit-convert").glob("probe-hidden.*.bin"))
    monkeypatch.delenv("QUANTKIT_FAULT")
    _convert(src, tmp_path / "o", resume=True, **kw)
    same = _same_pair(tmp_path / "o", ref.out)
    record("crash + --resume (GPTQ, gptq.low_dampening's probe)", point, 1, same)
    assert same


@pytest.mark.slow
def test_resume_from_an_older_state_is_byte_identical(src, tmp_path, monkeypatch):
    """With saves rarer than layers (QUANTKIT_STATE_EVERY=100: only after the embeddings and the
    last layer, as at full scale every few layers), a crash after layer 3 leaves a state from
    before layer 0 and the parts of layers 0-3; --resume drops those parts and redoes the layers:
    the same bytes."""
    kw = dict(method="gptq", calib="synthetic:train", num_samples=4, seq_len=16)
    ref = _convert(src, tmp_path / "ref", **kw).out
    monkeypatch.setenv("QUANTKIT_STATE_EVERY", "100")
    monkeypatch.setenv("QUANTKIT_FAULT", "layer:written#3:raise")
    with pytest.raises(faults.InjectedFault):
        _convert(src, tmp_path / "o", **kw)
    state = json.loads((tmp_path / "o" / ".quantkit-convert" / "state.json").read_text())
    assert state["next_layer"] == 0 and any((tmp_path / "o" / "decode.partial").glob("part-*.safetensors"))
    monkeypatch.delenv("QUANTKIT_FAULT")
    _convert(src, tmp_path / "o", resume=True, **kw)
    same = _same_pair(tmp_path / "o", ref)
    record("crash + --resume (GPTQ)", "the resume state saved before the last completed layers", 1, same)
    assert same


# ---- SIGKILL at random times --------------------------------------------------------------------------------
def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "quantkit.cli", *args]


def _phase(out: Path) -> str:
    state = out / ".quantkit-convert"
    if not out.exists():
        return "startup"
    if (out / REPORT).exists():
        return "finished"
    j = state / "finish.json"
    if j.is_file():
        return "finish: after " + json.loads(j.read_text())["done"][-1].split(":")[0]
    if (state / "state.json").is_file():
        n = json.loads((state / "state.json").read_text() or "{}").get("next_layer", -1)
        return "layers" if n >= 0 else "setup"
    return "setup"


@pytest.mark.slow
def test_sigkill_at_random_times_then_resume_is_byte_identical(tiny_glm, tmp_path):
    """SIGKILL at a random time; the next run resumes (and may be killed again). A run that ends on
    its own is compared with an uninterrupted one and the next kill starts a fresh folder."""
    kills = int(os.environ.get("QUANTKIT_KILLS", 3))
    seed = int(os.environ.get("QUANTKIT_KILL_SEED", 12))
    rng = random.Random(seed)
    cmd = ["convert", "tiny:glm-5.2", "--method", "rtn", "--no-validate", "--json"]
    t0 = time.time()
    subprocess.run(_cli(*cmd, "--out", str(tmp_path / "whole")), check=True, capture_output=True)
    span = time.time() - t0
    landed: dict[str, int] = {}
    outs, fresh, killed, launches = [], True, 0, 0
    while killed < kills and launches < 4 * kills:
        if fresh:
            outs.append(tmp_path / f"cut{len(outs)}")
        out = outs[-1]
        launches += 1
        proc = subprocess.Popen(_cli(*cmd, "--out", str(out), *([] if fresh else ["--resume"])),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.2, 1.0) * span)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed += 1
            where = _phase(out)
            landed[where] = landed.get(where, 0) + 1
            _never_looks_complete(out)
            fresh = False
        else:
            fresh = proc.wait() == 0
            assert fresh, f"run {launches} failed"
    if not fresh:
        done = subprocess.run(_cli(*cmd, "--out", str(outs[-1]), "--resume"), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    same = all(_same_pair(o, tmp_path / "whole") and verify(o).ok for o in outs)
    record("SIGKILL at random times (tiny GLM, subprocess)", f"seed {seed}, {launches} runs; killed in: "
           + ", ".join(f"{w} x{n}" for w, n in sorted(landed.items())), killed, same,
           f"{len(outs)} outputs byte-identical to an uninterrupted run")
    assert same


# ---- bad inputs: one line, a fix, no traceback, no output ---------------------------------------------------
def _edit_tensor(folder: Path, name: str, fn) -> None:
    path = folder / SHARD
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(path))
    t[name] = fn(t[name])
    save_file(t, str(path), metadata=meta)


def _edit_json(folder: Path, file: str, fn) -> None:
    d = json.loads((folder / file).read_text())
    fn(d)
    (folder / file).write_text(json.dumps(d))


def _nan_fp8(t):
    t = t.clone()
    t.view(torch.uint8).view(-1)[5] = 0x7F  # e4m3fn NaN
    return t


def _set(t, value, i=3):
    t = t.clone()
    t.view(-1)[i] = value
    return t


def _drop_from_index(folder):
    _edit_json(folder, "model.safetensors.index.json", lambda d: d["weight_map"].pop("model.layers.1.input_layernorm.weight"))


def _drop_everywhere(folder):
    _drop_from_index(folder)
    t = load_file(str(folder / SHARD))
    del t["model.layers.1.input_layernorm.weight"]
    save_file(t, str(folder / SHARD), metadata={"format": "pt"})


def _symlink_out(folder):
    outside = folder.parent / "outside.json"
    outside.write_text("{}")
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").symlink_to(outside)


def _truncate(folder):
    with open(folder / SHARD, "r+b") as f:
        f.truncate((folder / SHARD).stat().st_size - 100)


BAD = [
    # (case, mutate, expected message, commands that must refuse it)
    ("NaN in an FP8 attention weight (pass-through)", lambda f: _edit_tensor(f, "model.layers.0.self_attn.q_a_proj.weight", _nan_fp8),
     r"self_attn\.q_a_proj\.weight: contains NaN or Inf", ["convert"]),
    ("NaN in an FP8 scale (pass-through)", lambda f: _edit_tensor(f, "model.layers.1.self_attn.kv_b_proj.weight_scale_inv", lambda t: _set(t, float("nan"), 0)),
     r"kv_b_proj\.weight_scale_inv: contains NaN or Inf", ["convert"]),
    ("Inf in a BF16 norm (pass-through)", lambda f: _edit_tensor(f, "model.layers.2.input_layernorm.weight", lambda t: _set(t, float("inf"))),
     r"layers\.2\.input_layernorm\.weight: contains NaN or Inf", ["convert"]),
    ("Inf in the final norm", lambda f: _edit_tensor(f, "model.norm.weight", lambda t: _set(t, float("-inf"))),
     r"model\.norm\.weight: contains NaN or Inf", ["convert"]),
    ("norm length contradicts hidden_size", lambda f: _edit_tensor(f, "model.layers.0.post_attention_layernorm.weight", lambda t: torch.cat([t, t[:1]])),
     r"post_attention_layernorm\.weight: shape \(\d+,\) contradicts config\.json \(expected \(\d+,\)\)", ["inspect", "convert", "validate"]),
    ("indexer k_norm length contradicts index_head_dim", lambda f: _edit_tensor(f, "model.layers.0.self_attn.indexer.k_norm.weight", lambda t: t[:-1].clone()),
     r"k_norm\.weight: shape \(\d+,\) contradicts config\.json", ["inspect", "convert"]),
    ("tensor dropped from the index", _drop_from_index, r"does not list .*re-download model\.safetensors\.index\.json", ["inspect", "convert", "validate"]),
    ("tensor missing from index and shard", _drop_everywhere, r"input_layernorm\.weight: required tensor is missing", ["inspect", "convert", "validate"]),
    ("index names a tensor the shard lacks", lambda f: _edit_json(f, "model.safetensors.index.json", lambda d: d["weight_map"].update({"model.layers.0.mlp.gate.extra": SHARD})),
     r"does not hold it", ["inspect", "convert"]),
    ("index names a missing shard", lambda f: _edit_json(f, "model.safetensors.index.json", lambda d: d["weight_map"].update({"model.norm.weight": "gone.safetensors"})),
     r"missing shard 'gone\.safetensors'", ["inspect", "convert"]),
    ("truncated shard", _truncate, r"truncated|past the end", ["inspect", "convert"]),
    ("num_hidden_layers: \"five\"", lambda f: _edit_json(f, "config.json", lambda d: d.update(num_hidden_layers="five")),
     r"num_hidden_layers is 'five' \(str\); it must be an integer", ["inspect", "convert"]),
    ("hidden_size: 0", lambda f: _edit_json(f, "config.json", lambda d: d.update(hidden_size=0)), r"hidden_size is 0; it must be positive", ["inspect", "convert"]),
    ("rms_norm_eps: a string", lambda f: _edit_json(f, "config.json", lambda d: d.update(rms_norm_eps="1e-6")), r"rms_norm_eps .* must be a number", ["inspect", "convert"]),
    ("config has fewer layers than the shards", lambda f: _edit_json(f, "config.json", lambda d: d.update(num_hidden_layers=2)),
     r"beyond num_hidden_layers .*use the config\.json that came with them", ["inspect", "convert"]),
    ("config has more layers than the shards", lambda f: _edit_json(f, "config.json", lambda d: d.update(num_nextn_predict_layers=2)),
     r"no tensor of layer 4.*use the config\.json that came with them", ["inspect", "convert"]),
    ("MTP layer where config expects a decoder layer", lambda f: _edit_json(f, "config.json", lambda d: d.update(num_hidden_layers=4, num_nextn_predict_layers=0)),
     r"holds MTP tensors", ["inspect", "convert"]),
    ("symlink to a file outside the source", _symlink_out, r"symlink to .* outside the model folder", ["inspect", "convert"]),
    ("config.json not JSON", lambda f: (f / "config.json").write_text("{oops"), r"not valid JSON", ["inspect", "convert"]),
    ("unknown model_type", lambda f: _edit_json(f, "config.json", lambda d: d.update(model_type="llama")), r"unknown model_type 'llama'", ["inspect", "convert"]),
    # the family's invariants (what the router and the reference forward assume), checked before layer 0
    ("top-k above the expert count", lambda f: _edit_json(f, "config.json", lambda d: d.update(num_experts_per_tok=9)),
     r"num_experts_per_tok 9 is more than n_routed_experts 8", ["inspect", "convert"]),
    ("topk_group above n_group", lambda f: _edit_json(f, "config.json", lambda d: d.update(n_group=2, topk_group=3)),
     r"topk_group 3 is more than n_group 2", ["inspect", "convert"]),
    ("top-k above the experts of the chosen groups", lambda f: _edit_json(f, "config.json", lambda d: d.update(n_group=4, topk_group=1)),
     r"num_experts_per_tok 4 is more than the 2 experts", ["inspect", "convert"]),
    ("index_topk of 0", lambda f: _edit_json(f, "config.json", lambda d: d.update(index_topk=0)),
     r"index_topk is 0", ["inspect", "convert"]),
    # a negative eps made every norm NaN in a calibrated run, reported as a Hessian "not positive definite"
    ("rms_norm_eps negative", lambda f: _edit_json(f, "config.json", lambda d: d.update(rms_norm_eps=-1.0)),
     r"rms_norm_eps is -1.0; it must be finite and >= 0", ["inspect", "convert"]),
    ("rope_theta of 0", lambda f: _edit_json(f, "config.json", lambda d: d.update(rope_theta=0)),
     r"rope_theta is 0; it must be finite and positive", ["inspect", "convert"]),
]


CONFIG_CASES = {b[0] for b in BAD[BAD.index(next(b for b in BAD if b[0] == "top-k above the expert count")):]}


def _invoke(command: str, folder: Path, out: Path, whole_out: Path) -> tuple[int, str]:
    if command == "inspect":
        args = ["inspect", str(folder), "--json"]
    elif command == "convert":
        args = ["convert", str(folder), "--out", str(out), "--method", "rtn", "--no-validate", "--json"]
    else:  # validate a good pair against the damaged source
        args = ["validate", str(whole_out), "--reference", str(folder), "--device", "cpu", "--json"]
    res = runner.invoke(app, args)
    return res.exit_code, res.output


@pytest.mark.parametrize("case,mutate,message,commands", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_with_a_fix(src, whole, tmp_path, case, mutate, message, commands):
    import re

    folder = tmp_path / "src"
    shutil.copytree(src, folder, symlinks=True)
    mutate(folder)
    for command in commands:
        code, output = _invoke(command, folder, tmp_path / "out", whole[0])
        lines = output.strip().splitlines()
        ok = (code == 1 and "Traceback" not in output and len(lines) == 1 and lines[0].startswith("error:")
              and re.search(message, output) is not None)
        record("bad input", f"{case} ({command})", 1, ok)
        assert ok, f"{command}: exit {code}: {output}"
        assert not (tmp_path / "out" / "prefill").exists() and not (tmp_path / "out" / "decode").exists()
        if case in CONFIG_CASES:  # refused before any work: no folder, no *.partial
            assert not (tmp_path / "out").exists(), list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("device,message", [("cuda", "no CUDA device"), ("cuda:3", "cuda:3"), ("tpu", "not a device")])
def test_bad_device_fails_before_any_folder_exists(src, tmp_path, device, message):
    out = tmp_path / "out"
    res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--device", device, "--no-validate", "--json"])
    ok = res.exit_code == 1 and message in res.output and "Traceback" not in res.output and not out.exists()
    record("bad input", f"--device {device}", 1, ok, "no folder created")
    assert ok, res.output


def test_existing_and_interrupted_outputs_say_what_to_do(src, whole, tmp_path, monkeypatch):
    res = runner.invoke(app, ["convert", str(src), "--out", str(whole[0]), "--method", "rtn", "--no-validate"])
    assert res.exit_code == 1 and "already exists" in res.output
    out = tmp_path / "o"
    monkeypatch.setenv("QUANTKIT_FAULT", "finish:placed:decode#1:raise")
    with pytest.raises(faults.InjectedFault):
        _convert(src, out)
    monkeypatch.delenv("QUANTKIT_FAULT")
    # both folders are in place, the report is not: nothing treats the pair as finished
    assert not verify(out).ok and "convert-report.json: missing" in verify(out).problems[0] + "".join(verify(out).problems)
    v = runner.invoke(app, ["validate", str(out), "--device", "cpu"])
    assert v.exit_code == 1 and "--resume" in v.output and "Traceback" not in v.output
    again = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate"])
    assert again.exit_code == 1 and "add --resume" in again.output
    # a folder the finish had put in place, removed by hand: a clear error, never an empty checkpoint
    shutil.rmtree(out / "decode")
    gone = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--resume"])
    ok = gone.exit_code == 1 and "gone or incomplete" in gone.output and not (out / REPORT).exists()
    record("interrupted finish", "validate / convert without --resume / a placed folder removed by hand", 3, ok)
    assert ok, gone.output


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTKIT_FAULT")}
    return env | extra


def test_unfinished_output_names_itself_and_the_resume_command(src, whole, tmp_path):
    """verify / validate / check-serving on a convert still running, then killed: "still running",
    then "interrupted" with the exact command, which (run as printed) completes it byte-identically;
    never "reconvert it"; check-serving refuses both (exit 1)."""
    out = tmp_path / "o"
    args = ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--json"]
    live = subprocess.Popen(_cli(*args), env=_env(QUANTKIT_CONVERT_LAYER_DELAY="30"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (out / ".quantkit-convert" / "state.json").is_file() and time.time() < deadline:
            time.sleep(0.2)
        running = {c: runner.invoke(app, [c, str(out)] + (["--device", "cpu"] if c == "validate" else []))
                   for c in ("verify", "validate", "check-serving")}
    finally:
        live.send_signal(signal.SIGKILL)  # the same folder is now a killed run's
        live.wait()
    killed = {c: runner.invoke(app, [c, str(out)] + (["--device", "cpu"] if c == "validate" else []))
              for c in ("verify", "validate", "check-serving")}
    bad = [f"{c} (running): {r.output}" for c, r in running.items()
           if not (r.exit_code == 1 and ("still running" in r.output or f"in use by pid {live.pid}" in r.output)
                   and "reconvert" not in r.output)]
    bad += [f"{c} (killed): {r.output}" for c, r in killed.items()
            if not (r.exit_code == 1 and "interrupted" in r.output and "reconvert" not in r.output
                    and "--resume" in r.output and "Traceback" not in r.output)]
    line = killed["validate"].output.strip().splitlines()[-1]
    command = line.split("continue it with: ", 1)[1].split()
    assert command[:2] == ["quantkit", "convert"] and command[-1] == "--resume", line
    done = subprocess.run(_cli(*command[1:]), env=_env(), capture_output=True, text=True)
    ok = not bad and done.returncode == 0 and _same_pair(out, whole[0]) and verify(out).ok
    record("unfinished output", "verify / validate / check-serving on a running, then a killed convert: named as "
           "such, with the exact --resume command (which completes it)", 6, ok)
    assert ok, (bad, done.stderr[-2000:])


# ---- fail before the work ----------------------------------------------------------------------------------
def test_a_validate_dataset_that_cannot_load_fails_convert_before_any_layer(tmp_path):
    """A recipe whose validate.dataset cannot load offline: convert exits 1 naming the dataset
    before any layer is written (no .partial, no crash point of the layer loop passed); with
    --eval-data and the other eval options the same recipe converts, and the chained validate
    uses them."""
    from quantkit.recipe import recipe_dirs

    missing = "hf:quantkit-test/no-such-dataset@test"
    text = (recipe_dirs()[0] / "tiny-glm-5.2.yaml").read_text()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text.replace("dataset: synthetic:heldout", f"dataset: {missing}"))
    assert missing in recipe.read_text()
    out, log = tmp_path / "o", tmp_path / "points.log"
    env = _env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", QUANTKIT_FAULT_LOG=str(log))
    args = ["convert", "tiny:glm-5.2", "--recipe", str(recipe), "--method", "rtn", "--json"]
    res = subprocess.run(_cli(*args, "--out", str(out)), env=env, capture_output=True, text=True)
    points = log.read_text().split() if log.exists() else []
    refused = (res.returncode == 1 and missing in res.stderr and "before converting any layer" in res.stderr
               and "Traceback" not in res.stderr and not any(p.startswith(("layer:", "flush:")) for p in points)
               and not list(tmp_path.glob("o/*.partial")))
    given = tmp_path / "g"
    ran = subprocess.run(_cli(*args, "--out", str(given), "--eval-data", "synthetic:heldout", "--eval-num-samples", "2",
                              "--eval-seq-len", "16", "--gen-tokens", "0"), env=env, capture_output=True, text=True)
    v = json.loads((given / "validation.json").read_text()) if (given / "validation.json").is_file() else {}
    used = json.dumps(v)
    passed_on = ran.returncode in (0, 3) and "synthetic:heldout" in used and missing not in used
    ok = refused and passed_on
    record("fail before the work", "validate.dataset that cannot load offline: exit 1 naming it, no layer written; "
           "convert --eval-data ... reaches the chained validate", 2, ok)
    assert ok, (res.stderr[-1500:], points[:5], ran.stderr[-1500:])


def test_the_report_records_what_the_bytes_depend_on(whole):
    """convert-report.json names the torch build, its BLAS/LAPACK, the threads per rank and the device:
    GPTQ's and the KV scales' float sums change with them (the same convert at 2 threads and 1 differs)."""
    r = json.loads((whole[0] / REPORT).read_text())["reproducibility"]
    ok = (r["torch"] == torch.__version__ and r["blas"] and r["lapack"] and r["threads"] == torch.get_num_threads()
          and r["threads_per_rank"] == [r["threads"]] and r["device"] == "cpu" and "threads per rank" in r["must_match"])
    record("reproducible bytes", "the report records torch, BLAS/LAPACK, threads per rank, device", 1, ok,
           f"blas {r.get('blas')}, {r.get('threads')} threads")
    assert ok, r


# ---- logs for jobs nobody watches --------------------------------------------------------------------------
def test_a_log_fills_while_convert_runs_one_line_per_layer(src, whole, tmp_path):
    """stdout a pipe (nohup, CI): a flushed line per layer while the run goes on, with the layer,
    elapsed, ETA and peak memory; --quiet prints none; --resume says where it continues; validate
    prints a line per pass."""
    import re

    out = tmp_path / "o"
    n = json.loads((whole[0] / REPORT).read_text())["layers"][-1]["layer"] + 1
    args = ["convert", str(src), "--out", str(out), "--method", "rtn"]
    p = subprocess.Popen(_cli(*args, "--no-validate"), env=_env(QUANTKIT_CONVERT_LAYER_DELAY="1"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen_running = []
    for raw in p.stderr:
        if raw.startswith("layers "):
            seen_running.append((raw.strip(), p.poll() is None))
    p.wait()
    shape = re.compile(r"^layers (\d+)/%d  elapsed \d+:\d\d:\d\d  ETA (\?|\d+:\d\d:\d\d)  peak host \d+\.\d\d GB" % n)
    lines_ok = (p.returncode == 0 and [int(shape.match(line).group(1)) for line, _ in seen_running] == list(range(n + 1))
                and all(alive for _, alive in seen_running[:-1]))
    quiet = subprocess.run(_cli(*args, "--no-validate", "--quiet", "--out", str(tmp_path / "q")), env=_env(),
                           capture_output=True, text=True)
    quiet_ok = quiet.returncode == 0 and "layers " not in quiet.stderr + quiet.stdout and "predicted" not in quiet.stderr
    killed = tmp_path / "k"
    subprocess.run(_cli(*args[:2], "--out", str(killed), "--method", "rtn", "--no-validate", "--json"),
                   env=_env(QUANTKIT_FAULT="state:saved#3"), capture_output=True)
    resumed = subprocess.run(_cli(*args[:2], "--out", str(killed), "--method", "rtn", "--resume", "--no-validate"),
                             env=_env(), capture_output=True, text=True)
    at = re.search(r"resuming \S+ at layer (\d+) of %d" % n, resumed.stderr)
    validated = subprocess.run(_cli("validate", str(killed), "--device", "cpu", "--num-samples", "1", "--seq-len", "16",
                                    "--gen-tokens", "2", "--eval-data", "synthetic:heldout"), env=_env(), capture_output=True,
                               text=True)
    passes = [line.split("  ")[0] for line in validated.stderr.splitlines() if line.startswith("validate: pass ")]
    progress_on_stdout = [line for line in resumed.stdout.splitlines() + validated.stdout.splitlines()
                          if line.startswith(("layers ", "validate: pass "))]
    resume_ok = (resumed.returncode == 0 and at is not None and int(at.group(1)) > 0 and validated.returncode in (0, 3)
                 and passes == ["validate: pass 1/2", "validate: pass 2/2"] and not progress_on_stdout)
    ok = lines_ok and quiet_ok and resume_ok
    record("logs (stderr a pipe)", f"a line per layer while running ({n} layers), none with --quiet, --resume names "
           "its layer, validate a line per pass", 4, ok)
    assert ok, (seen_running, quiet.stdout[-500:], resumed.stderr[-1500:], validated.stderr[-1500:], passes)


# ---- one owner per output -----------------------------------------------------------------------------------
def test_a_tool_task_prints_progress_after_the_last_pass(src, whole, tmp_path, capsys):
    """`validate --tool-task` generates for minutes after the KL passes: it says so, a line per
    sixteenth of its greedy steps in a log, on stderr like every other progress line."""
    from importlib import resources

    from quantkit.validation.pipeline import validate

    out = tmp_path / "o"
    shutil.copytree(whole[0], out)
    task = json.loads(resources.files("quantkit.validation").joinpath("tooltask.json").read_text())
    task.update(name="tools-1", max_tokens=32, prompts=task["prompts"][:1])
    (tmp_path / "tools.json").write_text(json.dumps(task))
    capsys.readouterr()
    validate(out, eval_data="synthetic:heldout", num_samples=1, seq_len=8, gen_tokens=2, device="cpu", progress=True,
             tool_task=tmp_path / "tools.json",
             long_context=0)
    err, stdout = capsys.readouterr()[::-1]
    lines = [line.split("  ")[0] for line in err.splitlines() if line.startswith("validate: tool task")]
    steps = [line for line in lines if "greedy step" in line]
    ok = (len(steps) >= 2 and steps[-1].endswith("16/16") and err.index("validate: pass") < err.index(lines[0])
          and "validate: " not in stdout)
    record("logs (stderr a pipe)", "validate --tool-task after the last pass: a line per sixteenth of its greedy steps, "
           "on stderr", 1, ok)
    assert ok, err[-2000:]


def _holder(out: Path) -> subprocess.Popen:
    code = ("import sys, time; from quantkit.checkpoint.outlock import acquire; acquire(sys.argv[1], 'convert'); "
            "print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_convert_or_validate_on_one_folder_is_refused(src, whole, tmp_path, caplog):
    out = tmp_path / "o"
    holder = _holder(out)
    try:
        c = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate"])
        assert c.exit_code == 1 and f"in use by pid {holder.pid}" in c.output and "Traceback" not in c.output
        w = whole[0]
        h2 = _holder(w)
        v = runner.invoke(app, ["validate", str(w), "--device", "cpu"])
        assert v.exit_code == 1 and f"in use by pid {h2.pid}" in v.output and "--out" not in v.output  # validate has none
        h2.kill()
        h2.wait()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the owner died without cleaning up: its lock is taken over, and that is reported
    assert (out / ".quantkit.lock").is_file()
    with caplog.at_level("WARNING", logger="quantkit"):
        _convert(src, out)
    ok = "took over the lock" in caplog.text and str(holder.pid) in caplog.text and not (out / ".quantkit.lock").exists()
    record("one owner per --out", "second convert / validate refused; a dead owner's lock taken over and reported", 3, ok)
    assert ok


# ---- disk full, Ctrl-C, precheck ----------------------------------------------------------------------------
@pytest.mark.parametrize("point", ["flush:tmp#3", "finish:manifest#1", "finish:report#1"])
def test_disk_full_is_one_line_naming_the_folder_and_resume_completes(src, whole, tmp_path, monkeypatch, point):
    out = tmp_path / "o"
    monkeypatch.setenv("QUANTKIT_FAULT", f"{point}:enospc")
    faults.reset()
    res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--json"])
    monkeypatch.delenv("QUANTKIT_FAULT")
    line = res.output.strip()
    ok = (res.exit_code == 1 and len(line.splitlines()) == 1 and f"{out}: disk full" in line and "free" in line
          and "--resume" in line)
    _never_looks_complete(out)
    _convert(src, out, resume=True)
    ok = ok and _same_pair(out, whole[0])
    record("disk full (ENOSPC injected)", point, 1, ok, "one line; --resume byte-identical")
    assert ok, res.output


def _small_tmpfs(tmp_path: Path, name: str, options: str):
    d = tmp_path / name
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip(f"cannot mount a tmpfs ({options}) on this machine (needs root)")
    yield d
    subprocess.run(["umount", str(d)], capture_output=True)


@pytest.fixture
def full_folder(tmp_path):
    """A folder on a 4 KB tmpfs: every write past it fails with ENOSPC. (/dev/full no longer serves:
    safetensors 0.8 writes a temporary file beside the target and renames it, so a save "to"
    /dev/full fills /dev's tmpfs instead and then replaces the device node with a regular file.)"""
    yield from _small_tmpfs(tmp_path, "full", "size=4k")


@pytest.fixture
def read_only(tmp_path):
    """A read-only filesystem (a tmpfs mounted ro): every write there is OSError 30, EROFS."""
    yield from _small_tmpfs(tmp_path, "ro", "ro,size=4k")


def test_an_out_that_cannot_be_written_is_one_line(src, whole, tmp_path, read_only):
    """An --out that is a file (FileExistsError) or on a read-only filesystem (EROFS): one line,
    exit 1, for convert and for validate (whose fix is not "another --out")."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    cases = {"a file": a_file, "read-only, new folder": read_only / "out", "read-only, the folder itself": read_only}
    bad = []
    for case, out in cases.items():
        res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--json"])
        line = res.output.strip()
        if not (res.exit_code == 1 and len(line.splitlines()) == 1 and line.startswith(f"error: {out}: cannot write")
                and "choose another --out" in line and "Traceback" not in res.output):
            bad.append(f"{case}: {res.output}")
    ro_pair = read_only.parent / "ro-pair"
    shutil.copytree(whole[0], ro_pair)
    subprocess.run(["mount", "--bind", "-o", "ro", str(ro_pair), str(ro_pair)], check=True)
    try:
        v = runner.invoke(app, ["validate", str(ro_pair), "--device", "cpu", "--json"])
    finally:
        subprocess.run(["umount", str(ro_pair)], capture_output=True)
    if not (v.exit_code == 1 and f"{ro_pair}: cannot write" in v.output and "--out" not in v.output
            and "Traceback" not in v.output):
        bad.append(f"validate on a read-only pair: {v.output}")
    record("bad --out", "a file; a read-only filesystem (new folder, the folder itself); validate on a read-only pair",
           4, not bad, "one line, exit 1")
    assert not bad, bad


def test_outputs_are_readable_per_the_umask(whole):
    """Every file of a convert output has the mode a plain open() gives (0644 under umask 022), as
    transformers' own saves do: a server running as another user must read the shards."""
    mask = os.umask(0o022)
    os.umask(mask)
    modes = {p.relative_to(whole[0]).as_posix(): p.stat().st_mode & 0o777 for p in whole[0].rglob("*") if p.is_file()}
    wrong = {f: oct(m) for f, m in modes.items() if m != 0o666 & ~mask}
    record("output files", f"mode {oct(0o666 & ~mask)} under umask {oct(mask)}, shards included", len(modes), not wrong)
    assert not wrong, wrong


def test_safetensors_enospc_is_recognised(full_folder):
    """A full filesystem answers every write with ENOSPC; safetensors reports it in its own exception type."""
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError) as e:
        save_file({"x": torch.zeros(1 << 16)}, str(full_folder / "x.safetensors"))
    assert disk_full(e.value)


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    """validation.json, the report, the index, the manifest: a write that fails half-way (here an
    unencodable character after 3000 good ones) leaves the previous content, never a torn file."""
    target = tmp_path / "validation.json"
    target.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(target, "new" * 1000 + "\ud800")
    assert target.read_text() == "old"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("QUANTKIT_TEST_SMALL_FS"), reason="set QUANTKIT_TEST_SMALL_FS to a small "
                    "filesystem's mount point (e.g. a 32 MB tmpfs) to fill a real disk mid-run")
def test_a_real_full_disk_mid_run_then_resume(tmp_path):
    fs = Path(os.environ["QUANTKIT_TEST_SMALL_FS"])
    out = fs / f"qk-{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["convert", "tiny:glm-5.2", "--method", "rtn", "--no-validate", "--json"]
    subprocess.run(_cli(*cmd, "--out", str(tmp_path / "whole")), check=True, capture_output=True)
    env = dict(os.environ, QUANTKIT_CONVERT_LAYER_DELAY="0.5")
    proc = subprocess.Popen(_cli(*cmd, "--out", str(out)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    state = out / ".quantkit-convert" / "state.json"
    while proc.poll() is None and not (state.is_file() and json.loads(state.read_text() or "{}").get("next_layer", -1) >= 2):
        time.sleep(0.05)
    filler = fs / f"filler-{os.getpid()}"
    try:
        with open(filler, "wb") as f:  # take every free byte
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
    except OSError:
        pass
    try:
        _, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        ok = proc.returncode == 1 and len(lines) == 1 and f"{out}: disk full" in lines[0] and "--resume" in lines[0]
        _never_looks_complete(out)
    finally:
        filler.unlink(missing_ok=True)
    done = subprocess.run(_cli(*cmd, "--out", str(out), "--resume"), capture_output=True, text=True)
    ok = ok and done.returncode == 0 and _same_pair(out, tmp_path / "whole")
    shutil.rmtree(out, ignore_errors=True)
    record("disk full (a real full filesystem mid-run)", "tiny GLM, filled after layer 2; --resume", 1, ok,
           "disk full" + err.strip().split("disk full", 1)[-1][:150])
    assert ok, err


def test_sigterm_says_resume_continues(src, whole, tmp_path):
    """SIGTERM (kill, a job scheduler's stop) mid-run: it ended the process without a word (exit -15);
    now it stops as Ctrl-C does, exit 143 and one line naming --resume, and the resume is byte-identical."""
    out = tmp_path / "o"
    proc = subprocess.run(_cli("convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--quiet"),
                          capture_output=True, text=True, env=_env(QUANTKIT_FAULT="layer:written#2:term"))
    lines = proc.stderr.strip().splitlines()
    ok = (proc.returncode == 143 and len(lines) == 1 and lines[0].startswith("terminated (SIGTERM):")
          and "--resume" in lines[0] and "Traceback" not in proc.stderr)
    _convert(src, out, resume=True)
    ok = ok and _same_pair(out, whole[0])
    record("SIGTERM", "mid-layer: exit 143, says --resume; resume byte-identical", 1, ok)
    assert ok, (proc.returncode, proc.stderr[-2000:])


def test_ctrl_c_says_resume_continues(src, whole, tmp_path, monkeypatch):
    out = tmp_path / "o"
    monkeypatch.setenv("QUANTKIT_FAULT", "layer:written#2:interrupt")
    faults.reset()
    res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--json"])
    monkeypatch.delenv("QUANTKIT_FAULT")
    ok = res.exit_code == 130 and "--resume" in res.output and "Traceback" not in res.output
    _convert(src, out, resume=True)
    ok = ok and _same_pair(out, whole[0])
    record("Ctrl-C", "mid-layer: exit 130, says --resume; resume byte-identical", 1, ok)
    assert ok, res.output


def test_disk_precheck_message_has_real_sizes(src, tmp_path):
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.planner.precision import decide
    from quantkit.recipe import default_recipe

    ck = Checkpoint(src)
    rec = default_recipe(str(src), ck.arch)
    decisions = {n: decide(st, rec, rec.group_size, None) for n, st in ck.tensors.items()}
    with pytest.raises(OutputError) as e:
        check_disk(ck, decisions, tmp_path, rec.group_size, free=1000)
    msg = str(e.value)
    ok = "0.0 GB" not in msg and " MB more, only 1000 bytes free" in msg
    record("disk precheck", "a small pair on a nearly full disk", 1, ok, msg.split(": ", 1)[1][:60])
    assert ok, msg


# ---- verify ------------------------------------------------------------------------------------------------
def _flip(path: Path, name: str, n: int = 1) -> None:
    """Flip n bytes in the middle of stored tensor `name` in place."""
    import struct

    with open(path, "r+b") as f:
        (hl,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hl))
        b, e = header[name]["data_offsets"]
        start = 8 + hl + b + max(0, (e - b) // 2 - n // 2)
        f.seek(start)
        data = bytearray(f.read(n))
        f.seek(start)
        f.write(bytes(x ^ 0xFF for x in data))


def _where(out: Path, which: str, name: str) -> Path:
    wm = json.loads((out / which / "model.safetensors.index.json").read_text())["weight_map"]
    return out / which / wm[name]


def _expert(out):
    return next(n for n in json.loads((out / "decode" / "model.safetensors.index.json").read_text())["weight_map"]
                if ".mlp.experts." in n and n.endswith("weight_packed"))


DAMAGE = [
    ("1 byte in a decode expert", lambda o: _flip(_where(o, "decode", _expert(o)), _expert(o)), lambda o: _expert(o)),
    ("256 bytes in a decode expert", lambda o: _flip(_where(o, "decode", _expert(o)), _expert(o), 256), lambda o: _expert(o)),
    ("1 byte in a prefill norm", lambda o: _flip(_where(o, "prefill", "model.layers.1.input_layernorm.weight"), "model.layers.1.input_layernorm.weight"),
     lambda o: "model.layers.1.input_layernorm.weight"),
    ("1 byte in decode's FP8 attention scale", lambda o: _flip(_where(o, "decode", "model.layers.0.self_attn.o_proj.weight_scale"), "model.layers.0.self_attn.o_proj.weight_scale"),
     lambda o: "model.layers.0.self_attn.o_proj.weight_scale"),
    ("a file removed", lambda o: (o / "decode" / "tokenizer.json").unlink(), lambda o: "decode/tokenizer.json: missing"),
    ("a file added", lambda o: (o / "prefill" / "extra.safetensors").write_bytes(b"x"), lambda o: "prefill/extra.safetensors: not listed"),
    ("manifest.json replaced", lambda o: (o / "prefill" / MANIFEST).write_text((o / "prefill" / MANIFEST).read_text() + " "),
     lambda o: "differs from the one convert-report.json states"),
    ("the report removed", lambda o: (o / REPORT).unlink(), lambda o: "convert-report.json: missing"),
]


@pytest.mark.parametrize("case,damage,named", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_verify_finds_damage_and_names_it(whole, tmp_path, case, damage, named):
    out = tmp_path / "o"
    shutil.copytree(whole[0], out)
    assert verify(out).ok
    damage(out)
    res = verify(out)
    cli = runner.invoke(app, ["verify", str(out)])
    ok = not res.ok and any(named(out) in p for p in res.problems) and cli.exit_code == 1 and named(out) in cli.output
    record("verify", case, 1, ok)
    assert ok, res.problems
    with pytest.raises(IntegrityError):
        res.raise_for_problems()


def test_verify_checks_the_pair_shares_its_bytes(whole, tmp_path):
    """A change to one side only, with that side's manifest and the report rewritten to match: the
    per-file checks pass, the twin check does not."""
    from quantkit.checkpoint.manifest import build_manifest, write_manifest

    out = tmp_path / "o"
    shutil.copytree(whole[0], out)
    name = "model.layers.1.input_layernorm.weight"
    _flip(_where(out, "decode", name), name)
    shared = json.loads((out / "decode" / MANIFEST).read_text())["shared"]
    report = json.loads((out / REPORT).read_text())
    report["outputs"]["decode"]["manifest_sha256"] = write_manifest(out / "decode", build_manifest(out / "decode", shared))
    (out / REPORT).write_text(json.dumps(report))
    res = verify(out)
    ok = not res.ok and any("differs from its twin" in p and name in p for p in res.problems)
    record("verify", "one side of a shared tensor changed, its manifest rewritten to match", 1, ok)
    assert ok, res.problems
    import quantkit as qk

    assert qk.verify(whole[0]).ok  # the library API
    good = runner.invoke(app, ["verify", str(whole[0]), "--json"])
    assert good.exit_code == 0 and json.loads(good.output)["ok"]
    assert json.loads(good.output)["shared_checked"] > 0
    # the count the card states ("N identical, M differ") is the one verify states first
    identical = json.loads((whole[0] / REPORT).read_text())["shared_tensors"]["identical"]
    assert json.loads(good.output)["shared_tensors"] == identical
    shown = runner.invoke(app, ["verify", str(whole[0])]).output
    assert f"{identical} (" in shown, shown


def test_validate_verifies_first_and_the_card_states_the_manifest_digest(whole, src, tmp_path):
    from quantkit.checkpoint.manifest import manifest_digest
    from quantkit.validation.pipeline import validate

    out = tmp_path / "o"
    shutil.copytree(whole[0], out)
    validate(out, reference=src, eval_data="synthetic:heldout", num_samples=2, seq_len=16, gen_tokens=2, device="cpu",
             progress=False, gates={})
    report = json.loads((out / REPORT).read_text())
    for which in ("prefill", "decode"):
        digest = manifest_digest(out / which)
        assert report["outputs"][which]["manifest_sha256"] == digest
        assert digest in (out / which / "README.md").read_text()
    assert verify(out).ok  # the cards validate writes are outside the manifest
    _flip(_where(out, "decode", _expert(out)), _expert(out))
    with pytest.raises(IntegrityError, match=_expert(out).replace(".", r"\.")):
        validate(out, reference=src, eval_data="synthetic:heldout", num_samples=2, seq_len=16, gen_tokens=2,
                 device="cpu", progress=False)


def _results(out: Path) -> dict[str, object]:
    """What each of validate's result files says: validation.json's verdict, each card's, the figure's bytes."""
    def card(which):
        text = (out / which / "README.md").read_text()
        return "passed" if "all gates passed" in text else "FAILED" if "gates FAILED" in text else "?"
    verdict = json.loads((out / "validation.json").read_text())["passed"]
    md = (out / "validation.md").read_text()
    return {"json": "passed" if verdict else "FAILED", "prefill": card("prefill"), "decode": card("decode"),
            "md": "FAILED" if "FAIL" in md else "passed", "png": (out / "validation.png").read_bytes()}


def test_results_and_cards_never_disagree_after_a_crash(whole, src, tmp_path, monkeypatch):
    """A passed folder re-validated with a stricter gate, crashed between the writes: either every
    file is the old run's, or (crashed mid-rename) the next reader completes the new run's, all of
    them; never a card saying "all gates passed" beside a validation.json that failed."""
    from quantkit.validation.pipeline import validate

    out = tmp_path / "o"
    shutil.copytree(whole[0], out)
    kw = dict(reference=src, eval_data="synthetic:heldout", num_samples=1, seq_len=16, gen_tokens=0, device="cpu",
              progress=False)
    validate(out, gates={"kl_max": 100.0}, **kw)
    old = _results(out)
    assert {old[k] for k in ("json", "prefill", "decode", "md")} == {"passed"}
    rows = []
    for point in ("validate:staged", "renames:marked", "renames:renamed#1", "renames:renamed#3"):
        monkeypatch.setenv("QUANTKIT_FAULT", f"{point}:raise")
        faults.reset()
        with pytest.raises(faults.InjectedFault):
            validate(out, gates={"kl_max": 0.0}, **kw)  # fails: KL is never below 0
        monkeypatch.delenv("QUANTKIT_FAULT")
        verify(out)  # the next reader: completes an interrupted set of renames
        now = _results(out)
        verdicts = {now[k] for k in ("json", "prefill", "decode", "md")}
        whole_old = now == old
        whole_new = verdicts == {"FAILED"} and now["png"] != old["png"]
        rows.append((point, whole_old, whole_new, not (out / ".validation.pending.json").exists()))
        if whole_new:  # back to a passed folder for the next crash point
            validate(out, gates={"kl_max": 100.0}, **kw)
            old = _results(out)
    ok = [r[0] for r in rows if (r[1] or r[2]) and r[3]] == [r[0] for r in rows] and rows[0][1] and rows[-1][2]
    record("cards and results agree", "re-validate with a stricter gate, crash before the marker, after it, between "
           "renames; then verify", len(rows), ok, "all old or all new")
    assert ok, rows


# ---- a malicious Hub ----------------------------------------------------------------------------------------
HUB_REPO = "evil-org/tiny"


@pytest.fixture
def evil(tmp_path, monkeypatch, src):
    """A loopback Hub serving the small source; tests make it lie. HF_HOME and the quantkit cache are private."""
    from hub_server import serve_folder

    server = serve_folder(monkeypatch, tmp_path, HUB_REPO, src)
    yield server
    server.stop()


def _everything(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _lie(field: str, value):
    def hook(body):
        if field == "sha":
            body["sha"] = value
        else:
            s = next(s for s in body["siblings"] if s["rfilename"] == SHARD)
            if value is None:
                s.pop(field, None)
            else:
                s[field] = value
        return body
    return hook


def _rename(name: str):
    def hook(body):
        body["siblings"].append({"rfilename": name, "size": 2, "blobId": "0" * 40})
        return body
    return hook


def _no_checksum(body):
    s = next(s for s in body["siblings"] if s["rfilename"] == SHARD)
    s.pop("lfs", None)
    s.pop("blobId", None)
    return body


EVIL = [
    ("commit sha '../../../../tmp/x'", _lie("sha", "../../../../tmp/x"), r"not a 40-hex git sha"),
    ("commit sha of 40 non-hex chars", _lie("sha", "z" * 40), r"not a 40-hex git sha"),
    ("file name '../escape.json'", _rename("../escape.json"), r"unsafe file name"),
    ("file name with a NUL byte", _rename("a\x00b.json"), r"unsafe file name"),
    ("file name of 300 bytes", _rename("x" * 300 + ".json"), r"unsafe file name"),
    ("absolute file name", _rename("/etc/passwd"), r"unsafe file name"),
    ("file without sha256 or blob id", _no_checksum, r"no checksum .*--allow-unverified"),
    ("malformed LFS sha256", lambda b: _lie("lfs", {"sha256": "zz", "size": 1, "pointerSize": 1})(b), r"malformed sha256"),
]


@pytest.mark.parametrize("case,hook,message", EVIL, ids=[e[0] for e in EVIL])
def test_a_malicious_hub_cannot_steer_the_client(evil, tmp_path, case, hook, message):
    import re

    evil.listing_hook = hook
    before = _everything(tmp_path)
    results = []
    for args in (["inspect", f"hf://{HUB_REPO}", "--json"],
                 ["convert", f"hf://{HUB_REPO}", "--out", str(tmp_path / "out"), "--method", "rtn", "--no-validate", "--json"],
                 ["pull", HUB_REPO, "--out", str(tmp_path / "pulled"), "--json"]):
        res = runner.invoke(app, args)
        lines = res.output.strip().splitlines()
        results.append(res.exit_code == 1 and len(lines) == 1 and re.search(message, res.output) is not None
                       and "Traceback" not in res.output)
    created = _everything(tmp_path) - before
    # nothing outside the private caches, and no snapshot folder named by the lie
    escaped = [p for p in created if not p.startswith(("qk", "hf_home", "out"))]
    snapshots = [p for p in created if "/snapshots/" in p]
    ok = all(results) and not escaped and not snapshots and not (tmp_path / "out" / "prefill").exists()
    record("malicious Hub", f"{case} (inspect, convert, pull)", 3, ok)
    assert ok, (results, escaped, snapshots)


def test_a_file_without_checksum_needs_allow_unverified_and_is_recorded(evil, tmp_path):
    evil.listing_hook = _no_checksum
    res = _convert(f"hf://{HUB_REPO}", tmp_path / "out", allow_unverified=True)
    ok = res.report["source"]["unverified_files"] == [SHARD]
    from quantkit.hub.download import pull

    pulled = pull(HUB_REPO, tmp_path / "pulled", allow_unverified=True, progress=False)
    ok = ok and pulled.unverified == [SHARD]
    record("malicious Hub", "no checksum, --allow-unverified: accepted and listed in the report", 1, ok)
    assert ok


def test_a_truncated_body_is_refused(evil, tmp_path):
    from quantkit.hub.download import HubError, pull

    evil.truncate(SHARD, 100)
    with pytest.raises(HubError) as e:
        pull(HUB_REPO, tmp_path / "pulled", progress=False)
    ok = SHARD in str(e.value) and not (tmp_path / "pulled" / SHARD).exists() and "\n" not in str(e.value)
    evil.truncate(SHARD, 0)
    evil.inject(SHARD, "drop", after=1000)  # the connection dies mid-body: retried, then verified
    pulled = pull(HUB_REPO, tmp_path / "pulled2", progress=False)
    ok = ok and (tmp_path / "pulled2" / SHARD).read_bytes() == evil.content[SHARD] and pulled.unverified == []
    record("malicious Hub", "a short body in a complete response; a connection dropped mid-body", 2, ok, str(e.value)[:80])
    assert ok, str(e.value)


# ---- the output folder never loses work, never lies -------------------------------------------------------
def _interrupted(src, out, monkeypatch, point: str = "layer:written#2", **kw) -> None:
    monkeypatch.setenv("QUANTKIT_FAULT", f"{point}:raise")
    with pytest.raises(faults.InjectedFault):
        _convert(src, out, **kw)
    monkeypatch.delenv("QUANTKIT_FAULT")


def _kept(out: Path) -> dict[str, bytes]:
    """The folder's files but the lock (a dead owner's is taken over, and removed on release)."""
    return {k: v for k, v in _files(out).items() if k != ".quantkit.lock"}


def _settled(out: Path) -> dict[str, bytes]:
    """The folder's files once the interrupted run's background shard saves have finished (an
    in-process crash does not wait for them)."""
    last = _kept(out)
    while True:
        time.sleep(0.3)
        now = _kept(out)
        if now == last:
            return now
        last = now


def _one_error_line(res) -> str:
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in res.output, res.output
    return lines[0]


def test_a_rerun_without_resume_never_discards_an_interrupted_run(src, whole, tmp_path, monkeypatch):
    out = tmp_path / "o"
    _interrupted(src, out, monkeypatch)
    before = _settled(out)
    res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate"])
    line = _one_error_line(res)
    kept = _kept(out) == before
    ok = "--resume" in line and "--restart" in line and "interrupted" in line and kept
    assert ok, line
    both = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--resume", "--restart"])
    assert "--resume" in _one_error_line(both) and _kept(out) == before
    again = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--restart"])
    ok = ok and again.exit_code == 0 and _same_pair(out, whole[0])
    record("rerun on an interrupted output", "without --resume: refused naming --resume and --restart, nothing "
           "touched; --restart starts over (byte-identical)", 2, ok)
    assert ok, again.output


@pytest.mark.parametrize("finished", [False, True], ids=["interrupted", "finished"])
def test_resume_with_other_options_is_refused_naming_the_first_difference(src, whole, tmp_path, monkeypatch, finished):
    out = tmp_path / "o"
    if finished:
        shutil.copytree(whole[0], out)
    else:
        _interrupted(src, out, monkeypatch)
    before = _settled(out)
    res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "gptq", "--calib", "synthetic:train",
                              "--no-validate", "--resume"])
    line = _one_error_line(res)
    fix = "another --out" if finished else "--restart"
    ok = "method" in line and "rtn" in line and "gptq" in line and fix in line and _kept(out) == before
    grp = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--group-size", "64",
                              "--no-validate", "--resume"])
    ok = ok and "group_size" in _one_error_line(grp) and _kept(out) == before
    same = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--resume"])
    ok = ok and same.exit_code == 0 and _same_pair(out, whole[0])
    record("--resume with other options", f"{'a finished' if finished else 'an interrupted'} run, --method and "
           "--group-size changed: refused naming the field and both values; the same options resume", 3, ok)
    assert ok, (line, grp.output, same.output)


def test_stale_validation_files_and_another_runs_report_are_never_left_beside_a_new_pair(src, whole, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(whole[0], out)
    for which in ("prefill", "decode"):
        shutil.rmtree(out / which)  # an older pair removed by hand, its report and results left
    results = {f"validation{x}": f"PASSED {x}" for x in (".json", ".md", ".png", "-experts.png")}
    for name, text in results.items():
        (out / name).write_text(text)
    (out / ".quantkit.lock").unlink(missing_ok=True)  # a dead owner's, left by an earlier test
    report = (out / REPORT).read_text()
    res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate"])
    line = _one_error_line(res)
    ok = REPORT in line and "--restart" in line and (out / REPORT).read_text() == report
    (out / REPORT).unlink()  # results of a pair no longer there, no report: cleared, and said which
    res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate"])
    ok = ok and res.exit_code == 0 and all(n in res.output for n in results) and "removed" in res.output
    ok = ok and not any((out / n).exists() for n in results) and _same_pair(out, whole[0])
    record("stale files in --out", "another run's convert-report.json: refused; validation.json/.md/.png and "
           "validation-experts.png of a pair "
           "no longer there: removed and named", 2, ok)
    assert ok, res.output


def test_resume_with_nothing_to_resume_still_clears_stale_results(src, whole, tmp_path):
    """--resume on a folder holding only an earlier pair's validation.json/.md/.png (no state, no
    report) converts from the start; the old PASSED results must not stay beside the new pair."""
    out = tmp_path / "o"
    out.mkdir()
    results = {f"validation{x}": f"PASSED {x}" for x in (".json", ".md", ".png", "-experts.png")}
    for name, text in results.items():
        (out / name).write_text(text)
    res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--resume"])
    ok = res.exit_code == 0 and all(n in res.output for n in results) and "removed" in res.output
    ok = ok and not any((out / n).exists() for n in results) and _same_pair(out, whole[0])
    record("stale files in --out", "--resume with nothing to resume: an earlier pair's validation files removed "
           "and named", 1, ok)
    assert ok, res.output


@pytest.mark.parametrize("removed", [("prefill", "decode"), ("decode",)], ids=["both", "decode"])
def test_resume_on_a_report_whose_pair_is_gone_is_refused(src, whole, tmp_path, removed):
    """A finished run's convert-report.json with prefill/ or decode/ removed: --resume returned the
    report's result (exit 0, the table printed) for a pair that was not there, and verify said to
    continue it with --resume."""
    out = tmp_path / "o"
    shutil.copytree(whole[0], out)
    (out / ".quantkit.lock").unlink(missing_ok=True)  # a dead owner's, left by an earlier test
    for which in removed:
        shutil.rmtree(out / which)
    before = _files(out)
    res = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--resume"])
    line = _one_error_line(res)
    fix = "--restart" if len(removed) == 2 else "remove prefill/"
    ok = REPORT in line and all(f"{w}/" in line for w in removed) and fix in line and _files(out) == before
    checked = verify(out)
    ok = ok and not checked.ok and all("removed after the convert finished" in p for p in checked.problems
                                       if p.endswith(("prefill", "decode")) or "missing" in p.split(";")[0])
    ok = ok and not any("--resume" in p for p in checked.problems)
    if len(removed) == 2:  # the fix it names works
        again = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate", "--restart"])
        ok = ok and again.exit_code == 0 and _same_pair(out, whole[0])
    record("stale files in --out", f"--resume on a finished run's report, {' and '.join(removed)} removed: refused, "
           "naming what is gone and the fix; verify says removed, not 'continue with --resume'", 1, ok)
    assert ok, (line, checked.problems)


def test_the_start_up_disk_check_counts_two_copies_of_the_resume_state(src, tmp_path, monkeypatch):
    """Free space for the pair and one copy of the hidden states, not two: refused before layer 0
    (a run that passed the check with one copy ran out of disk at its first save)."""
    from collections import namedtuple

    from quantkit.conversion import outputs
    from quantkit.planner.cost import plan_convert_for

    opts = dict(method="gptq", num_samples=64, seq_len=16)
    c = plan_convert_for(str(src), gpu="cpu", **opts)
    pair = c.disk["prefill"] + c.disk["decode"]  # what the start-up check predicts for the pair
    one = c.disk["resume_state"] // 2
    assert one > 0 and c.store.backing == "memory"
    usage = namedtuple("usage", "total used free")
    for free, fits in ((pair + one * 3 // 2, False), (pair + one * 5 // 2, True)):
        out = tmp_path / f"o{free}"
        monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path, f=free: usage(10 * f, 9 * f, f))
        if fits:
            assert _convert(src, out, calib="synthetic:train", **opts).report["method"] == "gptq"
            continue
        with pytest.raises(OutputError, match=r"needs about .* more") as e:
            _convert(src, out, calib="synthetic:train", **opts)
        assert not (out / "prefill.partial").exists() or not any((out / "prefill.partial").glob("part-*")), e.value
    record("disk precheck", "free space for the pair and one copy of the resume state: refused at the start; "
           "for two copies: converts", 2, True)


def test_the_disk_precheck_counts_two_layers_of_resume_state(src, tmp_path):
    """At a save the next layer's hidden states are written beside the last saved ones (the old file
    is removed after state.json names the new one): the peak is two copies."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.planner.cost import plan_convert_for

    ck = Checkpoint(src)
    c = plan_convert_for(str(src), gpu="cpu", method="gptq", num_samples=64, seq_len=16)
    one = c.tokens * ck.arch.hidden_size * (4 if "32" in str(c.store.dtype) else 2)
    ok = c.store.backing == "memory" and c.disk["resume_state"] == 2 * one
    glm = plan_convert_for("glm-5.2", gpu="h200", max_host_memory="200GB")
    ok = ok and glm.disk["resume_state"] == 2 * glm.tokens * 6144 * 4 and "resume state 51.54" in glm.summary()
    record("disk precheck", "the resume state's peak (two layers' hidden states) counted; GLM 5.2's figure 51.5 GB",
           1, ok)
    assert ok, (c.disk, glm.disk)


def test_a_write_error_other_than_a_full_disk_is_one_line(src, tmp_path):
    """A file size limit (`ulimit -f`): the write fails with EFBIG (Python ignores SIGXFSZ)."""
    import resource

    out = tmp_path / "o"
    limit = 200_000

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(_cli("convert", str(src), "--out", str(out), "--method", "gptq", "--calib", "synthetic:train",
                               "--num-samples", "4", "--seq-len", "16", "--no-validate", "--quiet"),
                          capture_output=True, text=True, preexec_fn=small_files, env=_env())
    lines = proc.stderr.strip().splitlines()
    import re

    named = re.search(r"\((\S+\.tmp)\)", lines[0]) if lines else None  # the file whose write failed
    ok = (proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr and str(out) in lines[0]
          and "File too large" in lines[0] and "--resume" in lines[0] and named is not None
          and Path(named.group(1)).is_relative_to(out))
    record("write error (not a full disk)", "a file size limit (ulimit -f, EFBIG) mid-run", 1, ok,
           "one line naming the file, the error and --resume")
    assert ok, proc.stderr[-3000:]
    # the shard writer and the resume state's writer each name their file (safetensors' error and
    # write()'s name none): a part over 60 KB; the hidden states of 256 x 16 tokens (2 MB) over 1 MB
    for limit, samples, file in ((60_000, 4, r"prefill\.partial/part-\d+\.safetensors\.tmp"),
                                 (1_000_000, 256, r"\.quantkit-convert/hidden\.\S+\.bin\.tmp")):
        o = tmp_path / f"o{limit}"
        proc = subprocess.run(_cli("convert", str(src), "--out", str(o), "--method", "gptq", "--calib", "synthetic:train",
                                   "--num-samples", str(samples), "--seq-len", "16", "--no-validate", "--quiet"),
                              capture_output=True, text=True, env=_env(),
                              preexec_fn=lambda n=limit: resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and re.search(rf"\({re.escape(str(o))}/{file}\)", lines[0]), proc.stderr


def test_probe_against_a_server_that_accepts_and_never_answers_is_one_line_soon(whole, tmp_path):
    import socket
    import threading

    held: list[socket.socket] = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def accept_and_hold():
        while True:
            try:
                held.append(srv.accept()[0])  # never read, never answered
            except OSError:
                return

    threading.Thread(target=accept_and_hold, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}/v1"
    t0 = time.time()
    res = runner.invoke(app, ["probe", url, "--pair", str(whole[0]), "--timeout", "2", "--device", "cpu"])
    elapsed = time.time() - t0
    srv.close()
    for c in held:
        c.close()
    lines = res.output.strip().splitlines()
    ok = res.exit_code == 1 and len(lines) == 1 and "no answer within 2 s" in lines[0] and elapsed < 8
    ok = ok and "raise --timeout" in lines[0]
    record("silent server", "probe against a server that accepts and never answers (--timeout 2)", 1, ok,
           f"one line after {elapsed:.0f} s")
    assert ok, (elapsed, res.output)


def test_a_silent_model_listing_does_not_advise_a_longer_timeout(monkeypatch):
    """GET /models waits at most MODELS_TIMEOUT whatever --timeout is: its message must not say to
    raise --timeout (a user who did would wait the same and read the same advice)."""
    import socket

    from quantkit.probe import client
    from quantkit.probe.client import Endpoint, ProbeError

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # accepted by the kernel, never answered
    monkeypatch.setattr(client, "MODELS_TIMEOUT", 0.5)
    try:
        with pytest.raises(ProbeError) as e:
            Endpoint(f"http://127.0.0.1:{srv.getsockname()[1]}/v1", timeout=60).models()
    finally:
        srv.close()
    msg = str(e.value)
    ok = "no answer within 0.5 s" in msg and "raise --timeout" not in msg and "finished starting" in msg
    record("silent server", "probe --timeout 60 against a server that never lists its models", 1, ok,
           "one line after the listing's 10 s, without advising a longer --timeout")
    assert ok, msg
