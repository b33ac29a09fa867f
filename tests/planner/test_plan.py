"""The planner: published figures, fit / no-fit, config folders, parameter counts, serialisation."""

from __future__ import annotations

import json

import pytest

from quantkit.errors import ConfigError
from quantkit.model.arch import load_preset
from quantkit.planner.capacity import ARTICLE_FIGURES, GB, GiB, plan, render_plan


@pytest.fixture(scope="module")
def glm():
    return plan("glm-5.2")


@pytest.fixture(scope="module")
def kimi():
    return plan("kimi-k2.6")


# ----------------------------------------------------------------------------- published figures


@pytest.mark.parametrize("model", ["glm-5.2", "kimi-k2.6"])
def test_every_published_figure_within_3_percent(model, request):
    p = request.getfixturevalue("glm" if model == "glm-5.2" else "kimi")
    expected = {f.description for f in ARTICLE_FIGURES if f.model == model}
    assert {c.figure for c in p.article} == expected  # none silently skipped at the article's setup
    for c in p.article:
        assert 0.97 <= c.ratio <= 1.03, f"{c.figure}: quantkit {c.quantkit:,.4g} vs {c.article:,.4g} {c.unit}"


def test_glm_fp8_and_int4_sizes(glm):
    src, int4 = glm.checkpoints["source"], glm.checkpoints["int4-bf16"]
    assert src.total_gib == pytest.approx(705, rel=0.03)  # article "705GB" is GiB: 755.6 GB = 703.7 GiB
    assert src.total_bytes / GB == pytest.approx(755.6, rel=0.005)
    assert src.weights_gib_per_gpu == pytest.approx(88, rel=0.03)
    assert int4.total_bytes / GB == pytest.approx(421, rel=0.03)
    assert int4.weights_gib_per_gpu * GiB / GB == pytest.approx(52, rel=0.03)
    # our decode checkpoint keeps the non-expert Linears FP8, so it is smaller than the article's INT4
    assert glm.checkpoints["decode"].total_bytes < int4.total_bytes
    # GLM's published FP8 is what prefill emits
    assert glm.checkpoints["prefill"].total_bytes == src.total_bytes


def test_kimi_kv_capacity(kimi):
    src = kimi.checkpoints["source"]
    assert src.total_bytes / GB == pytest.approx(595, rel=0.03)
    assert src.kv["bf16"].tokens == pytest.approx(686_000, rel=0.03)
    assert src.kv["fp8"].tokens == pytest.approx(1_370_000, rel=0.03)
    assert (src.kv["bf16"].concurrent_requests, src.kv["fp8"].concurrent_requests) == (32, 64)
    assert kimi.kv_bytes_per_layer["bf16"]["per_token"] == 70_272
    assert kimi.kv_bytes_per_layer["fp8"]["per_token"] == 35_136


def test_glm_kv_adds_indexer_cache(glm):
    kv = glm.kv_bytes_per_layer
    assert kv["bf16"]["latent"] == 1152 and kv["fp8"]["latent"] == 656  # FlashMLA sparse FP8 layout
    assert kv["bf16"]["indexer"] == kv["fp8"]["indexer"] == 132
    assert kv["bf16"]["per_token"] == 78 * (1152 + 132)
    assert kv["bf16"]["per_token"] / kv["fp8"]["per_token"] == pytest.approx(1.63, abs=0.01)  # facts sheet
    owners = plan("glm-5.2", indexer_cache="owners").kv_bytes_per_layer["bf16"]
    assert owners["indexer_layers"] == 21 and owners["per_token"] == 78 * 1152 + 21 * 132


# ----------------------------------------------------------------------------- fit / no fit


def test_fp8_kimi_does_not_fit_on_8xh200(kimi):
    pre = kimi.checkpoints["prefill"]
    assert pre.total_bytes / 1e12 == pytest.approx(1.03, rel=0.02)
    assert not pre.fits and pre.reason.startswith("does not fit")
    assert pre.kv["fp8"].tokens == 0 and pre.kv["fp8"].concurrent_requests == 0


def test_fp8_kimi_fits_on_16xh200():
    pre = plan("kimi-k2.6", gpus=16, tp=16).checkpoints["prefill"]
    assert pre.fits and pre.reason == ""
    assert pre.kv["fp8"].concurrent_requests >= 64


def test_replicas_multiply_capacity():
    one = plan("glm-5.2").checkpoints["decode"].kv["fp8"].tokens
    two = plan("glm-5.2", gpus=16, tp=8).checkpoints["decode"].kv["fp8"].tokens
    assert two == 2 * one


def test_replicated_small_tensors_cost_memory(glm):
    rep = plan("glm-5.2", weight_split="replicate-small")
    assert rep.checkpoints["source"].weights_gib_per_gpu > glm.checkpoints["source"].weights_gib_per_gpu
    assert rep.checkpoints["source"].total_bytes == glm.checkpoints["source"].total_bytes


def test_small_gpu_does_not_fit():
    p = plan("glm-5.2", gpu="h100")
    assert not p.checkpoints["source"].fits and p.checkpoints["decode"].fits


def test_qwen3_gqa_kv_cache_and_heads_split_over_tp():
    """GQA caches 2 * num_key_value_heads * head_dim values a layer (Qwen3-30B-A3B: 2 * 4 * 128 * 48
    layers = 98,304 BF16 bytes a token), the key/value heads split over the TP ranks, at most one
    head a rank (vLLM replicates heads when tp > num_key_value_heads); the model has 30.5B parameters."""
    one = plan("qwen3-30b-a3b", gpus=1, gpu="h100")
    assert one.params_total == pytest.approx(30.5e9, rel=0.005)
    assert {d: v["per_token"] for d, v in one.kv_bytes_per_layer.items()} == {"bf16": 98_304, "fp8": 49_152}
    for tp, ways in ((2, 2), (8, 4)):
        p = plan("qwen3-30b-a3b", gpus=tp, gpu="h100")
        src = p.checkpoints["source"]
        room_tokens = src.kv["bf16"].kv_gib_per_gpu * GiB / (98_304 / ways)  # the room is rounded to 1e-3 GiB
        assert src.kv["bf16"].tokens == pytest.approx(room_tokens, rel=1e-3)


# ----------------------------------------------------------------------------- inputs


def test_config_folder_same_as_preset(tmp_path, glm):
    (tmp_path / "config.json").write_text(json.dumps(load_preset("glm-5.2")))
    p = plan(tmp_path)
    assert p.model == "glm-5.2"  # recognised, so it gets the article comparison too
    assert p.to_json()["checkpoints"] == glm.to_json()["checkpoints"]
    assert plan(str(tmp_path)).params_total == glm.params_total


def test_config_dict_works(kimi):
    p = plan(load_preset("kimi-k2.6"))
    assert p.checkpoints["source"].total_bytes == kimi.checkpoints["source"].total_bytes


def test_bad_inputs_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'glm-9'.*known presets: deepseek-v3, glm-5.2, kimi-k2.6, qwen3-30b-a3b"):
        plan("glm-9")
    with pytest.raises(ConfigError, match="config.json: not found"):
        plan(tmp_path)
    with pytest.raises(ConfigError, match="unknown gpu"):
        plan("glm-5.2", gpu="tpu")
    with pytest.raises(ConfigError, match="multiple of tp"):
        plan("glm-5.2", gpus=8, tp=3)
    with pytest.raises(ConfigError, match="kv dtype"):
        plan("glm-5.2", kv_dtypes=("int8",))


# ----------------------------------------------------------------------------- parameter counts


def test_kimi_param_count(kimi):
    assert 1.0e12 <= kimi.params_total <= 1.1e12
    assert kimi.params_text == pytest.approx(1.03e12, rel=0.01)
    assert kimi.params_mtp == 0
    assert 0.85e9 <= kimi.params_vision * 2 <= 1.0e9  # MoonViT + projector, ~0.9 GB BF16


def test_glm_param_count(glm):
    assert 744e9 <= glm.params_total <= 760e9  # MTP included
    assert glm.params_total - glm.params_mtp == pytest.approx(744e9, rel=0.005)
    assert glm.params_by_class["indexer"] == 22 * (32 * 128 * 2048 + 128 * 6144 + 2 * 128 + 32 * 6144)


def test_deepseek_v3_param_count():
    p = plan("deepseek-v3")
    assert p.params_total - p.params_mtp == pytest.approx(671e9, rel=0.005)
    assert p.params_mtp == pytest.approx(14e9, rel=0.05)
    assert p.params_active == pytest.approx(37e9, rel=0.03)


# ----------------------------------------------------------------------------- output


def test_to_json_round_trips(glm, kimi):
    for p in (glm, kimi):
        d = json.loads(json.dumps(p.to_json()))
        assert d["checkpoints"]["source"]["total_bytes"] == p.checkpoints["source"].total_bytes
        assert d["assumptions"]["context"]["value"] == 21_400
        assert d["article"] and d["notes"] is not None


def test_renderings_show_everything(kimi):
    from rich.console import Console

    console = Console(record=True, width=250)
    render_plan(kimi, console)
    text = console.export_text()
    for word in ("does not fit", "686,000", "mem_fraction", "kv_replicated", "1,377,"):
        assert word in text
    md, page = kimi._repr_markdown_(), kimi._repr_html_()
    assert "| kind |" in md and "overhead_gib" in md
    assert "<table>" in page and "does not fit" in page


# ----------------------------------------------------------------------------- group size: the recipe's, or --group-size


def test_group_size_follows_the_models_recipe(kimi, glm):
    """`plan kimi-k2.6` used group 128 while Kimi's recipe (and what convert writes) is group 32:
    decode 539.3 GB instead of 586.9 GB. The plan's default is the recipe's; --group-size still wins."""
    from typer.testing import CliRunner

    from quantkit.cli import app
    from quantkit.model.arch import arch_from_config, load_preset
    from quantkit.recipe import default_recipe

    kimi_rec, glm_rec = (default_recipe(n, arch_from_config(load_preset(n))) for n in ("kimi-k2.6", "glm-5.2"))
    assert kimi.assumptions["group_size"]["value"] == kimi_rec.group_size == 32
    assert glm.assumptions["group_size"]["value"] == glm_rec.group_size == 128
    assert kimi.checkpoints["decode"].total_bytes == plan("kimi-k2.6", group_size=32).checkpoints["decode"].total_bytes
    assert round(kimi.checkpoints["decode"].total_bytes / GB, 1) == 586.9
    runner = CliRunner()
    for args, G in ((["kimi-k2.6"], 32), (["kimi-k2.6", "--group-size", "128"], 128), (["tiny:kimi-k2.6"], 32),
                    (["glm-5.2"], 128)):
        res = runner.invoke(app, ["plan", *args, "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["assumptions"]["group_size"]["value"] == G, args


def test_plan_recommends_only_a_serving_layout_that_passes():
    """The planned TP size is checked with check-serving's per-rank kernel rules on the pair convert would
    write: GLM 5.2 and Kimi K2.6 at TP 8 pass; Qwen3-30B-A3B's 768-wide experts at TP 8 (96 per rank)
    split FP8 blocks and INT4 groups, so the plan recommends experts whole on each rank (EP 8)."""
    for name in ("glm-5.2", "kimi-k2.6"):
        s = plan(name).serving
        assert s["passes"] and s["recommended"] == "--tp 8 --gpu h200", s["problems"][:2]
    q = plan("qwen3-30b-a3b", gpus=8, gpu="h100")
    assert not q.serving["passes"] and q.serving["recommended"] == "--tp 8 --ep 8 --gpu h100"
    assert any("model.layers.0.mlp.experts" in p and "fp8-moe-block" in p for p in q.serving["problems"])
    assert "recommended: --tp 8 --ep 8 --gpu h100" in q.notes[-1]
