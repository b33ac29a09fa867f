"""quantkit.runtime.phases: a phase's seconds add up over its stretches, an exception still counts, take clears."""

from __future__ import annotations

import time

import pytest

from quantkit.runtime import phases


def test_timed_adds_wall_and_cpu_per_phase_and_take_clears():
    phases.take()
    for _ in range(2):
        with phases.timed("a"):
            time.sleep(0.02)
    with pytest.raises(ValueError), phases.timed("b"):
        raise ValueError("counted all the same")
    out = phases.take()
    assert set(out) == {"a", "b"}
    assert out["a"]["wall"] >= 0.04 and 0 <= out["a"]["cpu"] < out["a"]["wall"]  # sleeping spends no CPU
    assert phases.take() == {}
