"""gptq.low_dampening and its probe (quantkit.quant.experts, "Probe"; quantkit.conversion.stages.Calibration.probe):
the probe windows are judged on, never fitted on or measured into the KV scales, and what the guard
stores at the low dampening is GPTQ at that dampening, checked against a separate convert."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from oracle import read_raw

from quantkit.conversion.pipeline import convert
from quantkit.quant.experts import LOW
from quantkit.quant.methods import METHODS
from quantkit.recipe import load_recipe

N, T = 16, 32  # calibration windows x tokens: 2 probe windows


def _recipe(folder: Path, name: str, **gptq) -> Path:
    rec = load_recipe("tiny-glm-5.2").to_dict()
    rec["gptq"].update({"actorder": True, "observer": "hessian", "dampening": 0.1, **gptq})
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """tiny GLM converted three ways on the same calibration: the recipe dampening (0.1), with
    gptq.low_dampening 0.01 and its probe, and at dampening 0.01 alone."""
    root = tmp_path_factory.mktemp("probe")
    recipes = {"base": _recipe(root, "base"), "low": _recipe(root, "low", low_dampening=0.01),
               "d001": _recipe(root, "d001", dampening=0.01)}
    return {k: convert("tiny:glm-5.2", root / k, recipe=r, num_samples=N, seq_len=T, validate=False, progress=False)
            for k, r in recipes.items()}


def _first_moe_layer(report: dict) -> int:
    return min(e["layer"] for e in report["experts"])


def _expert(raw: dict, layer: int, e: int, proj: str) -> dict:
    pre = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
    return {k: v for k, v in raw.items() if k.startswith(pre)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and len(a) > 0 and all(a[k].equal(b[k]) for k in a)


def test_the_report_says_what_the_probe_judged(runs):
    r = runs["low"].report
    assert r["calibration"]["probe"]["windows"] == 2 and r["calibration"]["probe"]["low_dampening"] == 0.01
    assert "probe" not in runs["base"].report["calibration"]
    mtp = {e["layer"] for e in r["experts"]} - {e["layer"] for e in r["experts"] if e["probe"]}
    assert mtp == set(range(5, 5 + 1)), "only the MTP layer goes without a probe (docs/recipes.md)"
    s = r["experts_summary"]
    judged = [e for e in r["experts"] if e["probe"]]
    assert s["probe_judged"] == len(judged) > 0
    assert s["probe_admitted_low"] == sum(e["err_probe_low"] <= e["err_probe_rtn"] for e in judged)
    assert 0 < s["low_dampening"] <= s["probe_admitted_low"] <= s["probe_judged"]
    for e in judged:  # never stored at the low dampening unless the probe admitted it
        assert e["guard"] != LOW or e["err_probe_low"] <= e["err_probe_rtn"]
        assert "probe tokens" in e["why"]
    from quantkit.validation.card import _guard_line

    assert f"probe: {s['probe_judged']} judged at gptq.low_dampening" in _guard_line(r, METHODS["gptq"])


def test_probe_tokens_never_reach_the_fit_or_the_kv_scales(runs):
    """In the first MoE layer (before any expert choice can change h): every expert the guard kept at
    gptq.dampening has the base run's bytes, and the layer's other tensors too (its KV scales were
    measured on the calibration tokens alone)."""
    low, base = (read_raw(runs[k].decode) for k in ("low", "base"))
    first = _first_moe_layer(runs["low"].report)
    kept = [e["expert"] for e in runs["low"].report["experts"]
            if e["layer"] == first and e["guard"] is None and e["method"] == "gptq"]
    assert kept
    for e in kept:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert _same(_expert(low, first, e, proj), _expert(base, first, e, proj)), (e, proj)
    a, b = (read_raw(runs[k].prefill) for k in ("low", "base"))
    shared = [n for n in a if n.startswith(f"model.layers.{first}.") and ".mlp.experts." not in n]
    assert any(n.endswith("k_scale") for n in shared) and all(a[n].equal(b[n]) for n in shared)
    # the maxima themselves, up to the first MoE layer's attention (the probe's exceed the calibration's
    # there, so a probe measured into the KV cache would show)
    kv = {k: [lay["kv_cache"] for lay in runs[k].report["layers"][: first + 1]] for k in ("low", "base")}
    assert kv["low"] == kv["base"]


def test_what_is_stored_at_the_low_dampening_is_gptq_at_it(runs):
    """gate/up of an expert stored at gptq.low_dampening are the bytes of a convert at dampening 0.01
    (down differs by design: its Hessian comes from the gate/up at gptq.dampening)."""
    low, d001 = (read_raw(runs[k].decode) for k in ("low", "d001"))
    first = _first_moe_layer(runs["low"].report)
    ref = {e["expert"]: e for e in runs["d001"].report["experts"] if e["layer"] == first}
    stored_low = [e["expert"] for e in runs["low"].report["experts"]
                  if e["layer"] == first and e["guard"] == LOW and ref[e["expert"]]["guard"] is None]
    assert stored_low
    for e in stored_low:
        for proj in ("gate_proj", "up_proj"):
            assert _same(_expert(low, first, e, proj), _expert(d001, first, e, proj)), (e, proj)


def test_low_dampening_must_be_below_the_dampening(tmp_path):
    from quantkit.errors import ConfigError

    path = _recipe(tmp_path, "bad", low_dampening=0.2)
    with pytest.raises(ConfigError, match="gptq.low_dampening: 0.2 must be below gptq.dampening 0.1"):
        load_recipe(path)
