"""The `quantkit` command: thin typer commands over the library API.

Every command declares its options and calls one library function. Heavy libraries are imported
inside the commands, so `quantkit --help` answers at once. A QuantkitError prints one line and
exits 1; set QUANTKIT_DEBUG=1 to see the traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from quantkit.model.presets import preset_names
from quantkit.quant.methods import METHODS, unknown_method
from quantkit.synthetic import TINY_NAMES


class _Command(typer.core.TyperCommand):
    """A command whose help shows no type beside a flag (typer prints `<bool>` there, as if the flag
    took a value)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


app = typer.Typer(
    name="quantkit",
    help="Quantize trillion-parameter MoE checkpoints (Kimi K2.6, GLM 5.2) into a matched FP8-prefill / INT4-decode pair.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

Model = Annotated[str, typer.Argument(help="A model folder, an hf://org/repo@rev id, or a tiny id "
                                          f"({' / '.join('tiny:' + n for n in TINY_NAMES)}).")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout (for scripts).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress: no bar in a terminal, no line per layer in a log.")]
Device = Annotated[str, typer.Option(help="auto (CUDA when present, else CPU), cuda or cpu.")]
Unverified = Annotated[bool, typer.Option("--allow-unverified", help="hf:// only: accept files the Hub lists without a checksum (size only; recorded in the report).")]


def _shared(kind: type, convert_help: str, plan_help: str, shown: str | bool = False):
    """An option both `convert` and `plan --convert` take, declared once so that its name, type and
    default cannot drift apart between a run and its prediction; returned as each command's
    annotation, because each keeps its own help (plan's names its mode, and its GPU default is
    the --gpu's, not this machine's). `shown`: the default convert's help shows (the recipe's
    value, which no number here could state for every model)."""
    return (Annotated[Optional[kind], typer.Option(help=convert_help, show_default=shown)],
            Annotated[Optional[kind], typer.Option(help=plan_help)])


# The options `convert` and `plan --convert` share, each declared once (convert's, then plan's).
Recipe, PlanRecipe = _shared(str, "Recipe file or name (default: the model family's).",
                             "--convert: recipe file or name (default: the model family's).")
RECIPES = "the recipe's"
Method, PlanMethod = _shared(str, "; ".join(f"{n} ({m.help})" for n, m in METHODS.items()) + ".",
                             f"--convert: {', '.join(METHODS)}.", RECIPES)
NumSamples, PlanNumSamples = _shared(int, "Calibration samples.", "--convert: calibration samples.", RECIPES)
SeqLen, PlanSeqLen = _shared(int, "Tokens per calibration sample.", "--convert: tokens per calibration sample.", RECIPES)
GroupSize, PlanGroupSize = _shared(int, "INT4 group size: 32, 64 or 128.",
                                   "INT4 group size of the decode checkpoint (default: the model's recipe's, as convert writes).",
                                   RECIPES)
HostMemory, PlanHostMemory = _shared(str, "Host RAM budget, e.g. 8GB (default: available memory).",
                                     "--convert: host RAM budget, e.g. 8GB (default: available memory).")
GpuMemory, PlanGpuMemory = _shared(str, "GPU memory budget, e.g. 120GB (default: the device's).",
                                   "--convert: GPU memory budget (default: the --gpu's).")


def _version(value: bool) -> None:
    if value:
        from quantkit import __version__

        sys.stdout.write(f"quantkit {__version__}\n")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print quantkit's version and exit.")] = False) -> None:
    """Quantize trillion-parameter MoE checkpoints (Kimi K2.6, GLM 5.2) into a matched FP8-prefill / INT4-decode pair."""


def user_errors(fn):
    """Map quantkit's typed errors to one red line and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from quantkit.errors import QuantkitError

        try:
            return fn(*args, **kwargs)
        except QuantkitError as e:
            if os.environ.get("QUANTKIT_DEBUG"):
                raise
            from rich.markup import escape

            console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)  # messages quote paths, [x]
            raise typer.Exit(1) from None

    return wrapper


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@app.command(cls=_Command)
@user_errors
def inspect(model: Model, json_out: Json = False, allow_unverified: Unverified = False):
    """Family, layers, parameters and bytes by tensor class, storage format per class, shard count."""
    from quantkit.planner.inspection import inspect as run_inspect

    result = run_inspect(model, allow_unverified=allow_unverified)
    if json_out:
        emit_json(result.to_json())
    else:
        Console().print(result.table())


def _plan_tasks(model: str, tasks: str, gpus: int, gpu: str, group_size: int | None, json_out: bool) -> None:
    from quantkit.inputs.modelspec import is_tiny, resolve
    from quantkit.planner.taskcost import plan_tasks, render

    costs = plan_tasks(str(resolve(model)) if is_tiny(model) else model, tasks, gpus=gpus, gpu=gpu, group_size=group_size or 128)
    if json_out:
        emit_json({"tasks": [c.to_json() for c in costs]})
    else:
        Console().print(render(costs), highlight=False)


@app.command(cls=_Command)
@user_errors
def plan(
    model: Annotated[str, typer.Argument(help=f"A preset ({', '.join(preset_names())}), a folder with config.json, "
                                                    "a tiny:/realshape: id or an hf://org/repo@rev id (shard headers only).")],
    gpus: Annotated[int, typer.Option(help="GPUs in the set.")] = 8,
    gpu: Annotated[str, typer.Option(help="GPU kind: h200, h100, b200, ...")] = "h200",
    tp: Annotated[Optional[int], typer.Option(help="Tensor-parallel size (default: --gpus).")] = None,
    context: Annotated[int, typer.Option(help="Tokens per request for the concurrency figure.")] = 21_400,
    mem_fraction: Annotated[float, typer.Option(help="Share of GPU memory for weights + KV cache.")] = 0.90,
    overhead_gib: Annotated[float, typer.Option(help="Per-GPU runtime overhead (activations, graphs, NCCL).")] = 12.0,
    group_size: PlanGroupSize = None,
    convert: Annotated[bool, typer.Option("--convert", help="Predict a conversion instead: peak memory, disk, time per phase, validate's time.")] = False,
    recipe: PlanRecipe = None,
    method: PlanMethod = None,
    num_samples: PlanNumSamples = None,
    seq_len: PlanSeqLen = None,
    calib: Annotated[Optional[str], typer.Option(help="--convert: the calibration data, as convert's --calib (text read through the tokenizer costs its memory; ids do not).", show_default=RECIPES)] = None,
    max_host_memory: PlanHostMemory = None,
    max_gpu_memory: PlanGpuMemory = None,
    nproc: Annotated[int, typer.Option(help="--convert: ranks of an expert-parallel convert (one per GPU; `quantkit convert --nproc`): memory and time per rank.")] = 1,
    disk_gbps: Annotated[Optional[float], typer.Option(help="--convert: the disk's sustained GB/s, reads and writes together (default 2 for a GPU machine, 1 for --gpu cpu).")] = None,
    validation: Annotated[Optional[Path], typer.Option(help="A validation.json (validate --kv-cache-dtype fp8_e4m3): show the measured FP8 KV delta beside its capacity.")] = None,
    tasks: Annotated[Optional[str], typer.Option(help="What `validate --tasks` would cost (gsm8k, mmlu): passes over the layers, tokens, bytes read, time per checkpoint, on --gpus x --gpu.")] = None,
    json_out: Json = False,
):
    """Checkpoint sizes, weight memory per GPU, KV cache per token and capacity, beside the article's figures.
    With --convert: what `quantkit convert` would cost (--gpu cpu for a CPU-only run)."""
    if tasks:
        _plan_tasks(model, tasks, gpus, gpu, group_size, json_out)
        if not convert:
            return
    if convert:
        from quantkit.planner.cost import plan_convert_for

        cost = plan_convert_for(model, recipe=recipe, gpu=gpu, method=method, num_samples=num_samples, seq_len=seq_len,
                                calib=calib, group_size=group_size, max_host_memory=max_host_memory, max_gpu_memory=max_gpu_memory,
                                nproc=nproc, rates={"disk": disk_gbps * 1e9} if disk_gbps is not None else None)
        if json_out:
            emit_json(cost.to_json())
        else:
            Console().print(cost.summary(), highlight=False)
        return
    from quantkit.inputs.modelspec import is_tiny, resolve
    from quantkit.planner.capacity import plan as run_plan
    from quantkit.planner.gpus import GPUS
    from quantkit.planner.render import render_plan

    if gpu not in GPUS:  # checked here: the library's message names its own gpu_mem_gib argument, not an option
        from quantkit.errors import ConfigError

        raise ConfigError(f"--gpu {gpu}: unknown GPU kind; known: {', '.join(GPUS)}")

    target = resolve(model) if is_tiny(model) else model
    result = run_plan(target, gpus=gpus, gpu=gpu, tp=tp, context=context, mem_fraction=mem_fraction,
                      overhead_gib=overhead_gib, group_size=group_size)
    if validation is not None:
        from quantkit.inputs.results import load_validation
        from quantkit.planner.render import capacity_beside_delta

        result.notes[:0] = capacity_beside_delta(result, load_validation(validation))
    if json_out:
        emit_json(result.to_json())
    else:
        render_plan(result, Console())


@app.command(cls=_Command)
@user_errors
def pull(
    repo: Annotated[str, typer.Argument(help="org/repo, org/repo@rev or hf://org/repo@rev.")],
    out: Annotated[Path, typer.Option("--out", help="Folder to download into.")],
    include: Annotated[Optional[list[str]], typer.Option(help="Only files matching this pattern (repeatable).")] = None,
    workers: Annotated[int, typer.Option(help="Parallel downloads.")] = 8,
    allow_unverified: Unverified = False,
    json_out: Json = False,
):
    """Download a Hub repo at one pinned commit: parallel, resumable, every file checksum-verified."""
    from quantkit.hub.download import pull as run_pull

    result = run_pull(repo, out, include=include, max_workers=workers, progress=not json_out, allow_unverified=allow_unverified)
    if json_out:
        emit_json({k: str(v) if isinstance(v, Path) else v for k, v in vars(result).items()})
    else:
        console.print(f"pulled {len(result.files)} files of {result.repo_id}@{result.commit[:12]} into {out}")


@app.command(cls=_Command)
@user_errors
def convert(
    ctx: typer.Context,
    model: Model,
    out: Annotated[Path, typer.Option("--out", help="Output folder: prefill/, decode/ and convert-report.json appear when complete.")],
    recipe: Recipe = None,
    preset: Annotated[Optional[str], typer.Option(help="Alias of --recipe: a shipped recipe name (kimi-k2.6, glm-5.2, ...).")] = None,
    method: Method = None,
    calib: Annotated[Optional[str], typer.Option(help="Calibration data: hf:org/name@split, a .jsonl, .txt, .parquet, .npy or .safetensors file, or synthetic:train; replaces a recipe's calibration.mix.", show_default=RECIPES)] = None,
    num_samples: NumSamples = None,
    seq_len: SeqLen = None,
    group_size: GroupSize = None,
    decode_rest: Annotated[Optional[str], typer.Option(help="Decode's non-expert weights: prefill (same bytes as prefill, default) or bf16 (Kimi's official look).")] = None,
    device: Device = "auto",
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from its last completed layer (refused if the options or inputs differ from that run's).")] = False,
    restart: Annotated[bool, typer.Option("--restart", help="Discard an interrupted run in --out and start over (without it, or --resume, such a folder is refused).")] = False,
    no_validate: Annotated[bool, typer.Option("--no-validate", help="Skip validating the pair afterwards.")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow the tokenizer's own code to run.")] = False,
    delete_source_after: Annotated[bool, typer.Option("--delete-source-after", help="hf:// sources: delete each shard once consumed.")] = False,
    allow_unverified: Unverified = False,
    max_host_memory: HostMemory = None,
    max_gpu_memory: GpuMemory = None,
    nproc: Annotated[Optional[int], typer.Option(help="Ranks on this machine (one per GPU): launches torchrun, which splits each layer's routed experts across them (docs/distributed.md). The bytes equal one process's only at the same threads per process (torchrun's ranks run 1; set OMP_NUM_THREADS=1 for the single run), torch/BLAS build and device type: convert-report.json's reproducibility records them.")] = None,
    eval_data: Annotated[Optional[str], typer.Option(help="The chained validate's held-out data (default: the recipe's validate.dataset); loaded before the first layer.", show_default=RECIPES)] = None,
    eval_num_samples: Annotated[Optional[int], typer.Option(help="The chained validate's eval windows.", show_default=RECIPES)] = None,
    eval_seq_len: Annotated[Optional[int], typer.Option(help="The chained validate's tokens per eval window.", show_default=RECIPES)] = None,
    gen_tokens: Annotated[Optional[int], typer.Option(help="The chained validate's greedy tokens after each window.", show_default=RECIPES)] = None,
    gate: Annotated[Optional[Path], typer.Option(help="The chained validate's YAML/JSON gates (kl_max: 0.05, ...).", show_default=RECIPES)] = None,
    quiet: Quiet = False,
    json_out: Json = False,
):
    """Emit the FP8 prefill and INT4 decode checkpoints from one streaming pass, with calibrated per-expert GPTQ or AWQ."""
    from quantkit.conversion.pipeline import convert as run_convert

    if recipe and preset:
        raise typer.BadParameter("give --recipe or --preset, not both")
    if method is not None and method not in METHODS:  # before any rank starts; the recipe load says the same
        from quantkit.errors import ConfigError

        raise ConfigError(f"--method: {unknown_method(method)}")
    _relaunch_under_torchrun(ctx, nproc, out)
    stop = _stop_on_sigterm()
    try:
        result = run_convert(model, out, recipe=recipe or preset, method=method, calib=calib, num_samples=num_samples,
                             seq_len=seq_len, group_size=group_size, decode_rest=decode_rest, device=device, resume=resume, restart=restart,
                             validate=not no_validate, progress=not (json_out or quiet), trust_remote_code=trust_remote_code,
                             delete_source_after=delete_source_after, allow_unverified=allow_unverified,
                             max_host_memory=max_host_memory, max_gpu_memory=max_gpu_memory, eval_data=eval_data,
                             eval_num_samples=eval_num_samples, eval_seq_len=eval_seq_len, gen_tokens=gen_tokens, gate=gate)
    except KeyboardInterrupt as e:
        how = "terminated (SIGTERM)" if isinstance(e, _Terminated) else "interrupted"
        console.print(f"[red]{how}:[/red] {out} is not complete; run the same command with --resume to continue "
                      "from the last completed layer", highlight=False, soft_wrap=True)
        raise typer.Exit(143 if isinstance(e, _Terminated) else 130) from None
    finally:
        stop()
    if result.rank:  # a multi-rank convert's other ranks: rank 0 prints
        return
    if json_out:
        emit_json(result.to_json() | ({"validation": result.validation.to_json()} if result.validation else {}))
    else:
        Console().print(result.table())
        if result.validation:
            Console().print(result.validation.table())
    if result.validation and not result.validation.passed:
        _gates_failed(result.validation)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a job scheduler's stop) raised where Ctrl-C raises KeyboardInterrupt, so a
    convert stops the same way: its completed layers kept and one line saying how to continue (the
    default handler ended the process without a word)."""


def _stop_on_sigterm():
    """Raise _Terminated on SIGTERM while a convert runs; returns what restores the previous handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def terminated(signum, frame):
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    return lambda: signal.signal(signal.SIGTERM, previous)


@app.command(cls=_Command)
@user_errors
def validate(
    ctx: typer.Context,
    folder: Annotated[Path, typer.Argument(metavar="DIR", help="A convert output (prefill/, decode/, convert-report.json) or one checkpoint folder.")],
    reference: Annotated[Optional[str], typer.Option(help="Model to compare with (default: the source in convert-report.json).")] = None,
    eval_data: Annotated[Optional[str], typer.Option(help="Held-out data spec (default: the recipe's validate.dataset).")] = None,
    num_samples: Annotated[Optional[int], typer.Option(help="Eval windows (default: the recipe's).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per eval window (default: the recipe's).")] = None,
    gen_tokens: Annotated[Optional[int], typer.Option(help="Greedy tokens generated after each window (default: the recipe's).")] = None,
    device: Device = "auto",
    gate: Annotated[Optional[Path], typer.Option(help="YAML/JSON gates (kl_max: 0.05, top1_min: 0.9, ...); default: the recipe's.")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help="KV cache to simulate: bf16, fp8_e4m3 (static per-layer scales) or fp8_ds_mla (vLLM's DSA layout).")] = "bf16",
    max_host_memory: HostMemory = None,
    max_gpu_memory: Annotated[Optional[str], typer.Option(help="GPU memory budget (default: the device's).")] = None,
    weights: Annotated[str, typer.Option(help="auto: keep as much of the checkpoints (each rank its share) in memory, as stored, as the budget allows, so greedy tokens stop re-reading them; resident: all of it or an error; stream: re-read every layer for every greedy token.")] = "auto",
    nproc: Annotated[Optional[int], typer.Option(help="Ranks on this machine (one per GPU): launches torchrun; each rank runs its share of the routed experts (docs/distributed.md).")] = None,
    tasks: Annotated[Optional[str], typer.Option(help="lm-eval tasks (comma-separated) to run on the source and every checkpoint: scores, paired deltas, flipped items (needs the eval extra: pip install 'quantkit\\[eval]').")] = None,
    task_dir: Annotated[Optional[Path], typer.Option(help="A folder of local lm-eval task YAMLs for --tasks.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="--tasks: items per task (default: all).")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option(help="--tasks: few-shot examples (default: each task's).")] = None,
    long_context: Annotated[Optional[int], typer.Option(help="DSA models: tokens per long-context window (default 2 x index_topk, at most max_position_embeddings; 0: skip).")] = None,
    numerics: Annotated[str, typer.Option(help="engine: compute as vLLM/SGLang do (FP8 block Linears W8A8, activations quantized per token in 128-column groups; INT4 experts W4A16; the default, what the cards report); weights: on the dequantized weights alone (for a server that runs dequantized copies).")] = "engine",
    tool_task: Annotated[Optional[str], typer.Option(help="A tool task (JSON/JSONL chat prompts with OpenAI-style tool schemas; `default`: the shipped one): tool-call F1 and schema accuracy of every checkpoint against the source.")] = None,
    quiet: Quiet = False,
    json_out: Json = False,
):
    """Measure the pair against its source layer by layer; write validation.json/.md/.png, the per-expert map
    validation-experts.png and model cards. Exit 3 if a gate fails."""
    from quantkit.validation.pipeline import validate as run_validate

    _relaunch_under_torchrun(ctx, nproc, folder, resume_hint=False)
    result = run_validate(folder, reference=reference, eval_data=eval_data, num_samples=num_samples, seq_len=seq_len,
                          gen_tokens=gen_tokens, device=device, gate=gate, progress=not (json_out or quiet), kv_cache_dtype=kv_cache_dtype,
                          max_host_memory=max_host_memory, max_gpu_memory=max_gpu_memory, weights=weights,
                          tasks=tasks, task_dir=task_dir, limit=limit, num_fewshot=num_fewshot, numerics=numerics,
                          long_context=long_context, tool_task=tool_task)
    from quantkit.runtime.distributed import from_env

    if not from_env().leader:  # rank 0 prints and decides the exit status
        return
    if json_out:
        emit_json(result.to_json())
    else:
        Console().print(result.table())
    if not result.passed:
        _gates_failed(result)


@app.command("check-serving", cls=_Command)
@user_errors
def check_serving(
    path: Annotated[Path, typer.Argument(metavar="DIR", help="A checkpoint folder, or a convert output (checks prefill/ and decode/).")],
    engine: Annotated[str, typer.Option(help="vllm, sglang or all.")] = "all",
    tp: Annotated[Optional[int], typer.Option(help="GPUs per serving instance (tensor-parallel size): check every module's shard per rank against the kernel rules of each engine.")] = None,
    ep: Annotated[int, typer.Option(help="With --tp: expert-parallel size for the routed experts (divides --tp; MoE TP = tp / ep). vLLM's EP is 1 or --tp.")] = 1,
    dp_attention: Annotated[bool, typer.Option("--dp-attention", help="With --tp: attention data-parallel (attention weights whole on every rank).")] = False,
    gpu: Annotated[str, typer.Option(help="With --tp: the GPU the engines pick kernels for: h100, h200 or b200.")] = "h200",
    json_out: Json = False,
):
    """Ask vLLM's and SGLang's own code (pinned releases) which scheme each module gets, and with --tp whether
    every rank's shards keep the kernels' rules; exit 2 if one would refuse, naming a layout that works."""
    from quantkit.serving.checks import ENGINES, check_serving_many, render, serving_folders
    from quantkit.serving.layout import Layout

    engines = ENGINES if engine == "all" else (engine,)
    layout = Layout(tp, ep, dp_attention, gpu) if tp is not None else None
    reports = check_serving_many(serving_folders(path), engines, layout=layout)
    if json_out:
        emit_json([r.to_dict() for r in reports])
    else:
        for r in reports:
            Console().print(render(r))
    if not all(r.loads for r in reports):
        for r in reports:
            for e in r.engines:
                for p in e.problems[:5]:
                    console.print(f"[red]{e.engine} refuses {r.folder}:[/red] {p}", highlight=False, soft_wrap=True)
    if not json_out:
        Console().print(_serving_verdict(reports), highlight=False, soft_wrap=True)
    if not all(r.loads for r in reports):
        raise typer.Exit(2)


def _serving_verdict(reports) -> str:
    """check-serving's last line: whether every engine loads every folder, else who refuses what."""
    engines = sorted({e.engine for r in reports for e in r.engines})
    refused = [f"{e.engine} refuses {r.folder}" for r in reports for e in r.engines if not e.loads]
    refused += [f"compressed-tensors cannot compute {r.folder}" for r in reports if r.compressed_tensors]
    if not refused:
        return f"verdict: loads: {' and '.join(engines)} would load {', '.join(r.folder for r in reports)}"
    return f"verdict: REFUSED: {'; '.join(refused)} (exit 2)"


@app.command("serve-commands", cls=_Command)
@user_errors
def serve_commands(
    path: Annotated[Path, typer.Argument(metavar="DIR", help=f"A convert output (prefill/, decode/), or a preset ({', '.join(preset_names())}): the pair convert would write.")],
    engine: Annotated[str, typer.Option(help="sglang or vllm.")] = "sglang",
    tp: Annotated[int, typer.Option(help="GPUs per instance (tensor-parallel size) on each pool.")] = 8,
    ep: Annotated[int, typer.Option(help="Expert-parallel size for the routed experts (divides --tp; vLLM: 1 or --tp).")] = 1,
    dp_attention: Annotated[bool, typer.Option("--dp-attention", help="Attention data-parallel.")] = False,
    gpu: Annotated[str, typer.Option(help="The GPU the layout is checked for: h100, h200 or b200.")] = "h200",
    mount: Annotated[Optional[str], typer.Option(help="The path both pools mount their checkpoint at (the same on both: vLLM's handshake hashes it). Default /models/<name>.")] = None,
    mtp: Annotated[bool, typer.Option(help="Speculative decoding with the checkpoint's MTP layer, identically on both pools (when it has one).")] = True,
    check: Annotated[bool, typer.Option("--check", help="Parse every command with the pinned engine's own argument parser (fetched once from PyPI).")] = False,
    json_out: Json = False,
):
    """Print the prefill, decode and router commands for a pair at a parallel layout, with the flags the pair
    needs; exit 2 (naming a layout that works) if the layout breaks a kernel rule."""
    from quantkit.serving.commands import check_commands, layout_refusal, render
    from quantkit.serving.commands import serve_commands as build
    from quantkit.serving.layout import Layout

    layout = Layout(tp, ep, dp_attention, gpu)
    facts = stored = None
    if not path.is_dir() and str(path) in preset_names():  # the pair convert would write for a preset
        from quantkit.model.arch import arch_from_config
        from quantkit.model.presets import load_preset
        from quantkit.planner.capacity import recipe_group_size
        from quantkit.serving.commands import predicted_facts

        config = load_preset(str(path))
        facts, stored = predicted_facts(config, str(path), recipe_group_size(str(path), arch_from_config(config)))
    if why := layout_refusal(path, engine, layout, stored):
        console.print(f"[red]{why}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    cmds, facts = build(path, engine, layout, mount=mount, mtp=mtp, facts=facts)
    parsed = check_commands(cmds) if check else []
    if json_out:
        emit_json({"engine": engine, "layout": layout.flags(), "notes": facts.notes, "parsed": parsed,
                   "commands": [{"role": c.role, "argv": c.argv, "comment": c.comment} for c in cmds]})
    else:
        sys.stdout.write(render(cmds, facts, engine, layout))
        for p in parsed:
            verdict = "parses" if p["ok"] else f"REFUSED: {p['error']}"
            console.print(f"{p['role']}: {verdict} ({p['parser']}'s own parser)", highlight=False, soft_wrap=True)
    if any(not p["ok"] for p in parsed):
        raise typer.Exit(2)


@app.command(cls=_Command)
@user_errors
def verify(
    folder: Annotated[Path, typer.Argument(metavar="DIR", help="A convert output (prefill/, decode/, convert-report.json) or one of its checkpoints.")],
    json_out: Json = False,
):
    """Re-hash an output against its manifest.json and check the pair's shared tensors are identical. Exit 1 on any difference."""
    from quantkit.checkpoint.manifest import verify as run_verify

    result = run_verify(folder)
    if json_out:
        emit_json(result.to_json())
    else:
        Console().print(result.table())
        for p in result.problems:
            console.print(f"[red]{p}[/red]", highlight=False, soft_wrap=True)
    result.raise_for_problems()


@app.command(cls=_Command)
@user_errors
def probe(
    url: Annotated[str, typer.Argument(help="The endpoint's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.")],
    pair: Annotated[Optional[Path], typer.Option("--pair", metavar="DIR", help="The convert output (prefill/, decode/) to compare the endpoint with (not needed with --isolation).")] = None,
    model: Annotated[Optional[str], typer.Option(help="The server's name for the model (default: its only one).")] = None,
    api_key_env: Annotated[str, typer.Option(help="Environment variable holding the API key (sent as a Bearer token).")] = "OPENAI_API_KEY",
    timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 60.0,
    retries: Annotated[int, typer.Option(help="Retries on 429/5xx and dropped connections, with exponential backoff.")] = 4,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at most.")] = 4,
    kv_cache_dtype: Annotated[str, typer.Option(help="FP8 KV variants to compare with: auto (the engines' for this model), fp8_e4m3, fp8_ds_mla or bf16 (none).")] = "auto",
    min_agree: Annotated[float, typer.Option(help="Greedy agreement below which the endpoint matches no checkpoint.")] = 0.9,
    device: Device = "auto",
    write_card: Annotated[bool, typer.Option("--write-card", help="Add the verdict to the pair's model cards.")] = False,
    prompts: Annotated[Optional[Path], typer.Option(help="Another recorded prompt set (JSON like quantkit/probe/prompts.json; default: that one).")] = None,
    numerics: Annotated[str, typer.Option(help="How the candidates are computed: auto (each in every numerics that computes it differently, judged by its best-supported one), engine (vLLM/SGLang, transformers on a GPU or compressed-tensors: FP8 block Linears W8A8), transformers (transformers on a CPU: native FP8 dequantized on load) or weights (dequantized copies).")] = "auto",
    tokens: Annotated[Optional[int], typer.Option(help="Greedy tokens per prompt (default: the prompt set's max_tokens); the power lines say which budget separates the checkpoints.")] = None,
    tool_task: Annotated[Optional[str], typer.Option(help="Also send a tool task's prompts with tools= (`default`: the shipped one): finish_reason tool_calls F1 against the source and the schema accuracy of the endpoint's calls.")] = None,
    isolation: Annotated[bool, typer.Option("--isolation", help="Instead: test that the endpoint keeps concurrent requests apart (shared prefixes, distinct canaries, each answer against the same request sent alone); exit 2 on a leak.")] = False,
    requests: Annotated[int, typer.Option(help="--isolation: requests in flight together.")] = 4,
    rounds: Annotated[int, typer.Option(help="--isolation: concurrent rounds.")] = 6,
    seed: Annotated[int, typer.Option(help="--isolation: seed of the prefix and canaries.")] = 0,
    json_out: Json = False,
):
    """Check an OpenAI-compatible endpoint against the pair's reference forward; name the checkpoint it behaves like.
    With --isolation: check that it keeps concurrent requests apart."""
    if isolation:
        from quantkit.probe.isolation import isolation_probe

        res = isolation_probe(url, model=model, requests=requests, rounds=rounds, seed=seed, api_key_env=api_key_env,
                              timeout=timeout, retries=retries)
        if json_out:
            emit_json(res.data)
        else:
            for line in res.lines():
                Console().print(line, highlight=False, soft_wrap=True)
        if not res.isolated:
            raise typer.Exit(2)
        return
    if pair is None:
        raise typer.BadParameter("--pair DIR is required (or pass --isolation)")
    from quantkit.probe.pipeline import probe as run_probe

    result = run_probe(url, pair, model=model, api_key_env=api_key_env, timeout=timeout, retries=retries,
                       concurrency=concurrency, kv_cache_dtype=kv_cache_dtype, min_agree=min_agree, device=device,
                       write_card=write_card, prompts=prompts, numerics=numerics, tool_task=tool_task,
                       tokens=tokens)
    if json_out:
        emit_json(result.data)
    else:
        for line in result.lines():
            Console().print(line, highlight=False, soft_wrap=True)


def _relaunch_under_torchrun(ctx: typer.Context, nproc: Optional[int], out: Path, **launch) -> None:
    """`--nproc N` (N > 1) outside torchrun: run this same command under torchrun, with every
    option as given but --nproc, and exit with its status. Inside torchrun (WORLD_SIZE set, the
    ranks themselves) or with one rank: nothing, the command runs here."""
    if nproc is None or nproc <= 1 or "WORLD_SIZE" in os.environ:
        return
    raise typer.Exit(_torchrun(nproc, [ctx.command.name, *_command_line(ctx)], out, **launch))


def _command_line(ctx: typer.Context) -> list[str]:
    """The arguments that give this command the values it runs with: its arguments, then each
    option that has a value (in declaration order), then the flags that are set; --nproc left out."""
    args: list[str] = []
    options: list[str] = []
    flags: list[str] = []
    for p in ctx.command.params:
        value = ctx.params.get(p.name)
        if p.name == "nproc" or value is None or value is False:
            continue
        if p.param_type_name == "argument":
            args.append(str(value))
        elif p.is_flag:
            flags.append(p.opts[0])
        else:
            options += [p.opts[0], str(value)]
    return args + options + flags


def _torchrun(nproc: int, argv: list[str], out: Path, resume_hint: bool = True) -> int:
    """`quantkit ... --nproc N`: run `python -m torch.distributed.run --standalone --nproc-per-node N
    -m quantkit ARGV` (one machine, a free rendezvous port) and return its exit status. torchrun
    stops every rank when one fails (quantkit.runtime.distributed) and exits 1 whatever the rank's status,
    so a gate failure (rank 0 exits 3) is recovered from the out/validation.json this run wrote."""
    import subprocess
    import time

    from quantkit.inputs.results import gates_failed_since

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "quantkit", *argv]
    console.print(f"launching {nproc} ranks: {' '.join(cmd[2:])}", highlight=False, soft_wrap=True)
    t0 = time.time()
    rc = subprocess.run(cmd).returncode
    if rc and gates_failed_since(out / "validation.json", t0):
        from quantkit.validation.pipeline import GATES_FAILED_EXIT

        return GATES_FAILED_EXIT  # rank 0 printed which gate failed
    if rc:
        console.print(f"[red]error:[/red] a rank failed (exit {rc}; torchrun's summary above names it, and the first "
                      "failure is the cause)" + ("; the completed layers are saved: rerun the same command with --resume"
                                                 if resume_hint else ""), highlight=False, soft_wrap=True)
    return rc


def _gates_failed(result) -> None:
    """A failed gate: say which, exit 3 (so a CI job refuses to publish the artifact)."""
    from quantkit.validation.pipeline import GATES_FAILED_EXIT

    failed = ", ".join(f"{g['gate']} on {g['row']} ({g['value']:.4g})" for g in result.failed_gates)
    console.print(f"[red]validation failed:[/red] {failed}", highlight=False, soft_wrap=True)
    raise typer.Exit(GATES_FAILED_EXIT)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
