"""The family definitions (quantkit.model.families) are the one place that knows a family: every
other stage asks `arch.definition`, so no module outside quantkit/model/ tests a family name or a
model_type, and a family's layer kinds (its attention, its router) are written in its own module.
The greps below keep it so."""

from __future__ import annotations

import ast
import re
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


# ---- what adding a family touched: its names stay in its own files --------------------------------
# Qwen3-MoE brought GQA attention (q/k norms, q/k/v projections, key/value heads) and a softmax
# router; DeepSeek-V3 brought MLA and the sigmoid group router, which GLM and Kimi import. Each
# may be named only in the family's definition module, in the registry's lines, and in
# quantkit/synthetic/ (the tiny and real-shape model builders: test fixtures that write each
# release's config and weights). Presets and recipes are data files outside the scan.
FAMILIES = ROOT / "quantkit" / "model" / "families"
QWEN3 = re.compile(r"gqa|qwen|\bq_norm\b|\b[qkv]_proj\b|qkv_proj|num_key_value_heads|softmax_topk", re.IGNORECASE)
QWEN3_OWN = {FAMILIES / "qwen3_moe.py"}
# code, not prose (MLA is the engines' cache layout the KV and planner docs discuss): identifiers,
# and strings naming an MLA tensor
MLA_NAMES = re.compile(r"^MLA|^mla|^(q_lora_rank|kv_lora_rank|qk_nope_head_dim|kv_cache_width|sigmoid_group_topk|observe_query)$")
MLA_TENSORS = re.compile(r"(^|self_attn\.)(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|q_a_layernorm|kv_a_layernorm)\b")
# DeepSeek-V3's module, GLM's (it imports MLA), and ModelArch, whose size fields are MLA's ranks
# (the fields every stage was written against; a later kind's own sizes go in `attention_sizes`)
MLA_OWN = {FAMILIES / "deepseek_v3.py", FAMILIES / "glm.py", ROOT / "quantkit" / "model" / "arch.py"}


def _fixture(p: Path, root: Path) -> bool:
    return p.relative_to(root).parts[:2] == ("quantkit", "synthetic")


def _registry_line(p: Path, line: str) -> bool:
    """The registry's own lines: the definition's import and its place in REGISTRY."""
    return p.name == "__init__.py" and p.parent.name == "families" and (line.startswith("from ") or line.startswith("REGISTRY"))


def qwen3_mentions(root: Path = ROOT) -> list[str]:
    """Every line of quantkit/ (code, comments and docstrings) naming Qwen3-MoE's kinds outside its files."""
    return [f"{p.relative_to(root)}:{i}: {line.strip()}"
            for p in sorted((root / "quantkit").rglob("*.py")) if p not in QWEN3_OWN and not _fixture(p, root)
            for i, line in enumerate(p.read_text().splitlines(), 1) if QWEN3.search(line) and not _registry_line(p, line)]


def mla_code(root: Path = ROOT) -> list[str]:
    """Every identifier or tensor-name string of MLA's outside its owners."""
    out = []
    for p in sorted((root / "quantkit").rglob("*.py")):
        if p in MLA_OWN or _fixture(p, root):
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            name = (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
                    else n.name if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.alias)) else None)
            text = n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None
            if name and MLA_NAMES.search(name) or text and MLA_TENSORS.search(text) and len(text) < 80:
                out.append((str(p.relative_to(root)), getattr(n, "lineno", 0), name or text))
    return [f"{p}:{i}: {t}" for p, i, t in sorted(out)]


def test_qwen3_moe_is_named_only_in_its_own_files():
    """Adding Qwen3-MoE touched its definition, the registry line, its preset and recipes (and tests,
    docs, the tiny-model builder): nothing else names GQA or its tensors."""
    assert qwen3_mentions() == [], "move it into quantkit/model/families/qwen3_moe.py (its Attention, Router):\n" + "\n".join(qwen3_mentions())


def test_mla_code_is_only_in_its_owners():
    assert mla_code() == [], "MLA lives in quantkit/model/families/deepseek_v3.py:\n" + "\n".join(mla_code())


def test_the_scans_find_what_they_look_for(tmp_path):
    pkg = tmp_path / "quantkit" / "planner"
    pkg.mkdir(parents=True)
    (pkg / "kv.py").write_text('"""GQA heads."""\nx = w["self_attn.kv_b_proj.weight"]\nif a.kv_lora_rank:\n    y = mla_attention(h)\n')
    assert qwen3_mentions(tmp_path) == ['quantkit/planner/kv.py:1: """GQA heads."""']
    assert mla_code(tmp_path) == ["quantkit/planner/kv.py:2: self_attn.kv_b_proj.weight", "quantkit/planner/kv.py:3: kv_lora_rank",
                                  "quantkit/planner/kv.py:4: mla_attention"]


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
    assert (a.family, a.definition.router.__name__, a.size("head_dim"), a.size("num_key_value_heads")) == ("qwen3_moe", "softmax_topk", 16, 2)
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
