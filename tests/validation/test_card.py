"""quantkit.validation.card: the guard line counts the experts under the thin-calibration prior."""

from __future__ import annotations

from quantkit.conversion.report import decision
from quantkit.validation.card import _decisions_line, _guard_line


def test_guard_line_counts_experts_under_the_width_prior():
    e = {"total": 8, "reused": 0, "gptq": 8, "guarded": 8, "guard_kept_rtn": 1, "width_prior": 6}
    line = _guard_line({"experts_summary": e})
    assert "8 judged against RTN" in line and "6 under the thin-calibration prior" in line
    assert "thin-calibration" not in _guard_line({"experts_summary": e | {"width_prior": 0}})


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
