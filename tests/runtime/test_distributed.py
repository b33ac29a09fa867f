"""Expert-parallel convert (quantkit.runtime.distributed): 2 ranks under torchrun (gloo, CPU) write the
bytes 1 rank does; a killed or hung rank stops the job within a bounded time and --resume completes
it; the partition balances routed tokens; the planner divides what is split and says what is not.

Threads: every process here, the single-process references included, runs torch on ONE thread
(OMP_NUM_THREADS=1 in _env; the in-process ones as every test process, tests/conftest.py): the bytes are
equal at equal threads per process, which is what the reports' reproducibility.threads_per_rank
records (docs/reliability.md, "Reproducing the bytes")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from quantkit.planner.budgets import expert_fixed_tokens
from quantkit.planner.cost import plan_convert_for
from quantkit.quant.gptq import gptq
from quantkit.runtime import distributed

# a small calibration: the tiny models convert in about a second, so a run is mostly torch's import
CALIB = ["--num-samples", "8", "--seq-len", "64", "--no-validate"]
MODELS = {"glm": "tiny:glm-5.2", "kimi": "tiny:kimi-k2.6"}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTKIT_FAULT")}
    # float reductions depend on the thread count: every process of a comparison uses one
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]), **extra)
    return env


def _single(model: str, out: Path, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit", "convert", model, "--out", str(out), *CALIB, *args],
                          capture_output=True, text=True, env=_env(**env), timeout=600)


def _torchrun(model: str, out: Path, *args: str, nproc: int = 2, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "quantkit", "convert", model, "--out", str(out), *CALIB, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), timeout=600)


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for which in ("prefill", "decode")
            for p in sorted((out / which).iterdir())}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, Path]:
    """One single-process convert per tiny model: the bytes every multi-rank run must equal."""
    outs = {}
    for key, model in MODELS.items():
        out = tmp_path_factory.mktemp("single") / key
        done = _single(model, out, "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        outs[key] = out
    return outs


# ---- the partition -----------------------------------------------------------------------------
def test_partition_balances_routed_tokens_not_indices():
    counts = {0: 900, 1: 10, 2: 10, 3: 10, 4: 500, 5: 400, 6: 20, 7: 30}
    owner = distributed.partition(counts, 2)
    load = [sum(c for e, c in counts.items() if owner[e] == r) for r in range(2)]
    assert sorted(load) == [940, 940]  # 900+10+30 and 500+400+20+10+10: exact here
    assert owner == distributed.partition(dict(reversed(counts.items())), 2)  # deterministic, order-free
    # by index it would be 0-3 vs 4-7 (930 vs 950); the largest expert goes alone-first to rank 0
    assert owner[0] == 0 and set(owner) == set(counts)


def test_partition_fixed_cost_spreads_expert_counts():
    counts = {e: (1000 if e == 0 else 1) for e in range(9)}
    by_tokens = distributed.partition(counts, 2)
    assert sum(r == 0 for r in by_tokens.values()) == 1  # tokens only: expert 0 alone, 8 on the other rank
    both = distributed.partition(counts, 2, fixed=1000.0)  # GPTQ's per-expert work counts too
    assert sorted(sum(r == k for r in both.values()) for k in range(2)) == [4, 5]


def test_partition_ties_go_by_index_and_rank():
    assert distributed.partition({e: 5 for e in range(6)}, 3) == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}
    assert distributed.partition({}, 4) == {} and distributed.partition({3: 1}, 4) == {3: 0}


def test_single_process_is_not_distributed(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    g, dev = distributed.init(torch.device("cpu"))
    assert g is distributed.SINGLE and not g.distributed and g.leader and dev == torch.device("cpu")
    g.barrier()  # no process group: nothing to wait for
    assert g.all_gather_object(3) == [3]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Exception, match="torchrun"):
        distributed.from_env()


# ---- the premise: an expert's GPTQ bytes do not depend on its batch ------------------------------
def _gptq_batches(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(7, 64, 256, generator=g)
    X = torch.randn(7, 300, 256, generator=g)
    H = (X.transpose(1, 2) @ X).to(device)  # [7, 256, 256]
    W = W.to(device)
    whole = gptq(W, H, 128)
    for parts in ([3, 4], [1] * 7, [2, 5]):
        at = 0
        for n in parts:
            piece = gptq(W[at:at + n], H[at:at + n], 128)
            assert torch.equal(piece.q, whole.q[at:at + n]) and torch.equal(piece.scale, whole.scale[at:at + n]), (device, parts)
            at += n


def test_gptq_bytes_do_not_depend_on_the_batch_cpu():
    _gptq_batches("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gptq_bytes_do_not_depend_on_the_batch_cuda():
    """What makes ranks' own chunks give the single-process bytes on GPUs (cuBLAS/cuSOLVER batched)."""
    _gptq_batches("cuda")


def test_expert_chunk_does_not_change_the_output(tmp_path, monkeypatch):
    """convert at 16, 3 and 1 experts per chunk: one output (each rank chunks its own experts)."""
    import quantkit.planner.cost as cost
    from quantkit.conversion.pipeline import convert

    plan = cost.plan_convert
    outs = []
    for chunk in (16, 3, 1):
        def forced(*a, chunk=chunk, **k):
            c = plan(*a, **k)
            c.expert_chunk = chunk
            return c

        monkeypatch.setattr(cost, "plan_convert", forced)
        r = convert("tiny:glm-5.2", tmp_path / str(chunk), num_samples=8, seq_len=64, validate=False, progress=False)
        assert r.report["cost"]["expert_chunk"] == chunk
        outs.append(_files(r.out))
    assert outs[0] == outs[1] == outs[2]


# ---- 2 ranks vs 1 --------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_equal_one_glm_via_nproc(single, tmp_path):
    """`quantkit convert --nproc 2` launches torchrun; GLM's experts are quantized (GPTQ), split 2 ways."""
    out = tmp_path / "glm2"
    done = subprocess.run([sys.executable, "-m", "quantkit", "convert", MODELS["glm"], "--out", str(out), *CALIB,
                           "--nproc", "2", "--json"], capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _files(out) == _files(single["glm"])
    report = json.loads((out / "convert-report.json").read_text())
    d = report["distributed"]
    assert d["world"] == 2 and d["backend"] == "gloo" and all(n > 0 for n in d["experts_per_rank"])
    assert all(n > 0 for n in d["parts_written_per_rank"])  # both ranks wrote shards
    calibrated = report["experts"]  # MoE layers 1-4 and the MTP layer 5 (calibrated, split like any layer)
    assert sum(d["experts_per_rank"]) == len(calibrated) == sum("rank" in e for e in report["experts"]) == 80
    assert {e["rank"] for e in report["experts"] if "rank" in e} == {0, 1}
    assert json.loads(done.stdout)["distributed"]["world"] == 2  # one JSON document: rank 0's
    # the threads these equal bytes were made at, as both reports record them
    assert report["reproducibility"]["threads_per_rank"] == [1, 1]
    assert json.loads((single["glm"] / "convert-report.json").read_text())["reproducibility"]["threads_per_rank"] == [1]


@pytest.mark.slow
def test_two_ranks_equal_one_kimi_via_torchrun(single, tmp_path):
    """Kimi's experts are reused INT4: nothing to split, everything else redundant; same bytes."""
    out = tmp_path / "kimi2"
    done = _torchrun(MODELS["kimi"], out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _files(out) == _files(single["kimi"])


# ---- the token split: each micro-batch's attention and expert outputs on one rank ---------------
@pytest.fixture(scope="module")
def single_mb(tmp_path_factory) -> dict[tuple[str, int], Path]:
    """Single-process converts with 2 and 3 samples per micro-batch (QUANTKIT_MICRO_BATCH), so
    that 8 samples are 4 or 3 micro-batches: the bytes a token-split run must equal."""
    outs = {}
    for key, mb, method in (("glm", 2, "gptq"), ("glm", 3, "awq"), ("kimi", 3, "gptq")):
        out = tmp_path_factory.mktemp("single_mb") / f"{key}{mb}"
        done = _single(MODELS[key], out, "--method", method, QUANTKIT_MICRO_BATCH=str(mb))
        assert done.returncode == 0, done.stderr[-3000:]
        outs[key, mb] = out
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("key, mb, method, nproc", [
    ("glm", 2, "gptq", 2),  # 4 micro-batches, 2 each; GLM's DSA selections (seq_len 64 > index_topk 16) travel
    ("glm", 2, "gptq", 3),  # 2, 1, 1 micro-batches
    ("glm", 3, "awq", 2),  # 3, 3, 2 samples: uneven micro-batches; AWQ reads its experts' rows from every one
    ("kimi", 3, "gptq", 4),  # rank 3 owns no micro-batch (nothing of the attention pass to do)
])
def test_token_split_equals_one_process(single_mb, tmp_path, key, mb, method, nproc):
    """Every rank computes attention and the routed-expert outputs of its own micro-batches only
    (i % world); x, routing, DSA selections and h are then shared and the KV-cache maxima combined:
    the bytes, the experts' records and the KV-cache report equal a single process's."""
    out = tmp_path / f"{key}{nproc}"
    done = _torchrun(MODELS[key], out, "--method", method, nproc=nproc, QUANTKIT_MICRO_BATCH=str(mb))
    assert done.returncode == 0, done.stderr[-3000:]
    ref = single_mb[key, mb]
    assert _files(out) == _files(ref)
    got, want = (json.loads((o / "convert-report.json").read_text()) for o in (out, ref))
    assert got["kv_cache"] == want["kv_cache"]
    assert [{k: v for k, v in e.items() if k != "rank"} for e in got["experts"]] == want["experts"]


@pytest.mark.slow
def test_token_split_with_a_probe_equals_one_process(tmp_path):
    """gptq.low_dampening: every rank runs all the probe windows itself (never split, never shared),
    so the probe's verdicts, and the bytes, equal a single process's."""
    import yaml

    from quantkit.recipe import load_recipe

    rec = load_recipe("tiny-glm-5.2").to_dict()
    rec["gptq"].update({"dampening": 0.1, "low_dampening": 0.01})
    (tmp_path / "low.yaml").write_text(yaml.safe_dump(rec))
    args = ("--recipe", str(tmp_path / "low.yaml"), "--json")
    one = _single(MODELS["glm"], tmp_path / "one", *args, QUANTKIT_MICRO_BATCH="2")
    two = _torchrun(MODELS["glm"], tmp_path / "two", *args, QUANTKIT_MICRO_BATCH="2")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
    got, want = (json.loads((tmp_path / o / "convert-report.json").read_text()) for o in ("two", "one"))
    assert want["experts_summary"]["probe_judged"] > 0
    assert [{k: v for k, v in e.items() if k != "rank"} for e in got["experts"]] == want["experts"]


@pytest.mark.slow
def test_token_split_killed_rank_resumes_on_another_world(single_mb, tmp_path):
    """A rank killed after its third layer with 4 micro-batches split 2 ways: the resume state
    holds every micro-batch's h and DSA selection (not only rank 0's), so resuming on 3 ranks
    (another split) gives the single-process bytes."""
    out = tmp_path / "kill"
    done = _torchrun(MODELS["glm"], out, QUANTKIT_FAULT="layer:written#3:kill", QUANTKIT_FAULT_RANK="1",
                     QUANTKIT_DIST_TIMEOUT="10", QUANTKIT_MICRO_BATCH="2")
    assert done.returncode != 0 and (out / ".quantkit-convert" / "state.json").is_file()
    resumed = _torchrun(MODELS["glm"], out, "--resume", nproc=3, QUANTKIT_MICRO_BATCH="2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _files(out) == _files(single_mb["glm", 2])


# ---- validate on several ranks -------------------------------------------------------------------
SAME = ("rows", "continuations", "reference_metrics", "kv_cache", "long_context")  # what a multi-rank validate must equal


def _validate(out: Path, *args: str, nproc: int = 1) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`quantkit validate OUT --json` as a plain process or `--nproc N` (torchrun); (run, validation.json)."""
    cmd = [sys.executable, "-m", "quantkit", "validate", str(out), "--json", *args]
    done = subprocess.run(cmd + (["--nproc", str(nproc)] if nproc > 1 else []), capture_output=True, text=True,
                          env=_env(), timeout=600)
    path = out / "validation.json"
    return done, json.loads(path.read_text()) if path.is_file() else None


@pytest.fixture(scope="module")
def single_validated(single, tmp_path_factory) -> dict[str, dict]:
    """validation.json of one process on a copy of each single-process output (validate writes
    model cards into prefill/ and decode/, which the convert comparisons must not see)."""
    import shutil

    got = {}
    for key, kv in (("glm", "fp8_e4m3"), ("kimi", "bf16")):
        out = tmp_path_factory.mktemp("validated") / key
        shutil.copytree(single[key], out)
        done, got[key] = _validate(out, "--kv-cache-dtype", kv)
        assert done.returncode == 0, done.stderr[-3000:]
    return got


@pytest.mark.slow
@pytest.mark.parametrize("key, nproc, weights", [
    ("glm", 2, "auto"),  # resident (the tiny checkpoints fit), FP8 KV rows: 7 prompt streams, 10 decode streams
    ("kimi", 3, "stream"),  # 3 ranks, every layer re-read for every greedy token
])
def test_validate_on_several_ranks_equals_one_process(single, single_validated, tmp_path, key, nproc, weights):
    """Each rank runs attention for every token and its own routed experts (convert's partition);
    the experts' output rows travel as bytes and every rank adds them in ascending expert order:
    every number, curve and greedy continuation is the single process's, bit for bit (tolerance 0
    on one device type). A failing gate makes `--nproc` exit 3 (torchrun itself exits 1)."""
    import shutil

    out = tmp_path / key
    shutil.copytree(single[key], out)
    want = single_validated[key]
    args = ["--kv-cache-dtype", want["kv_cache"]["dtype"], "--weights", weights]
    if key == "kimi":
        (tmp_path / "strict.yaml").write_text("kl_max: 0.0\n")
        args += ["--gate", str(tmp_path / "strict.yaml")]
    done, got = _validate(out, *args, nproc=nproc)
    assert done.returncode == (3 if key == "kimi" else 0), done.stderr[-3000:]
    assert {k: got[k] for k in SAME} == {k: want[k] for k in SAME}
    w = got["weights"]
    assert w["world"] == nproc and w["backend"] == "gloo" and w["mode"] == ("resident" if weights == "auto" else "stream")
    one = want["weights"]
    assert sum(w["experts_per_rank"]) == one["experts_per_rank"][0] and all(n > 0 for n in w["experts_per_rank"])
    assert all(share < one["share_bytes_per_rank"][0] for share in w["share_bytes_per_rank"])  # experts split
    for read, share in zip(w["read_bytes_per_rank"], w["share_bytes_per_rank"]):
        if weights == "stream":  # the prompt pass and each further greedy token re-read this rank's share
            assert share < read <= got["gen_tokens"] * share
        else:  # read once, kept
            assert read <= share
    if key == "kimi":
        assert "kl_max" in done.stderr and not got["passed"]


def _since_last_point(points: Path) -> float:
    """Seconds from the last crash point any rank reached (QUANTKIT_FAULT_LOG: the fault itself, or what a
    survivor did after it) to now, just after the job exited: how long the failure took to stop the job.
    Timed from the job's start instead, the bound also held the startup and the layers before the fault,
    which a busy machine stretches past it (the same run, several times slower beside other jobs)."""
    assert points.is_file(), f"no crash point reached ({points})"
    return time.time() - points.stat().st_mtime


@pytest.mark.slow
def test_validate_stops_when_a_rank_dies(single, tmp_path):
    """A rank killed after its second layer: torchrun stops the other, the job exits non-zero
    within a bounded time and writes no validation.json (nothing half-measured is published)."""
    import shutil

    out = tmp_path / "glm"
    shutil.copytree(single["glm"], out)
    points = tmp_path / "points.log"
    done = subprocess.run([sys.executable, "-m", "quantkit", "validate", str(out), "--nproc", "2"], capture_output=True,
                          text=True, env=_env(QUANTKIT_FAULT="validate:layer#2:kill", QUANTKIT_FAULT_RANK="1",
                                              QUANTKIT_DIST_TIMEOUT="10", QUANTKIT_FAULT_LOG=str(points)), timeout=600)
    assert done.returncode not in (0, 3) and _since_last_point(points) < 120, done.stderr[-2000:]
    assert not (out / "validation.json").exists() and "a rank failed" in done.stderr and "--resume" not in done.stderr


@pytest.mark.slow
def test_convert_on_two_ranks_validates_on_two_ranks(single_validated, tmp_path):
    """`convert --nproc 2` (validation on, as shipped): every rank validates with its share of the
    experts once rank 0 has finished the output; the numbers are a single process's."""
    out = tmp_path / "kimi"
    done = subprocess.run([sys.executable, "-m", "quantkit", "convert", MODELS["kimi"], "--out", str(out),
                           *[a for a in CALIB if a != "--no-validate"], "--nproc", "2", "--json"],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads((out / "validation.json").read_text())
    assert got["weights"]["world"] == 2
    assert got["rows"] == single_validated["kimi"]["rows"]
    assert got["continuations"] == single_validated["kimi"]["continuations"]


# ---- failure: bounded exit, then --resume --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("point, how, rank, again", [
    ("layer:written#3", "kill", 1, 2),
    ("layer:written#3", "kill", 0, 1),
    ("flush:tmp#3", "kill", 1, 2),  # rank 1 dies while saving a part it owns
    ("layer:written#3", "hang", 1, 2),
])
def test_a_failed_rank_stops_the_job_and_resume_completes(single, tmp_path, point, how, rank, again):
    """SIGKILL of one rank after its third layer or mid-write (torchrun's agent stops the other),
    or a hung rank (the others' collective times out after QUANTKIT_DIST_TIMEOUT): non-zero exit
    within 120 s, then --resume on `again` ranks (1: a plain process) gives the single-process bytes."""
    out = tmp_path / f"{how}{rank}"
    points = tmp_path / f"{how}{rank}.points"
    done = _torchrun(MODELS["glm"], out, QUANTKIT_FAULT=f"{point}:{how}", QUANTKIT_FAULT_RANK=str(rank),
                     QUANTKIT_DIST_TIMEOUT="10", QUANTKIT_FAULT_LOG=str(points))
    took = _since_last_point(points)
    assert done.returncode != 0 and took < 120, (done.returncode, took)
    assert not (out / "decode").exists() and (out / ".quantkit-convert" / "state.json").is_file()
    if how == "hang":  # the survivor says what happened, in one line
        assert "another rank died or did not answer within 10s" in done.stderr and "--resume" in done.stderr
    resumed = _torchrun(MODELS["glm"], out, "--resume") if again == 2 else _single(MODELS["glm"], out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _files(out) == _files(single["glm"])


def test_ranks_that_do_not_share_the_output_folder_are_refused(tmp_path):
    """Several nodes with node-local disks: each rank would save its parts where rank 0 never
    looks. Rank 1 is given another folder under the same name (what a node-local disk is): the
    check fails at the start and names rank 1."""
    script = tmp_path / "check.py"
    # one launch, two checks (each torchrun start is three torch imports): the shared folder passes on
    # every rank, then rank 1 given another folder fails on every rank
    script.write_text(
        "import os, sys, torch\n"
        "from quantkit.runtime import distributed\n"
        "g, _ = distributed.init(torch.device('cpu'))\n"
        "try:\n"
        "    distributed.check_shared_folder(g, sys.argv[1])\n"
        "    open(sys.argv[3] + f'.{g.rank}', 'w').close()\n"
        "    distributed.check_shared_folder(g, sys.argv[1] if g.rank == 0 else sys.argv[2])\n"
        "finally:\n"
        "    distributed.close(g)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    done = subprocess.run(cmd + [str(tmp_path / "out"), str(tmp_path / "b"), str(tmp_path / "shared-ok")],
                          capture_output=True, text=True, env=_env(), timeout=300)
    # each rank marks the first check passed in its own file: the ranks' prints share one pipe, and two
    # prints can interleave mid-line ("shared okshared ok 0\n 1\n" in one CI run)
    assert (tmp_path / "shared-ok.0").exists() and (tmp_path / "shared-ok.1").exists(), done.stderr[-2000:]
    assert list((tmp_path / "out").iterdir()) == []  # the marker is gone
    assert done.returncode != 0 and "rank(s) [1] do not see what rank 0 writes" in done.stderr


# ---- the planner ---------------------------------------------------------------------------------
def test_plan_divides_the_split_phases_and_keeps_the_redundant_ones():
    one, eight = (plan_convert_for("glm-5.2", gpu="h200", nproc=n) for n in (1, 8))
    assert eight.seconds["hessians"] < one.seconds["hessians"] / 6
    # GPTQ on a GPU is partly launch-bound per call: a rank's 32 experts are one call, as 64 would be
    assert one.seconds["gptq"] / 8 < eight.seconds["gptq"] < one.seconds["gptq"] / 4
    for phase in ("attention", "experts_out"):  # the token split: 128 micro-batches of 4, 16 per rank
        assert eight.seconds[phase] == pytest.approx(one.seconds[phase] / 8, abs=0.1)
    for phase in ("read", "write"):
        assert eight.seconds[phase] == one.seconds[phase]
    assert 0 < eight.seconds["gather"] < eight.seconds["attention"] and "gather" not in one.seconds
    assert eight.nproc == 8 and eight.memory["received"] > 0 and eight.peak_device > one.peak_device
    assert "per rank (8 ranks)" in eight.summary() and any("split" in n for n in eight.notes)
    kimi = plan_convert_for("kimi-k2.6", gpu="h200", nproc=8)  # reused QAT experts: nothing to split
    assert kimi.seconds["hessians"] == kimi.seconds["gptq"] == 0 and kimi.memory["received"] == 0
    assert kimi.seconds["attention"] < plan_convert_for("kimi-k2.6", gpu="h200").seconds["attention"] / 6


def test_token_share_is_by_micro_batches():
    from quantkit.planner.cost import token_share

    assert token_share(512, 4, 8) == 1 / 8
    assert token_share(8, 3, 2) == 2 / 3  # 3 micro-batches: rank 0 has two
    assert token_share(8, 8, 4) == 1.0  # one micro-batch: no split


def test_fixed_cost_is_gptq_over_hessian_work_per_token(tiny_glm):
    from quantkit.inputs.modelspec import open_checkpoint

    a = open_checkpoint(tiny_glm).arch
    D, I = a.hidden_size, a.moe_intermediate_size
    assert expert_fixed_tokens(a) == pytest.approx((4 * I * D * D + 2 * D * I * I + D**3 + I**3)
                                                   / (2 * D * D + 4 * I * D + 2 * I * I))


# ---- the CLI -------------------------------------------------------------------------------------
def test_convert_nproc_launches_torchrun_with_the_same_options(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from quantkit import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = []
    monkeypatch.setattr(cli, "_torchrun", lambda n, argv, out: seen.append((n, argv)) or 7)
    out = tmp_path / "o"
    r = CliRunner().invoke(cli.app, ["convert", "tiny:glm-5.2", "--out", str(out), "--num-samples", "8", "--resume",
                                     "--no-validate", "--max-host-memory", "8GB", "--nproc", "4"])
    assert r.exit_code == 7  # torchrun's status
    assert seen == [(4, ["convert", "tiny:glm-5.2", "--out", str(out), "--num-samples", "8", "--device", "auto",
                         "--max-host-memory", "8GB", "--resume", "--no-validate"])]
    assert not out.exists()  # nothing ran here


def test_validate_nproc_launches_torchrun_with_the_same_options(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from quantkit import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = []
    monkeypatch.setattr(cli, "_torchrun", lambda n, argv, out, resume_hint: seen.append((n, argv, out, resume_hint)) or 3)
    r = CliRunner().invoke(cli.app, ["validate", str(tmp_path), "--gen-tokens", "4", "--weights", "stream",
                                     "--nproc", "2", "--json"])
    assert r.exit_code == 3  # what _torchrun decided (a failed gate)
    assert seen == [(2, ["validate", str(tmp_path), "--gen-tokens", "4", "--device", "auto", "--kv-cache-dtype", "bf16",
                         "--weights", "stream", "--numerics", "engine", "--json"], tmp_path, False)]


def test_plan_convert_nproc_on_the_command_line():
    from typer.testing import CliRunner

    from quantkit import cli

    r = CliRunner().invoke(cli.app, ["plan", "glm-5.2", "--convert", "--nproc", "8", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["nproc"] == 8 and d["memory"]["received"] > 0 and "exchange" in d["seconds"]
