"""validate's per-expert map (validation-experts.png): the arrays it plots, checked against the convert
report they come from and against an expert made to starve, not against pixels."""

from __future__ import annotations

import json
import math

from conftest import starve_expert

from quantkit.conversion.pipeline import convert
from quantkit.validation.expertmap import expert_map, input_width, plot_expert_map
from quantkit.validation.pipeline import validate


def _e(layer, expert, tokens, err, err_rtn, method="gptq", fallback=None, guard=None, decision="calibrated"):
    return {"layer": layer, "expert": expert, "tokens": tokens, "method": method, "fallback": fallback,
            "guard": guard, "err": err, "err_rtn": err_rtn, "decision": decision}


def test_map_places_each_expert_and_shows_the_stored_weights_error():
    report = {"experts": [
        _e(1, 0, 900, 0.1, 0.5),
        _e(1, 1, 40, 0.2, 0.1, guard="rtn", decision="fallback"),  # the guard kept RTN: RTN's error is stored
        _e(3, 1, 5, 0.3, 0.6, fallback="all_tokens", decision="fallback"),
        _e(3, 0, 700, None, None, method="rtn", decision="data-free"),
    ]}
    m = expert_map(report, width=64)
    assert m["layers"] == [1, 3] and m["experts"] == 2
    assert m["error"][0] == [0.1, 0.1] and m["error"][1][1] == 0.3 and math.isnan(m["error"][1][0])
    assert m["vs_rtn"][0] == [0.2, 1.0] and m["vs_rtn"][1][1] == 0.5
    assert sorted(m["fallback"]) == [(0, 1), (1, 1)]
    assert sorted(m["few_tokens"]) == [(0, 1), (1, 1)]  # 40 and 5 routed tokens < width 64
    assert expert_map(report)["few_tokens"] == []  # no width known: nothing claimed


def test_reused_experts_are_counted_not_plotted(tmp_path):
    report = {"experts": [_e(1, e, 0, None, None, method="reused", decision="reused") for e in range(4)]}
    m = plot_expert_map(report, tmp_path / "m.png")
    assert m["reused"] == 4 and all(math.isnan(v) for v in m["error"][0])
    assert (tmp_path / "m.png").stat().st_size > 5_000
    assert input_width({"text_config": {"hidden_size": 7168}}) == 7168 and input_width({}) is None


def test_validate_writes_the_map_that_marks_a_starved_expert(tmp_path, tiny_glm):
    starve_expert(tiny_glm, tmp_path / "src", layer=2, expert=3)
    out = convert(tmp_path / "src", tmp_path / "out", recipe="tiny-glm-5.2", validate=False, progress=False).out
    validate(out, reference=tmp_path / "src", device="cpu", num_samples=2, seq_len=32, gen_tokens=2, progress=False)
    assert (out / "validation-experts.png").stat().st_size > 10_000
    for which in ("prefill", "decode"):
        assert "validation-experts.png" in (out / which / "README.md").read_text()

    report = json.loads((out / "convert-report.json").read_text())
    width = input_width(json.loads((out / "decode" / "config.json").read_text()))
    m = expert_map(report, width)
    moe = sorted({e["layer"] for e in report["experts"]})
    assert m["layers"] == moe and m["experts"] == 16
    assert m["labels"][-1] == f"{moe[-1]} (MTP)" and report["mtp"]["calibrated_layers"] == [moe[-1]]
    row = moe.index(2)
    assert (row, 3) in m["fallback"] and (row, 3) in m["few_tokens"]  # the starved one, marked twice
    starved = next(e for e in report["experts"] if (e["layer"], e["expert"]) == (2, 3))
    assert starved["tokens"] == 0
    for e in report["experts"]:  # every cell is the report's number for that expert
        v = m["error"][moe.index(e["layer"])][e["expert"]]
        want = e["err_rtn"] if e.get("guard") == "rtn" else e["err"]
        assert (math.isnan(v) and want is None) or v == want
