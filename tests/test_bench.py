"""scripts/bench_convert.py: the pieces its fairness rests on (fast), and one whole run (opt-in).

The fast tests check that the copy llm-compressor starts from has exactly the source's values, that
splicing quantkit's INT4 experts into it reproduces quantkit's decode model, that per-child peak RSS
is that child's own, and that the table renders. The whole benchmark takes minutes; it runs only
with QUANTKIT_BENCH=1.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import small_config, write_random

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_convert", ROOT / "scripts" / "bench_convert.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_measured_reports_each_child_alone(bench, tmp_path):
    big = bench.measured([sys.executable, "-c", "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])"],
                         tmp_path / "big.log")
    small = bench.measured([sys.executable, "-c", "pass"], tmp_path / "small.log")
    assert big["peak_rss_bytes"] > 300 * 2**20
    assert small["peak_rss_bytes"] < 100 * 2**20  # not the maximum over all children so far
    assert small["wall_s"] > 0 and small["cpu_s"] >= 0
    with pytest.raises(RuntimeError, match="exited 3"):
        bench.measured([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "fail.log")


def test_reference_copy_is_exact_and_splice_reproduces_decode(bench, tmp_path):
    from quantkit.validation.forward import logits

    src, _ = write_random(tmp_path / "src", small_config("glm"), linears="fp8", experts="fp8")
    ref = bench.reference_copy(src, tmp_path / "ref", "float32")
    ids = torch.tensor([[1, 5, 9, 13, 40, 41, 42, 7, 8, 100, 101, 3]])
    assert torch.equal(logits(src, ids, device="cpu"), logits(ref, ids, device="cpu"))

    # an RTN pair needs no calibration; FP8 linears pass through, so decode differs only in experts
    env = dict(os.environ, OMP_NUM_THREADS="1")
    m = bench.quantkit_convert(src, tmp_path / "qk", "rtn", _args(), "tiny-glm-5.2", tmp_path / "logs", env)
    assert m["report"]["experts_summary"]["rtn"] > 0
    spliced = bench.splice_experts(ref, tmp_path / "qk" / "decode", tmp_path / "spliced")
    a, b = logits(tmp_path / "qk" / "decode", ids, device="cpu"), logits(spliced, ids, device="cpu")
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
    assert not torch.equal(a, logits(ref, ids, device="cpu"))  # the experts really changed


def test_llm_compressor_gets_the_windows_quantkit_calibrates_on(bench, tmp_path):
    """With a random share (or a mix) in the recipe, the ids handed to llm-compressor are convert's own."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.conversion.pipeline import _calibration_tokens
    from quantkit.recipe import load_recipe, recipe_overrides

    src, _ = write_random(tmp_path / "src", small_config("glm"))
    base = load_recipe("tiny-glm-5.2")
    for share in (0.0, 0.25):
        rec = recipe_overrides(base.model_copy(update={"calibration": base.calibration.model_copy(
            update={"extra_random": share})}), num_samples=8, seq_len=16, calib="synthetic:train")
        ours = bench.calibration_tokens(rec, src)
        assert ours.ids.shape == (8 + round(8 * share), 16)
        assert ours.sha256 == _calibration_tokens(rec, None, Checkpoint(src), False).sha256


def test_compare_and_paired(bench):
    ref = torch.randn(4, 8, 16).log_softmax(-1)
    same = bench.compare(ref, ref)
    assert same["kl"] == 0 and same["top1"] == 1
    other = bench.compare(ref, (ref + 0.1 * torch.randn_like(ref)).log_softmax(-1))
    assert other["kl"] > 0 and other["kl_se"] > 0
    p = bench.paired(other, same)
    assert p["diff"] == pytest.approx(other["kl"])


def test_render(bench):
    run = {"wall_s": 1.0, "cpu_s": 0.5, "peak_rss_bytes": 300 * 2**20}
    q = {"kl": 0.001, "kl_se": 0.0001, "top1": 0.99}
    res = {"model": "tiny:glm-5.2", "model_type": "glm_moe_dsa", "calibration": "c", "group_size": 128, "eval": "e",
           "threads": 1, "runs": {"a": run}, "labels": {"a": "run a", "b": "row without a run"},
           "quality": {"vs_source": {"a": q, "b": q}, "experts_only": {"a": q}},
           "ratios": {"wall time": bench._ratio(0.4, 0.5), "CPU time": bench._ratio(0.3) | {"diff": 0.1, "diff_se": 0.01}}}
    out = bench.render(res)
    assert "run a" in out and "row without a run" in out and "met" in out and "paired KL difference" in out


def test_arithmetic_holds_each_phase_against_the_planners_flops(bench, tmp_path):
    """A GPTQ convert times its phases per layer; the table divides the planner's FLOPs for that run by
    their CPU seconds summed over layers, and the guard is the solve's remainder."""
    src, _ = write_random(tmp_path / "src", small_config("glm"), linears="fp8", experts="fp8")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = bench.quantkit_convert(src, tmp_path / "qk", "gptq", _args(), "tiny-glm-5.2", tmp_path / "logs", env)
    rep = run["report"]
    moe = [la for la in rep["layers"] if la["calibrated"]]
    assert moe and all({"attention", "hessians", "gptq", "quantize", "experts_out"} <= set(la["phases"]) for la in moe)
    rate = {"flops_per_thread": 1e11, "threads": 1, "shape": "s"}
    rows = {r["phase"]: r for r in bench.arithmetic(run, rate)}
    assert list(rows) == ["attention", "hessians", "gptq", "experts_out", "guard"]
    for name in ("attention", "hessians", "gptq", "experts_out"):
        r = rows[name]
        cpu = sum(la["phases"][name]["cpu"] for la in rep["layers"] if name in la["phases"])
        assert r["cpu_s"] == pytest.approx(cpu) and r["gflop"] == pytest.approx(rep["cost"]["flops"][name] / 1e9)
        assert r["of_rate"] == pytest.approx(r["gflops"] * 1e9 / 1e11)
    solve = sum(la["phases"]["quantize"]["cpu"] for la in moe)
    assert rows["guard"]["cpu_s"] == pytest.approx(solve - rows["hessians"]["cpu_s"] - rows["gptq"]["cpu_s"])
    assert rows["guard"]["cpu_s"] >= -0.01  # the Hessians and the solve are parts of the method's solve
    assert "of matmul" in "\n".join(bench.render_arithmetic({"matmul": rate, "arithmetic": list(rows.values())}))


def _args(**kw):
    import argparse

    return argparse.Namespace(**{"num_samples": 8, "seq_len": 32, "group_size": 128, **kw})


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("QUANTKIT_BENCH"), reason="minutes; set QUANTKIT_BENCH=1 to run the benchmark")
def test_whole_benchmark_runs(bench, tmp_path, capsys):
    assert bench.main(["--num-samples", "16", "--eval-samples", "8", "--no-depth", "--no-llmc-routed",
                       "--no-scaled-calib", "--out", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "llm-compressor GPTQ" in out and "quantkit GPTQ" in out


def test_launcher_samples_the_childs_rss_over_its_run(bench, tmp_path):
    """The memory figure's curve is the child's own: it rises to the allocation and stays at the peak
    getrusage reports (within the two counters' rounding)."""
    code = "import time; time.sleep(0.3); b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.4)"
    m = bench.measured([sys.executable, "-c", code], tmp_path / "rss.log")
    t, rss = zip(*m["rss_samples"], strict=True)
    assert len(t) >= 5 and list(t) == sorted(t) and t[-1] <= m["wall_s"]
    assert min(rss) < 100 * 2**20 < 200 * 2**20 < max(rss) <= 1.01 * m["peak_rss_bytes"]  # VmRSS vs ru_maxrss: pages


def test_rss_figure_plots_each_tools_samples(bench, tmp_path):
    res = {"model": "m", "calibration": "synthetic:train 4x8", "labels": {"qk-gptq": "quantkit GPTQ", "llmc": "llmc"},
           "runs": {"qk-gptq": {"rss_samples": [[0.1, 2**20], [0.2, 3 * 2**20]], "peak_rss_bytes": 3 * 2**20, "wall_s": 0.3},
                    "llmc": {"rss_samples": [[0.1, 5 * 2**20]], "peak_rss_bytes": 6 * 2**20, "wall_s": 0.2},
                    "qk-rtn": {"peak_rss_bytes": 2**20, "wall_s": 0.1},  # no samples: not drawn
                    "floor-torch": {"peak_rss_bytes": 2**20, "wall_s": 0.1}}}
    curves = bench.plot_rss(res, tmp_path / "rss.png")
    assert list(curves) == ["quantkit GPTQ", "llmc"]
    assert curves["quantkit GPTQ"] == {"t": [0.1, 0.2], "rss_mib": [1.0, 3.0], "peak_mib": 3.0, "wall_s": 0.3}
    assert curves["llmc"]["rss_mib"] == [5.0] and curves["llmc"]["peak_mib"] == 6.0
    assert (tmp_path / "rss.png").stat().st_size > 5_000
