"""quantkit.validation.card: the guard line counts the experts under the thin-calibration prior."""

from __future__ import annotations

from quantkit.validation.card import _guard_line


def test_guard_line_counts_experts_under_the_width_prior():
    e = {"total": 8, "reused": 0, "gptq": 8, "guarded": 8, "guard_kept_rtn": 1, "width_prior": 6}
    line = _guard_line({"experts_summary": e})
    assert "8 judged against RTN" in line and "6 under the thin-calibration prior" in line
    assert "thin-calibration" not in _guard_line({"experts_summary": e | {"width_prior": 0}})
