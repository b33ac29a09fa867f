"""The method registry: every registered method states what the other stages print and count for it,
an unregistered name is refused in one line at recipe load and on the command line, and no module
outside quantkit/quant/methods.py chooses a method by comparing its name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import ConfigError
from quantkit.quant.methods import METHODS, Inputs, Method, method_for
from quantkit.recipe import Recipe, load_recipe, recipe_overrides

ROOT = Path(__file__).resolve().parents[2]
NAMES = ", ".join(METHODS)


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_states_its_fields(name):
    m = METHODS[name]
    assert isinstance(m, Method) and m.name == name and method_for(name) is m
    assert m.display and m.help and isinstance(m.inputs, Inputs)
    assert m.section is None or m.section in Recipe.model_fields  # its settings are a recipe section
    assert m.time_factor >= 1.0 and m.flops_per_weight > 0  # the planner's terms
    assert not m.data_free().calibrated and m.data_free().data_free() is m.data_free()
    rec = Recipe(name="x", method=name, calibration={"dataset": "synthetic:train"})
    line = m.settings_line(rec.model_dump(mode="json"))  # the card's line, from the report's recipe
    assert line is None or (line.startswith(f"- {m.display}") and "None" not in line), line
    assert m.quantize is not Method.quantize  # it quantizes a chunk of experts itself


def test_an_unregistered_method_fails_at_recipe_load_with_one_line(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("name: x\nmethod: hqq\ncalibration: {dataset: synthetic:train}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(p)
    assert str(e.value).endswith(f": method: unknown method 'hqq'; use one of the registered methods: {NAMES}")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        recipe_overrides(load_recipe("tiny-glm-5.2"), method="GPTQ")  # names are exact
    assert str(e.value) == ("command line (recipe tiny-glm-5.2): --method: unknown method 'GPTQ'; "
                            f"use one of the registered methods: {NAMES}")
    with pytest.raises(ConfigError, match=f"unknown method 'hqq'; use one of the registered methods: {NAMES}"):
        method_for("hqq")


@pytest.mark.parametrize("argv", [["convert", "tiny:glm-5.2", "--method", "hqq", "--no-validate"],
                                  ["plan", "glm-5.2", "--convert", "--method", "hqq", "--gpu", "cpu"]])
def test_an_unregistered_method_fails_on_the_command_line(tmp_path, argv):
    if argv[0] == "convert":
        argv = [*argv, "--out", str(tmp_path / "out")]
    r = CliRunner().invoke(app, argv)
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert "unknown method 'hqq'" in lines[0] and NAMES in lines[0], r.output
    assert not (tmp_path / "out").exists()


def test_the_cli_help_lists_every_registered_method():
    out = " ".join(CliRunner().invoke(app, ["convert", "--help"], terminal_width=200).output.replace("│", " ").split())
    assert all(f"{name} ({m.help})" in out for name, m in METHODS.items()), out


# A comparison or membership test between something called *method and a registered name (either
# side), e.g. `method == "awq"`, `rec.method != "rtn"`, `r["method"] == "gptq"`, `method in ("gptq", "awq")`.
_LIT = r"""["']([\w.-]+)["']"""
_LHS = r"""[\w.\[\]"']*method\b[\]"')]*"""
PATTERNS = [re.compile(_LHS + r"\s*(?:==|!=)\s*" + _LIT), re.compile(_LIT + r"\s*(?:==|!=)\s*" + _LHS),
            re.compile(_LHS + r"\s+(?:not\s+)?in\s+[(\[{]([^)\]}]*)")]


def _compares_a_method_name(line: str) -> bool:
    for p in PATTERNS:
        for m in p.finditer(line):
            if any(n in METHODS for n in re.findall(r"""["']([\w.-]+)["']""", m.group(0))):
                return True
    return False


def test_only_the_registry_compares_method_names():
    """A new method is its registered class: no stage picks maths, costs or wording by a name."""
    assert _compares_a_method_name('if method == "awq":') and _compares_a_method_name("x = rec.method != 'rtn'")
    assert _compares_a_method_name('gptq_on = calibrate and method in ("gptq", "awq")')
    assert not _compares_a_method_name('if r.method != "reused":') and not _compares_a_method_name('g.fallback == "rtn"')
    home = ROOT / "quantkit" / "quant" / "methods.py"
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "quantkit").rglob("*.py")) if p != home
             for i, line in enumerate(p.read_text().splitlines(), 1) if _compares_a_method_name(line)]
    assert found == []


def test_architecture_doc_names_the_files_a_new_method_touches():
    """docs/architecture.md's recipe for a new method is the one this registry follows."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    part = doc.split("**A new quantization method**", 1)[1].split("\n- **", 1)[0]
    for needed in ("quant/methods.py", "METHODS", "Settings", "tests/", "docs/"):
        assert needed in part, needed
    for not_needed in ("quant/moe.py", "conversion/", "validation/", "cli.py"):  # they ask the registry
        assert not_needed not in part, not_needed


def test_a_methods_recipe_section_is_declared_by_the_method():
    """Recipe's method sections are the registry's (each method's `settings`), and recipe.py names none of
    them: adding a method does not touch it."""
    sections = {m.section: m.settings for m in METHODS.values() if m.settings is not None}
    assert sections and all(m.section in sections for m in METHODS.values() if m.section)
    for section, settings in sections.items():
        assert Recipe.model_fields[section].annotation is settings
    text = (ROOT / "quantkit" / "recipe.py").read_text()
    for section, settings in sections.items():  # no field, class or attribute of a method's section
        assert not re.search(rf"\.{section}\b|^\s*{section}\s*:|{settings.__name__}", text, re.M), section
    # and a method's own checks reach every recipe (GPTQ's: block_size against group_size)
    with pytest.raises(ConfigError, match="gptq.block_size: 96 must be a multiple of group_size 64"):
        from quantkit.recipe import _validate

        _validate({"name": "x", "group_size": 64, "calibration": {"dataset": "synthetic:train"},
                   "gptq": {"block_size": 96}}, "x.yaml")
