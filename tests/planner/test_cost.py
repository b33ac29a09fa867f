"""The convert cost model: budget-driven settings, refusal naming the knob, and one accounting for
`quantkit plan --convert` and `convert` itself."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.errors import ConfigError
from quantkit.model.arch import arch_from_config, load_preset
from quantkit.planner.budgets import parse_bytes
from quantkit.planner.cost import plan_convert, plan_convert_for
from quantkit.quant.methods import METHODS
from quantkit.runtime.units import GB

runner = CliRunner()


def _glm(**kw):
    a = arch_from_config(load_preset("glm-5.2"))
    args = dict(method=METHODS["gptq"], group_size=128, num_samples=512, seq_len=2048, calibrate=True, device="cpu",
                source_bytes=755 * GB, output_bytes=(755 * GB, 400 * GB))
    return plan_convert(a, **(args | kw))


def test_parse_bytes():
    assert parse_bytes("8GB", "x") == 8 * 10**9
    assert parse_bytes("8GiB", "x") == 8 * 2**30
    assert parse_bytes("512MB", "x") == 512 * 10**6
    assert parse_bytes(123, "x") == 123 and parse_bytes(None, "x") is None
    with pytest.raises(ConfigError, match="--max-host-memory"):
        parse_bytes("eight gigs", "--max-host-memory")


def test_budget_drives_store_dtype_backing_and_chunk():
    roomy = _glm(max_host_memory="400GB")
    assert roomy.store.dtype == torch.float32 and roomy.store.backing == "memory" and roomy.expert_chunk == 16
    mid = _glm(max_host_memory="50GB")  # f32 h and x (51.6 GB) do not fit; bf16 (25.8 GB) does
    assert mid.store.dtype == torch.bfloat16 and mid.store.backing == "memory"
    tight = _glm(max_host_memory="24GB")
    assert tight.store.backing == "disk"
    tighter = _glm(max_host_memory="9GB")
    assert tighter.store.backing == "disk" and 1 <= tighter.expert_chunk < tight.expert_chunk
    for c in (roomy, mid, tight, tighter):
        assert c.fits and c.peak_host <= c.host_budget, c.summary()


def test_more_tokens_under_a_binding_budget_keep_the_peak():
    small = _glm(num_samples=8, seq_len=512, max_host_memory="12GB")
    big = _glm(num_samples=32, seq_len=512, max_host_memory="12GB")
    assert big.tokens == 4 * small.tokens
    assert big.peak_host <= 1.10 * small.peak_host
    assert big.peak_host <= 12 * GB


def test_cpu_micro_batch_work_is_capped_whatever_the_budget():
    """On the CPU a micro-batch's attention work stays under MICRO_BATCH_CPU_BYTES however roomy the
    budget (a 64-sample micro-batch took the random DeepSeek-V3-layout benchmark's peak to
    975 MB); on a GPU the budget alone decides. The tiny recipes' 64 x 64 windows stay one
    micro-batch, so their output bytes do not change."""
    from quantkit.planner.budgets import layer_shapes
    from quantkit.planner.cost import MICRO_BATCH_CPU_BYTES, _attention_bytes
    from quantkit.synthetic.tiny import tiny_config

    x = layer_shapes(arch_from_config(load_preset("glm-5.2")))
    cpu = _glm(num_samples=64, seq_len=64, max_host_memory="400GB")
    B = cpu.store.micro_batch
    assert _attention_bytes(x, B, 64) <= MICRO_BATCH_CPU_BYTES < _attention_bytes(x, 2 * B, 64)
    gpu = _glm(num_samples=64, seq_len=64, device="cuda", max_gpu_memory="141GB", max_host_memory="400GB")
    assert gpu.store.micro_batch > B
    for name in ("glm-5.2", "kimi-k2.6"):
        tiny = plan_convert(arch_from_config(tiny_config(name)), method=METHODS["gptq"], group_size=128, num_samples=64,
                            seq_len=64, calibrate=True, max_host_memory="400GB", source_bytes=10**7,
                            output_bytes=(10**7, 10**7))
        assert tiny.store.micro_batch == 64, name


def test_cpu_awq_chunk_rows_are_capped_whatever_the_budget():
    """On the CPU an AWQ chunk's gathered search rows stay under AWQ_ROWS_CPU_BYTES however roomy the
    budget (16 experts at 512 x 512 calibration tokens took a hidden-512 model's AWQ to
    8.4 GB; 2 at a time, 3.5 GB and the same bytes); GPTQ's chunk and a GPU's are the budget's alone,
    and the tiny recipes' calibration keeps its 16-expert chunk (their bytes do not change)."""
    from quantkit.planner.budgets import layer_shapes
    from quantkit.planner.cost import AWQ_ROWS_CPU_BYTES, _awq_rows
    from quantkit.synthetic.tiny import tiny_config

    x = layer_shapes(arch_from_config(load_preset("glm-5.2")))
    awq = _glm(method=METHODS["awq"], num_samples=256, seq_len=512, max_host_memory="400GB")
    assert awq.expert_chunk * _awq_rows(x, awq.tokens) <= AWQ_ROWS_CPU_BYTES < (awq.expert_chunk + 1) * _awq_rows(x, awq.tokens)
    assert _glm(method=METHODS["gptq"], num_samples=256, seq_len=512, max_host_memory="400GB").expert_chunk > awq.expert_chunk
    gpu = _glm(method=METHODS["awq"], num_samples=256, seq_len=512, device="cuda", max_gpu_memory="141GB", max_host_memory="400GB")
    assert gpu.expert_chunk > awq.expert_chunk
    for name in ("glm-5.2", "kimi-k2.6"):
        tiny = plan_convert(arch_from_config(tiny_config(name)), method=METHODS["awq"], group_size=128, num_samples=64,
                            seq_len=64, calibrate=True, max_host_memory="400GB", source_bytes=10**7,
                            output_bytes=(10**7, 10**7))
        assert tiny.expert_chunk == 16, name


def test_awq_budgets_its_chunk_rows_and_never_the_layer_inputs_whole():
    """AWQ reads each expert's rows per chunk from the micro-batches (Inputs.EXPERT_ROWS): its experts
    phase is the chunk's experts (rows included) and one micro-batch, with no N T D term; a method
    that gathers the layer's inputs (Inputs.LAYER) adds exactly that."""
    from quantkit.planner.budgets import layer_shapes
    from quantkit.planner.cost import _awq_block, _awq_per_expert, _expert_mb_bytes
    from quantkit.quant.methods import Inputs

    x = layer_shapes(arch_from_config(load_preset("glm-5.2")))
    awq = _glm(method=METHODS["awq"], num_samples=128, seq_len=512, max_host_memory="64GB")
    C, B = awq.expert_chunk, awq.store.micro_batch
    assert awq.memory["experts"] == C * _awq_per_expert(x, awq.tokens) + _awq_block(x, awq.tokens) + _expert_mb_bytes(x, B, 512)

    class Gathering(type(METHODS["awq"])):  # not registered: the same method, reading the layer whole
        inputs = Inputs.LAYER

    whole = _glm(method=Gathering(), num_samples=128, seq_len=512, max_host_memory="64GB")
    assert whole.expert_chunk == C  # the cap on a chunk's rows binds both (AWQ_ROWS_CPU_BYTES)
    assert whole.memory["experts"] - awq.memory["experts"] == awq.tokens * x.hidden * 4


def test_writer_term_is_the_part_being_filled_per_output():
    """The writers hold the part being filled, up to a shard, per output; the part cut before it is
    on disk before the next chunk's GPTQ peaks (not in the peak: the real-shape GLM's measured peak,
    docs/benchmarks.md)."""
    c = _glm(num_samples=8, seq_len=512, max_host_memory="8GB")
    assert c.shard_bytes == 500 * 10**6 and c.memory["writer"] == 2 * c.shard_bytes  # a GLM 5.2 layer is over a shard
    from quantkit.planner.budgets import layer_shapes

    a = arch_from_config(load_preset("glm-5.2"))
    L = layer_shapes(a).layers  # 78 decoder layers and the MTP layer
    small = plan_convert(a, method=METHODS["gptq"], group_size=128, num_samples=8, seq_len=512, calibrate=True,
                         max_host_memory="8GB", source_bytes=10**9, output_bytes=(L * 10**8, L * 10**7))
    assert small.memory["writer"] == int(10**8 * 1.5) + int(10**7 * 1.5)  # 1.5 x a layer's share, under a shard


def test_reused_experts_cost_their_weights_not_gptq():
    """With every routed expert the source's INT4, reused (Kimi K2.6), a chunk holds its experts'
    float32 weights for the h update (3 I D w each) and nothing of GPTQ, so it takes more experts."""
    from quantkit.planner.budgets import layer_shapes
    from quantkit.planner.cost import _expert_mb_bytes, reused_per_expert

    a = arch_from_config(load_preset("kimi-k2.6"))
    x = layer_shapes(a)
    kw = dict(method=METHODS["gptq"], group_size=32, num_samples=8, seq_len=512, calibrate=True, max_host_memory="8GB",
              source_bytes=600 * GB, output_bytes=(600 * GB, 600 * GB))
    reused, requantized = plan_convert(a, quantized=0.0, **kw), plan_convert(a, quantized=1.0, **kw)
    assert reused_per_expert(x) == 3 * x.expert_width * x.hidden * 4
    C, B = reused.expert_chunk, reused.store.micro_batch
    assert reused.memory["experts"] == (C + 1) * reused_per_expert(x) + _expert_mb_bytes(x, B, 512)  # + one FP8 transient
    assert C > requantized.expert_chunk and reused.peak_host < requantized.peak_host


def test_refuses_and_names_the_knob():
    c = _glm(max_host_memory="4GB")
    assert not c.fits and "--max-host-memory" in c.reason and "raise" in c.reason
    g = _glm(device="cuda", gpu="h100", max_gpu_memory="3GB")
    assert not g.fits and "--max-gpu-memory" in g.reason


def test_rtn_and_reused_experts_need_no_activations():
    c = _glm(method=METHODS["rtn"], calibrate=False)
    assert c.tokens == 0 and c.memory["store"] == 0 and c.seconds["hessians"] == 0


def test_full_scale_glm_on_one_h200_fits_and_says_validate_is_long():
    c = plan_convert_for("glm-5.2", gpu="h200", max_host_memory="200GB")
    assert c.fits and c.peak_device <= c.gpu_budget
    assert c.tokens == 512 * 2048 and c.probe == 0  # 410 windows of data + 102 random; no gptq.low_dampening probe
    assert sum(c.seconds.values()) < 2 * 3600  # the 2 h target (docs/benchmarks.md, "Full-scale predictions")
    assert c.disk["resume_state"] > 0
    # 340 GB of the 1.9 TB kept (device, then host): every greedy token re-reads the rest
    assert c.validate_kept < c.validate_share and any("each greedy token re-reads" in n for n in c.notes)
    big = plan_convert_for("glm-5.2", gpu="h200", max_host_memory="2000GB")
    assert big.validate_kept == big.validate_share and big.validate_seconds < c.validate_seconds / 2


def test_each_compute_phase_carries_the_flops_its_seconds_come_from():
    """ConvertCost.flops: what bench_convert holds each measured phase against. On one H200 the matmul
    phases' seconds are their FLOPs at the device's rate (GLM 5.2: Hessians the largest)."""
    from quantkit.planner.budgets import GPUS

    c = plan_convert_for("glm-5.2", gpu="h200", max_host_memory="200GB")
    rate = GPUS["h200"].flops
    for phase in ("attention", "hessians", "experts_out"):
        assert c.flops[phase] > 0 and c.seconds[phase] == pytest.approx(c.flops[phase] / rate, rel=0.02, abs=0.1)
    assert c.flops["hessians"] > c.flops["gptq"] > 0 and c.flops["rtn"] >= 0
    assert json.loads(json.dumps(c.to_json()))["flops"] == c.flops
    assert plan_convert_for("tiny:glm-5.2", gpu="cpu", method="rtn").flops["hessians"] == 0


def test_a_text_calibration_adds_the_tokenizer_to_the_base(tmp_path):
    """Ids (synthetic, random, token files) need no tokenizer; text does, and transformers' tokenizer is
    TOKENIZER_BYTES of the process (quantkit.inputs.tokens.reads_text)."""
    from quantkit.planner.budgets import BASE_BYTES, TOKENIZER_BYTES

    text = tmp_path / "calib.jsonl"
    text.write_text('{"text": "a b c"}\n')
    ids = plan_convert_for("tiny:glm-5.2", gpu="cpu", validate=False)  # the tiny recipe: synthetic:train
    read = plan_convert_for("tiny:glm-5.2", gpu="cpu", validate=False, calib=str(text))
    assert ids.memory["base"] == BASE_BYTES and read.memory["base"] == BASE_BYTES + TOKENIZER_BYTES
    assert read.peak_host - ids.peak_host == TOKENIZER_BYTES
    missing = CliRunner().invoke(app, ["plan", "tiny:glm-5.2", "--convert", "--gpu", "cpu", "--calib", str(tmp_path / "no.jsonl")])
    assert missing.exit_code != 0 and "no.jsonl: file not found" in missing.output  # refused as convert refuses it


def test_resume_state_saves_are_bounded_by_the_overhead():
    """Rank 0 saves h (26 GB at full scale) every `state_every` layers, as many as keep the saves
    at STATE_OVERHEAD of the run: every layer when a save is quick, every few layers otherwise.
    A count of layers, not a clock, so every run (and every rank) saves after the same layers."""
    from quantkit.planner.cost import STATE_OVERHEAD, state_every

    assert state_every(0.001, 1.0) == 1  # tiny: after every layer
    assert state_every(13.0, 78.0) == 4  # GLM 5.2, one H200
    c = plan_convert_for("glm-5.2", gpu="h200", max_host_memory="200GB")
    compute = sum(v for k, v in c.seconds.items() if k not in ("read", "write", "disk_wait", "resume_state"))
    assert c.state_every > 1
    assert 0 < c.seconds["resume_state"] <= 1.1 * STATE_OVERHEAD * compute + c.disk["resume_state"] / 2e9
    assert plan_convert_for("tiny:glm-5.2", gpu="cpu").state_every == 1


def test_plan_convert_cli_json():
    r = runner.invoke(app, ["plan", "glm-5.2", "--convert", "--gpu", "h200", "--json", "--num-samples", "64"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    # 64 windows and the recipe's extra_random 0.25 of them (16)
    assert d["tokens"] == (64 + 16) * 2048 and d["probe"] == 0 and d["store"]["dtype"] in ("float32", "bfloat16")
    assert d["seconds_total"] > 0
    r = runner.invoke(app, ["plan", "glm-5.2", "--convert", "--gpu", "cpu", "--max-host-memory", "4GB"])
    assert r.exit_code == 0 and "does not fit" in r.output and "--max-host-memory" in r.output


def test_convert_reports_the_same_prediction_as_plan(tiny_glm, tmp_path):
    """One accounting: convert's recorded cost is what `plan --convert` predicts for the same folder."""
    from quantkit.conversion.pipeline import convert

    res = convert(tiny_glm, tmp_path / "out", recipe="tiny-glm-5.2", validate=False, progress=False,
                  max_host_memory="6GB", device="cpu")
    planned = plan_convert_for(str(tiny_glm), recipe="tiny-glm-5.2", gpu="cpu", max_host_memory="6GB", validate=False)
    got = res.report["cost"]
    assert got["memory"] == planned.to_json()["memory"] and got["expert_chunk"] == planned.expert_chunk
    assert got["store"] == planned.to_json()["store"]
    assert res.report["peak_rss_bytes"] <= 6 * GB


def test_a_probe_is_counted_as_tokens_gptq_twice_and_the_copies_it_keeps():
    """gptq.low_dampening's probe windows (quantkit.quant.methods.gptq.probe_windows): stored and run like
    calibration windows but enter no Hessian; every expert quantized twice in one batched call
    (arithmetic x 2, the same launches), with W and H stacked twice."""
    roomy = dict(num_samples=64, seq_len=512, max_host_memory="400GB")  # not this machine's free memory: both at the cap
    base, probed = _glm(**roomy), _glm(**roomy, probe=8)
    assert probed.tokens == base.tokens + 8 * 512
    assert probed.seconds["hessians"] == pytest.approx(base.seconds["hessians"], rel=0.01)
    assert base.seconds["gptq"] < probed.seconds["gptq"] < 2 * base.seconds["gptq"]
    # per expert more (W and H stacked twice); on the CPU half the chunk, so one chunk's work stays put
    assert probed.expert_chunk == base.expert_chunk // 2
    assert probed.memory["experts"] < 1.2 * base.memory["experts"]
    assert any("gptq.low_dampening" in n for n in probed.notes)


def test_convert_and_plan_count_the_probe_alike(tiny_glm, tmp_path):
    import yaml

    from quantkit.conversion.pipeline import convert
    from quantkit.recipe import load_recipe

    rec = load_recipe("tiny-glm-5.2").to_dict()
    rec["gptq"].update({"dampening": 0.1, "low_dampening": 0.01})
    (tmp_path / "low.yaml").write_text(yaml.safe_dump(rec))
    res = convert(tiny_glm, tmp_path / "out", recipe=tmp_path / "low.yaml", validate=False, progress=False,
                  max_host_memory="6GB", device="cpu")
    planned = plan_convert_for(str(tiny_glm), recipe=str(tmp_path / "low.yaml"), gpu="cpu", max_host_memory="6GB",
                               validate=False)
    n, T = rec["calibration"]["num_samples"], rec["calibration"]["seq_len"]
    assert res.report["cost"]["tokens"] == planned.tokens == (n + -(-n // 8)) * T
    assert res.report["cost"]["memory"] == planned.to_json()["memory"]


def test_convert_refuses_before_writing(tiny_glm, tmp_path):
    from quantkit.conversion.pipeline import convert
    from quantkit.errors import OutputError

    with pytest.raises(OutputError, match="--max-host-memory"):
        convert(tiny_glm, tmp_path / "out", recipe="tiny-glm-5.2", validate=False, progress=False,
                max_host_memory="1MB", device="cpu")
    assert not (tmp_path / "out" / "prefill").exists()


def test_disk_overlaps_compute_and_decides_the_multi_gpu_time():
    """Reads (ahead) and writes (in the background) overlap compute: the plan charges the first
    layer's read, the last layer's write and the disk's excess over compute (`disk_wait`), so a
    faster disk helps only while the disk is the bottleneck (`--disk-gbps`)."""
    one = plan_convert_for("glm-5.2", gpu="h200", max_host_memory="2000GB")
    assert "disk_wait" not in one.seconds and one.seconds["write"] < 10  # 1.2 TB hidden behind 1h40m of compute
    slow, fast = (plan_convert_for("glm-5.2", gpu="h200", nproc=8, max_host_memory="250GB", rates={"disk": b})
                  for b in (1e9, 8e9))
    assert slow.seconds["disk_wait"] > 10 * 60 and "disk_wait" not in fast.seconds
    r = runner.invoke(app, ["plan", "glm-5.2", "--convert", "--nproc", "8", "--disk-gbps", "8", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["seconds_total"] == pytest.approx(sum(fast.seconds.values()), abs=1)


def test_a_disk_bandwidth_must_be_positive():
    r = runner.invoke(app, ["plan", "glm-5.2", "--convert", "--disk-gbps", "0"])
    assert r.exit_code == 1 and "--disk-gbps 0" in r.output and "must be positive" in r.output


def test_a_tiny_models_prediction_says_it_is_below_the_resolution_in_units_that_read():
    """A 5.6 MB model was predicted "time 0m00s", "shards 1.29 GB", "disk 0.01 GB"."""
    c = plan_convert_for("tiny:glm-5.2", gpu="cpu")
    text = c.summary()
    assert "0m00s" not in text and "below the planner's resolution" in text and "0.00 GB" not in text
    assert " MB" in text
    shards = text.split("shards up to ")[1].split(";")[0]
    assert shards.endswith("MB"), shards
    big = plan_convert_for("glm-5.2", gpu="h200", max_host_memory="200GB").summary()
    assert "below the planner's resolution" not in big and "time 1h" in big
