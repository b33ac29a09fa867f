"""The family definitions (quantkit.model.families) are the one place that knows a family: every
other stage asks `arch.definition`, so no module outside quantkit/model/ tests a family name or a
model_type. The grep below keeps it so."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from quantkit.errors import ConfigError
from quantkit.model.arch import arch_from_config, load_preset, preset_names
from quantkit.model.families import REGISTRY, family_of
from quantkit.model.inventory import tensor_inventory
from quantkit.model.tensors import TensorClass
from quantkit.recipe import available_recipes

ROOT = Path(__file__).resolve().parents[2]
NAMES = set(REGISTRY) | {f.name for f in REGISTRY.values()}
FIELDS = {"model_type", "family"}
# synthetic/ builds the tiny and real-shape checkpoints of named releases (tiny:glm-5.2): it writes
# model_types into the configs it makes and picks a release by its name, it does not branch on a family.
EXEMPT = ("model", "synthetic")


def _mentions_family(node: ast.AST) -> bool:
    """A family name or model_type as a string, or a `model_type` / `family` field read."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and (n.value in NAMES or n.value in FIELDS):
            return True
        if isinstance(n, ast.Attribute) and n.attr in FIELDS or isinstance(n, ast.Name) and n.id in FIELDS:
            return True
    return False


def family_checks(path: Path, root: Path = ROOT) -> list[str]:
    """Comparisons and lookup tables on a family name or model_type in one module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and _mentions_family(node):
            out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in NAMES for k in node.keys):
            out.append(f"{path.relative_to(root)}:{node.lineno}: a table keyed by family")
    return out


def test_no_family_checks_outside_model():
    bad = [line for p in sorted((ROOT / "quantkit").rglob("*.py"))
           if p.relative_to(ROOT / "quantkit").parts[0] not in EXEMPT for line in family_checks(p)]
    assert bad == [], "ask arch.definition (quantkit.model.family) instead:\n" + "\n".join(bad)


def test_only_the_registry_imports_a_definition():
    """A family's module is reached through REGISTRY only (families/__init__.py, or a sibling that
    builds on it, as glm on deepseek_v3's MLA): adding one is that module and one registry line."""
    bad = []
    for p in sorted((ROOT / "quantkit").rglob("*.py")):
        if p.parent == ROOT / "quantkit" / "model" / "families":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quantkit.model.families."):
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno}: from {node.module} import ...")
    assert bad == []


def test_the_grep_finds_what_it_looks_for(tmp_path):
    (tmp_path / "m.py").write_text('a = arch.family == "kimi"\nb = cfg.get("model_type") != "glm_moe_dsa"\n'
                                   'c = {"kimi_k25": 1}\nd = x == 1\ne = fam.indexer\n')
    assert family_checks(tmp_path / "m.py", tmp_path) == [
        "m.py:1: arch.family == 'kimi'", "m.py:2: cfg.get('model_type') != 'glm_moe_dsa'", "m.py:3: a table keyed by family"]


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_definitions_are_complete(model_type):
    """Each definition's recipe ships, its presets parse to it, and its declared attention names are
    exactly the attention Linears the inventory lists."""
    fam = REGISTRY[model_type]
    assert fam.recipe is None or fam.recipe in available_recipes()  # None: a family registered without one
    for name in fam.presets:
        assert name in preset_names()
        a = arch_from_config(load_preset(name))
        assert a.definition is fam
        leaves = {s.role for s in tensor_inventory(a) if s.klass == TensorClass.ATTENTION and s.linear}
        assert leaves == set(fam.attention_projections)
        assert set(fam.attention_shapes(a)) >= leaves
        assert set(fam.prefill_bf16_projections) <= set(fam.recipe_projections)


def test_qwen3_moe_inspects_as_its_inventory_says(tmp_path):
    """A Qwen3-MoE saved by transformers: every tensor classified by the definition's names, and the
    inventory from config.json alone lists the same tensors with the same shapes."""
    from test_reference import tiny_qwen3_moe

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.planner.inspection import inspect

    ckpt = Checkpoint(tiny_qwen3_moe(tmp_path / "qwen3"))
    a = ckpt.arch
    assert (a.family, a.definition.router, a.head_dim, a.num_key_value_heads) == ("qwen3_moe", "softmax_topk", 16, 2)
    stored = {n: tuple(st.shape) for n, st in ckpt.tensors.items()}
    listed = {}
    for s in tensor_inventory(a):
        for i in range(s.count):  # a spec of `count` experts names the first one
            listed[s.name.replace("experts.0.", f"experts.{i}.")] = s.shape
    assert listed == stored
    got = inspect(ckpt.folder)
    assert (got.model_type, got.layers, got.routed_experts) == ("qwen3_moe", 3, 8)
    assert got.classes["attention"].tensors == 4 * 3 and got.classes["routed_expert"].tensors == 2 * 8 * 3


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(ConfigError, match=r"config.json: unknown model_type 'llama'; quantkit supports deepseek_v3, "
                                          r"glm_moe_dsa, kimi_k2, kimi_k25, qwen3_moe"):
        family_of("llama")
