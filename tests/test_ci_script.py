"""The CI quantize job: the workflow file's shape, and scripts/ci_quantize.sh run for real on the tiny GLM.

The script is what .github/workflows/quantize.yml runs, so running it here (convert, validate
with gates, summary) is the CI job minus the runner and the artifact upload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ci_quantize.sh"
WORKFLOW = ROOT / ".github" / "workflows" / "quantize.yml"
ARTIFACTS = ("prefill/config.json", "decode/config.json", "convert-report.json",
             "validation.json", "validation.md", "validation.png", "validation-experts.png", "ci-summary.md")


# ---- the workflow file ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps(workflow: dict) -> list[dict]:
    jobs = workflow["jobs"]
    assert jobs, "no jobs"
    return [s for job in jobs.values() for s in job["steps"]]


def test_workflow_dispatch_inputs(workflow):
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    inputs = on["workflow_dispatch"]["inputs"]
    assert {"model", "recipe", "group_size"} <= set(inputs)
    assert inputs["model"]["required"] is True
    assert inputs["group_size"]["required"] is False


def test_workflow_steps(workflow):
    steps = _steps(workflow)
    uses = [s.get("uses", "") for s in steps]
    assert any(u.startswith("actions/checkout@") for u in uses)
    setup = [s for s in steps if s.get("uses", "").startswith("actions/setup-python@")]
    assert setup and str(setup[0]["with"]["python-version"]) == "3.11"
    runs = "\n".join(s.get("run", "") for s in steps)
    assert 'pip install "torch==2.13.0" -e .' in runs  # the README's install line
    (script,) = [s for s in steps if "scripts/ci_quantize.sh" in s.get("run", "")]
    assert "if" not in script
    uploads = [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@")]
    published = [s for s in uploads if "if" not in s]  # default `if: success()`: only after the script passed
    paths = "\n".join(s["with"]["path"] for s in published)
    for part in ("prefill/", "decode/", "convert-report.json", "validation.json", "validation.md", "validation.png",
                 "validation-experts.png"):
        assert part in paths, part
    # the checkpoints are never uploaded from a failed run; artifact steps come after the script
    for s in uploads:
        if "if" in s:
            assert "prefill" not in s["with"]["path"] and "decode" not in s["with"]["path"]
        assert steps.index(s) > steps.index(script)


def test_workflow_inputs_reach_shell_only_through_env(workflow):
    """`${{ inputs.x }}` pasted into a run script is a script-injection hole; env vars are not."""
    for s in _steps(workflow):
        assert "${{ inputs." not in s.get("run", ""), s.get("name")


# ---- the script ----------------------------------------------------------------------------------
def _run(out: Path, *args: str, gate: Path | None = None, convert_args: str = "", validate_args: str = "",
         timeout: int = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # this venv's quantkit
    # One thread: the tiny models' ops are too small to gain from more, and OpenMP threads spinning
    # beside other test processes cost several times the work itself.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("GITHUB_ACTIONS", None)
    env.pop("QK_GATE", None)
    if gate is not None:
        env["QK_GATE"] = str(gate)
    env["QK_CONVERT_ARGS"] = convert_args
    env["QK_VALIDATE_ARGS"] = validate_args
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=out.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _explain(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"


def test_script_converts_validates_and_summarises(tmp_path):
    """The tiny recipe as it ships (GPTQ, the recipe's eval sizes and gates): exit 0, every artifact."""
    out = tmp_path / "out"
    p = _run(out, "tiny:glm-5.2", "tiny-glm-5.2", str(out))
    assert p.returncode == 0, _explain(p)
    for f in ARTIFACTS:
        assert (out / f).is_file(), f
    assert sorted(out.glob("prefill/model-*-of-*.safetensors")) and sorted(out.glob("decode/model-*-of-*.safetensors"))
    report = json.loads((out / "convert-report.json").read_text())
    assert report["source"]["spec"] == "tiny:glm-5.2" and report["recipe"]["name"] == "tiny-glm-5.2"
    assert report["method"] == "gptq"
    validation = json.loads((out / "validation.json").read_text())
    assert validation["passed"] is True and validation["gates"]
    assert (out / "validation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "ci-summary.md").read_text()
    assert "PASSED" in summary and summary in p.stdout
    assert "| decode |" in summary and "| cross_phase |" in summary
    assert not (out / ".quantkit-convert").exists()


def test_script_fails_on_a_failed_gate(tmp_path):
    """kl_max: 0 cannot hold for INT4 experts: validate exits 3, so does the script, summary says FAILED."""
    gate = tmp_path / "gate.yaml"
    gate.write_text("kl_max: 0\n")
    out = tmp_path / "out"
    p = _run(out, "tiny:glm-5.2", "tiny-glm-5.2", str(out), "64", gate=gate, convert_args="--method rtn",
             validate_args="--num-samples 2 --seq-len 16 --gen-tokens 2")
    assert p.returncode == 3, _explain(p)
    report = json.loads((out / "convert-report.json").read_text())
    assert report["group_size"] == 64 and report["method"] == "rtn"
    validation = json.loads((out / "validation.json").read_text())
    assert validation["passed"] is False
    assert validation["gates_from"] == str(gate)
    failed = {g["row"] for g in validation["gates"] if g["passed"] is False}
    assert "decode" in failed
    assert "FAILED" in (out / "ci-summary.md").read_text()
    assert "validation failed" in p.stderr


def test_script_stops_when_convert_fails(tmp_path):
    out = tmp_path / "out"
    p = _run(out, "tiny:no-such-model", "", str(out))
    assert p.returncode == 1, _explain(p)
    assert "convert failed" in p.stderr
    assert not (out / "validation.json").exists()


def test_script_usage(tmp_path):
    p = _run(tmp_path / "x", "tiny:glm-5.2")
    assert p.returncode == 2
    assert "usage" in p.stderr
    p = _run(tmp_path / "x", "tiny:glm-5.2", "tiny-glm-5.2", str(tmp_path / "x"), gate=tmp_path / "missing.yaml")
    assert p.returncode == 2 and "no such file" in p.stderr


def test_script_is_executable():
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().startswith("#!/usr/bin/env bash\n")
