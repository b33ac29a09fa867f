"""The wheel is complete: built from a copy of the source, installed into a fresh venv that sees no
source tree, it answers `quantkit --help` and runs a tiny convert. An editable install would hide
a sub-package that the build forgot; this does not."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_and_converts(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "out", "build", "dist", "*.egg-info",
                                                              "__pycache__", ".quantkit-cache", "tests", "docs"))
    dist = tmp_path / "dist"
    # --no-build-isolation: setuptools comes from this environment (tests never reach a package index)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("quantkit-*.whl")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing may point back at a source tree
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)  # ensurepip: offline
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the dependencies (torch & co.) from this environment's site-packages; a path in a .pth file is
    # added without running the .pth files inside it, so this environment's editable quantkit stays out
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True, text=True, env=env)

    run = tmp_path / "elsewhere"
    run.mkdir()
    where = subprocess.run([str(py), "-c", "import quantkit; print(quantkit.__file__)"], cwd=run, env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(site), where

    # the repo's top-level recipes/ ships inside the package (setup.py), and an installed quantkit finds them there
    found = subprocess.run([str(py), "-c", "from quantkit.recipe import available_recipes, recipe_dirs; "
                            "print(recipe_dirs()[0]); print(*available_recipes())"], cwd=run, env=env, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    assert Path(found[0]) == Path(where).parent / "recipes", found
    assert found[1].split() == sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")), found

    cli = [str(env_dir / "bin" / "quantkit")]  # the console script the wheel installed
    assert "convert" in subprocess.run([*cli, "--help"], cwd=run, env=env, check=True, capture_output=True,
                                       text=True).stdout
    assert "convert" in subprocess.run([str(py), "-m", "quantkit", "--help"], cwd=run, env=env, check=True,
                                       capture_output=True, text=True).stdout
    out = run / "out"
    r = subprocess.run([*cli, "convert", "tiny:glm-5.2", "--out", str(out), "--no-validate", "--json"], cwd=run, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "convert-report.json").read_text())
    assert report["recipe"]["name"] == "tiny-glm-5.2"
    assert (out / "decode" / "config.json").is_file() and (out / "prefill" / "config.json").is_file()
