"""quantkit.planner.budgets: the long-context window's activations are in validate's budget."""

from __future__ import annotations

from quantkit.model.arch import arch_from_config
from quantkit.model.ops import SCORE_CHUNK_BYTES
from quantkit.model.presets import load_preset
from quantkit.planner.budgets import layer_shapes, long_pass_bytes, long_pass_terms, validate_room, validate_working_set
from quantkit.runtime.units import GB


def test_the_long_window_is_counted_where_validate_keeps_weights():
    """GLM 5.2's default long window (2 x index_topk = 4096 tokens), by hand: four streams' hidden states,
    normed inputs, expert outputs and next states held through a layer; one stream's MLA step and three
    score chunks, which come after the weights' load transient, not with it."""
    a = arch_from_config(load_preset("glm-5.2"))
    n = 2 * a.index_topk
    held, step = long_pass_terms(a, n)
    assert held == 4 * 4 * n * 6144 * 4 and step == n * 64 * 3 * (256 + 256) * 4 + 3 * SCORE_CHUNK_BYTES
    assert 3.5 * GB < long_pass_bytes(a, n) == held + step < 4.5 * GB and long_pass_bytes(a, 0) == 0
    fixed, per = validate_working_set(a, "cpu")
    load = 3 * layer_shapes(a).largest_tensor * 4
    less = validate_room(a, "cpu", 100 * GB) - validate_room(a, "cpu", 100 * GB, long_len=n)
    assert less == held + max(load, per, step) - load - per > 0
