"""convert's progress on disk, so that `--resume` restarts exactly after the last saved layer.

The state folder (`out/.quantkit-convert`) holds `state.json` (the layers done, the parts each
output has cut, the experts' and layers' report entries) and, for a calibrated run, the hidden
states the next layer starts from. A fingerprint of the source, the recipe, the calibration tokens
and quantkit's version guards against resuming with other inputs: the result would not be the
one an uninterrupted run makes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import load_file, save_file

from quantkit import __version__
from quantkit.errors import OutputError
from quantkit.runtime import faults

if TYPE_CHECKING:
    from quantkit.recipe import Recipe


STATE_DIR = ".quantkit-convert"


@dataclass
class State:
    """What state.json records: enough to continue after layer `next_layer - 1` and still write
    the report an uninterrupted run would."""

    fingerprint: str
    next_layer: int = -1  # -1: the non-layer tensors are not written yet
    prefill_parts: int = 0
    decode_parts: int = 0
    experts: list[dict] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)  # run_inputs(): what --resume compares, field by field


def fingerprint(source_files: dict[str, str], rec: Recipe, tokens) -> str:
    """One digest of everything that decides the output bytes (a resume must match it)."""
    return hashlib.sha256(json.dumps(
        [source_files, rec.model_dump(mode="json"), tokens.sha256 if tokens else None, __version__]).encode()).hexdigest()


# recipe fields a user sets with an option: the refusal names the option too
_OPTION_OF = {"method": "--method", "group_size": "--group-size", "calibration.num_samples": "--num-samples",
              "calibration.seq_len": "--seq-len", "calibration.dataset": "--calib", "calibration.mix": "--calib",
              "decode.rest": "--decode-rest"}


TOKENS = "calibration tokens (sha256)"


def run_inputs(source_files: dict[str, str], recipe: dict, tokens_sha256: str | None = None,
               version: str = __version__) -> dict:
    """What decides the output bytes, flat and ordered so that the first difference is the one a user
    changed: the recipe's own fields (method, group size, ...) before its sections', then the source's
    files, the calibration tokens and quantkit's version. state.json and convert-report.json hold it,
    and --resume compares it field by field (the fingerprint only says *that* something differs)."""
    flat: dict = {}
    for key, value in recipe.items():
        if not isinstance(value, dict):
            flat[key] = value
    for key, value in recipe.items():
        if isinstance(value, dict):
            flat |= {f"{key}.{k}": v for k, v in value.items()}
    flat |= {f"source file {name}": digest for name, digest in source_files.items()}
    if tokens_sha256 is not None:
        flat[TOKENS] = tokens_sha256
    return flat | {"quantkit version": version}


def first_difference(saved: dict, now: dict) -> str | None:
    """The first field (in `now`'s order) whose value differs, as "field: A there, B here", else None.
    The calibration tokens are compared only where both sides know them (they are read later)."""
    for key in list(now) + [k for k in saved if k not in now]:
        if key == TOKENS and (key not in saved or key not in now):
            continue
        a, b = saved.get(key, "(absent)"), now.get(key, "(absent)")
        if a != b:
            option = f" ({_OPTION_OF[key]})" if key in _OPTION_OF else ""
            return f"{key}{option} was {_short(a)} in that run, {_short(b)} in this one"
    return None


def _short(v) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= 60 else text[:57] + "..."


def refuse_other_inputs(out: Path, saved: dict, now: dict, *, finished: bool) -> None:
    """--resume: refuse a run whose options or inputs differ from the recorded run's, naming the first."""
    diff = first_difference(saved, now)
    if diff is None:
        return
    if finished:
        raise OutputError(f"{out}: --resume: the finished pair here was made with other options: {diff}; "
                          "resume with that run's options, or choose another --out for a new conversion")
    raise OutputError(f"{out}: --resume: the interrupted run used other options: {diff}; resume with that "
                      "run's options, or add --restart (without --resume) to discard it and start over")


def saved_inputs(state_dir: Path) -> dict | None:
    """The run_inputs() an interrupted run recorded in its state.json (None: no state, or one
    written before they were recorded)."""
    try:
        return json.loads((Path(state_dir) / "state.json").read_text()).get("inputs") or None
    except (OSError, ValueError, AttributeError):
        return None


def open_state(state_dir: Path, digest: str, resume: bool, leader: bool, inputs: dict | None = None) -> State:
    """The state to continue from: the interrupted run's with --resume (refused, naming the first
    difference, when its inputs differ), else a fresh one. Rank 0 clears a stale folder (not
    resuming) and makes it."""
    state = State(digest, inputs=inputs or {})
    if resume and (state_dir / "state.json").is_file():
        saved = json.loads((state_dir / "state.json").read_text())
        saved.pop("hidden", None)
        state = State(**saved)
        if state.inputs and inputs:
            refuse_other_inputs(state_dir.parent, state.inputs, inputs, finished=False)
        state.inputs = inputs or state.inputs
        if state.fingerprint != digest:
            raise OutputError(f"{state_dir}: the interrupted run used another source, recipe or calibration; "
                              "resume with the same ones, or rerun with --restart to discard it")
    elif state_dir.exists() and leader:
        if not resume:
            shutil.rmtree(state_dir)
    if leader:
        state_dir.mkdir(exist_ok=True)
    return state


def _save_hidden(folder: Path, prefix: str, tag: int, store, topks: list) -> dict:
    """One store's hidden states as raw bytes and its DSA selections as safetensors; returns what
    state.json records of them."""
    store.h.save(folder / f"{prefix}hidden.{tag}.bin")
    meta = {"shape": list(store.shape), "dtype": str(store.plan.dtype), "file": f"{prefix}hidden.{tag}.bin"}
    # a copy of each (one, from any device): the selections are views of one buffer per layer
    # (attention_pass), and safetensors refuses shared storage
    topk = {f"topk.{i}": t.to("cpu", copy=True) for i, t in enumerate(topks) if t is not None}
    if topk:
        save_file(topk, str(folder / "topk.tmp"))
        os.replace(folder / "topk.tmp", folder / f"{prefix}topk.{tag}.safetensors")
        meta["topk"] = f"{prefix}topk.{tag}.safetensors"
    return meta


def save_state(folder: Path, state: State, store, topks: list, probe=None) -> None:
    """Progress after a layer, written atomically. The hidden states (the largest thing here: tokens
    x hidden, in the store's dtype) go to disk as raw bytes a sample at a time, one copy (the next
    layer's replaces it); the DSA selections (only kept when seq_len > index_topk) as safetensors.
    `probe` (quantkit.conversion.stages.Calibration.probe, gptq.low_dampening): its store and
    selections the same way, files prefixed `probe-`."""
    # The files are named by the layer they precede and only state.json names them, so a crash
    # between any two of these writes leaves state.json and its hidden states agreeing.
    tag = state.next_layer
    state_h = _save_hidden(folder, "", tag, store, topks) if store is not None else None
    if state_h is not None and probe is not None:
        state_h["probe"] = _save_hidden(folder, "probe-", tag, probe.store, probe.topks)
    if state_h is not None:
        faults.point("state:hidden")
    (folder / "state.tmp").write_text(json.dumps(vars(state) | {"hidden": state_h}))
    os.replace(folder / "state.tmp", folder / "state.json")
    keep = {(m or {}).get(k) for m in (state_h, (state_h or {}).get("probe")) for k in ("file", "topk")}
    for old in [*folder.glob("*hidden.*.bin"), *folder.glob("*topk.*.safetensors")]:
        if old.name not in keep:
            old.unlink()
    faults.point("state:saved")


def load_hidden(folder: Path, n_topks: int, store, dev, probe=None) -> list:
    """Put the saved hidden states back into `store`; returns the saved DSA selections (None where
    none was kept). A store of another dtype or shape (other budgets) cannot continue them. With
    `probe`, its saved states too (its selections set on it)."""
    meta = json.loads((folder / "state.json").read_text())["hidden"]
    topks = _load_hidden(folder, meta, n_topks, store, dev)
    if probe is not None:
        if not meta.get("probe"):  # the fingerprint covers the recipe, so this is a damaged state folder
            raise OutputError(f"{folder}: the interrupted run kept no probe hidden states; rerun without --resume")
        probe.topks = _load_hidden(folder, meta["probe"], len(probe.topks), probe.store, dev)
    return topks


def _load_hidden(folder: Path, meta: dict, n_topks: int, store, dev) -> list:
    if meta["dtype"] != str(store.plan.dtype) or meta["shape"] != list(store.shape):
        raise OutputError(f"{folder}: the interrupted run kept its hidden states as {meta['dtype']}, this run would "
                          f"use {store.plan.dtype}; resume with the same --max-host-memory / --max-gpu-memory")
    store.h.load(folder / meta["file"])
    topk = load_file(str(folder / meta["topk"])) if meta.get("topk") else {}
    return [topk[f"topk.{i}"].to(dev) if f"topk.{i}" in topk else None for i in range(n_topks)]
