"""quantkit.validation.card: the guard line counts the experts under the thin-calibration prior."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from quantkit.conversion.report import decision
from quantkit.quant.methods import METHODS
from quantkit.validation.card import _decisions_line, _guard_line


def test_guard_line_counts_experts_under_the_width_prior():
    e = {"total": 8, "reused": 0, "gptq": 8, "guarded": 8, "guard_kept_rtn": 1, "width_prior": 6}
    line = _guard_line({"experts_summary": e}, METHODS["gptq"])
    assert "8 judged against RTN" in line and "6 under the thin-calibration prior" in line
    assert "thin-calibration" not in _guard_line({"experts_summary": e | {"width_prior": 0}}, METHODS["gptq"])


def test_each_expert_is_calibrated_or_a_fallback_with_why_and_the_card_counts_them():
    base = {"tokens": 40, "heldout": 5, "fallback": None, "guard": None, "err": 0.1, "err_rtn": 0.3}
    kept = decision(base | {"method": "gptq"})
    assert kept == ("calibrated", "output error 0.1 < RTN's 0.3 on 5 held-out tokens")
    assert decision(base | {"method": "rtn", "guard": "rtn", "err": 0.4})[0] == "fallback"
    assert decision(base | {"method": "rtn", "fallback": "rtn", "tokens": 3, "heldout": 0})[1].startswith("starved: 3")
    assert decision(base | {"method": "rtn", "heldout": 0, "err": None, "err_rtn": None}) == ("data-free", "method rtn")
    assert decision(base | {"method": "reused"})[0] == "reused"
    # a starved expert fitted on every token of the layer is a fallback, judged by the guard like any other
    starved = base | {"method": "gptq", "fallback": "all_tokens", "tokens": 7}
    assert decision(starved) == ("fallback", "starved: 7 routed calibration tokens, below gptq.min_tokens; fitted on "
                                             "every calibration token of the layer; output error 0.1 < RTN's 0.3 on 5 "
                                             "held-out tokens")
    kept_rtn = decision(starved | {"method": "rtn", "guard": "rtn", "err": 0.4})[1]
    assert kept_rtn.startswith("starved: 7") and "guard: RTN's output error 0.3 <= the calibrated 0.4" in kept_rtn
    assert _decisions_line({"calibrated": 14, "fallback": 2}).endswith("14 calibrated, 2 fallback")


# ---- a validated tiny pair: self-contained cards, tables that render, rows identical by construction ----


@pytest.fixture(scope="module")
def validated(tmp_path_factory, tiny_glm):
    """The tiny GLM pair (an FP8 source: prefill holds its bytes) converted with RTN and validated small."""
    from quantkit.conversion.pipeline import convert
    from quantkit.validation.pipeline import validate

    out = convert("tiny:glm-5.2", tmp_path_factory.mktemp("card") / "glm", method="rtn", validate=False, progress=False).out
    res = validate(out, num_samples=1, seq_len=8, gen_tokens=2, device="cpu", progress=False)  # MTP and long-context rows
    assert res.data["long_context"] and res.data["mtp"]
    return out, res


def _table_line_numbers(text: str) -> set[int]:
    """The lines (0-based) a CommonMark+GFM parser puts in a table."""
    from markdown_it import MarkdownIt

    rows: set[int] = set()
    for t in MarkdownIt("commonmark").enable("table").parse(text):
        if t.map and t.type == "table_open":
            rows |= set(range(*t.map))
    return rows


def _table_lines_outside_tables(text: str) -> list[str]:
    """Lines that look like table rows ("| ... |") but that a CommonMark+GFM parser does not put in a table."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(text)
    in_table: set[int] = set()
    code: set[int] = set()
    for t in tokens:
        if t.map and t.type == "table_open":
            in_table |= set(range(*t.map))
        if t.map and t.type in ("fence", "code_block", "html_block"):
            code |= set(range(*t.map))
    return [line for i, line in enumerate(text.split("\n"))
            if line.startswith("|") and i not in in_table and i not in code]


def test_each_checkpoint_folder_alone_renders_its_card_complete(validated, tmp_path):
    out, _ = validated
    for which in ("prefill", "decode"):
        alone = tmp_path / which
        shutil.copytree(out / which, alone)  # what a Hub upload of this folder holds
        card = (alone / "README.md").read_text()
        assert "../" not in card, which
        targets = re.findall(r"\]\(([^)#\s]+)\)", card)  # markdown links and images
        assert "validation.png" in targets and "validation.md" in targets, targets
        missing = [t for t in targets if "://" not in t and not (alone / t).is_file()]
        assert not missing, (which, missing)
        assert json.loads((alone / "validation.json").read_text())["passed"] in (True, False)
    from quantkit.checkpoint.manifest import verify

    assert verify(out).ok, verify(out).problems  # the copies beside the cards are outside the manifest, like the card


def test_the_cards_tables_render_and_the_mtp_sentence_is_below_its_table(validated):
    out, _ = validated
    for which in ("prefill", "decode"):
        text = (out / which / "README.md").read_text()
        assert "MTP draft accuracy" in text
        assert _table_lines_outside_tables(text) == [], which
        lines = text.split("\n")
        sentences = [i for i, line in enumerate(lines) if line.startswith("MTP ")]  # acceptance, draft accuracy
        assert sentences, which
        rows = _table_line_numbers(text)
        for i in sentences:  # each its own paragraph, none a row of the table above
            assert i not in rows and lines[i - 1].strip() == "", (which, lines[i - 1:i + 1])
        assert not [lines[i] for i in rows if not lines[i].startswith("|")], which  # no sentence inside a table


def test_a_row_identical_to_the_source_by_construction_is_no_gate_evidence(validated):
    from quantkit.validation.gates import BY_CONSTRUCTION

    out, res = validated
    prefill = [g for g in res.data["gates"] if g["row"] == "prefill"]
    assert prefill and all(g["passed"] is None and g["note"] == BY_CONSTRUCTION for g in prefill)
    assert all(g["passed"] is not None for g in res.data["gates"] if g["row"] == "decode")
    card = (out / "prefill" / "README.md").read_text()
    assert "identical to the source by construction" in card
    assert "(prefill pass" not in card and "prefill pass" not in card.split("Gates (")[1].split("\n")[0]
    caption = str(res.table().caption)
    assert "not counted:" in caption and "prefill FP8" in caption.split("not counted:")[1].split(")")[0], caption


def test_coverage_section_lists_each_layer_and_counts_each_decision_with_why():
    from quantkit.validation.coverage import coverage_card

    rows = [{"layer": 1, "experts": 16, "routed_tokens": {"min": 3, "p10": 10.5, "median": 40.0},
             "tokens_per_column": {"min": 0.0005, "p10": 0.0017, "median": 0.0065}, "under_one_per_column": 16,
             "reasons": {"calibrated": 14, "guard kept RTN": 2}},
            {"layer": 2, "experts": 16, "reasons": {"reused": 16}}]
    card = "\n".join(coverage_card({"coverage": rows}))
    assert "32 routed experts in 2 MoE layers: 16 reused, 14 calibrated, 2 guard kept RTN" in card
    assert "16 of the experts not reused from the source saw under one routed token per input column" in card
    assert "| 1 | 16 | 3 / 10.5 / 40 | 0.0005 / 0.0017 / 0.0065 | 14 calibrated, 2 guard kept RTN |" in card
    assert "| 2 | 16 | — | — | 16 reused |" in card
    assert coverage_card({}) == []  # a report from before the coverage table: no section
