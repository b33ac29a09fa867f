"""What validate measures against what, and with which settings: the folders under test, the
reference they are compared with, the eval data, sizes and gates (the call's, else the recipe's),
and the notes a reader of the numbers should see (a reference that is not the converted source,
eval data that is the calibration data)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import ConfigError
from quantkit.runtime.files import file_sha256
from quantkit.validation.gates import resolve_gates

__all__ = ["Settings", "Target", "config_sha256", "settings", "target", "target_notes"]


@dataclass
class Target:
    """The folders under test: a convert output (prefill + decode + report) or one checkpoint."""

    out: Path  # where validation.* are written
    models: dict[str, Path]  # row -> checkpoint folder: {"prefill", "decode"} or {"model"}
    report: dict | None  # convert-report.json
    reference: str  # how the reference is named in reports: its spec, or the folder
    reference_source: str | Path  # what to open: a folder, or a spec (tiny:, hf://) for models.open_checkpoint
    reference_path: Path  # a local folder with its config.json and tokenizer

    @property
    def pair(self) -> bool:
        return "decode" in self.models


def target(folder: str | Path, reference: str | Path | None) -> Target:
    from quantkit.inputs.modelspec import resolve

    def is_hub(spec) -> bool:
        return isinstance(spec, str) and spec.startswith("hf://")

    out = Path(folder)
    if not out.is_dir():
        raise ConfigError(f"{out}: no such folder; pass a `quantkit convert` output or a checkpoint folder")
    report = None
    if (out / "convert-report.json").is_file():
        try:
            report = json.loads((out / "convert-report.json").read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{out / 'convert-report.json'}: not valid JSON ({e.msg}); rerun `quantkit convert`") from None
    if (out / "prefill" / "config.json").is_file() and (out / "decode" / "config.json").is_file():
        models = {"prefill": out / "prefill", "decode": out / "decode"}
    elif (out / "config.json").is_file():
        models = {"model": out}
    else:
        raise ConfigError(f"{out}: neither a convert output (prefill/ and decode/) nor a checkpoint folder (config.json)")

    if reference is not None:
        return Target(out, models, report, str(reference), reference, resolve(reference))
    src = (report or {}).get("source") or {}
    if not src.get("spec"):
        raise ConfigError(f"{out}: no convert-report.json names the source; pass the reference with --reference")
    if src.get("path") and (Path(src["path"]) / "config.json").is_file() and not is_hub(src["spec"]):
        # the very folder convert read (tiny models: keyed by their content)
        return Target(out, models, report, src["spec"], Path(src["path"]), Path(src["path"]))
    try:
        return Target(out, models, report, src["spec"], src["spec"], resolve(src["spec"]))
    except ConfigError as e:
        raise ConfigError(f"{out}: cannot open the source convert recorded ({e}); pass it with --reference") from None


def _tiny_name(path: Path) -> str | None:
    """`glm-5.2` when `path` is an embedded tiny model's cache folder."""
    from quantkit.synthetic.tiny import TINY_NAMES, cache_dir

    try:
        path.resolve().relative_to((cache_dir() / "tiny").resolve())
    except ValueError:
        return None
    return next((n for n in TINY_NAMES if path.name.startswith(n + "-")), None)


@dataclass
class Settings:
    dataset: str
    num_samples: int
    seq_len: int
    gen_tokens: int
    gates: dict[str, float]
    gates_from: str  # where the gates came from: a file, the recipe, the call


def settings(t: Target, arch, eval_data, num_samples, seq_len, gen_tokens, gates) -> Settings:
    """Explicit options, else the recipe recorded in the report, else the reference family's recipe."""
    from quantkit.recipe import ValidateSettings, default_recipe

    if t.report and isinstance(t.report.get("recipe"), dict) and "validate" in t.report["recipe"]:
        base, base_from = ValidateSettings(**t.report["recipe"]["validate"]), f"recipe {t.report['recipe'].get('name')}"
    else:
        tiny = _tiny_name(t.reference_path)
        try:
            rec = default_recipe(f"tiny:{tiny}" if tiny else t.reference, arch)
            base, base_from = rec.validate, f"recipe {rec.name}"
        except ConfigError:
            base, base_from = ValidateSettings(), "defaults"
    dataset = eval_data or base.dataset
    if not dataset:
        raise ConfigError("no eval data: pass --eval-data (a held-out data spec, e.g. hf:org/name@test or a .jsonl file)")
    calib = ((t.report or {}).get("recipe") or {}).get("calibration", {}).get("dataset")
    if eval_data is None and calib and dataset.strip() == calib.strip():
        raise ConfigError(f"{base_from}: validate.dataset {dataset} is the calibration data; pass held-out --eval-data")
    gate_map, gates_from = resolve_gates(gates, base.gates, base_from)
    for name, value in (("num_samples", num_samples), ("seq_len", seq_len), ("gen_tokens", gen_tokens)):
        low = 0 if name == "gen_tokens" else (2 if name == "seq_len" else 1)
        if value is not None and (not isinstance(value, int) or value < low):
            raise ConfigError(f"--{name.replace('_', '-')}: must be an integer >= {low} (got {value!r})")
    return Settings(
        dataset=dataset,
        num_samples=num_samples if num_samples is not None else base.num_samples,
        seq_len=seq_len if seq_len is not None else base.seq_len,
        gen_tokens=gen_tokens if gen_tokens is not None else base.gen_tokens,
        gates=gate_map,
        gates_from=gates_from,
    )


def target_notes(t: Target, tokens) -> list[str]:
    """Things a reader of the numbers should know: a reference that is not the converted source,
    eval data that is the calibration data."""
    notes = []
    src = (t.report or {}).get("source") or {}
    recorded = (src.get("files") or {}).get("config.json")
    if recorded and recorded != config_sha256(t.reference_path, git_blob=recorded.startswith("git-blob:")):
        notes.append(f"the reference's config.json differs from the source convert recorded ({src.get('spec')})")
    cal = (t.report or {}).get("calibration") or {}
    cal_spec = cal.get("spec") or (((t.report or {}).get("recipe") or {}).get("calibration") or {}).get("dataset")
    if (cal.get("sha256") and cal["sha256"] == tokens.sha256) or (cal_spec and cal_spec.strip() == tokens.spec):
        notes.append(f"the eval data {tokens.spec} is the calibration data: the numbers flatter the checkpoint")
    if note := pair_contract_note((t.report or {}).get("pair_contract")):
        notes.append(note)
    return notes


def pair_contract_note(pc: dict | None) -> str | None:
    """The cross-phase row's premise, stated: prefill/ and decode/ share what a KV cache needs to cross
    them (pair.json, which `quantkit verify` checks before validate runs)."""
    if not pc:
        return None
    if pc.get("holds"):
        n = sum((pc.get("counts") or {}).values())
        return (f"cross-phase: the pair's contract held (pair.json: {n} attention, indexer, KV-scale, MTP, "
                "RoPE/cache-config and tokenizer items identical in prefill/ and decode/, verified before this run)")
    return (f"cross-phase: the pair's contract does not hold ({pc.get('first_difference')}): a KV cache from the "
            "prefill pool is not what this decode checkpoint would write; the cross-phase row measures that mix")


def config_sha256(folder: Path, *, git_blob: bool = False) -> str | None:
    """The config's identity as convert records it: sha256, or for an hf:// source (whose small
    files the Hub lists by git blob id) `git-blob:<sha1>`; compared with a sha256, every hf://
    source's config read as "differs"."""
    config = folder / "config.json"
    if not config.is_file():
        return None
    if git_blob:
        import hashlib

        data = config.read_bytes()
        return "git-blob:" + hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return file_sha256(config)
