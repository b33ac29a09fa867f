"""Both engines load both outputs: asked of vLLM 0.33.0's and SGLang 0.5.23's own code.

The engines' config-resolution modules come from the pinned release wheels (quantkit.serving.engines,
downloaded once into the quantkit cache) and run in a child process (quantkit.serving.harness, whose
docstring lists what is stubbed: kernels, distributed state, the GPU as sm90). Which modules the
engines build, under which names, is a cited reading of their model files (quantkit.serving.checks's
docstring); everything from there on is the engines' code: config parsing, target matching,
ignore lists, scheme selection and constructors, `weight_block_size`, and `create_weights`, whose
registered parameters are compared with the stored tensors.

Skipped, with the reason, when the registry cannot be reached and the cache is empty.
"""

from __future__ import annotations

import json
import shutil

import pytest

from quantkit.conversion.pipeline import convert
from quantkit.serving.checks import check_serving_many

pytestmark = pytest.mark.slow  # one engine process per engine (~10 s each) plus two tiny conversions

ENGINES = ("vllm", "sglang")
INT4_MOE = {"vllm": "CompressedTensorsWNA16MoEMethod", "sglang": "CompressedTensorsWNA16MoE"}  # Marlin on sm90


@pytest.fixture(scope="module")
def engines_available():
    from quantkit.serving.engines import EngineUnavailable, engine_source

    try:
        return {e: engine_source(e) for e in ENGINES}
    except EngineUnavailable as e:
        pytest.skip(f"engine code unavailable: {e}")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tiny_glm, tiny_kimi, tiny_qwen3):
    root = tmp_path_factory.mktemp("serving")
    return {name: convert(spec, root / name, method="rtn", validate=False, progress=False)
            for name, spec in (("glm", "tiny:glm-5.2"), ("kimi", "tiny:kimi-k2.6"), ("qwen3", "tiny:qwen3-moe"))}


@pytest.fixture(scope="module")
def variants(outputs, tmp_path_factory):
    """Checkpoints engines should refuse or flag, made from the GLM decode output by editing config.json,
    and a `--decode-rest bf16` conversion."""
    root = tmp_path_factory.mktemp("variants")

    def legacy(cfg):
        cfg["quantization_config"] = _legacy_config(cfg["quantization_config"])

    def g64(cfg):
        g = next(g for g in cfg["quantization_config"]["config_groups"].values() if g["weights"]["num_bits"] == 4)
        g["weights"]["group_size"] = 64

    def real_count(cfg):
        cfg["n_routed_experts"] = 256

    out = {name: _with_config(outputs["glm"].decode, root / name, edit)
           for name, edit in (("legacy", legacy), ("g64", g64), ("e256", real_count))}
    rest = convert("tiny:glm-5.2", root / "rest-bf16", method="rtn", decode_rest="bf16", validate=False, progress=False)
    out["rest-bf16"] = rest.decode
    out["rest-bf16-result"] = rest
    # BF16 shared experts beside FP8 attention: SGLang checks `ignore` against the fused gate_up_proj
    # name itself (gate_up_proj is not in its packed-modules map), so quantkit lists that name too
    import yaml

    from quantkit.recipe import load_recipe

    rec = load_recipe("tiny-kimi-k2.6").to_dict()  # Kimi: BF16 shared experts in the source (GLM's are FP8)
    rec["prefill"]["shared_experts"] = "bf16"
    (root / "shared-bf16.yaml").write_text(yaml.safe_dump(rec))
    out["shared-bf16"] = convert("tiny:kimi-k2.6", root / "shared-bf16", recipe=root / "shared-bf16.yaml",
                                 validate=False, progress=False).decode
    return out


@pytest.fixture(scope="module")
def reports(outputs, variants, engines_available):
    """Every folder checked in one engine process per engine."""
    folders = {f"{m}/{w}": getattr(outputs[m], w) for m in outputs for w in ("prefill", "decode")}
    folders |= {k: v for k, v in variants.items() if not k.endswith("-result")}
    got = check_serving_many(list(folders.values()))
    return {k: {e.engine: e for e in r.engines} for k, r in zip(folders, got)}


def test_qwen3_attention_is_one_fused_qkv_module(reports):
    """Qwen3-MoE's q, k and v load as the engines' one QKVParallelLinear (the family definition's
    engine_attention), o_proj on its own; no shared expert."""
    for engine in ENGINES:
        rows = reports["qwen3/decode"][engine].rows
        attn = {r.module.rsplit(".", 1)[-1] for r in rows if ".layers.0.self_attn." in r.module}
        assert attn == {"qkv_proj", "o_proj"} and not any("shared_experts" in r.module for r in rows)


def _rows(rep, stored=None):
    return [r for r in rep.rows if stored is None or r.stored == stored]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("folder", ["glm/prefill", "glm/decode", "kimi/prefill", "kimi/decode", "qwen3/prefill",
                                    "qwen3/decode"])
def test_engine_loads_every_module(reports, folder, engine):
    rep = reports[folder][engine]
    assert rep.source == "engine code" and rep.version
    assert rep.loads, rep.problems
    decode = folder.endswith("decode")
    moe = [r for r in rep.rows if r.module.endswith("mlp.experts")]
    assert moe and all(r.stored == ("int4" if decode else "fp8") for r in moe)
    for r in moe:  # every routed expert: the W4A16 MoE scheme (decode), block FP8 (prefill)
        assert r.scheme == (INT4_MOE[engine] if decode else "Fp8MoEMethod block [128, 128]"), r
    for r in _rows(rep, "fp8"):
        if not r.module.endswith("mlp.experts"):
            assert r.scheme == ("CompressedTensorsW8A8Fp8" if decode else "Fp8LinearMethod") + " block [128, 128]", r
    for r in _rows(rep, "bf16"):  # ignored / not converted: unquantized
        assert r.scheme in ("UnquantizedLinearMethod", "None"), r
    # the tensors each scheme's create_weights registers take the stored ones (names, dtypes, shapes)
    assert all(r.params_checked for r in rep.rows if r.stored != "bf16"), [r for r in rep.rows if not r.params_checked]


def test_mtp_layer_resolves_under_each_engines_names(reports):
    """GLM's MTP layer (index 5 in the tiny): SGLang's draft model names it `model.decoder.`
    (deepseek_nextn.py), vLLM keeps `model.layers.5.` (deepseek_mtp.py)."""
    sg = {r.module: r for r in reports["glm/decode"]["sglang"].rows}
    vl = {r.module: r for r in reports["glm/decode"]["vllm"].rows}
    assert sg["model.decoder.mlp.experts"].scheme == INT4_MOE["sglang"]
    assert sg["model.decoder.self_attn.fused_qkv_a_proj_with_mqa"].scheme == "CompressedTensorsW8A8Fp8 block [128, 128]"
    assert sg["model.decoder.mlp.shared_experts.gate_up_proj"].scheme == "CompressedTensorsW8A8Fp8 block [128, 128]"
    assert vl["model.layers.5.mlp.experts"].scheme == INT4_MOE["vllm"]
    assert not any(m.startswith("model.layers.5.") for m in sg)


def test_kimi_bf16_attention_stays_unquantized(reports):
    """Kimi keeps q_a_proj / kv_a_proj_with_mqa BF16; both engines fuse them and must leave the fused module alone."""
    for engine, name in (("sglang", "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa"),
                         ("vllm", "language_model.model.layers.1.self_attn.fused_qkv_a_proj")):
        rows = {r.module: r for r in reports["kimi/decode"][engine].rows}
        assert rows[name].stored == "bf16" and rows[name].scheme == "UnquantizedLinearMethod"


def _legacy_config(qc: dict) -> dict:
    """quantkit's decode config before this fix: top-level mixed-precision, INT4 group owning Linear,
    FP8 group by exact-name patterns (which vLLM's compressed-tensors loader matched wrongly)."""
    int4 = next(g for g in qc["config_groups"].values() if g["weights"]["num_bits"] == 4)
    fp8 = next(g for g in qc["config_groups"].values() if g["weights"]["num_bits"] == 8)
    int4 = dict(int4, targets=["Linear", r"re:.*mlp\.experts\..*"])
    fp8 = dict(fp8, targets=[r"re:(^|.*\.)layers\.\d+\.(self_attn|mlp)\..*_proj$", r"re:.*indexer\.(wq_b|wk)$"])
    return dict(qc, format="mixed-precision", config_groups={"group_0": int4, "group_1": fp8})


def _with_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_todays_broken_format_is_refused_by_sglang(reports):
    rep = reports["legacy"]
    assert rep["vllm"].loads, rep["vllm"].problems  # vLLM uses each group's own format: it coped
    sg = rep["sglang"]
    assert not sg.loads
    problems = "\n".join(sg.problems)
    assert "mlp.experts: refused: ValueError" in problems and "pack-quantized" in problems  # finding 1
    assert "fused_qkv_a_proj_with_mqa: stored FP8 blocks but the engine picks CompressedTensorsWNA16" in problems  # 2
    assert "gate_up_proj: stored FP8 blocks but the engine picks CompressedTensorsWNA16" in problems  # 2
    assert "weight_block_size is None" in problems  # finding 3


@pytest.mark.slow
def test_cli_exits_nonzero_with_the_reason(outputs, variants, engines_available):
    from typer.testing import CliRunner

    from quantkit.cli import app

    res = CliRunner().invoke(app, ["check-serving", str(variants["legacy"]), "--engine", "sglang"])
    assert res.exit_code == 2
    assert "sglang refuses" in res.output and "pack-quantized" in res.output
    ok = CliRunner().invoke(app, ["check-serving", str(outputs["kimi"].out), "--engine", "vllm", "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.stdout)
    assert [d["loads"] for d in data] == [True, True] and data[0]["engines"][0]["engine"] == "vllm"


def test_create_weights_comparison_catches_a_wrong_group_size(reports):
    """The config says group 64 while the scales were written for 128: the schemes still resolve, but
    the scale tensors SGLang's and vLLM's create_weights register no longer take the stored ones."""
    for e in reports["g64"].values():
        assert not e.loads
        assert any("mlp.experts" in p and "weight_scale" in p for p in e.problems), e.problems


def test_glm_shared_expert_fusion_needs_the_flag(reports):
    """SGLang fuses GLM-5.2's shared expert (256 routed experts) into the routed MoE unless the Linear
    group is INT4. The tiny has 16 experts, so the gate is off for it; with the real count the FP8
    shared expert would land in the INT4 MoE.

    Not executed: the gate itself (models/deepseek_v2.py
    `DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason`; the model file needs the GPU model
    stack) is re-stated in `quantkit.serving.checks.sglang_fusion_flags`; its quantization test,
    `is_wint4afp8_or_wint4a16_config` (models/deepseek_common/utils.py), runs for real."""
    assert not [f for e in reports["glm/decode"].values() for f in e.flags]
    assert reports["e256"]["sglang"].flags == ["--disable-shared-experts-fusion"] and reports["e256"]["vllm"].flags == []
    assert reports["e256"]["sglang"].loads  # a flag to pass, not a refusal


def test_card_asks_for_the_fusion_flag_when_sglang_would_fuse(outputs, variants):
    from quantkit.validation.card import serving_section

    report = outputs["glm"].report
    for folder, flag in ((outputs["glm"].decode, False), (variants["e256"], True)):
        text = "\n".join(serving_section("decode", report, "glm", json.loads((folder / "config.json").read_text())))
        # on the decode command's own line (serve-commands puts it after the network options)
        assert ("\\\n  --disable-shared-experts-fusion" in text) == flag, text


def test_offline_falls_back_to_the_restated_rules(outputs, variants, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "empty"))
    good, bad = check_serving_many([outputs["glm"].decode, variants["legacy"]], ("sglang",), download=False)
    assert good.engines[0].source == "rules" and good.loads
    assert not bad.loads and "rule 1" in " ".join(bad.engines[0].problems)


def test_bf16_shared_experts_stay_unquantized_under_their_fused_name(reports):
    for rep in reports["shared-bf16"].values():
        assert rep.loads, rep.problems
        fused = [r for r in rep.rows if r.module.endswith("shared_experts.gate_up_proj")]
        assert fused and all(r.stored == "bf16" and r.scheme == "UnquantizedLinearMethod" for r in fused), fused


def test_decode_rest_bf16(reports, variants):
    """Kimi's official look: INT4 experts, BF16 everything else; both engines load it, and the report
    says the non-expert bytes differ from prefill."""
    res = variants["rest-bf16-result"]
    qc = json.loads((res.decode / "config.json").read_text())["quantization_config"]
    assert list(qc["config_groups"]) == ["group_0"] and "Linear" in qc["config_groups"]["group_0"]["targets"]
    shared = res.report["shared_tensors"]
    assert {"attention", "shared_expert", "routed_expert"} <= set(shared["differ_classes"])
    assert res.report["recipe"]["decode"]["rest"] == "bf16"
    assert "bf16" in res.report["outputs"]["decode"]["precision"]["attention"]
    for e in reports["rest-bf16"].values():
        assert e.loads, e.problems
        assert not e.flags  # SGLang sees an INT4 Linear group and turns shared-expert fusion off itself
        assert not [r for r in e.rows if r.stored == "fp8"]
        assert [r for r in e.rows if r.stored == "bf16" and "fused_qkv_a" in r.module]


def _real_dims(folder, preset: str):
    """The tiny checkpoint's tensor table with the real model's dimensions (same names, formats and
    quantization config; headers only, nothing allocated): the engines' shape checks on 576-row
    kv_a_proj_with_mqa, 2624-row fused projections and real expert widths."""
    from quantkit.model.arch import arch_from_config, load_preset
    from quantkit.serving.stored import read_stored

    st = read_stored(folder)
    a = arch_from_config(load_preset(preset))
    h, heads = a.hidden_size, a.num_attention_heads
    dims = {"q_a_proj": (a.q_lora_rank, h), "q_b_proj": (heads * a.qk_head_dim, a.q_lora_rank),
            "kv_a_proj_with_mqa": (a.kv_cache_width, h), "kv_b_proj": (heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
            "o_proj": (h, heads * a.v_head_dim)}
    if a.has_dsa:
        dims |= {"wq_b": (a.index_n_heads * a.index_head_dim, a.q_lora_rank), "wk": (a.index_head_dim, h)}
    group = next((g["weights"].get("group_size") for g in st.qc.get("config_groups", {}).values()
                  if g["weights"]["num_bits"] == 4), 128)
    tensors = {}
    for name, (dtype, shape) in st.tensors.items():
        module, _, suffix = name.rpartition(".")
        proj = module.rsplit(".", 1)[-1]
        width = a.moe_intermediate_size * (a.n_shared_experts if ".shared_experts." in module else 1)
        if ".mlp." in module and proj in ("gate_proj", "up_proj", "down_proj"):
            inter = a.intermediate_size if ".experts." not in module and ".shared_experts." not in module else width
            out, inp = (inter, h) if proj != "down_proj" else (h, inter)
        elif proj in dims:
            out, inp = dims[proj]
        else:
            tensors[name] = (dtype, shape)
            continue
        tensors[name] = (dtype, {
            "weight": [out, inp], "weight_packed": [out, inp // 8], "weight_shape": [2],
            "weight_scale": [out, inp // group] if f"{module}.weight_packed" in st.tensors  # INT4 groups
            else [-(-out // 128), -(-inp // 128)],  # FP8 blocks (compressed-tensors' name)
            "weight_scale_inv": [-(-out // 128), -(-inp // 128)]}[suffix])
    return type(st)(st.config, st.text, st.qc, tensors)


def test_real_dimensions_load(outputs, engines_available):
    from quantkit.serving.checks import engine_reports

    cases = [(model, which) for model in ("glm", "kimi") for which in ("prefill", "decode")]
    presets = {"glm": "glm-5.2", "kimi": "kimi-k2.6"}
    stored = [_real_dims(getattr(outputs[model], which), presets[model]) for model, which in cases]
    for engine in ENGINES:  # all four checkpoints in one engine process per engine
        for (model, which), rep in zip(cases, engine_reports(engine, stored, download=False), strict=True):
            assert rep.loads, (model, which, engine, rep.problems)
            assert all(r.params_checked for r in rep.rows if r.stored != "bf16")
            kv_a = [r for r in rep.rows if "fused_qkv_a" in r.module]
            assert kv_a and all(r.stored == ("bf16" if model == "kimi" else "fp8") for r in kv_a)
