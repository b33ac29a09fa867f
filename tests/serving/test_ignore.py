"""A module stored BF16 that the engines would build with the quantization config is a refusal.

GLM-5.x checkpoints that keep the MTP layer BF16 without listing it in the quantization config's
ignore list crash at load: the engines build the MTP layer's Linears with the FP8 / INT4 scheme and
its BF16 weights do not fit. Made here from a tiny GLM pair by rewriting the MTP layer (index 5)
BF16 in place, config untouched; refused by both engines' own code and by the offline rules (rule
5), with the ignore entries that fix it, which the engines then accept.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.serving.checks import check_serving_many

MTP = 5  # the tiny GLM's MTP layer: num_hidden_layers 5, one nextn layer
FIX = [r"re:(^|.*\.)layers\.5\..*", r"re:(^|.*\.)decoder\..*"]


def mtp_stored_bf16(src: Path, dst: Path, layer: int = MTP) -> Path:
    """A copy of a checkpoint whose layer `layer` is stored BF16 (FP8 weights cast, INT4 experts as
    BF16 of their true shape, scales dropped), config.json as it was."""
    shutil.copytree(src, dst)
    (dst / "manifest.json").unlink(missing_ok=True)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    wm, pre = index["weight_map"], f"model.layers.{layer}."
    for f in sorted({f for n, f in wm.items() if n.startswith(pre)}):
        t = load_file(dst / f)
        out = {n: v for n, v in t.items() if not n.startswith(pre)}
        for n, v in t.items():
            mod, _, suffix = n.rpartition(".")
            if not n.startswith(pre) or suffix in ("weight_scale", "weight_scale_inv", "weight_shape"):
                continue
            if suffix == "weight_packed":
                out[f"{mod}.weight"] = torch.zeros(*t[f"{mod}.weight_shape"].tolist(), dtype=torch.bfloat16)
            else:
                out[n] = v.to(torch.bfloat16) if v.dtype == torch.float8_e4m3fn else v
        save_file(out, dst / f, metadata={"format": "pt"})
        wm = {n: ff for n, ff in wm.items() if ff != f} | {n: f for n in out}
    index["weight_map"] = wm
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from quantkit.conversion.pipeline import convert

    root = tmp_path_factory.mktemp("ignore")
    out = convert("tiny:glm-5.2", root / "glm", method="rtn", validate=False, progress=False)
    made = {"decode": mtp_stored_bf16(out.decode, root / "decode-mtp-bf16"),
            "prefill": mtp_stored_bf16(out.prefill, root / "prefill-mtp-bf16")}
    fixed = mtp_stored_bf16(out.decode, root / "decode-mtp-bf16-ignored")
    cfg = json.loads((fixed / "config.json").read_text())
    cfg["quantization_config"]["ignore"] += FIX
    (fixed / "config.json").write_text(json.dumps(cfg))
    made["fixed"] = fixed
    return made


def _assert_refused(rep, phase: str) -> None:
    key = "ignore" if phase == "decode" else "modules_to_not_convert"
    for e in rep.engines:
        assert not e.loads, (e.engine, phase)
        mtp = "model.decoder." if e.engine == "sglang" else f"model.layers.{MTP}."
        first = next(p for p in e.problems if p.startswith(mtp))
        assert "stored BF16" in first and f"quantization_config.{key} does not list it" in first, first
        assert FIX[0] in first and FIX[1] in first
        assert not [p for p in e.problems if not p.startswith(mtp)], e.problems  # nothing else is wrong


def test_engines_refuse_an_mtp_layer_stored_bf16_but_not_ignored(folders):
    from quantkit.serving.engines import EngineUnavailable, engine_source

    try:
        engine_source("vllm"), engine_source("sglang")
    except EngineUnavailable as e:
        pytest.skip(f"engine code unavailable: {e}")
    dec, pre, fixed = check_serving_many([folders["decode"], folders["prefill"], folders["fixed"]])
    assert all(e.source == "engine code" for e in dec.engines)
    _assert_refused(dec, "decode")
    _assert_refused(pre, "prefill")
    assert all(e.loads for e in fixed.engines), [e.problems for e in fixed.engines]  # the suggested fix works


def test_offline_rules_refuse_it_too(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "empty"))
    dec, pre, fixed = check_serving_many([folders["decode"], folders["prefill"], folders["fixed"]], download=False)
    assert all(e.source == "rules" for e in dec.engines)
    _assert_refused(dec, "decode")
    _assert_refused(pre, "prefill")
    assert all(e.loads for e in fixed.engines)


def test_cli_exits_2(folders):
    import os

    env = dict(os.environ, COLUMNS="200")  # the engines' code where cached, else the rules: both refuse
    proc = subprocess.run([sys.executable, "-m", "quantkit", "check-serving", str(folders["decode"])],
                          capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 2
    assert "MTP layer" in proc.stderr and "ignore does not list it" in " ".join(proc.stderr.split())
