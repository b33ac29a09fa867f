"""`quantkit validate --tasks`: lm-eval tasks on the source and every checkpoint, through quantkit's
streaming forward as an lm-eval model, held to lm-eval's own HF model on the same tiny source (the
integration is checked against the harness, not against itself); the paired deltas; bad input.

The tasks are built here: a multiple-choice task and a generation task, lm-eval task YAMLs over local
jsonl files (`dataset_path: json`), a handful of items each."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from oracle import transformers_model
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.conversion.pipeline import convert
from quantkit.errors import ConfigError
from quantkit.validation.tasks import INSTALL, paired, prepare

runner = CliRunner()

MC = [("the quick fox chases the", ["dog", "cat", "owl", "fish"], 0),
      ("the lazy cat sees a", ["bird", "mouse", "crab", "goat"], 1),
      ("bob likes the small", ["fish", "dog", "frog", "seal"], 2),
      ("count 1 2 3", ["4", "9", "7", "0"], 0),
      ("ada meets the old", ["wolf", "lion", "bear", "horse"], 3),
      ("2 plus 2 is", ["4", "5", "3", "22"], 0)]
GEN = [("count 1 2 3", "4"), ("count 5 6 7", "8"), ("2 plus 3 is", "5"), ("the cat sees the", "dog"),
       ("eve has a red", "bird")]


def write_tasks(folder: Path) -> Path:
    """tiny_mc (acc over 4 choices) and tiny_gen (exact match of greedy text up to a space), lm-eval's own YAML."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    common = "test_split: test\nfewshot_split: test\ndoc_to_text: \"{{question}}\"\n"
    (folder / "mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n{common}"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n")
    (folder / "gen.yaml").write_text(
        f"task: tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n{common}"
        "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\" \", \"\\n\"]\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 2.0\n")
    return folder


def hf_folder(src: Path, out: Path) -> Path:
    """The tiny source as a plain fp32 transformers folder (tests/oracle.py: dequantized by safetensors and
    compressed-tensors' own code), with the source's tokenizer."""
    transformers_model(src, out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, out / f)
    return out


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("QUANTKIT_DEBUG", raising=False)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, tiny_glm, task_dir):
    """The tasks through lm-eval's own HF model on the tiny GLM source."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    folder = hf_folder(tiny_glm, tmp_path_factory.mktemp("hf") / "glm")
    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", device="cpu",
                                   tasks=["tiny_mc", "tiny_gen"], task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                   num_fewshot=1, bootstrap_iters=1000, log_samples=True)


@pytest.fixture(scope="module")
def validated(tmp_path_factory, tiny_glm, task_dir):
    """`quantkit convert tiny:glm-5.2 --no-validate`, then `quantkit validate OUT --tasks ...` (FP8 KV rows too)."""
    out = convert("tiny:glm-5.2", tmp_path_factory.mktemp("pair") / "glm", validate=False, progress=False).out
    r = runner.invoke(app, ["validate", str(out), "--device", "cpu", "--num-samples", "2", "--seq-len", "16",
                            "--gen-tokens", "2", "--kv-cache-dtype", "fp8_e4m3", "--tasks", "tiny_mc,tiny_gen",
                            "--task-dir", str(task_dir), "--num-fewshot", "1"])
    return out, r


@pytest.mark.slow
def test_streaming_model_matches_lm_eval_hf_item_by_item(tiny_glm, task_dir, hf_run):
    """Every log-likelihood within float32 noise and every generated string equal to lm-eval's HF model's."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.planner.taskcost import activation_bytes
    from quantkit.validation.lmmodel import QuantkitLM

    ckpt = Checkpoint(tiny_glm)  # a budget of about three sequences a pass: the batching is exercised
    lm = QuantkitLM(ckpt, device="cpu", batch_bytes=3 * activation_bytes(ckpt.arch, 12))
    ours = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_gen"], task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                   num_fewshot=1, bootstrap_iters=1000, log_samples=True)
    assert lm.passes > 2 and lm.tokens_generated > 0
    for a, b in zip(hf_run["samples"]["tiny_mc"], ours["samples"]["tiny_mc"], strict=True):
        theirs, mine = torch.tensor([r[0][0] for r in a["resps"]]), torch.tensor([r[0][0] for r in b["resps"]])
        assert torch.allclose(mine, theirs, atol=1e-4, rtol=1e-5), (a["doc_id"], mine, theirs)
        assert a["acc"] == b["acc"]
    gen_theirs = [a["resps"] for a in hf_run["samples"]["tiny_gen"]]
    assert [b["resps"] for b in ours["samples"]["tiny_gen"]] == gen_theirs
    assert len({r[0][0] for r in gen_theirs}) > 2  # the model really generates (not one string for every item)
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_gen", "exact_match,none")):
        assert ours["results"][task][metric] == hf_run["results"][task][metric]


@pytest.mark.slow
def test_validate_tasks_end_to_end_against_lm_eval_hf(validated, hf_run):
    out, r = validated
    assert r.exit_code in (0, 3), r.output
    d = json.loads((out / "validation.json").read_text())
    t = d["tasks"]
    assert t["rows"] == ["reference", "prefill", "decode", "decode_kv"]
    for task, metric in (("tiny_mc", "acc"), ("tiny_gen", "exact_match")):
        got = t["tasks"][task]
        hf = hf_run["results"][task]
        # the source's score and its SE are lm-eval's HF model's on the same tiny source
        assert got["rows"]["reference"]["score"] == pytest.approx(hf[f"{metric},none"], abs=1e-12)
        assert got["rows"]["reference"]["stderr"] == pytest.approx(hf[f"{metric}_stderr,none"], rel=1e-9)
        assert got["metric"] == metric and got["num_fewshot"] == 1
        assert got["items"] == len(MC if task == "tiny_mc" else GEN)
        assert got["version"] == (1.0 if task == "tiny_mc" else 2.0)
        for row in ("prefill", "decode", "decode_kv"):
            e = got["rows"][row]
            assert e["paired_items"] == got["items"]
            assert e["delta"] == pytest.approx(e["score"] - got["rows"]["reference"]["score"], abs=1e-12)
            assert e["flipped"] == e["flipped_better"] + e["flipped_worse"] == len(e["flips"])
    md = (out / "validation.md").read_text()
    assert "## Task-level deltas" in md and "tiny_mc" in md and "tiny_gen" in md
    for which in ("prefill", "decode"):
        card = (out / which / "README.md").read_text()
        assert "## Task accuracy" in card and "| tiny_mc | 1.0 | 1 | 6 | acc | source |" in card
    assert "task tiny_mc" in r.output


def test_paired_delta_and_flips():
    ref = {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0}
    other = {0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0}
    p = paired(ref, other)
    assert p["delta"] == pytest.approx(-0.25)
    d = [0.0, 1.0, -1.0, -1.0]  # the SE of the per-item differences, by hand
    mean = sum(d) / 4
    assert p["delta_stderr"] == pytest.approx((sum((x - mean) ** 2 for x in d) / 3 / 4) ** 0.5)
    assert (p["flipped"], p["flipped_better"], p["flipped_worse"]) == (3, 1, 2)
    assert [f["doc_id"] for f in p["flips"]] == [1, 2, 3]
    same = paired(ref, dict(ref))
    assert same["delta"] == 0 and same["delta_stderr"] == 0 and same["flipped"] == 0


def test_local_tasks_do_not_index_lm_evals_own(task_dir):
    """Tasks that are all in --task-dir are found without lm-eval's index of its ~15K own YAMLs (about
    20 s of every validate --tasks); a name that is not local still gets the whole index."""
    spec = prepare("tiny_mc,tiny_gen", task_dir=task_dir)
    assert set(spec.manager.all_tasks) == {"tiny_mc", "tiny_gen"}


def test_unknown_task_is_one_line(tiny_glm, tmp_path, task_dir):
    (tmp_path / "config.json").write_text((tiny_glm / "config.json").read_text())
    r = runner.invoke(app, ["validate", str(tmp_path), "--tasks", "tiny_mc,no_such_task_xyz", "--task-dir", str(task_dir)])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "no_such_task_xyz" in lines[0] and "no such lm-eval task" in lines[0], r.output


def test_lm_eval_missing_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with pytest.raises(ConfigError, match="not installed"):
        prepare("tiny_mc")
    (tmp_path / "config.json").write_text("{}")
    r = runner.invoke(app, ["validate", str(tmp_path), "--tasks", "tiny_mc"])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and INSTALL.split()[0] in lines[0] and '".[eval]"' in lines[0], r.output


def test_task_cost_counts_passes_and_rereads():
    """gsm8k on GLM 5.2's decode checkpoint, by hand: two prompts a pass, 256 greedy passes per batch,
    and every pass re-reads what the GPU does not keep."""
    from quantkit.model.arch import arch_from_config, load_preset
    from quantkit.planner.taskcost import PROFILES, activation_bytes, task_cost

    arch = arch_from_config(load_preset("glm-5.2"))
    p = PROFILES["gsm8k"]
    T = p.prompt_tokens + p.max_gen_toks
    bb = 2 * activation_bytes(arch, T)
    ckpt, gpu = 400e9, 40e9
    c = task_cost(arch, "gsm8k", "decode", int(ckpt), active_params=40_000_000_000, gpus=1, gpu_bytes=int(gpu),
                  flops=33.5e12, disk=2e9, hbm=4.8e12, batch_bytes=bb)
    assert c.sequences_per_pass == 2
    assert c.passes == -(-p.items // 2) * 256
    kept = int(gpu * 0.85 - bb)
    assert c.kept_bytes == kept
    assert c.bytes_read == int(ckpt) + (c.passes - 1) * (int(ckpt) - kept)
    assert c.tokens_generated == p.items * 256
    resident = task_cost(arch, "gsm8k", "decode", int(ckpt), active_params=40_000_000_000, gpus=8, gpu_bytes=int(141e9),
                         flops=33.5e12, disk=2e9, hbm=4.8e12, batch_bytes=bb)
    assert resident.bytes_read == int(ckpt) and resident.seconds < c.seconds / 100
    with pytest.raises(ConfigError, match="no cost profile"):
        task_cost(arch, "hellaswag", "decode", int(ckpt), active_params=1, gpus=1, gpu_bytes=int(gpu), flops=1, disk=1, hbm=1)


def test_plan_tasks_cli():
    r = runner.invoke(app, ["plan", "glm-5.2", "--tasks", "gsm8k,mmlu", "--gpus", "8", "--json"])
    assert r.exit_code == 0, r.output
    costs = json.loads(r.stdout)["tasks"]
    assert [(c["task"], c["checkpoint"]) for c in costs][:3] == [("gsm8k", "source"), ("gsm8k", "prefill"), ("gsm8k", "decode")]
    assert all(c["passes"] > 0 and c["bytes_read"] >= c["checkpoint_bytes"] for c in costs)
    # the GPU's own memory bandwidth prices the per-pass dequantization: the same run is slower on an H100
    h100 = runner.invoke(app, ["plan", "glm-5.2", "--tasks", "gsm8k", "--gpus", "8", "--gpu", "h100", "--json"])
    assert h100.exit_code == 0, h100.output
    assert json.loads(h100.stdout)["tasks"][2]["seconds"] > costs[2]["seconds"]
    r = runner.invoke(app, ["plan", "glm-5.2", "--tasks", "nope"])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1


def test_task_data_that_cannot_load_is_one_line_before_anything_runs(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "t.yaml").write_text("task: tiny_missing\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                f"    test: {bad / 'nowhere.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
                                "doc_to_text: \"{{q}}\"\ndoc_to_target: \"{{a}}\"\n"
                                "metric_list:\n  - metric: exact_match\n")
    with pytest.raises(ConfigError, match="could not load the task data"):
        prepare("tiny_missing", task_dir=bad)


def test_summary_takes_the_first_filter_and_pairs_items_by_doc_id():
    """lm-eval's result layout for a two-filter task (gsm8k's strict-match, flexible-extract): the metric
    is read under the first filter, items are paired by doc_id whatever their order, flips are named."""
    from quantkit.validation.tasks import summarize_task

    def run(strict: list[float], flexible: list[float]) -> dict:
        n = len(strict)
        samples = [{"doc_id": i, "filter": f, "metrics": ["exact_match"], "exact_match": v}
                   for f, vals in (("strict-match", strict), ("flexible-extract", flexible)) for i, v in enumerate(vals)]
        return {"results": {"gsm8k": {"exact_match,strict-match": sum(strict) / n, "exact_match_stderr,strict-match": 0.1,
                                      "exact_match,flexible-extract": sum(flexible) / n,
                                      "exact_match_stderr,flexible-extract": 0.2}},
                "samples": {"gsm8k": samples[::-1]}, "versions": {"gsm8k": 3.0}, "n-shot": {"gsm8k": 5},
                "n-samples": {"gsm8k": {"original": 1319, "effective": n}}, "higher_is_better": {"gsm8k": {"exact_match": True}}}

    raw = {"reference": run([1, 1, 0, 0], [1, 1, 1, 1]), "decode": run([1, 0, 1, 0], [0, 0, 0, 0])}
    t = summarize_task("gsm8k", raw)
    assert (t["metric"], t["filter"], t["version"], t["num_fewshot"], t["items"], t["items_in_task"]) == \
        ("exact_match", "strict-match", 3.0, 5, 4, 1319)
    d = t["rows"]["decode"]
    assert d["score"] == 0.5 and d["stderr"] == 0.1 and d["delta"] == 0.0
    assert [(f["doc_id"], f["reference"], f["this"]) for f in d["flips"]] == [(1, 1.0, 0.0), (2, 0.0, 1.0)]
    assert d["delta_stderr"] == pytest.approx(((2 * 1.0) / 3 / 4) ** 0.5)  # differences 0, -1, +1, 0
