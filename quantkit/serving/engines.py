"""The serving engines' own code, pinned: fetched once from PyPI, kept as plain .py files.

`quantkit check-serving` and tests/serving/test_serving.py ask vLLM and SGLang themselves which scheme each
module of a checkpoint gets. The engines cannot be installed beside quantkit (they pin their own
torch and need CUDA), so the pinned release wheel is downloaded with pip (`pip download --no-deps`),
only the modules that turn a config into schemes are extracted (a few hundred KB, `EXTRACT`), and
the wheel is deleted. They run in a child process (`quantkit.serving.harness`).

Cache: `$QUANTKIT_CACHE/engines/<engine>-<version>/` (default ~/.cache/quantkit). A folder is used
only when complete (extracted into `.partial`, renamed at the end). Offline, with the folder
absent, `engine_source` raises EngineUnavailable and the caller says so (check-serving falls back
to `quantkit.serving.checks.RULES`, tests skip).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.runtime.files import cache_dir

# The releases whose code the tests run (the newest on PyPI when this was written; bump together
# with docs/serving.md).
PINNED = {"vllm": "0.33.0", "sglang": "0.5.23"}

# Path prefixes (inside the wheel) of the files the harness executes.
EXTRACT = {
    "sglang": (
        "sglang/srt/layers/quantization/compressed_tensors/",
        "sglang/srt/layers/quantization/fp8.py",
        "sglang/srt/layers/quantization/utils.py",
        "sglang/srt/layers/quantization/base_config.py",
        "sglang/srt/layers/parameter.py",
        "sglang/srt/layers/moe/utils.py",
        "sglang/srt/models/deepseek_common/utils.py",
    ),
    "vllm": (
        "vllm/model_executor/layers/quantization/compressed_tensors/",
        "vllm/model_executor/layers/quantization/fp8.py",
        "vllm/model_executor/layers/quantization/base_config.py",
        "vllm/model_executor/layers/quantization/utils/quant_utils.py",
        "vllm/model_executor/layers/quantization/utils/config_utils.py",
        "vllm/model_executor/layers/quantization/utils/fp8_utils.py",
        "vllm/model_executor/parameter.py",
    ),
}


# The command-line parsers (`quantkit serve-commands`' tests): the release files that build each parser
# (cli_files.json: exactly the modules `python -m quantkit.serving.cliparse` executes; the rest are
# stubs), and the third-party packages they import that quantkit's environment lacks, pinned too.
CLI_PINNED = {"sglang": "0.5.23", "vllm": "0.33.0", "sglang-router": "0.3.2"}
CLI_DEPS = {"sglang": ("msgspec==0.23.0",), "vllm": (), "sglang-router": ()}


def cli_files() -> dict[str, list[str]]:
    return json.loads((Path(__file__).with_name("cli_files.json")).read_text())


class EngineUnavailable(QuantkitError):
    """The pinned engine release could not be fetched (offline, registry unreachable)."""


def cache_root() -> Path:
    """Where the extracted engine releases are kept: quantkit's cache folder's `engines/`."""
    return cache_dir() / "engines"


@dataclass(frozen=True)
class EngineSource:
    engine: str
    version: str
    path: Path  # put this on the harness's search path: it holds `sglang/...` or `vllm/...`


def engine_source(engine: str, *, download: bool = True, timeout: float = 600) -> EngineSource:
    """The extracted files of the pinned `engine` release, fetching them on first use."""
    if engine not in PINNED:
        raise QuantkitError(f"unknown engine {engine!r}; choose from {', '.join(PINNED)}")
    version = PINNED[engine]
    final = cache_root() / f"{engine}-{version}"
    if _complete(final, engine):
        return EngineSource(engine, version, final)
    if not download:
        raise EngineUnavailable(f"{engine} {version}: not in {cache_root()} and downloading is off")
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{engine}-download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--dest", tmp, f"{engine}=={version}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise EngineUnavailable(f"{engine} {version}: pip download failed ({e})") from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise EngineUnavailable(f"{engine} {version}: pip download failed: {last}")
        partial = Path(tmp) / "extracted"
        files = extract(wheels[0], engine, partial)
        (partial / "files.json").write_text(json.dumps(
            {"wheel": wheels[0].name, "extract": list(EXTRACT[engine]), "files": files}, indent=1))
        if _complete(final, engine):  # another process finished first
            return EngineSource(engine, version, final)
        if final.exists():  # extracted for an older EXTRACT list
            shutil.rmtree(final)
        shutil.move(str(partial), final)
    return EngineSource(engine, version, final)


def cli_source(engine: str, *, download: bool = True, timeout: float = 600) -> EngineSource:
    """The files that build `engine`'s own command-line parser (sglang, vllm, sglang-router), from its
    pinned release wheel, plus the packages they need that quantkit's environment lacks; fetched
    on first use into `<cache>/engines/<engine>-<version>-cli/`."""
    if engine not in CLI_PINNED:
        raise QuantkitError(f"unknown engine {engine!r}; choose from {', '.join(CLI_PINNED)}")
    version, want = CLI_PINNED[engine], cli_files()[engine]
    final = cache_root() / f"{engine}-{version}-cli"
    marker = {"files": want, "deps": list(CLI_DEPS[engine])}
    if _marked(final, marker):
        return EngineSource(engine, version, final)
    if not download:
        raise EngineUnavailable(f"{engine} {version} parser: not in {cache_root()} and downloading is off")
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{engine}-cli-download-") as tmp:
        partial = Path(tmp) / "extracted"
        for spec in (f"{engine}=={version}", *CLI_DEPS[engine]):
            wheel = _download(spec, Path(tmp), timeout)
            with zipfile.ZipFile(wheel) as z:
                names = [n for n in z.namelist() if n in want] if spec.startswith(engine + "==") else z.namelist()
                missing = set(want) - set(names) if spec.startswith(engine + "==") else set()
                if missing:
                    raise EngineUnavailable(f"{wheel.name}: lacks {sorted(missing)[0]} (cli_files.json is for {version})")
                for n in names:
                    z.extract(n, partial)
        (partial / "files.json").write_text(json.dumps(marker, indent=1))
        if _marked(final, marker):
            return EngineSource(engine, version, final)
        if final.exists():
            shutil.rmtree(final)
        shutil.move(str(partial), final)
    return EngineSource(engine, version, final)


def _download(spec: str, dest: Path, timeout: float) -> Path:
    """`pip download --no-deps spec` into dest; the wheel (binary for this interpreter where it has code)."""
    sub = dest / spec.replace("=", "_")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
           "--dest", str(sub), spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineUnavailable(f"{spec}: pip download failed ({e})") from None
    wheels = sorted(sub.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise EngineUnavailable(f"{spec}: pip download failed: {last}")
    return wheels[0]


def _marked(folder: Path, marker: dict) -> bool:
    try:
        return json.loads((folder / "files.json").read_text()) == marker
    except (OSError, json.JSONDecodeError):
        return False


def _complete(folder: Path, engine: str) -> bool:
    """The folder was extracted for today's EXTRACT list (an older quantkit may have taken fewer files)."""
    try:
        return json.loads((folder / "files.json").read_text()).get("extract") == list(EXTRACT[engine])
    except (OSError, json.JSONDecodeError):
        return False


def extract(wheel: Path, engine: str, dest: Path) -> list[str]:
    """The wheel's files under EXTRACT[engine] into `dest`; returns their paths."""
    out = []
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.endswith(".py") and name.startswith(EXTRACT[engine]):
                z.extract(name, dest)
                out.append(name)
    if not out:
        raise EngineUnavailable(f"{wheel.name}: none of the expected files ({', '.join(EXTRACT[engine])})")
    return sorted(out)


def run_harness(source: EngineSource, request: dict, timeout: float = 300) -> dict:
    """One `quantkit.serving.harness` run in a child process (its stubs never touch this one)."""
    req = dict(request, engine=source.engine, src=str(source.path))
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "quantkit.serving.harness"], input=json.dumps(req),
                          capture_output=True, text=True, timeout=timeout, env=env, check=False)
    try:
        ans = json.loads(proc.stdout)
    except json.JSONDecodeError:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise QuantkitError(f"{source.engine} {source.version} harness failed: {tail}") from None
    if "fatal" in ans:
        ans.setdefault("modules", [])
    return ans


def parse_commands(source: EngineSource, commands: list[list[str]], timeout: float = 300) -> list[dict]:
    """Each argument list parsed by the engine's own parser (`quantkit.serving.cliparse`, a child
    process): [{"ok", "error", "args"}], in order."""
    req = {"engine": source.engine, "src": str(source.path), "commands": commands}
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "quantkit.serving.cliparse"], input=json.dumps(req),
                          capture_output=True, text=True, timeout=timeout, env=env, check=False)
    try:
        ans = json.loads(proc.stdout)
    except json.JSONDecodeError:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise QuantkitError(f"{source.engine} {source.version} parser failed: {tail}") from None
    if "fatal" in ans:
        raise QuantkitError(f"{source.engine} {source.version} parser could not be built: {ans['fatal']}")
    return ans["parsed"]
