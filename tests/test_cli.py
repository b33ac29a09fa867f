"""The `quantkit` command through typer's CliRunner: help, inspect, and bad input as one line."""

from __future__ import annotations

import json

import pytest
from bad_checkpoints import BAD
from typer.testing import CliRunner

from quantkit.cli import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("QUANTKIT_DEBUG", raising=False)


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0, r.output
    for cmd in ("inspect", "plan", "pull"):
        assert cmd in r.output
    assert "Usage" in r.output


def test_help_imports_no_torch():
    """`quantkit --help` answers at once: the CLI module and every command's help import no torch (2.5 s
    of a 3 s --help when the model list came from quantkit.model.arch)."""
    import subprocess
    import sys

    code = ("import sys, quantkit.cli as c; from typer.testing import CliRunner; r = CliRunner().invoke(c.app, ['--help']);"
            " [CliRunner().invoke(c.app, [n, '--help']) for n in ('convert', 'validate', 'plan', 'inspect')];"
            " print(r.exit_code, sorted({'torch', 'transformers', 'safetensors', 'datasets'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "[]"], out


def test_no_args_shows_help():
    r = runner.invoke(app, [])
    assert "inspect" in r.output and "Usage" in r.output


def test_inspect_glm_table(tiny_glm):
    r = runner.invoke(app, ["inspect", "tiny:glm-5.2"])
    assert r.exit_code == 0, r.output
    assert "fp8-block128" in r.stdout and "routed_expert" in r.stdout and "glm_moe_dsa" in r.stdout
    assert "int4" not in r.stdout


def test_inspect_kimi_json(tiny_kimi):
    r = runner.invoke(app, ["inspect", "tiny:kimi-k2.6", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["model_type"], d["family"], d["layers"], d["mtp_layers"]) == ("kimi_k25", "kimi", 4, 0)
    routed = d["classes"]["routed_expert"]
    assert routed["formats"] == {"int4-g32": routed["tensors"]} and routed["tensors"] == 3 * 16 * 3
    assert set(d["classes"]["vision"]["formats"]) == {"bf16"}
    assert d["shards"] == 5 and d["bytes"] == sum(c["bytes"] for c in d["classes"].values())


def test_inspect_folder_equals_tiny_id(tiny_glm):
    a = json.loads(runner.invoke(app, ["inspect", str(tiny_glm), "--json"]).stdout)
    b = json.loads(runner.invoke(app, ["inspect", "tiny:glm-5.2", "--json"]).stdout)
    assert {k: v for k, v in a.items() if k != "path"} == {k: v for k, v in b.items() if k != "path"}


def assert_one_line_error(r, *needles):
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit)  # typer.Exit, not an escaped exception
    assert "Traceback" not in r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert r.stdout == ""


# NaN / Inf are found when a weight is read (test_checkpoint); inspect reads headers only.
CLI_BAD = sorted(k for k in BAD if k not in ("nan", "inf"))


@pytest.mark.parametrize("case", CLI_BAD)
def test_inspect_bad_input(tmp_path, case):
    folder, _, file, tensor, _ = BAD[case](tmp_path)
    r = runner.invoke(app, ["inspect", str(folder)])
    assert_one_line_error(r, str(file), *([tensor] if tensor else []))


@pytest.mark.parametrize("spec,needle", [
    ("no/such/folder", "not a folder"),
    ("tiny:llama", "unknown tiny model"),
])
def test_inspect_bad_spec(spec, needle):
    assert_one_line_error(runner.invoke(app, ["inspect", spec]), spec.split(":")[-1], needle)


def test_inspect_hub_id_offline_with_nothing_cached(tmp_path, monkeypatch):
    """hf:// ids stream from the Hub; offline with nothing cached is a one-line error, no network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "qk"))
    r = runner.invoke(app, ["inspect", "hf://org/repo"])
    assert_one_line_error(r, "org/repo", "HF_HUB_OFFLINE")


def test_debug_env_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_DEBUG", "1")
    r = runner.invoke(app, ["inspect", str(tmp_path)])
    assert r.exit_code != 0 and type(r.exception).__name__ == "ConfigError"


# ---- what a new user tries first: --version, short help ---------------------------------------------------
def test_version_and_short_help():
    from quantkit import __version__

    v = runner.invoke(app, ["--version"])
    assert v.exit_code == 0 and v.stdout.strip() == f"quantkit {__version__}"
    for args in (["-h"], ["convert", "-h"], ["validate", "-h"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0 and "Usage" in r.output, (args, r.output)


def test_help_of_the_package_lists_the_public_functions():
    import pydoc

    import quantkit as qk

    text = pydoc.render_doc(qk, renderer=pydoc.plaintext)
    for name in qk.__all__:
        assert f"{name}" in qk.__doc__, name  # each public name has its line in the docstring
    assert "convert(model, out)" in text and "validate(dir)" in text


def test_convert_help_shows_the_recipes_defaults_and_the_whole_calib_text(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = runner.invoke(app, ["convert", "--help"], terminal_width=80).output
    flat = " ".join(out.replace("│", " ").split())
    assert "…" not in out, out
    assert ".safetensors file, or synthetic:train" in flat
    for opt in ("--method", "--num-samples", "--seq-len", "--group-size"):
        after = flat.split(opt, 1)[1].split(" --", 1)[0]
        assert "[default: (the recipe's)]" in after, (opt, after)


def test_no_message_borrowed_from_another_api():
    r = runner.invoke(app, ["plan", "glm-5.2", "--gpu", "h900"])
    assert r.exit_code == 1 and "--gpu h900" in r.output and "gpu_mem_gib" not in r.output, r.output


def test_a_rejected_option_leaves_no_empty_out(tmp_path):
    out = tmp_path / "never"
    r = runner.invoke(app, ["convert", "tiny:glm-5.2", "--out", str(out), "--method", "bogus", "--no-validate"])
    assert r.exit_code == 1 and "--method" in r.output and not out.exists(), r.output


@pytest.mark.parametrize("command", ["convert", "validate", "plan", "verify", "check-serving", "probe", "inspect", "pull"])
def test_help_shows_no_type_beside_a_flag_and_keeps_its_brackets(command):
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "250"})
    assert r.exit_code == 0 and "<bool>" not in r.output, r.output
    if command == "validate":
        assert "quantkit[eval]" in r.output and "(needs .)" not in r.output


def test_plan_takes_the_family_name_its_recipe_and_tiny_model_use():
    r = runner.invoke(app, ["plan", "qwen3-moe", "--json"])
    assert r.exit_code == 0, r.output
    real = json.loads(runner.invoke(app, ["plan", "qwen3-30b-a3b", "--json"]).output)
    assert json.loads(r.output) | {"model": real["model"]} == real
    assert runner.invoke(app, ["plan", "qwen3-moe", "--convert", "--gpu", "h200", "--json"]).exit_code == 0


def test_out_equal_to_or_inside_the_source_is_refused(tmp_path, tiny_glm):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_glm, src)
    before = sorted(p.name for p in src.iterdir())
    for out in (src, src / "out"):
        r = runner.invoke(app, ["convert", str(src), "--out", str(out), "--method", "rtn", "--no-validate"])
        assert r.exit_code == 1 and "--out" in r.output and "source folder" in r.output, r.output
        assert sorted(p.name for p in src.iterdir()) == before


@pytest.mark.parametrize("loads", [True, False])
def test_check_serving_ends_in_one_verdict_line(monkeypatch, tmp_path, loads):
    from quantkit.serving import checks

    def reports(folders, engines, layout=None):
        assert layout is None  # no --tp: the engines' answers only, no per-rank check
        return [checks.ServingReport(str(f), "fp8", [checks.EngineReport(e, "1", "rules", loads or e == "vllm",
                                                                         problems=[] if loads or e == "vllm" else ["no scheme"])
                                                     for e in engines]) for f in folders]

    monkeypatch.setattr(checks, "check_serving_many", reports)
    monkeypatch.setattr(checks, "serving_folders", lambda path: [tmp_path / "prefill", tmp_path / "decode"])
    monkeypatch.setattr(checks, "render", lambda r: f"table of {r.folder}")
    r = runner.invoke(app, ["check-serving", str(tmp_path)])
    last = r.output.strip().splitlines()[-1]
    assert r.exit_code == (0 if loads else 2) and last.startswith("verdict: ")
    assert ("would load" in last) if loads else ("REFUSED" in last and "sglang refuses" in last)
