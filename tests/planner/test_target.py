"""resolve_target: every kind of model spec the planning commands take, read one way."""

from __future__ import annotations

import json

import pytest

from quantkit.errors import ConfigError
from quantkit.model.presets import load_preset
from quantkit.planner.target import resolve_target


def test_a_preset_a_config_and_a_dict_give_the_architecture_without_weights(tmp_path):
    preset = resolve_target("glm-5.2")
    assert preset.preset == "glm-5.2" and preset.checkpoint is None and preset.source == "preset glm-5.2"
    (tmp_path / "config.json").write_text(json.dumps(load_preset("glm-5.2")))
    for spec in (tmp_path / "config.json", load_preset("glm-5.2")):
        t = resolve_target(spec)
        assert t.checkpoint is None and t.preset is None
        assert t.arch.n_routed_experts == preset.arch.n_routed_experts == 256
    # a folder holding only its config plans (headers=False), and is refused where shards are read
    assert resolve_target(tmp_path, headers=False).arch.num_hidden_layers == preset.arch.num_hidden_layers


def test_a_tiny_id_opens_the_checkpoint_headers(tiny_glm):
    t = resolve_target("tiny:glm-5.2")
    assert t.checkpoint is not None and t.checkpoint.folder == tiny_glm and t.arch.n_routed_experts == 16
    assert resolve_target(tiny_glm, headers=False).checkpoint is None


@pytest.mark.parametrize("spec,needle", [("glm-9", "unknown preset 'glm-9'.*known presets"),
                                         ("no/such/folder", "not a folder.*or a preset")])
def test_what_names_nothing_is_one_error_saying_what_is_accepted(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        resolve_target(spec)
