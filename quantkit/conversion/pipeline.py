"""`quantkit convert`: one streaming pass from a source checkpoint to the prefill/decode pair.

The conversion loop, one decoder layer at a time (peak memory: one layer plus the calibration
activations, whatever the depth):

    h = embed(calibration tokens)
    for each layer:
        load the layer from the shards (dequantized on the fly)
        decide each tensor's storage in both outputs (quantkit.planner.precision)
        run attention with the weights both outputs will hold          h += attention(h)
        MoE layers: route the normed h's tokens; per routed expert, build GPTQ Hessians from the tokens the
                    router actually sends it (gate and up share one; down's from the quantized
                    gate/up's output); starved experts take the recipe's fallback, counted
        quantize the experts (batched), write both outputs' tensors, flush a shard per layer
        h += MoE/MLP output computed with the *decode* weights
        save h and the progress (so --resume restarts exactly here)

Calibration choice: each layer is calibrated on the hidden states the quantized decode model
produces at that point (errors of earlier layers included), as GPTQ's sequential mode does; the
attention weights are the shared (FP8) ones both pools run.

`convert` below is that loop as named steps; the pieces live beside it: quantkit.conversion.stages
(the embeddings stage, one layer, the prefetcher), .outputs (the folder's owner, the disk, the
pair's writers and configs), .resume (the saved progress) and .report (convert-report.json).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.checkpoint.finish import finish_pair, journal
from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.unfinished import record_command
from quantkit.conversion.job import Job
from quantkit.conversion.outputs import (
    PairWriter,
    close_pair,
    open_pair,
    output_configs,
    owned_output,
    refuse_existing,
    shard_digits,
)
from quantkit.conversion.report import ConvertResult, convert_report, source_identity
from quantkit.conversion.resume import (
    STATE_DIR,
    fingerprint,
    load_hidden,
    open_state,
    refuse_other_inputs,
    run_inputs,
    save_state,
    saved_inputs,
)
from quantkit.conversion.stages import Calibration, Prefetcher, convert_layer, outside_layers, start_calibration
from quantkit.errors import ConfigError, OutputError
from quantkit.inputs.modelspec import open_checkpoint
from quantkit.planner.precision import Decision, decide_all, needs_calibration, predicted_bytes
from quantkit.runtime import distributed
from quantkit.runtime.machine import peak_rss
from quantkit.runtime.progress import LayerProgress

if TYPE_CHECKING:
    from quantkit.model.arch import ModelArch
    from quantkit.recipe import Recipe
    from quantkit.runtime.distributed import Group


@owned_output
def convert(
    model: str | Path,
    out: str | Path,
    *,
    recipe: str | Path | None = None,
    method: str | None = None,
    calib: str | None = None,
    num_samples: int | None = None,
    seq_len: int | None = None,
    group_size: int | None = None,
    decode_rest: str | None = None,
    device: str = "auto",
    resume: bool = False,
    restart: bool = False,
    validate: bool = True,
    progress: bool = True,
    trust_remote_code: bool = False,
    delete_source_after: bool = False,
    allow_unverified: bool = False,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    max_host_memory: int | str | None = None,
    max_gpu_memory: int | str | None = None,
    activation_dtype: str | None = None,
    eval_data: str | None = None,
    eval_num_samples: int | None = None,
    eval_seq_len: int | None = None,
    gen_tokens: int | None = None,
    gate: str | Path | dict[str, float] | None = None,
) -> ConvertResult:
    """Convert `model` into `out/prefill` (FP8) and `out/decode` (INT4 experts), with a report.

    Args:
        model: a folder, `hf://org/repo@rev`, or `tiny:kimi-k2.6` / `tiny:glm-5.2`.
        out: output folder; `prefill/`, `decode/` and `convert-report.json` appear when complete.
        recipe: a recipe file or name (default: the model family's recipe); the keyword options
            below override its fields when given.
        decode_rest: "bf16" stores everything but the routed experts BF16 in decode (Kimi's official
            INT4 look; recipe `decode.rest`); default "prefill": the prefill checkpoint's bytes.
        resume: continue an interrupted run from its last completed layer (byte-identical result);
            refused, naming the first difference, when the options or inputs differ from that run's.
        restart: discard an interrupted run in `out` (and results of a pair no longer there) and
            start over. Without it (or resume) a folder holding an interrupted run is refused: its
            layers are never thrown away silently.
        validate: run `quantkit.validate` on the pair afterwards.
        delete_source_after: with an `hf://` source, delete each downloaded shard once every
            tensor in it has been consumed (local disk then holds a few shards at a time).
        allow_unverified: with an `hf://` source, accept files the Hub lists without a checksum
            (size only); the report lists them.
        max_host_memory, max_gpu_memory: budgets in bytes or "8GB"-style strings (default: the
            machine's available memory, the device's total); quantkit.planner.cost sizes the activation
            store, micro-batches and expert chunks to keep to them, prints the prediction, and
            refuses to start when even the smallest settings don't fit.
        activation_dtype: force the calibration hidden states' dtype, "float32" or "bfloat16"
            (default: float32 when the budget holds it; docs/benchmarks.md gives bfloat16's KL cost).
        eval_data, eval_num_samples, eval_seq_len, gen_tokens, gate: the chained validate's
            `eval_data`, `num_samples`, `seq_len`, `gen_tokens` and `gates` (default: the recipe's
            `validate:`). With validate on, the eval data is loaded (and the gates read) before
            the first layer, so a dataset that cannot load fails the run before any work.

    Example:
        >>> res = quantkit.convert("tiny:glm-5.2", "out/glm")
        >>> res.report["experts_summary"]
    """
    t_start = time.time()
    argv = _command_line(model, out, locals())  # what verify/validate/check-serving tell a user to rerun
    out = Path(out)
    ckpt = open_checkpoint(model, release_consumed=delete_source_after, allow_unverified=allow_unverified)
    rec = _recipe(model, ckpt.arch, recipe, method=method, group_size=group_size, num_samples=num_samples,
                  seq_len=seq_len, calib=calib, decode_rest=decode_rest)
    group, dev = _join_ranks(device, out, delete_source_after)
    progress = progress and group.leader
    decisions, calibrate = _decide(ckpt, rec)  # every tensor, up front (a dry run of the whole conversion)

    state_dir = out / STATE_DIR
    source_files = source_identity(ckpt)
    inputs = run_inputs(source_files, rec.model_dump(mode="json"))
    finished, finishing = _previous_run(out, state_dir, inputs, resume=resume, restart=restart, leader=group.leader)
    if finished is not None:  # --resume after a run that had completed: only its validate is left
        return _validated(finished, group, validate, device, progress, _later_options(locals()))
    tokens = _calibration_tokens(rec, recipe, ckpt, trust_remote_code) if calibrate else None
    later = {"max_host_memory": max_host_memory, "max_gpu_memory": max_gpu_memory}  # the chained validate's options
    if validate:
        later |= _validation_inputs(rec, ckpt, eval_data=eval_data, num_samples=eval_num_samples, seq_len=eval_seq_len,
                                    gen_tokens=gen_tokens, gates=gate)
    out.mkdir(parents=True, exist_ok=True)
    state = open_state(state_dir, fingerprint(source_files, rec, tokens), resume, group.leader,
                       run_inputs(source_files, rec.model_dump(mode="json"), tokens.sha256 if tokens else None))
    if group.leader:
        record_command(state_dir, argv + ([f"--nproc={group.world}"] if group.distributed else []),
                       ckpt.arch.num_layers_with_mtp)
    group.barrier("starting")  # every rank has read the state rank 0 will overwrite, and sees its folder

    job = Job(ckpt, rec, decisions, group, dev, dtype, state, state_dir)
    job.cost = _plan(job, calibrate, progress, validate=validate, max_host_memory=max_host_memory,
                     max_gpu_memory=max_gpu_memory, max_shard_bytes=max_shard_bytes, activation_dtype=activation_dtype)
    digits = shard_digits(ckpt)
    pair = open_pair(job, out, digits, resume=resume, finishing=finishing)
    n_layers = ckpt.arch.num_layers_with_mtp
    bar = LayerProgress(progress, n_layers, "layers")
    if progress and resume and state.next_layer > 0:
        _say(f"resuming {out} at layer {state.next_layer} of {n_layers} (layers 0-{state.next_layer - 1} are done)")
    calibration = start_calibration(job, tokens)
    state_every = int(os.environ.get("QUANTKIT_STATE_EVERY", job.cost.state_every))  # debug knob: the resume tests
    with bar:
        # 1. tensors outside the decoder layers: embeddings, final norm, head, vision
        if state.next_layer == -1:
            outside_layers(job, pair, calibration)
            group.barrier("after the embeddings")
            if group.leader:
                save_state(state_dir, state, calibration.store, calibration.topks, calibration.probe)
        elif calibration.store is not None and state.next_layer <= ckpt.arch.num_hidden_layers:
            # (past the first MTP layer no layer calibrates, and the saved h is the MTP's, T - 1 long)
            calibration.topks = load_hidden(state_dir, len(calibration.topks), calibration.store, dev, calibration.probe)
        bar.update(state.next_layer)

        # 2. the decoder layers, one at a time (a streamed source fetches the next layer's shards meanwhile)
        fetcher = Prefetcher(ckpt)
        for layer in range(state.next_layer, n_layers):
            fetcher.ahead(layer + 1)
            convert_layer(job, pair, calibration, bar, layer)
            _save_progress(job, pair, calibration, layer, save=(layer + 1) % state_every == 0 or layer == n_layers - 1)
            ckpt.release_finished()
            bar.update(layer + 1)
            _debug_delay()
        fetcher.close()

    # 3. configs, carried files, rename into place: journaled in the state folder so that --resume
    #    completes an interrupted finish from any step (quantkit.checkpoint.finish); the report comes last
    configs = output_configs(job)
    carried = ckpt.other_files()
    calibration.close()
    parts = close_pair(pair)
    # every rank has written its parts and is done with the state folder (rank 0 finishes alone)
    used = group.all_gather_object({"peak_rss": peak_rss(), "parts": pair.written(), "threads": torch.get_num_threads()},
                                   "before the finish")
    if not group.leader:
        return _other_rank(out, group, validate, device, later)
    report = finish_pair(out, state_dir, parts, digits, configs, carried, set(state.differ),
                         lambda manifests: convert_report(model, job, tokens, source_files, out, t_start, used, manifests))
    if validate:
        group.barrier("waiting for the other ranks to validate")
    return _validated(ConvertResult(out, out / "prefill", out / "decode", report), group, validate, device, progress, later)


# ---- the steps ---------------------------------------------------------------------------------
_FLAGS = {"trust_remote_code": "--trust-remote-code", "delete_source_after": "--delete-source-after",
          "allow_unverified": "--allow-unverified"}
_OPTIONS = ("recipe", "method", "calib", "num_samples", "seq_len", "group_size", "decode_rest", "max_host_memory",
            "max_gpu_memory", "eval_data", "eval_num_samples", "eval_seq_len", "gen_tokens", "gate")


def _command_line(model, out, args: dict) -> list[str]:
    """The `quantkit convert` line for these arguments (the CLI's options; --resume left out), so
    that a reader of an interrupted folder can print the exact command that continues it."""
    argv = ["quantkit", "convert", str(model), "--out", str(out)]
    for name in _OPTIONS:
        if args.get(name) is not None:
            argv.append(f"--{name.replace('_', '-')}={args[name]}")
    if args.get("device", "auto") != "auto":
        argv.append(f"--device={args['device']}")
    argv += [flag for name, flag in _FLAGS.items() if args.get(name)]
    return argv + ([] if args.get("validate", True) else ["--no-validate"])


def _previous_run(out: Path, state_dir: Path, inputs: dict, *, resume: bool, restart: bool,
                  leader: bool) -> tuple[ConvertResult | None, bool]:
    """What `out` holds already: with --resume, a run that had completed (its result) or one that
    had reached its finish (True: the layers are done; only the finish is left), each refused when
    this run's options or inputs differ from its own. A complete output is never overwritten; an
    interrupted one is discarded only with --restart; a report or results of a pair that is no
    longer there are never left beside a new one."""
    if resume and restart:
        raise ConfigError("give --resume (continue the interrupted run) or --restart (discard it), not both")
    if leader:
        shutil.rmtree(out / (STATE_DIR + ".done"), ignore_errors=True)  # a finished run's state, left by a crash
    report = out / "convert-report.json"
    if resume and report.is_file() and not state_dir.exists():
        _refuse_report_without_pair(out)
        done = json.loads(report.read_text())  # the interrupted run had finished
        recorded = run_inputs(done.get("source", {}).get("files", {}), done.get("recipe", {}), None,
                              done.get("quantkit_version"))
        refuse_other_inputs(out, recorded, inputs, finished=True)
        return ConvertResult(out, out / "prefill", out / "decode", done), False
    if resume and (saved := saved_inputs(state_dir)) is not None:
        refuse_other_inputs(out, saved, inputs, finished=False)  # before the calibration data is read
    finishing = resume and journal(state_dir) is not None
    if not resume or not (finishing or (state_dir / "state.json").is_file()):
        # --resume with nothing to resume converts from the start: what is here is cleared as without it
        _clear_previous(out, state_dir, restart=restart, leader=leader)
    refuse_existing(out, state_dir, finishing)
    return None, finishing


def _refuse_report_without_pair(out: Path) -> None:
    """--resume on a finished run's report whose prefill/ or decode/ was removed: nothing to continue,
    and returning the report's result would claim a pair that is not there."""
    gone = [f"{w}/" for w in ("prefill", "decode") if not (out / w).is_dir()]
    if not gone:
        return
    left = [f"{w}/" for w in ("prefill", "decode") if (out / w).exists()]
    fix = (f"remove {' and '.join(left)} too (or choose another --out), then convert again without --resume" if left
           else "add --restart (without --resume) to discard the report and convert again, or choose another --out")
    raise OutputError(f"{out}: --resume: convert-report.json is of a finished run, but its {' and '.join(gone)} "
                      f"{'is' if len(gone) == 1 else 'are'} gone: nothing to continue; {fix}")


def _clear_previous(out: Path, state_dir: Path, *, restart: bool, leader: bool) -> None:
    """A run without --resume: an interrupted run here is refused (or, with --restart, discarded);
    another run's report is refused (or removed); results of a pair no longer here are removed.
    Each removal is said on stderr."""
    from quantkit.runtime.files import RESULTS_PENDING

    partial = [out / f"{w}.partial" for w in ("prefill", "decode")]
    placed = [out / w for w in ("prefill", "decode")] if journal(state_dir) is not None else []
    # work worth keeping: a saved state (layers done) or a finish under way; a state folder without
    # either (a run refused by its plan, or killed before its first save) holds nothing to resume
    interrupted = (state_dir / "state.json").is_file() or bool(placed)
    report = out / "convert-report.json"
    pair = any((out / w).exists() for w in ("prefill", "decode"))
    if interrupted and not restart:
        raise OutputError(f"{out}: holds an interrupted convert{_layers_done(state_dir)} (its completed layers are "
                          "kept); add --resume to continue it, or --restart to discard it and start over")
    if report.is_file() and not pair and not interrupted and not restart:
        raise OutputError(f"{out}: holds convert-report.json of another run (its prefill/ and decode/ are gone); "
                          "remove it, choose another --out, or add --restart to discard it")
    if not leader:
        return
    if restart and interrupted:
        for p in [state_dir, *partial, *placed]:
            if p.exists():
                shutil.rmtree(p)
        _say(f"{out}: --restart: discarded the interrupted convert")
    if any((out / w).exists() for w in ("prefill", "decode")):
        return  # a finished pair: refused next, its results with it
    removed = [report.name] if restart and report.is_file() else []
    removed += [n for n in ("validation.json", "validation.md", "validation.png", "validation-experts.png", RESULTS_PENDING)
                if (out / n).exists()]
    for name in removed:
        (out / name).unlink()
    if removed:
        _say(f"{out}: removed {', '.join(removed)}: the results of an earlier pair that is no longer here")


def _layers_done(state_dir: Path) -> str:
    try:
        n = json.loads((state_dir / "state.json").read_text()).get("next_layer", 0)
    except (OSError, ValueError, AttributeError):
        return ""
    n = max(n, 0)
    return f" ({n} layer{'' if n == 1 else 's'} done)"


def _recipe(model: str, arch: ModelArch, recipe: str | Path | None, **overrides) -> Recipe:
    """The recipe named, else the model family's; the options given override its fields."""
    from quantkit.recipe import resolve_recipe

    return resolve_recipe(model, arch, recipe, **overrides)


def _join_ranks(device: str, out: Path, delete_source_after: bool):
    """The compute device, and under torchrun the other ranks (quantkit.runtime.distributed); a plain
    run is SINGLE and this is a no-op. Several ranks share the source and (several nodes) --out."""
    from quantkit.runtime.device import resolve_device

    group, dev = distributed.init(resolve_device(device))
    if group.distributed and delete_source_after:
        raise ConfigError("--delete-source-after: ranks share the source's files; with several ranks pull the model "
                          "first (quantkit pull) and convert the local folder")
    distributed.check_shared_folder(group, out)  # several nodes: --out must be one folder for all
    return group, dev


def _decide(ckpt: Checkpoint, rec: Recipe) -> tuple[dict[str, Decision], bool]:
    """Every tensor's storage in both outputs, and whether the run reads calibration data
    (quantkit.planner.precision: the same calls `plan --convert` makes)."""
    return decide_all(ckpt, rec), needs_calibration(rec)


def _later_options(args: dict) -> dict:
    """The chained validate's options from convert's arguments, unchecked (a finished run's resume)."""
    names = {"max_host_memory": "max_host_memory", "max_gpu_memory": "max_gpu_memory", "eval_data": "eval_data",
             "eval_num_samples": "num_samples", "eval_seq_len": "seq_len", "gen_tokens": "gen_tokens", "gate": "gate"}
    return {v: args[k] for k, v in names.items() if args.get(k) is not None}


def _validation_inputs(rec: Recipe, ckpt: Checkpoint, *, eval_data, num_samples, seq_len, gen_tokens, gates) -> dict:
    """What the chained validate will read, read now, before the first layer: its eval data must
    load and yield its windows, its gates must parse. On a real model a dataset that cannot load
    offline otherwise fails hours later, after every layer. Returns validate's keyword options."""
    from quantkit.errors import QuantkitError
    from quantkit.inputs.tokens import load_tokens
    from quantkit.validation.gates import resolve_gates

    v = rec.validate
    dataset = eval_data or v.dataset
    fix = "pass --eval-data (a local .jsonl/.txt file, or synthetic:heldout) or --no-validate"
    if not dataset:
        raise ConfigError(f"recipe {rec.name}: no validate.dataset to validate the pair with; {fix}")
    if eval_data is None and dataset.strip() in {spec.strip() for spec, _ in rec.calibration.sources()}:
        raise ConfigError(f"recipe {rec.name}: validate.dataset {dataset} is the calibration data; {fix}")
    try:
        resolve_gates(gates, v.gates, f"recipe {rec.name}")
        load_tokens(dataset, tokenizer=ckpt.folder, num_samples=num_samples or v.num_samples,
                    seq_len=seq_len or v.seq_len)
    except QuantkitError as e:
        raise ConfigError(f"validate's eval data {dataset} (checked before converting any layer): {e}; {fix}") from None
    opts = {"eval_data": eval_data, "num_samples": num_samples, "seq_len": seq_len, "gen_tokens": gen_tokens,
            "gate": gates}
    return {k: x for k, x in opts.items() if x is not None}


def _calibration_tokens(rec: Recipe, recipe: str | Path | None, ckpt: Checkpoint, trust_remote_code: bool):
    """The recipe's calibration tokens, tokenized with the source's own tokenizer: its one dataset,
    or its mix (quantkit.inputs.mix), every source read before the first layer. `recipe` is what
    convert was given (a file, a name, or None for the model family's), for naming the file."""
    from quantkit.inputs.mix import MixSourceError, load_mix
    from quantkit.inputs.tokens import load_tokens
    from quantkit.recipe import recipe_file

    c = rec.calibration
    if not c.mix and not c.random_windows():
        return load_tokens(c.dataset, tokenizer=ckpt.folder, num_samples=c.num_samples, seq_len=c.seq_len, seed=c.seed,
                           trust_remote_code=trust_remote_code)
    try:
        return load_mix(c.sources(), tokenizer=ckpt.folder, seq_len=c.seq_len, seed=c.seed,
                        trust_remote_code=trust_remote_code)
    except MixSourceError as e:
        try:
            where = recipe_file(recipe if recipe is not None else rec.name)
        except ConfigError:
            where = f"recipe {rec.name}"
        if c.mix and e.index < len(c.mix):
            field, fix = f"calibration.mix[{e.index}]", "or point this source at other data, lower its share, or remove it from the mix"
        elif e.spec == "random" and e.index == len(c.sources()) - 1:
            field, fix = "calibration.extra_random", "or set extra_random: 0"
        else:
            field, fix = "calibration.dataset", "or point calibration.dataset at other data"
        raise ConfigError(f"{where}: {field} ({e.spec}): {e.problem}; {fix}") from None


def _plan(job: Job, calibrate: bool, progress: bool, *, validate: bool, max_host_memory, max_gpu_memory,
          max_shard_bytes: int, activation_dtype: str | None):
    """The run sized to the budgets (quantkit.planner.cost: the activation store, micro-batches,
    expert chunks, shard size, how often the state is saved), printed, and refused before any
    work when even the smallest settings don't fit."""
    from quantkit.planner.cost import calibration_tokenizes, plan_convert, quantized_fraction  # per run: tests replace it

    ckpt, rec, decisions = job.ckpt, job.rec, job.decisions
    cost = plan_convert(ckpt.arch, method=job.method, group_size=job.G, num_samples=rec.calibration.windows(),
                        seq_len=rec.calibration.seq_len, calibrate=calibrate, device=job.dev.type,
                        max_host_memory=max_host_memory, max_gpu_memory=max_gpu_memory,
                        source_bytes=sum(ckpt.storage_bytes(n) for n in ckpt.tensors),
                        output_bytes=predicted_bytes(ckpt, decisions, job.G), max_shard_bytes=max_shard_bytes,
                        validate=rec.validate if validate else None, activation_dtype=activation_dtype,
                        quantized=quantized_fraction(ckpt, decisions), nproc=job.group.world,
                        probe=job.method.probe_windows(rec) if calibrate and quantized_fraction(ckpt, decisions) else 0,
                        tokenizes=calibration_tokenizes(rec))
    if mb := os.environ.get("QUANTKIT_MICRO_BATCH"):
        # debug knob: fewer samples per micro-batch than the budget allows, so that a small test run has
        # several micro-batches (the ranks' token split, docs/distributed.md); changes the float sums' order
        cost.store.micro_batch = max(1, int(mb))
    if progress:
        from rich.console import Console

        Console(stderr=True).print(cost.summary(), highlight=False)
    if not cost.fits:
        raise OutputError(cost.reason)
    return cost


def _save_progress(job: Job, pair: PairWriter, calibration: Calibration, layer: int, *, save: bool) -> None:
    """The end of a layer, on every rank. The resume state holds every calibration token's h (26 GB
    at GLM 5.2's shipped recipe), so it is saved every `state_every` layers (the plan's: at most
    STATE_OVERHEAD of the run) and after the last; a crash redoes the layers since, whose parts
    resume drops. It names every part so far, so each rank's must be on disk first."""
    group = job.group
    if save:
        pair.drain()
        group.barrier(f"end of layer {layer}")  # a dead rank stops the others here at the latest
        if group.leader:
            save_state(job.state_dir, job.state, calibration.store, calibration.topks, calibration.probe)
    else:
        group.barrier(f"end of layer {layer}")


def _say(text: str) -> None:
    """One line on stderr, flushed (a log under nohup shows it at once)."""
    import sys

    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _debug_delay() -> None:
    """QUANTKIT_CONVERT_LAYER_DELAY: a pause after each layer, a debug knob that widens the window
    for the crash/resume tests."""
    if delay := float(os.environ.get("QUANTKIT_CONVERT_LAYER_DELAY", 0)):
        time.sleep(delay)


def _other_rank(out: Path, group: Group, validate: bool, device, later: dict) -> ConvertResult:
    """A multi-rank convert's rank > 0: rank 0 finishes the output alone and has the report; this
    rank joins the chained validate (with its share of the experts) once the output is finished."""
    result = ConvertResult(out, out / "prefill", out / "decode", {}, rank=group.rank)
    if validate:
        group.barrier("waiting for rank 0 to finish the output")
    return _validated(result, group, validate, device, False, later)


def _validated(result: ConvertResult, group: Group, validate: bool, device, progress, later: dict | None = None) -> ConvertResult:
    """convert's last step: `quantkit.validate` on the pair (unless validate=False), then the ranks part."""
    if validate:
        from quantkit.validation.pipeline import validate as run_validate

        result.validation = run_validate(result.out, device=device, progress=progress, **(later or {}))
    distributed.close(group)
    return result
