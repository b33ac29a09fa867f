"""quantkit.recipe: the shipped recipes load, mistakes give one line per problem naming the file,
the field and the fix, and CLI overrides are validated like the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import small_config, write_random
from oracle import dequantized_state_dict

from quantkit.conversion.pipeline import convert
from quantkit.errors import ConfigError
from quantkit.inputs.tokens import parse_spec
from quantkit.model.arch import arch_from_config
from quantkit.recipe import Recipe, available_recipes, default_recipe, load_recipe, recipe_dirs, recipe_overrides, resolve_recipe
from quantkit.synthetic.tiny import tiny_config

SHIPPED = ["deepseek-v3", "glm-5.2", "kimi-k2.6", "qwen3-moe", "tiny-glm-5.2", "tiny-kimi-k2.6", "tiny-qwen3-moe"]
REPO_RECIPES = Path(__file__).resolve().parent.parent / "recipes"  # the one place they live (setup.py ships them)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def errors(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_recipe(path)
    return str(e.value).splitlines()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_load(name):
    r = load_recipe(name)
    assert r.name == name
    assert r == load_recipe(REPO_RECIPES / f"{name}.yaml")
    assert r.method == "gptq" and r.gptq.block_size % r.group_size == 0
    calib = [spec for spec, _ in r.calibration.sources()]
    for spec in (*calib, r.validate.dataset):  # every one parses (no data is read)
        parse_spec(spec)
    assert r.validate.dataset not in calib and r.validate.gates


def test_shipped_recipe_settings():
    assert set(SHIPPED) <= set(available_recipes()) and recipe_dirs()[0] == REPO_RECIPES
    kimi, glm, ds = load_recipe("kimi-k2.6"), load_recipe("glm-5.2"), load_recipe("deepseek-v3")
    assert kimi.group_size == 32 and kimi.decode.reuse_source_int4
    assert kimi.prefill.keep_bf16 == ["q_a_proj", "kv_a_proj_with_mqa"] and glm.prefill.keep_bf16 == []
    assert glm.group_size == 128
    # DeepSeek-V3 has Kimi's attention shapes (the fused 1536 + 576 q_a/kv_a) and GLM's BF16/FP8 source
    assert (ds.method, ds.group_size, ds.prefill.keep_bf16) == ("gptq", 128, ["q_a_proj", "kv_a_proj_with_mqa"])
    assert ds.gptq == glm.gptq
    # GLM's validate settings and gates, but its KV bound: no DSA index-key cache to add error
    assert ds.validate.model_dump(exclude={"gates"}) == glm.validate.model_dump(exclude={"gates"})
    # ... and no DSA indexer whose long-context rows to gate
    glm_gates = {k: v for k, v in glm.validate.gates.items() if k != "indexer_overlap_min"}
    assert {**ds.validate.gates, "kv_delta_max": None} == {**glm_gates, "kv_delta_max": None}
    assert "indexer_overlap_min" in glm.validate.gates
    assert ds.validate.gates["kv_delta_max"] < glm.validate.gates["kv_delta_max"]
    for r in (kimi, glm, ds, load_recipe("qwen3-moe")):
        # the shipped mix (docs/recipes.md, "The shipped mix"): chat, code, tool calls in English and in Chinese
        # and the random share (docs/recipes.md, "The random share"): 410 windows of data and 102 of random ids,
        # the 512 windows the full-scale time was planned on
        assert (r.calibration.dataset, r.calibration.num_samples, r.calibration.seq_len) == (None, 410, 2048)
        assert r.calibration.sources() == [("hf:HuggingFaceH4/ultrachat_200k@train_sft", 205),
                                           ("hf:HuggingFaceTB/smoltalk:self-oss-instruct@train", 103),
                                           ("hf:llamafactory/glaive_toolcall_en@train", 51),
                                           ("hf:llamafactory/glaive_toolcall_zh@train", 51),
                                           ("random", 102)]
        assert r.calibration.windows() == 512
        assert [parse_spec(spec).kind for spec, _ in r.calibration.sources()] == ["hf"] * 4 + ["random"]
        assert r.validate.dataset not in dict(r.calibration.sources())
    for name in ("tiny-kimi-k2.6", "tiny-glm-5.2"):
        t = load_recipe(name)
        assert (t.calibration.dataset, t.calibration.num_samples, t.calibration.seq_len) == ("synthetic:train", 64, 64)
        assert (t.validate.dataset, t.validate.num_samples, t.validate.seq_len, t.validate.gen_tokens) == (
            "synthetic:heldout", 8, 64, 8)
    assert load_recipe("tiny-kimi-k2.6").group_size == 32 and load_recipe("tiny-glm-5.2").group_size == 128


def test_recipes_live_at_the_top_of_the_repo():
    """recipes/ beside quantkit/, as the layout promises (a user copies one from there to edit);
    no second copy inside the package (setup.py ships recipes/ as quantkit/recipes/ in the wheel)."""
    assert sorted(p.stem for p in REPO_RECIPES.glob("*.yaml")) == SHIPPED
    assert not (REPO_RECIPES.parent / "quantkit" / "recipes").exists() and recipe_dirs() == [REPO_RECIPES]


def test_an_edited_copy_converts_with_its_settings(tmp_path):
    """The documented way to tune a recipe: copy it, edit it, `quantkit convert --recipe path`."""
    from typer.testing import CliRunner

    from quantkit.cli import app

    src, _ = write_random(tmp_path / "src", small_config("glm"))
    edited = tmp_path / "my-glm.yaml"
    edited.write_text((REPO_RECIPES / "tiny-glm-5.2.yaml").read_text().replace("group_size: 128", "group_size: 64")
                      .replace("name: tiny-glm-5.2", "name: my-glm"))
    res = CliRunner().invoke(app, ["convert", str(src), "--out", str(tmp_path / "out"), "--recipe", str(edited),
                                   "--method", "rtn", "--device", "cpu", "--no-validate", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "out" / "convert-report.json").read_text())
    assert (report["recipe"]["name"], report["recipe"]["group_size"]) == ("my-glm", 64)


def test_defaults_of_a_minimal_recipe(tmp_path):
    r = load_recipe(write(tmp_path, "name: mine\ncalibration:\n  dataset: data.jsonl\n"))
    assert (r.method, r.group_size) == ("gptq", 128)
    assert (r.calibration.num_samples, r.calibration.seq_len, r.calibration.seed) == (128, 512, 0)
    g = r.gptq
    assert (g.dampening, g.block_size, g.actorder, g.min_tokens, g.fallback) == (0.01, 128, False, 32, "all_tokens")
    assert (r.awq.grid, r.awq.duo_scaling) == (20, True)
    p = r.prefill
    assert (p.fp8_block, p.keep_bf16, p.shared_experts, p.dense_mlp) == (128, [], "fp8", "fp8")
    assert r.decode.reuse_source_int4 is True
    v = r.validate
    assert (v.dataset, v.num_samples, v.seq_len, v.gen_tokens, v.gates) == (None, 8, 128, 8, {})
    assert Recipe.model_validate(r.to_dict()) == r
    assert load_recipe(write(tmp_path, "name: fast\nmethod: rtn\n")).calibration.dataset is None


def test_typos_and_bad_values_name_file_and_field(tmp_path):
    path = write(tmp_path, """\
name: x
group_size: 100
calibration:
  dataset: synthetic:train
  num_sample: 3
gptq:
  dampning: 0.01
  dampening: 0
  fallback: zeros
prefill:
  keep_bf16: [q-a-proj]
validate:
  seq_len: 1.5
  gates: {kl: 0.1}
""")
    lines = errors(path)
    where = str(path)
    assert lines == [
        f"{where}: group_size: must be one of 32, 64 or 128 (got 100)",
        f"{where}: calibration.num_sample: unknown field; did you mean 'num_samples'?",
        f"{where}: gptq.dampening: must be > 0.0 (got 0)",
        f"{where}: gptq.fallback: must be one of 'all_tokens' or 'rtn' (got 'zeros')",
        f"{where}: gptq.dampning: unknown field; did you mean 'dampening'?",
        f"{where}: prefill.keep_bf16: 'q-a-proj' is not a projection name (the last part of a module name, e.g. q_a_proj)",
        f"{where}: validate.seq_len: must be an integer (got 1.5)",
        f"{where}: validate.gates: gate 'kl' must end in _max or _min (an upper or lower bound), e.g. kl_max, top1_min",
    ]


def test_cross_field_rules(tmp_path):
    lines = errors(write(tmp_path, "name: x\ngroup_size: 64\ngptq: {block_size: 96}\n"
                                   "calibration: {dataset: synthetic}\nvalidate: {dataset: synthetic:train}\n"))
    assert [line.split(": ", 2)[1] for line in lines] == ["gptq.block_size", "validate.dataset"]
    assert "must be a multiple of group_size 64" in lines[0] and "held-out" in lines[1]
    (line,) = errors(write(tmp_path, "name: x\nmethod: gptq\n"))
    assert "calibration.dataset: method gptq needs calibration data" in line and "method: rtn" in line


def test_structural_errors(tmp_path):
    (line,) = errors(write(tmp_path, "name: [x\n"))
    assert "YAML syntax error" in line and line.startswith(str(tmp_path / "r.yaml") + ":2:")
    (line,) = errors(write(tmp_path, "- a\n"))
    assert "a recipe is a YAML mapping" in line
    (line,) = errors(write(tmp_path, "method: rtn\nfoo: 1\n"))[:1]
    assert line.endswith("name: required; add it")
    (line,) = errors(write(tmp_path, "name: x\nmethod: rtn\nprefil: {}\n"))
    assert line.endswith("prefil: unknown field; did you mean 'prefill'?")
    with pytest.raises(ConfigError, match="no such recipe file or name; pass a YAML path or one of: deepseek-v3, glm-5.2"):
        load_recipe("kimi-k3")


def test_default_recipe_by_model():
    kimi_arch = arch_from_config(tiny_config("kimi-k2.6"))
    glm_arch = arch_from_config(tiny_config("glm-5.2"))
    assert default_recipe("tiny:kimi-k2.6", kimi_arch).name == "tiny-kimi-k2.6"
    assert default_recipe("tiny:glm-5.2", glm_arch).name == "tiny-glm-5.2"
    assert default_recipe("/models/Kimi-K2.6", kimi_arch).name == "kimi-k2.6"
    assert default_recipe("hf://zai-org/GLM-5.2-FP8", glm_arch).name == "glm-5.2"
    assert default_recipe("/models/DeepSeek-V3", arch_from_config(small_config("deepseek_v3"))).name == "deepseek-v3"
    assert default_recipe("/models/Qwen3-30B-A3B", arch_from_config(tiny_config("qwen3-moe"))).name == "qwen3-moe"
    assert default_recipe("tiny:qwen3-moe", arch_from_config(tiny_config("qwen3-moe"))).name == "tiny-qwen3-moe"
    with pytest.raises(ConfigError, match="no default recipe for tiny_moe; pass one with --recipe"):
        default_recipe("/models/tiny-moe", "tiny_moe")  # a family registered without a recipe


def test_keep_bf16_names_the_models_projections(tmp_path):
    """Which projections a recipe may keep BF16 is the model family's (its definition), checked when
    the recipe meets the model: GLM's indexer wq_b is one, a typo is one line with the closest name."""
    glm = arch_from_config(tiny_config("glm-5.2"))
    kimi = arch_from_config(tiny_config("kimi-k2.6"))
    path = write(tmp_path, "name: typo\nmethod: rtn\nprefill: {keep_bf16: [q_a_prj]}\n")
    with pytest.raises(ConfigError) as e:
        resolve_recipe("/models/GLM", glm, path)
    assert str(e.value) == ("recipe typo: prefill.keep_bf16: unknown projection 'q_a_prj' for model_type glm_moe_dsa; "
                            "did you mean 'q_a_proj'? choose from q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, "
                            "o_proj, wq_b, wk")
    assert resolve_recipe("/models/GLM", glm, write(tmp_path, "name: w\nmethod: rtn\nprefill: {keep_bf16: [wq_b]}\n")).prefill.keep_bf16 == ["wq_b"]
    with pytest.raises(ConfigError, match="unknown projection 'wq_b' for model_type kimi_k25; choose from q_a_proj"):
        resolve_recipe("/models/Kimi", kimi, write(tmp_path, "name: w\nmethod: rtn\nprefill: {keep_bf16: [wq_b]}\n"))


@pytest.mark.slow
def test_deepseek_v3_bf16_source_converts_with_the_default_recipe(tmp_path):
    """A BF16 deepseek_v3 checkpoint (no --recipe) gets deepseek-v3: GPTQ group 128 experts, q_a/kv_a kept
    BF16, the rest FP8. Calibration comes from the command line because tests don't reach the Hub."""
    src, w = write_random(tmp_path / "src", small_config("deepseek_v3"))
    res = convert(src, tmp_path / "out", calib="synthetic:train", num_samples=8, seq_len=32, validate=False, progress=False)
    r = res.report
    assert r["recipe"]["name"] == "deepseek-v3" and r["group_size"] == 128
    assert r["experts_summary"]["gptq"] == 2 * 8 and r["experts_summary"]["fallbacks"] == 0  # 2 MoE layers x 8
    d = r["decisions"]
    assert d["model.layers.1.self_attn.q_a_proj.weight"]["prefill"] == "pass"  # stays BF16
    assert d["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]["prefill"] == "pass"
    assert d["model.layers.1.self_attn.q_b_proj.weight"]["prefill"] == "fp8"
    cfg = json.loads((res.decode / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["weights"]["group_size"] == 128
    # the decode experts, dequantized by compressed-tensors, are close to the source
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    wq = dequantized_state_dict(res.decode)[name]
    assert wq.shape == w[name].shape and (wq - w[name]).norm() / w[name].norm() < 0.2


def test_overrides():
    base = load_recipe("kimi-k2.6")
    assert recipe_overrides(base) is base and recipe_overrides(base, method=None, group_size=None) is base
    r = recipe_overrides(base, method="rtn", group_size=128, num_samples=16, seq_len=256, calib="synthetic:train", seed=3)
    assert (r.method, r.group_size) == ("rtn", 128)
    assert r.calibration.model_dump() == {"dataset": "synthetic:train", "mix": None, "num_samples": 16, "seq_len": 256,
                                          "seed": 3, "extra_random": 0.25}  # --calib keeps the random share
    assert r.prefill == base.prefill and base.group_size == 32  # the base recipe is untouched
    for kwargs, line in [
        (dict(group_size=100), "command line (recipe kimi-k2.6): --group-size: must be one of 32, 64 or 128 (got 100)"),
        (dict(num_samples=0), "command line (recipe kimi-k2.6): --num-samples: must be >= 1 (got 0)"),
        # an MTP layer calibrates on seq_len - 1 positions: 1 ended in torch's "max(): ... numel() == 0" at the MTP layer
        (dict(seq_len=1), "command line (recipe kimi-k2.6): --seq-len: must be >= 2 (got 1)"),
        (dict(method="hqq"), "command line (recipe kimi-k2.6): --method: unknown method 'hqq'; use one of the registered "
         "methods: gptq, awq, rtn, rtn-clip"),
        (dict(calib="hf:HuggingFaceH4/ultrachat_200k@test_sft"), "command line (recipe kimi-k2.6): validate.dataset: "
         "hf:HuggingFaceH4/ultrachat_200k@test_sft is the calibration data; evaluate on held-out data "
         "(synthetic:heldout, a test split, or another file)"),
    ]:
        with pytest.raises(ConfigError) as e:
            recipe_overrides(base, **kwargs)
        assert str(e.value) == line
    with pytest.raises(TypeError, match="unknown option"):
        recipe_overrides(base, group=32)


# ---- calibration mixes ---------------------------------------------------------------------------
MIX = "name: x\ncalibration:\n  num_samples: 8\n  seq_len: 32\n  mix:\n"


def test_mix_windows_by_weight_or_tokens(tmp_path):
    r = load_recipe(write(tmp_path, MIX + "  - {data: synthetic:train, weight: 0.34}\n  - {data: a.jsonl, weight: 0.33}\n"
                                          "  - {data: b.jsonl, weight: 0.33}\n"))
    assert r.calibration.sources() == [("synthetic:train", 3), ("a.jsonl", 3), ("b.jsonl", 2)]  # largest remainder
    r = load_recipe(write(tmp_path, MIX + "  - {data: synthetic:train, tokens: 192}\n  - {data: a.jsonl, tokens: 64}\n"))
    assert r.calibration.sources() == [("synthetic:train", 6), ("a.jsonl", 2)]
    single = recipe_overrides(r, calib="synthetic:train")  # --calib names the one source: the mix goes
    assert single.calibration.mix is None and single.calibration.sources() == [("synthetic:train", 8)]
    # extra_random: round(num_samples x it) windows of the `random` spec after the data, on top of num_samples
    r = load_recipe(write(tmp_path, MIX.replace("  mix:\n", "  extra_random: 0.25\n  dataset: synthetic:train\n")))
    assert r.calibration.sources() == [("synthetic:train", 8), ("random", 2)] and r.calibration.windows() == 10
    more = recipe_overrides(r, num_samples=64)  # the share follows --num-samples; --calib keeps it
    assert more.calibration.sources() == [("synthetic:train", 64), ("random", 16)]
    assert recipe_overrides(r, calib="a.jsonl").calibration.sources() == [("a.jsonl", 8), ("random", 2)]


@pytest.mark.parametrize("body, line", [
    ("  - {data: a.jsonl, weight: 0.5}\n  - {data: b.jsonl, weight: 0.7}\n",
     "calibration.mix: the weights sum to 1.2; make them sum to 1"),
    ("  - {data: a.jsonl, weight: 0.5}\n  - {data: b.jsonl, tokens: 128}\n",
     "calibration.mix: some sources give tokens, others weight; use one of them for every source"),
    ("  - {data: a.jsonl}\n", "calibration.mix[0]: a.jsonl: give tokens or weight (one of them)"),
    ("  - {data: a.jsonl, tokens: 100}\n", "calibration.mix[0]: a.jsonl: tokens 100 is not a multiple of seq_len 32; "
     "use 96"),
    ("  - {data: a.jsonl, tokens: 128}\n", "calibration.mix: the tokens sum to 128, num_samples x seq_len is 256; "
     "set num_samples: 4"),
    ("  - {data: a.jsonl, weight: 0.99}\n  - {data: b.jsonl, weight: 0.01}\n",
     "calibration.mix: b.jsonl: weight 0.01 of 8 windows is no window; raise its weight or num_samples"),
    ("  - {data: a.jsonl, weight: 1.0}\n  dataset: c.jsonl\n", "calibration.mix: give calibration.dataset (one source)"),
    ("  - {data: a.jsonl, wieght: 1.0}\n", "calibration.mix.0.wieght: unknown field; did you mean 'weight'?"),
])
def test_bad_mixes_name_file_source_and_fix(tmp_path, body, line):
    (got,) = errors(write(tmp_path, MIX + body))
    assert got.startswith(f"{tmp_path / 'r.yaml'}: {line}"), got


def test_a_mix_converts_with_per_source_counts(tmp_path):
    """Two local sources (a token file and the synthetic corpus) calibrate a small GLM; the report and
    card list each source's tokens; a source that cannot give its windows stops the run before any layer."""
    from quantkit.validation import card

    src, _ = write_random(tmp_path / "src", small_config("glm"))
    ids = tmp_path / "second.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 100, size=(64, 16)))
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(MIX.replace("seq_len: 32", "seq_len: 16") + "  - {data: synthetic:train, weight: 0.75}\n"
                      f"  - {{data: {ids}, weight: 0.25}}\n  extra_random: 0.25\n")
    res = convert(src, tmp_path / "out", recipe=recipe, validate=False, progress=False)
    cal = res.report["calibration"]
    assert cal["sources"] == [{"spec": "synthetic:train", "windows": 6, "tokens": 96},
                              {"spec": f"file:{ids}", "windows": 2, "tokens": 32},
                              {"spec": "random", "windows": 2, "tokens": 32}]  # extra_random, on top
    assert (cal["num_samples"], cal["tokens"]) == (10, 160)
    lines = card._recipe(res.report)  # the card's "Recipe and calibration" section
    assert any("`synthetic:train` 96 tokens (6 windows)" in line for line in lines), lines
    recipe.write_text(recipe.read_text().replace(str(ids), str(tmp_path / "missing.npy")))
    with pytest.raises(ConfigError) as e:
        convert(src, tmp_path / "bad", recipe=recipe, validate=False, progress=False)
    assert str(e.value).startswith(f"{recipe}: calibration.mix[1] ({tmp_path / 'missing.npy'}): ")
    assert "file not found" in str(e.value) and not (tmp_path / "bad" / "decode").exists()
