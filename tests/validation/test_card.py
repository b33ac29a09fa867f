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
    assert _decisions_line({"calibrated": 14, "fallback": 2}).endswith("14 calibrated, 2 fallback")
