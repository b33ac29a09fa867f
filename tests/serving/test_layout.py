"""check-serving at a parallel layout: each module's shard per rank against the engines' kernel rules.

Three kinds of evidence:
  - the engines' own `create_weights` (pinned releases, quantkit.serving.harness) building one rank's
    shard agree with the restated rules on passing and failing sizes (the oracle: skipped offline);
  - the shipped GLM 5.2 and Kimi K2.6 pairs (full-depth preset configs, the checkpoint convert would
    write predicted from config.json) and the real-shape configs pass at TP 1/2/4/8, EP on and off,
    while a real-shape model whose per-rank expert width breaks a rule (Qwen3-30B-A3B: 768 / 8 = 96)
    is refused naming the module, the rule and a layout that works;
  - `quantkit check-serving DIR --tp N` on a tiny converted pair exits 2 with the same.
"""

from __future__ import annotations

import pytest

from quantkit.model.presets import load_preset
from quantkit.serving.layout import (
    Layout,
    check_layout,
    predicted_stored,
    working_layout,
)
from quantkit.synthetic.realshape import realshape_config

ENGINES = ("vllm", "sglang")
RECIPE_GROUP = {"glm-5.2": 128, "kimi-k2.6": 32, "qwen3-30b-a3b": 128}  # what convert writes by default


@pytest.fixture(scope="module")
def shipped():
    """The full-depth pairs convert writes for the shipped presets (predicted from config.json)."""
    return {(name, phase): predicted_stored(load_preset(name), phase, group_size=RECIPE_GROUP[name])
            for name in ("glm-5.2", "kimi-k2.6") for phase in ("prefill", "decode")}


@pytest.mark.parametrize("ep", [1, 8])
@pytest.mark.parametrize("name", ["glm-5.2", "kimi-k2.6"])
def test_shipped_pairs_pass_at_tp8_on_h200(shipped, name, ep):
    for phase in ("prefill", "decode"):
        for engine in ENGINES:
            rep = check_layout(shipped[name, phase], Layout(8, ep, gpu="h200"), engine)
            assert rep.ok, [p.text(engine) for p in rep.problems]
            assert rep.per_rank["routed experts"]["intermediate"] == (2048 if ep == 8 else 256)


def test_kimi_int4_kernel_follows_the_gpu(shipped):
    """Group-32 symmetric experts: Marlin on Hopper; on Blackwell vLLM's FlashInfer TRT-LLM MxInt4 and
    SGLang's Triton WNA16 (the backends the engines' selection code picks)."""
    st = shipped["kimi-k2.6", "decode"]
    assert check_layout(st, Layout(8, gpu="h200"), "vllm").kernels["int4 experts"].startswith("Marlin")
    assert check_layout(st, Layout(8, gpu="h200"), "sglang").kernels["int4 experts"].startswith("Marlin")
    assert "MxInt4" in check_layout(st, Layout(8, gpu="b200"), "vllm").kernels["int4 experts"]
    assert "Triton" in check_layout(st, Layout(8, gpu="b200"), "sglang").kernels["int4 experts"]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["glm-5.2", "kimi-k2.6"])
def test_realshape_configs_pass_at_every_tp(name, tp):
    cfg = realshape_config(name)
    for phase in ("prefill", "decode"):
        st = predicted_stored(cfg, phase, group_size=RECIPE_GROUP[name])
        for ep in (1, tp):
            for dpa in (False, True):
                for engine in ENGINES:
                    rep = check_layout(st, Layout(tp, ep, dpa), engine)
                    assert rep.ok, (tp, ep, dpa, engine, [p.text(engine) for p in rep.problems])


@pytest.fixture(scope="module")
def qwen3():
    cfg = load_preset("qwen3-30b-a3b")  # real shapes: 48 layers, 128 experts of width 768
    return {phase: predicted_stored(cfg, phase, group_size=128) for phase in ("prefill", "decode")}


@pytest.mark.parametrize("tp", [4, 8])
def test_group_and_block_split_across_ranks_is_refused(qwen3, tp):
    """768 / 4 = 192 and 768 / 8 = 96: INT4 group 128 and FP8 128-blocks would straddle ranks."""
    inter = 768 // tp
    for engine in ENGINES:
        dec = check_layout(qwen3["decode"], Layout(tp), engine)
        pre = check_layout(qwen3["prefill"], Layout(tp), engine)
        d = {p.rule: p for p in dec.problems}
        f = {p.rule: p for p in pre.problems}
        assert d["int4-group-per-rank"].module == "model.layers.0.mlp.experts"
        assert f"768 / {tp} = {inter}" in d["int4-group-per-rank"].detail
        assert "compressed_tensors" in d["int4-group-per-rank"].cite and "create_weights" in d["int4-group-per-rank"].cite
        assert f["fp8-moe-block"].module == "model.layers.0.mlp.experts"
        assert "fp8" in f["fp8-moe-block"].cite
    # experts whole on each rank (EP = TP) keeps every rule
    found = working_layout(list(qwen3.values()), Layout(tp), ENGINES)
    assert found == Layout(tp, tp)
    for engine in ENGINES:
        for st in qwen3.values():
            assert check_layout(st, found, engine).ok


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_passes_where_groups_stay_whole(qwen3, tp):
    for engine in ENGINES:
        for st in qwen3.values():
            assert check_layout(st, Layout(tp), engine).ok


def test_vllm_has_no_partial_expert_parallelism(qwen3):
    rep = check_layout(qwen3["decode"], Layout(8, 4), "vllm")
    assert "ep-span" in {p.rule for p in rep.problems}
    assert check_layout(qwen3["decode"], Layout(8, 4), "sglang").ok  # moe_tp 2: 384 per rank


def test_sglang_refuses_experts_that_do_not_divide_by_ep():
    cfg = realshape_config("glm-5.2", experts=12)
    st = predicted_stored(cfg, "decode", group_size=128)
    assert "ep-experts" in {p.rule for p in check_layout(st, Layout(8, 8), "sglang").problems}
    assert check_layout(st, Layout(8, 8), "vllm").ok  # vLLM's expert map spreads a remainder


def test_asymmetric_zero_points_need_whole_int32_per_rank():
    cfg = load_preset("qwen3-30b-a3b")
    cfg["moe_intermediate_size"] = 8 * 97  # 776: at TP 4, 2 x 194 = 388 zero points per rank, not whole int32s
    st = predicted_stored(cfg, "decode", group_size=-1, symmetric=False)
    st.qc["config_groups"]["g"]["weights"].update(strategy="channel", group_size=None)
    rules = {p.rule for p in check_layout(st, Layout(4, gpu="h100"), "vllm").problems}
    assert "int4-zero-point-pack" in rules
    assert "int4-zero-point-pack" not in {p.rule for p in check_layout(st, Layout(2, gpu="h100"), "vllm").problems}


# ---- the engines' own create_weights as the oracle for the restated rules --------------------
@pytest.fixture(scope="module")
def engine_src():
    from quantkit.serving.engines import EngineUnavailable, engine_source

    try:
        return {e: engine_source(e) for e in ENGINES}
    except EngineUnavailable as e:
        pytest.skip(f"engine code unavailable: {e}")


FP8_QC = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
INT4_QC = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
    "targets": [r"re:.*mlp\.experts.*"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 128}}}}


def _moe(inter: int) -> dict:
    return {"name": "model.layers.1.mlp.experts", "class": "FusedMoE", "kind": "moe",
            "create": {"num_experts": 4, "hidden_size": 2048, "intermediate_size": inter}}


def _linear(klass: str, tp: int, full_in: int, full_out: int) -> dict:
    row = klass == "RowParallelLinear"
    create = {"input_size": full_in // tp if row else full_in, "output_sizes": [full_out if row else full_out // tp],
              "input_size_full": full_in, "output_size_full": full_out}
    return {"name": "model.layers.0.self_attn." + ("o_proj" if row else "q_b_proj"), "class": klass,
            "kind": "linear", "tp": tp, "create": create}


def _ask(src, qc: dict, modules: list[dict]) -> list[dict]:
    from quantkit.serving.engines import run_harness

    ans = run_harness(src, {"jobs": [{"quantization_config": qc, "packed_modules_mapping": {}, "create_weights": True,
                                      "modules": modules}]})
    return ans["jobs"][0]["modules"]


def test_engines_own_create_weights_agree_with_the_rules(engine_src):
    """Per-rank sizes that pass and fail each restated rule, built as one rank's shard by the engine's
    own create_weights: a ValueError exactly where the rule says the layout is refused."""
    fp8_cases = [(_moe(256), True), (_moe(96), False),
                 (_linear("RowParallelLinear", 2, 256, 512), True), (_linear("RowParallelLinear", 2, 384, 512), False),
                 (_linear("ColumnParallelLinear", 2, 512, 256), True),
                 (_linear("ColumnParallelLinear", 2, 512, 384), False)]
    for engine, src in engine_src.items():
        got = _ask(src, FP8_QC, [m for m, _ in fp8_cases])
        for (m, ok), row in zip(fp8_cases, got):
            assert row["error"] is None, row
            refused = "not divisible" in (row.get("params_error") or "")
            assert refused == (not ok), (engine, m, row.get("params_error"))
    # INT4 group 128: vLLM refuses 96 per rank outright; SGLang's create_weights floors the down
    # projection's scale groups (96 // 128 = 0), so the scales no longer cover K: a broken load
    vllm, sglang = (_ask(engine_src[e], INT4_QC, [_moe(256), _moe(96)]) for e in ENGINES)
    assert vllm[0]["params"] and "divisible by group_size" in vllm[1]["params_error"]
    for row, inter in zip(sglang, (256, 96)):
        w2_scale = row["params"]["w2_weight_scale"]["shape"]  # [experts, K groups, N] (transposed layout)
        assert (w2_scale[1] * 128 == inter) == (inter == 256), w2_scale


# ---- tiny pairs as convert writes them ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pairs(tmp_path_factory):
    from quantkit.conversion.pipeline import convert

    root = tmp_path_factory.mktemp("tiny")
    return {name: convert(f"tiny:{name}", root / name, method="rtn", validate=False, progress=False)
            for name in ("glm-5.2", "kimi-k2.6")}


def _built(st, engine: str) -> dict[str, tuple]:
    """What check_layout reads of each module the engine builds: its format and its shards' weight shapes."""
    from quantkit.serving.stored import inventory

    def shape(mod: str):
        return next((tuple(st.tensors[f"{mod}.{s}"][1]) for s in ("weight", "weight_packed")
                     if f"{mod}.{s}" in st.tensors), None)
    return {m.name: (m.stored, m.klass, [shape(s) for s in sorted(m.shards)]) for m in inventory(st, engine)}


@pytest.mark.parametrize("name", ["glm-5.2", "kimi-k2.6"])
def test_the_predicted_pair_is_what_convert_writes(tiny_pairs, name):
    """The shipped-pair checks read the checkpoint predicted from config.json (predicted_stored): on the
    tiny configs it is, module by module, what convert writes (format, class, shard shapes, INT4 scheme),
    Kimi's BF16 q_a_proj / kv_a_proj_with_mqa included."""
    import json

    from quantkit.serving.layout import int4_scheme
    from quantkit.serving.stored import read_stored

    out = tiny_pairs[name]
    config = json.loads((out.prefill / "config.json").read_text())
    config.pop("quantization_config", None)
    for phase in ("prefill", "decode"):
        real = read_stored(getattr(out, phase))
        pred = predicted_stored(config, phase, group_size=RECIPE_GROUP[name], all_experts=True)
        for engine in ENGINES:
            assert _built(pred, engine) == _built(real, engine), (phase, engine)
        w_real, w_pred = int4_scheme(real.qc) or {}, int4_scheme(pred.qc) or {}
        assert {k: w_real.get(k) for k in ("group_size", "symmetric")} == \
            {k: w_pred.get(k) for k in ("group_size", "symmetric")}, phase


@pytest.mark.parametrize("ep_on", [False, True], ids=["ep-off", "ep-on"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tiny_pairs_at_every_tp_and_ep(tiny_pairs, tp, ep_on, tmp_path, monkeypatch):
    """The tiny pairs' 128-wide attention and experts split FP8 blocks and INT4 groups at any TP > 1:
    each refusal names the module, the rule and a layout that works, and that layout passes both
    engines on both checkpoints. (The engines' scheme check runs on the offline rules here.)"""
    from quantkit.serving.checks import check_serving_many
    from quantkit.serving.layout import RULES
    from quantkit.serving.stored import read_stored

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "empty"))
    layout = Layout(tp, tp if ep_on else 1)
    for name, out in tiny_pairs.items():
        folders = [out.prefill, out.decode]
        reps = check_serving_many(folders, download=False, layout=layout)
        if tp == 1:
            assert all(r.loads for r in reps), [p for r in reps for e in r.engines for p in e.problems]
            continue
        works = set()
        for r in reps:
            for e in r.engines:
                assert not e.loads, (name, r.folder, e.engine)
                head = next(p for p in e.problems if "break a kernel rule" in p)
                works.add(head.split("a layout that works: ")[1])
                named = [p for p in e.problems if p.startswith(f"at {layout.flags()}: ") and "(rule " in p]
                assert named, e.problems
                for p in named:
                    module = p.split(": ")[1]
                    rule = p.split("(rule ")[1].split(":")[0]
                    assert rule in RULES and RULES[rule][1][e.engine] in p, p  # the rule and its citation
                    assert module.startswith(("model.", "language_model.", "self_attn", "all routed")), p
        assert len(works) == 1, works
        flags = works.pop().split()
        found = Layout(int(flags[1]), int(flags[3]) if "--ep" in flags else 1, "--dp-attention" in flags,
                       flags[flags.index("--gpu") + 1])
        for engine in ENGINES:
            for folder in folders:
                assert check_layout(read_stored(folder), found, engine).ok, (name, found, engine)


def test_check_serving_cli_refuses_a_tiny_pair_at_tp2(tiny_pairs):
    """Tiny GLM: 128-wide attention and experts. At TP 2 every FP8 block and INT4 group splits: exit 2
    naming the module, the rule and a layout that works."""
    import subprocess
    import sys

    out = tiny_pairs["glm-5.2"]
    proc = subprocess.run([sys.executable, "-m", "quantkit", "check-serving", str(out.decode), "--tp", "2",
                           "--engine", "vllm"], capture_output=True, text=True, env=_env(), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = " ".join(proc.stderr.split())
    assert "model.layers.1.mlp.experts" in err and "rule int4-group-per-rank" in err
    assert "a layout that works: --tp 2 --ep 2 --dp-attention --gpu h200" in err
    last = proc.stdout.strip().splitlines()[-1]  # one verdict line ends the report
    assert last.startswith("verdict: REFUSED: vllm refuses ") and last.endswith("(exit 2)"), proc.stdout[-500:]
    assert proc.stdout.count("verdict:") == 1
    ok = subprocess.run([sys.executable, "-m", "quantkit", "check-serving", str(out.decode), "--tp", "1",
                         "--engine", "vllm"], capture_output=True, text=True, env=_env(), check=False)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip().splitlines()[-1].startswith("verdict: loads: vllm would load "), ok.stdout[-500:]


def _env():
    import os

    return dict(os.environ, COLUMNS="200")
