"""Parses launch commands with the serving engines' own command-line parsers, in a child process.

`python -m quantkit.serving.cliparse` reads one JSON request on stdin and prints one JSON answer:

    request  {"engine": "sglang" | "vllm" | "sglang-router", "src": <folder from engines.cli_source>,
              "commands": [[arg, ...], ...]}          (the arguments after the program name)
    answer   {"parsed": [{"ok": bool, "error": str | None, "args": {dest: value as text}}]}

The parsers are the pinned releases' own, built from their files (quantkit.serving.engines.cli_source):
  - SGLang: `ServerArgs.add_cli_args` (srt/server_args.py, with srt/arg_groups/: every option,
    its type and its choices), what `python -m sglang.launch_server` parses with;
  - vLLM: `make_arg_parser(FlexibleArgumentParser())` (entrypoints/common/cli_args.py with
    engine/arg_utils.py and the config dataclasses it reads its options from), what `vllm serve`
    parses with; JSON options (`--kv-transfer-config`) are validated into their config classes;
  - sglang-router: `RouterArgs.add_cli_args` + `RouterArgs.from_cli_args` (router_args.py, with its
    compiled extension), what `python -m sglang_router.launch_router` parses with.
As in quantkit.serving.harness, the engine modules outside cli_files.json are inert stubs (kernels,
platforms, model code): what runs is argument parsing only, not the servers' start-up checks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path


def _modules(files: list[str]) -> tuple[str, ...]:
    """Dotted module names of the release files the parser process executes."""
    out = []
    for f in files:
        if not f.endswith(".py"):
            continue
        mod = f[: -len(".py")].replace("/", ".")
        out.append(mod.removesuffix(".__init__"))
    return tuple(out)


def _install(engine: str, src: Path) -> None:
    from quantkit.serving import harness
    from quantkit.serving.engines import cli_files

    real = _modules(cli_files()[engine])

    class Finder(harness.EngineFinder):
        def is_real(self, name: str) -> bool:
            return name in real

    import compressed_tensors  # noqa: F401  (the real ones, before any stub can exist)
    import torch  # noqa: F401

    sys.path.append(str(src))  # third-party packages fetched beside the engine files (msgspec)
    finder = Finder(engine, src)
    sys.meta_path.insert(0, finder)
    sys.meta_path.append(harness.MissingFinder(finder))


def parser_for(engine: str, src: Path):
    """(parse, the engine's parser) for one engine: parse(argv) -> namespace, raising SystemExit."""
    if engine == "sglang-router":
        sys.path.insert(0, str(src))
        from sglang_router.router_args import RouterArgs

        p = argparse.ArgumentParser(prog="python -m sglang_router.launch_router")
        RouterArgs.add_cli_args(p)
        return lambda argv: RouterArgs.from_cli_args(p.parse_args(argv))
    _install(engine, src)
    if engine == "sglang":
        from sglang.srt.server_args import ServerArgs

        p = argparse.ArgumentParser(prog="python -m sglang.launch_server")
        ServerArgs.add_cli_args(p)
        return p.parse_args
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    return p.parse_args


def run(req: dict) -> dict:
    parse = parser_for(req["engine"], Path(req["src"]))
    out = []
    for argv in req["commands"]:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = parse(list(argv))
            out.append({"ok": True, "error": None, "args": {k: str(v) for k, v in vars(ns).items()}})
        except SystemExit:
            lines = [ln for ln in err.getvalue().strip().splitlines() if ln.strip()]
            out.append({"ok": False, "error": lines[-1] if lines else "the parser exited", "args": {}})
        except Exception as e:  # noqa: BLE001 - a parser refusing a value is the answer
            out.append({"ok": False, "error": f"{type(e).__name__}: {e}", "args": {}})
    return {"parsed": out}


def main() -> None:
    req = json.loads(sys.stdin.read())
    try:
        ans = run(req)
    except Exception as e:  # noqa: BLE001 - the parent reports it
        import traceback

        ans = {"fatal": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    sys.stdout.write(json.dumps(ans))
    sys.stdout.flush()
    os._exit(0)  # stubbed modules confuse exit-time hooks


if __name__ == "__main__":
    main()
