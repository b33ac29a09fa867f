"""convert: the pair loads in a real client, matches quantkit.logits, shares its non-expert bytes,
beats RTN with GPTQ, resumes byte-identically after a kill, and reports every fallback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import starve_expert
from oracle import read_raw, transformers_model

from quantkit.checkpoint.reader import Checkpoint
from quantkit.conversion.pipeline import convert
from quantkit.errors import OutputError
from quantkit.quant.gptq import quantize_rtn
from quantkit.synthetic.tiny import batches
from quantkit.validation.forward import logits, run
from quantkit.validation.metrics import paired, token_kl

IDS = torch.tensor([[1, 5, 9, 13, 40, 41, 42, 7, 8, 100, 101, 3]])


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_glm, tiny_kimi):
    root = tmp_path_factory.mktemp("pairs")
    out = {}
    for name, spec in (("glm", "tiny:glm-5.2"), ("kimi", "tiny:kimi-k2.6")):
        out[name] = convert(spec, root / name, validate=False, progress=False)
    out["glm-rtn"] = convert("tiny:glm-5.2", root / "glm-rtn", method="rtn", validate=False, progress=False)
    out["kimi-g128"] = convert("tiny:kimi-k2.6", root / "kimi-g128", group_size=128, validate=False, progress=False)
    out["kimi-g128-rtn"] = convert("tiny:kimi-k2.6", root / "kimi-g128-rtn", group_size=128, method="rtn", validate=False, progress=False)
    return out


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _without_activation_quant(model):
    """transformers runs compressed-tensors FP8 layers with dynamic 1x128 activation fake-quant (as
    the engines' W8A8 kernels do); quantkit's reference measures the weights. Switch that off to
    compare the same function, and upcast what transformers kept in BF16 (merged experts)."""
    from compressed_tensors.quantization import disable_quantization

    model.apply(disable_quantization)
    for p in model.parameters():
        p.data = p.data.float()
    return model


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_glm_outputs_load_in_transformers_and_match(pairs, which, tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder = pairs["glm"].out / which
    ours = logits(folder, IDS)
    if which == "decode":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
        model = _without_activation_quant(model)
    else:
        # transformers loads it (checked), but on CPU it dequantizes FP8 with a block inferred from
        # the scale grid, wrong for the 160-row kv_a_proj_with_mqa: compare on weights dequantized
        # independently with the 128x128 formula (tests/oracle.py).
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model = transformers_model(folder, tmp_path / "oracle")
    with torch.no_grad():
        theirs = model(IDS).logits
    assert _rel(ours, theirs) < 1e-4


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_kimi_outputs_load_in_transformers_and_match(pairs, which):
    """Kimi keeps its kimi_k25 wrapper: transformers' native Kimi_K25ForConditionalGeneration,
    vision tower included, loads both outputs."""
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig

    folder = pairs["kimi"].out / which
    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if which == "decode" else {}
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **kw)
    model = _without_activation_quant(model) if which == "decode" else model
    for p in model.parameters():
        p.data = p.data.float()
    with torch.no_grad():
        theirs = model(input_ids=IDS).logits
    assert _rel(logits(folder, IDS), theirs) < 1e-4


EVAL = batches(256, 64, seed=3000)  # 16384 held-out tokens; verdicts from paired differences (quantkit.validation.metrics)


# GLM's experts start from FP8: INT4 costs real accuracy and GPTQ recovers most of it (scripts/
# quality.py: ~5 standard errors better than RTN on three builds of the tiny GLM). Kimi's start as
# QAT INT4 g32, so requantizing to g128 loses little either way: GPTQ must not be worse than RTN.
@pytest.mark.parametrize("gptq_run,rtn_run,src,claim", [
    ("glm", "glm-rtn", "tiny:glm-5.2", "better"),
    ("kimi-g128", "kimi-g128-rtn", "tiny:kimi-k2.6", "not_worse"),
])
def test_gptq_vs_rtn_on_heldout_kl(pairs, gptq_run, rtn_run, src, claim):
    ref = logits(src, EVAL)
    d = paired(token_kl(ref, logits(pairs[gptq_run].decode, EVAL)), token_kl(ref, logits(pairs[rtn_run].decode, EVAL)))
    assert getattr(d, claim)(z=2.0), f"GPTQ - RTN KL: {d}"


def test_guard_keeps_rtn_where_it_is_better_on_heldout_tokens(pairs):
    """Every calibrated expert was judged against RTN on held-out routed tokens, and what is stored
    is the one with the lower error there."""
    judged = [e for e in pairs["glm"].report["experts"] if e["heldout"]]
    assert judged and pairs["glm"].report["experts_summary"]["guarded"] == len(judged)
    for e in judged:
        assert (e["method"] == "rtn") == (e["err_rtn"] < e["err"]) == (e["guard"] == "rtn")
        # the report says it in words too: calibrated or fallback, and the errors that decided it. A
        # starved expert (fitted on every token of the layer) is judged too, and stays a fallback: which
        # experts starve depends on the trained tiny model's routing, so on some CPUs there are none
        starved = e["fallback"] == "all_tokens"
        assert e["decision"] == ("fallback" if e["guard"] == "rtn" or starved else "calibrated")
        assert e["why"].startswith("starved: ") == starved
        assert f"{e['err']:.4g}" in e["why"] and f"{e['err_rtn']:.4g}" in e["why"]
    s = pairs["glm"].report["experts_summary"]
    assert sum(s["decisions"].values()) == s["total"]


def test_coverage_per_layer_and_each_experts_statistics(pairs, tiny_glm):
    """convert-report.json's coverage: per layer the routed tokens' min, p10 and median (checked against
    the statistics module's inclusive quantiles), per input column of gate/up, and the reasons'
    counts, which add up to the layer's experts and agree with each expert's decision."""
    import statistics

    r = pairs["glm"].report
    hidden = Checkpoint(tiny_glm).arch.hidden_size
    assert all(e["tokens_per_column"] == round(e["tokens"] / hidden, 4) for e in r["experts"])
    rows = {row["layer"]: row for row in r["coverage"]}
    assert sorted(rows) == sorted({e["layer"] for e in r["experts"]}) == [1, 2, 3, 4, 5]  # the MTP layer too
    for layer, row in rows.items():
        mine = [e for e in r["experts"] if e["layer"] == layer]
        seen = [e["tokens"] for e in mine]
        assert row["experts"] == len(mine) == 16
        assert row["routed_tokens"]["min"] == min(seen)
        assert row["routed_tokens"]["p10"] == round(statistics.quantiles(seen, n=10, method="inclusive")[0], 1)
        assert row["routed_tokens"]["median"] == round(statistics.median(seen), 1)
        assert row["tokens_per_column"]["median"] == round(statistics.median(seen) / hidden, 4)
        assert sum(row["reasons"].values()) == 16 and row["reasons"] == dict(Counter(e["reason"] for e in mine))
        for e in mine:
            assert e["reason"].startswith("calibrated") == (e["decision"] == "calibrated")
            assert (e["reason"] == "guard kept RTN") == (e["guard"] == "rtn" and not e["fallback"])
    kimi = pairs["kimi"].report["coverage"]  # the source's INT4 reused: nothing calibrated to count tokens for
    assert all(row["reasons"] == {"reused": 16} and "routed_tokens" not in row for row in kimi)
    rtn = pairs["glm-rtn"].report["coverage"]  # a data-free method (and its MTP layer): no calibration to count
    assert all(len(row["reasons"]) == 1 and "routed_tokens" not in row for row in rtn)
    assert [next(iter(row["reasons"])) for row in rtn] == ["data-free"] * 4 + ["mtp: no calibration path (RTN)"]
    from typing import get_args

    from quantkit.quant.experts import Fallback

    for pair in pairs.values():  # every fallback is one of the typed names; the words are the report's `why`
        assert all(e["fallback"] in (None, *get_args(Fallback)) for e in pair.report["experts"])
    assert {e["fallback"] for e in pairs["glm-rtn"].report["experts"] if e["layer"] == 5} == {"mtp-no-path"}


@pytest.mark.parametrize("name", ["glm", "kimi"])
def test_non_expert_tensors_byte_identical_across_the_pair(pairs, name):
    prefill, decode = read_raw(pairs[name].prefill), read_raw(pairs[name].decode)
    shared = 0
    for k, v in prefill.items():
        if ".mlp.experts." in k:
            continue
        dk = k.replace("weight_scale_inv", "weight_scale")  # compressed-tensors' name, same bytes
        assert dk in decode, k
        assert v.dtype == decode[dk].dtype and torch.equal(v.view(torch.uint8), decode[dk].view(torch.uint8)), k
        shared += 1
    assert shared > 50
    experts = [k for k in decode if ".mlp.experts." in k]
    assert experts and all(k.endswith(("weight_packed", "weight_scale", "weight_shape")) for k in experts)
    assert pairs[name].report["shared_tensors"]["differ_classes"] == ["routed_expert"]


def test_kimi_decode_reuses_source_int4_bit_for_bit(pairs, tiny_kimi):
    src, dec = read_raw(tiny_kimi), read_raw(pairs["kimi"].decode)
    expert_keys = [k for k in src if ".mlp.experts." in k]
    assert expert_keys
    for k in expert_keys:
        assert torch.equal(src[k], dec[k]), k
    assert pairs["kimi"].report["experts_summary"]["reused"] == pairs["kimi"].report["experts_summary"]["total"]
    # the prefill side re-blocks the INT4 experts as FP8 (dequantized, not copied)
    pre = read_raw(pairs["kimi"].prefill)
    assert pre[expert_keys[0].rsplit(".", 1)[0] + ".weight"].dtype == torch.float8_e4m3fn


def test_glm_prefill_passes_source_fp8_through(pairs, tiny_glm):
    src, pre = read_raw(tiny_glm), read_raw(pairs["glm"].prefill)
    kv_scales = {k for k in pre if k.endswith(("self_attn.k_scale", "self_attn.v_scale"))}  # convert's own (quantkit.model.kvcache)
    assert kv_scales and set(src) == set(pre) - kv_scales
    for k, v in src.items():
        assert torch.equal(v.view(torch.uint8), pre[k].view(torch.uint8)), k


def test_configs_are_what_engines_load(pairs):
    pre = json.loads((pairs["glm"].prefill / "config.json").read_text())["quantization_config"]
    assert pre["quant_method"] == "fp8" and pre["weight_block_size"] == [128, 128]
    assert any("mlp.gate" in m for m in pre["modules_to_not_convert"])
    dec = json.loads((pairs["glm"].decode / "config.json").read_text())["quantization_config"]
    g0, g1 = dec["config_groups"]["group_0"], dec["config_groups"]["group_1"]
    assert dec["quant_method"] == "compressed-tensors" and dec["format"] == "pack-quantized"
    assert g0["weights"]["symmetric"] is True and g0["weights"]["group_size"] == 128
    assert g0["targets"] == [r"re:.*mlp\.experts\..*"] and g1["targets"] == ["Linear"]  # see test_serving.py
    kimi = json.loads((pairs["kimi"].decode / "config.json").read_text())
    assert kimi["model_type"] == "kimi_k25"
    assert kimi["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    # tokenizer, chat template and generation config are carried to both outputs
    for folder in (pairs["kimi"].prefill, pairs["kimi"].decode):
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    # Kimi keeps six-digit shard names, GLM five
    assert any(p.name.endswith("-of-000005.safetensors") for p in pairs["kimi"].decode.iterdir())
    assert any(p.name.endswith("-of-00007.safetensors") for p in pairs["glm"].decode.iterdir())


def test_report(pairs, tiny_glm):
    r = pairs["glm"].report
    assert r["source"]["files"] and all(len(h) == 64 for h in r["source"]["files"].values())
    assert r["calibration"]["tokens"] == r["calibration"]["num_samples"] * r["calibration"]["seq_len"]
    assert len(r["layers"]) == 6 and all(l["seconds"] >= 0 for l in r["layers"])
    assert r["experts_summary"]["total"] == 5 * 16  # 4 MoE layers + the MTP layer
    mtp = [e for e in r["experts"] if e["layer"] == 5]
    # the MTP layer is calibrated on its serving inputs (tests/model/test_mtp.py), judged by the guard like any layer
    assert all(e["method"] == "gptq" or e["guard"] == "rtn" for e in mtp) and r["mtp"]["calibrated_layers"] == [5]
    calibrated = [e for e in r["experts"] if e["layer"] < 5]
    assert sum(e["tokens"] for e in calibrated) == 4 * r["calibration"]["tokens"] * 4  # 4 layers x top-4
    cal = r["calibration"]
    assert sum(e["tokens"] for e in mtp) == cal["num_samples"] * (cal["seq_len"] - 1) * 4  # T - 1 MTP positions
    assert r["outputs"]["decode"]["bytes"] < r["outputs"]["prefill"]["bytes"]


def test_starved_expert_takes_fallback_and_is_reported(tiny_glm, tmp_path):
    starve_expert(tiny_glm, tmp_path / "src", layer=2, expert=3)
    res = convert(tmp_path / "src", tmp_path / "out", recipe="tiny-glm-5.2", validate=False, progress=False)
    rec = next(e for e in res.report["experts"] if e["layer"] == 2 and e["expert"] == 3)
    assert rec["tokens"] == 0 and rec["fallback"] == "all_tokens"
    assert rec["decision"] == "fallback" and rec["why"].startswith("starved: 0 routed calibration tokens")
    assert rec["method"] == "gptq" or rec["guard"] == "rtn"  # the held-out guard may prefer RTN, and says so
    assert res.report["experts_summary"]["starved"] >= 1
    # never silently zeroed: its INT4 weights are a quantization of this expert, as far from the
    # source as INT4 goes (GPTQ moves weights to cancel output error: within 3x RTN's weight error;
    # an all-zero expert would be at 1.0)
    ck_src, ck_dec = Checkpoint(tmp_path / "src"), Checkpoint(res.decode)
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    w, wq = ck_src.get(name), ck_dec.get(name)
    rtn = quantize_rtn(w, 128).dequantize()
    assert wq.abs().sum() > 0 and (w - wq).norm() < 3 * (w - rtn).norm() < 0.5 * w.norm()


def _convert_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "quantkit.cli", "convert", "tiny:glm-5.2", "--out", str(out), "--no-validate", *extra]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_kill_and_resume_gives_byte_identical_outputs(tiny_glm, tmp_path):
    env = dict(os.environ, QUANTKIT_CONVERT_LAYER_DELAY="0.7")  # slow the loop so the kill lands mid-run
    whole = tmp_path / "whole"
    subprocess.run(_convert_cmd(whole), check=True, capture_output=True, env=env)

    cut = tmp_path / "cut"
    proc = subprocess.Popen(_convert_cmd(cut), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    state = cut / ".quantkit-convert" / "state.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        if state.is_file() and json.loads(state.read_text() or "{}").get("next_layer", -1) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "prefill").exists() and not (cut / "decode").exists()  # nothing under a final name
    done = subprocess.run(_convert_cmd(cut, "--resume"), capture_output=True, env=env, text=True)
    assert done.returncode == 0, done.stderr
    for which in ("prefill", "decode"):
        assert _files(cut / which) == _files(whole / which), which


def test_same_inputs_give_identical_outputs(pairs, tmp_path):
    again = convert("tiny:glm-5.2", tmp_path / "again", validate=False, progress=False)
    for which in ("prefill", "decode"):
        assert _files(again.out / which) == _files(pairs["glm"].out / which)


def test_existing_output_is_refused(pairs):
    with pytest.raises(OutputError, match="already exists"):
        convert("tiny:glm-5.2", pairs["glm"].out, validate=False, progress=False)


def test_cli_convert_json_and_errors(tmp_path):
    from typer.testing import CliRunner

    from quantkit.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["convert", "tiny:kimi-k2.6", "--out", str(tmp_path / "k"), "--no-validate", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["experts_summary"]["reused"] == 48
    again = runner.invoke(app, ["convert", "tiny:kimi-k2.6", "--out", str(tmp_path / "k"), "--no-validate"])
    assert again.exit_code == 1 and "already exists" in again.output and "Traceback" not in again.output
    bad = runner.invoke(app, ["convert", "tiny:kimi-k2.6", "--out", str(tmp_path / "b"), "--group-size", "48", "--no-validate"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output


def test_decode_checkpoint_runs_through_reference_incremental_path(pairs):
    """The decode checkpoint decodes through the MLA cache like the source does."""
    from quantkit.validation.forward import new_caches

    ck = Checkpoint(pairs["glm"].decode)
    full = run(ck, IDS)
    caches = new_caches(ck)
    first = run(ck, IDS[:, :8], caches=caches)
    rest = [run(ck, IDS[:, t:t + 1], caches=caches) for t in range(8, IDS.shape[1])]
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, rtol=1e-4, atol=1e-4)


# ---- Qwen3-MoE (GQA with q/k norms, softmax router, no shared expert), end to end ----------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tiny_qwen3):
    """tiny:qwen3-moe converted with its recipe (GPTQ experts, FP8 prefill + INT4 decode), then
    validated with the KV cache stored in FP8 (every bf16 row plus the FP8-KV rows)."""
    from quantkit.validation.pipeline import validate

    res = convert("tiny:qwen3-moe", tmp_path_factory.mktemp("qwen3") / "out", validate=False, progress=False)
    return res, validate(res.out, kv_cache_dtype="fp8_e4m3", progress=False)


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_qwen3_outputs_load_in_transformers_and_match(qwen3, which):
    """Qwen3MoeForCausalLM loads both outputs (transformers' own FP8 block dequantization: every
    projection is a multiple of 128 rows here) and computes quantkit's logits."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder = getattr(qwen3[0], which)
    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if which == "decode" else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    model = _without_activation_quant(model) if which == "decode" else model.float()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        theirs = model(IDS).logits
    assert _rel(logits(folder, IDS), theirs) < 1e-4


def test_qwen3_pair_precisions_kv_scales_and_validation(qwen3):
    res, val = qwen3
    r = res.report
    assert r["experts_summary"]["total"] == 3 * 16 and r["outputs"]["decode"]["bytes"] < r["outputs"]["prefill"]["bytes"]
    pre, dec = read_raw(res.prefill), read_raw(res.decode)
    assert pre["model.layers.1.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.mlp.experts.5.down_proj.weight_packed" in dec and not any("shared_experts" in k for k in dec)
    # GQA: a k_scale and a v_scale per layer, apart (keys and values have their own maxima), both outputs alike
    for layer, got in r["kv_cache"]["layers"].items():
        p = f"model.layers.{layer}.self_attn."
        assert got["k_scale"] != got["v_scale"]
        for out in (pre, dec):
            stored = (float(out[p + "k_scale"]), float(out[p + "v_scale"]))  # float32 of the report's values
            assert stored == pytest.approx((got["k_scale"], got["v_scale"]), rel=1e-7)
    assert val.passed and val.data["kv_cache"]["calibrated"]
    assert {"decode_kv", "cross_phase_kv"} <= set(val.data["rows"])


def test_qwen3_plan_reads_the_output(qwen3):
    """plan on the decode folder: GQA's KV bytes (2 x 2 heads x 64 x 3 layers x 2 bytes) and the INT4 experts' size."""
    from quantkit.planner.capacity import plan

    p = plan(qwen3[0].decode, gpus=1, gpu="h100")
    assert {d: v["per_token"] for d, v in p.kv_bytes_per_layer.items()} == {"bf16": 1536, "fp8": 768}


def test_qwen3_fp8_source_reads(tiny_qwen3, tmp_path):
    """Qwen's fine-grained FP8 release layout (e4m3 + float32 weight_scale_inv per 128x128 block, norms,
    router and head BF16: Qwen3-30B-A3B-FP8) is the one GLM-5.2-FP8 ships, and the same reader takes it:
    its logits are the BF16 source's within FP8's rounding, and transformers agrees on the same file."""
    from quantkit.model.arch import load_arch
    from quantkit.synthetic.tiny import save_glm

    src = read_raw(tiny_qwen3)
    cfg = json.loads((tiny_qwen3 / "config.json").read_text())
    body = {k: v.float() for k, v in src.items() if not k.startswith(("model.embed", "model.norm", "lm_head"))}
    save_glm(src | body, load_arch(tiny_qwen3), cfg, tmp_path / "fp8")  # GLM-5.2-FP8's = Qwen3-FP8's layout
    ck = Checkpoint(tmp_path / "fp8")
    assert ck.tensors["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == "F8_E4M3"
    assert _rel(logits(tmp_path / "fp8", IDS), logits(tiny_qwen3, IDS)) < 0.05
    model = transformers_model(tmp_path / "fp8", tmp_path / "oracle")
    with torch.no_grad():
        assert _rel(logits(tmp_path / "fp8", IDS), model(IDS).logits) < 1e-4


def test_new_family_of_existing_layer_kinds_needs_only_its_definition(qwen3, tiny_qwen3, tmp_path):
    """A family quantkit has never seen, made only of layer kinds it runs (Qwen3-MoE's, under another
    model_type and other tensor names: the decoder under `backbone.`, the head `output.weight`), is one
    Family registered at run time and nothing else: inspect reads it and convert makes the same bytes
    as for Qwen3-MoE, tensor for tensor under the new names."""
    from dataclasses import replace

    from quantkit.checkpoint.writer import CheckpointWriter
    from quantkit.model.families import QWEN3_MOE, REGISTRY, register
    from quantkit.planner.inspection import inspect
    from quantkit.synthetic.tiny import tokenizer_files

    fam = replace(QWEN3_MOE, model_type="tiny_moe", name="tiny_moe", description="a test family",
                  prefix="backbone.", head_name="output.weight", recipe=None, presets=())
    rename = {"model.": fam.prefix, "lm_head.weight": fam.head_name}

    def renamed(name: str) -> str:
        return next((new + name[len(old):] for old, new in rename.items() if name.startswith(old)), name)

    register(fam)
    try:
        cfg = json.loads((tiny_qwen3 / "config.json").read_text()) | {"model_type": "tiny_moe"}
        w = CheckpointWriter(tmp_path / "src", digits=5)
        for name, t in read_raw(tiny_qwen3).items():
            w.add(renamed(name), t)
        w.finish(cfg, extra=tokenizer_files())
        got = inspect(tmp_path / "src")
        assert (got.model_type, got.layers, got.routed_experts) == ("tiny_moe", 3, 16)
        res = convert(tmp_path / "src", tmp_path / "out", recipe="tiny-qwen3-moe", validate=False, progress=False)
    finally:
        REGISTRY.pop("tiny_moe")
    for which in ("prefill", "decode"):
        ours, theirs = read_raw(getattr(res, which)), read_raw(getattr(qwen3[0], which))
        assert set(ours) == {renamed(k) for k in theirs}
        for k, v in theirs.items():
            assert torch.equal(ours[renamed(k)].view(torch.uint8), v.view(torch.uint8)), k
