"""The method registry (quantkit.quant.methods.registry): every registered method states what the other
stages print and count for it, an unregistered name is refused in one line at recipe load and on the
command line, no module outside quantkit/quant/methods/ chooses a method by comparing its name, and a
method registered at test time converts a tiny model with no other change."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import ConfigError
from quantkit.quant.methods import METHODS, Inputs, Method, method_for
from quantkit.recipe import Recipe, load_recipe, recipe_overrides

ROOT = Path(__file__).resolve().parents[3]
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
    home = ROOT / "quantkit" / "quant" / "methods"
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "quantkit").rglob("*.py")) if home not in p.parents
             for i, line in enumerate(p.read_text().splitlines(), 1) if _compares_a_method_name(line)]
    assert found == []


def test_architecture_doc_names_the_files_a_new_method_touches():
    """docs/architecture.md's recipe for a new method is the one this registry follows."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    part = doc.split("**A new quantization method**", 1)[1].split("\n- **", 1)[0]
    for needed in ("quant/methods/", "@register", "Settings", "solve", "tests/", "docs/"):
        assert needed in part, needed
    for not_needed in ("quant/moe.py", "conversion/", "validation/", "cli.py"):  # they ask the registry
        assert not_needed not in part, not_needed


def test_a_gptq_option_lives_in_gptqs_module_alone():
    """gptq.low_dampening, the last option GPTQ gained, as code: its field, its settings, its probe, its report
    counts, its per-expert words and its card line are all in quant/methods/gptq.py; the report and the card
    ask the run's method (Method.summary_counts, record_words, guard_note). Comments may name it elsewhere."""
    import tokenize

    where = set()
    for path in sorted((ROOT / "quantkit").rglob("*.py")):
        with open(path, "rb") as f:
            for t in tokenize.tokenize(f.readline):
                if (t.type == tokenize.NAME and t.string == "low_dampening") or (
                        t.type == tokenize.STRING and t.string.strip("\"'") == "low_dampening"):
                    where.add(path.relative_to(ROOT).as_posix())
    assert where == {"quantkit/quant/methods/gptq.py"}


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


def test_the_layer_pass_knows_no_method_and_names_resolve_once():
    """convert's layer pass hands any method the layer's rows and never names one; a recipe's method
    name is resolved by the recipe (Recipe.resolved_method, once per Job); outside the registry
    `method_for` reads a name only where it comes back from a report (the model card)."""
    text = (ROOT / "quantkit" / "conversion" / "layerpass.py").read_text()
    assert not re.search(r"gptq|awq|Inputs\.|hessian", text, re.I)
    calls = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "quantkit").rglob("*.py"))
             if (ROOT / "quantkit" / "quant" / "methods") not in p.parents
             for i, line in enumerate(p.read_text().splitlines(), 1) if "method_for(" in line]
    assert len(calls) == 1, calls


def test_a_name_is_registered_once():
    from quantkit.quant.methods import register

    class Again(Method):
        name = "gptq"

    with pytest.raises(ValueError, match="'gptq' is registered already"):
        register(Again)


# ---- a method registered at test time ----------------------------------------------------------------


def _clip_by_diagonal(W, d, group_size):
    """Each group's scale by the clip search weighted by d (in,), a Hessian diagonal; INT4 codes."""
    import torch

    from quantkit.quant.gptq import QuantizedWeight, mse_group_scales

    scale = mse_group_scales(W, group_size, weight=d)  # (out, in / group_size), bf16
    Wg = W.float().unflatten(-1, (-1, group_size))  # (out, G, group_size)
    q = (Wg / scale.float().unsqueeze(-1)).clamp_(-8, 7).round_().to(torch.int8)
    return QuantizedWeight(q=q.flatten(-2), scale=scale)


class HessianDiagonal(Method):
    """A toy calibrated method: per expert, diag(H) of gate/up's input (sum x^2) and of down's
    (sum z^2, z under the float gate/up), observed one micro-batch at a time from the layer's rows;
    each group's scale by the clip search weighted by that diagonal."""

    name, display, help = "toy-hdiag", "HDiag", "test only: Hessian-diagonal weighted clip search"
    inputs = Inputs.STREAMED

    def __init__(self):
        self.batches, self.seen = 0, {}  # micro-batches observed; routed tokens per layer

    def _solve(self, w, experts, group_size, layer, batches):
        import torch.nn.functional as F

        from quantkit.quant.experts import ExpertRecord, expert_weights

        dx, dz, n = {e: 0.0 for e in experts}, {e: 0.0 for e in experts}, {e: 0 for e in experts}
        for x, idx in batches:  # x (B T, D), idx (B T, k)
            self.batches += 1
            for e in experts:
                xe = x[(idx == e).any(-1)]
                gate, up, _ = (t.float() for t in expert_weights(w, e))
                dx[e] = dx[e] + xe.square().sum(0)
                dz[e] = dz[e] + (F.silu(xe @ gate.T) * (xe @ up.T)).square().sum(0)
                n[e] += len(xe)
        self.seen[layer] = self.seen.get(layer, 0) + sum(n.values())
        out = {e: {p: _clip_by_diagonal(t, dz[e] if p == "down_proj" else dx[e], group_size)
                   for p, t in zip(("gate_proj", "up_proj", "down_proj"), expert_weights(w, e))} for e in experts}
        return out, [ExpertRecord(layer, e, n[e], self.name) for e in experts]

    def quantize(self, w, experts, recipe, group_size, layer, *, x=None, tokens=None, alternatives=None, probe=False):
        import torch

        idx = torch.full((len(x), 1), -1)  # the whole layer as one batch, each token's routed experts
        for e in experts:
            idx[tokens[e]] = e
        return self._solve(w, experts, group_size, layer, [(x, idx)])

    def solve(self, rows, w, experts, recipe, group_size, layer):
        return self._solve(w, experts, group_size, layer, ((b.x, b.idx) for b in rows.batches()))


@pytest.fixture
def toy():
    from quantkit.quant.methods import register

    register(HessianDiagonal)
    try:
        yield METHODS[HessianDiagonal.name]
    finally:
        del METHODS[HessianDiagonal.name]


def test_a_method_registered_at_test_time_converts_a_tiny_model(toy, tiny_glm, tmp_path):
    """HessianDiagonal, registered here and nowhere else, converts tiny:glm-5.2: the recipe accepts it, the
    planner budgets it, the layer pass streams every calibration token of every calibrated MoE layer to
    it, and the report counts its experts under its name."""
    import json

    from quantkit.conversion.pipeline import convert

    res = convert("tiny:glm-5.2", tmp_path / "out", method="toy-hdiag", validate=False, progress=False)
    rep = res.report
    summary = rep["experts_summary"]
    assert rep["method"] == "toy-hdiag" and summary["toy-hdiag"] == summary["total"] - summary["reused"] > 0
    assert "HDiag" in res.table().caption
    config = json.loads((res.prefill / "config.json").read_text())
    cal = rep["calibration"]
    moe = sorted({e["layer"] for e in rep["experts"] if e["method"] == "toy-hdiag"})
    # every calibration token reached the method once per routed slot, in every calibrated MoE layer (the
    # MTP layer's tokens are T - 1 per window: quantkit.conversion.stages.mtp_inputs)
    tokens = {lay: cal["num_samples"] * (cal["seq_len"] - (lay >= config["num_hidden_layers"])) for lay in moe}
    assert toy.seen == {lay: tokens[lay] * config["num_experts_per_tok"] for lay in moe}
    assert moe[-1] >= config["num_hidden_layers"]  # the MTP layer is calibrated too
    assert toy.batches >= len(moe)
    assert all(e["decision"] == "calibrated" for e in rep["experts"] if e["method"] == "toy-hdiag")


def test_the_toy_methods_streamed_form_is_its_whole_layer_form(toy):
    """The same method through convert's rows, two micro-batches, and through its whole-layer form."""
    import torch

    from quantkit.conversion.activations import ActivationStore, LayerRouting, StoreRows
    from quantkit.planner.cost import StorePlan

    g = torch.Generator().manual_seed(0)
    n, t, D, I, E = 4, 16, 64, 32, 3
    w = {f"mlp.experts.{e}.{p}.weight": torch.randn(*((I, D) if p != "down_proj" else (D, I)), generator=g)
         for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    x = torch.randn(n * t, D, generator=g)
    idx = torch.randint(0, E, (n * t, 1), generator=g)
    store = ActivationStore(n, t, D, StorePlan(micro_batch=2), "cpu")
    for sl in store.slices():
        store.open_x().write(sl, x.view(n, t, D)[sl])
    per = 2 * t
    routing = LayerRouting([idx[:per], idx[per:]], [torch.ones(per, 1)] * 2, [per, per], E)
    q_s, rec_s = toy.solve(StoreRows(store, routing), w, list(range(E)), None, 32, 1)
    q_m, rec_m = toy.quantize(w, list(range(E)), None, 32, 1, x=x, tokens=StoreRows(store, routing).routed(list(range(E))))
    assert [r.tokens for r in rec_s] == [r.tokens for r in rec_m] == [int((idx == e).sum()) for e in range(E)]
    for e in range(E):
        for p in q_s[e]:
            assert torch.equal(q_s[e][p].scale, q_m[e][p].scale)
            assert (q_s[e][p].q != q_m[e][p].q).float().mean() < 1e-3  # sums in another order: ties aside
