"""Integrity of a finished output: `manifest.json` in each checkpoint, and `quantkit verify`.

convert writes `manifest.json` into `prefill/` and `decode/` as the last file before each folder is
renamed into place. It records

    files    sha256 and size of every file (but the manifest itself and README.md, the model card
             that `validate` rewrites; the card states the manifest's digest instead)
    tensors  for every stored tensor: its file, dtype, shape and the sha256 of its bytes
    shared   the tensors the pair promises to hold byte-identically (every non-expert tensor; the
             FP8 block multiplier is `weight_scale_inv` in prefill and `weight_scale` in decode),
             with their digest; the same list in both manifests

`verify(dir)` re-hashes everything in one read per file, checks the shared tensors are identical
in prefill and decode, and for a convert output checks that convert-report.json (written last)
exists and names these very manifests. Every difference names its file and tensor.

Why one pass per file: at real scale an output is hundreds of GB, so the file digest and the
per-tensor digests come from the same read.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from quantkit.checkpoint.unfinished import is_unfinished, resume_command, unfinished
from quantkit.errors import IntegrityError
from quantkit.runtime.files import (
    RESULTS_PENDING,
    atomic_write_text,  # also imported from here (validation, tests)
    finish_renames,
)

MANIFEST = "manifest.json"
FORMAT = "quantkit-manifest/1"
REPORT = "convert-report.json"
# the card and the validation results each checkpoint folder carries (and their staged next versions,
# quantkit.runtime.files.staged) are rewritten by validate; the card states the manifest's digest
CARD_FILES = ("README.md", "validation.json", "validation.md", "validation.png", "validation-experts.png")
UNCOVERED = {MANIFEST, *CARD_FILES, *(f".{Path(n).stem}.staged{Path(n).suffix}" for n in CARD_FILES)}
_CHUNK = 16 << 20


# ---- hashing ------------------------------------------------------------------------------------
def hash_file(path: Path) -> tuple[dict, dict[str, dict]]:
    """({bytes, sha256}, {tensor: {dtype, shape, sha256}}) of one file in a single read.

    Non-safetensors files have no tensors. A safetensors file whose header cannot be parsed is
    hashed as plain bytes (verify then reports its tensors as missing)."""
    size = path.stat().st_size
    fh = hashlib.sha256()
    tensors: dict[str, dict] = {}
    with open(path, "rb") as f:
        entries = _safetensors_entries(f, size) if path.suffix == ".safetensors" else None
        f.seek(0)
        if entries is None:
            while chunk := f.read(_CHUNK):
                fh.update(chunk)
            return {"bytes": size, "sha256": fh.hexdigest()}, {}
        header_len, items = entries
        fh.update(f.read(8 + header_len))
        pos = 8 + header_len
        for name, dtype, shape, begin, end in items:  # in offset order
            begin, end = 8 + header_len + begin, 8 + header_len + end
            if begin > pos:  # padding between tensors (not written by safetensors, but allowed)
                fh.update(f.read(begin - pos))
                pos = begin
            th = hashlib.sha256()
            left = end - pos
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                fh.update(chunk)
                th.update(chunk)
                left -= len(chunk)
                pos += len(chunk)
            tensors[name] = {"dtype": dtype, "shape": shape, "sha256": th.hexdigest()}
        while chunk := f.read(_CHUNK):
            fh.update(chunk)
    return {"bytes": size, "sha256": fh.hexdigest()}, tensors


def _safetensors_entries(f, size: int):
    raw = f.read(8)
    if len(raw) < 8:
        return None
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8:
        return None
    try:
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        items = sorted(
            ((k, v["dtype"], list(v["shape"]), int(v["data_offsets"][0]), int(v["data_offsets"][1])) for k, v in header.items()),
            key=lambda e: (e[3], e[4]),
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return n, items


def digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_digest(folder: Path) -> str:
    """sha256 of a checkpoint's manifest.json: what the report and the model card state."""
    return digest_bytes((Path(folder) / MANIFEST).read_bytes())


def _covered(folder: Path) -> list[str]:
    """Every file under `folder` the manifest covers, as relative posix paths."""
    return sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).as_posix() not in UNCOVERED
    )


# ---- writing ------------------------------------------------------------------------------------
def shared_pairs(prefill_names: list[str], differ: set[str]) -> list[tuple[str, str]]:
    """(prefill name, decode name) of every stored tensor the pair holds identically: all but the
    parts of the logical tensors in `differ` (the routed experts)."""
    from quantkit.model.tensors import QUANT_SUFFIXES

    out = []
    for name in sorted(prefill_names):
        head, _, leaf = name.rpartition(".")
        logical = f"{head}.weight" if (leaf in QUANT_SUFFIXES or leaf == "weight") else name
        if logical in differ:
            continue
        dname = f"{head}.weight_scale" if leaf == "weight_scale_inv" else name
        out.append((name, dname))
    return out


def build_manifest(folder: Path, shared: list[dict] | None = None) -> dict:
    """The manifest of a checkpoint folder as it is on disk now (not yet written)."""
    folder = Path(folder)
    files, tensors = {}, {}
    for rel in _covered(folder):
        files[rel], ts = hash_file(folder / rel)
        for name, t in ts.items():
            tensors[name] = {"file": rel, **t}
    return {"format": FORMAT, "files": files, "tensors": dict(sorted(tensors.items())), "shared": shared or []}


def write_manifest(folder: Path, manifest: dict) -> str:
    """Write manifest.json atomically; returns its sha256."""
    text = json.dumps(manifest, indent=1, sort_keys=False) + "\n"
    atomic_write_text(Path(folder) / MANIFEST, text)
    return digest_bytes(text.encode())


# ---- verifying ----------------------------------------------------------------------------------
@dataclass
class VerifyResult:
    """What `verify` checked and every difference it found (one line each: file, tensor, what)."""

    dir: Path
    folders: list[str]
    files_checked: int = 0
    tensors_checked: int = 0
    shared_checked: int = 0  # stored tensors (an FP8 weight and its block scales count apart)
    shared_tensors: int = 0  # the same as the model's tensors, as convert-report.json and the cards count them
    problems: list[str] = field(default_factory=list)
    manifest_sha256: dict[str, str] = field(default_factory=dict)
    unfinished: str | None = None  # a convert still running or interrupted (quantkit.checkpoint.unfinished)
    pair_contract: dict | None = None  # pair.json checked (quantkit.checkpoint.pair): holds, first difference

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"dir": str(self.dir), "ok": self.ok, "folders": self.folders, "files_checked": self.files_checked,
                "tensors_checked": self.tensors_checked, "shared_checked": self.shared_checked,
                "shared_tensors": self.shared_tensors,
                "manifest_sha256": self.manifest_sha256, "pair_contract": self.pair_contract, "problems": self.problems}

    def raise_for_problems(self) -> "VerifyResult":
        if self.unfinished:  # not damage: a convert still running or interrupted (never "reconvert it")
            raise IntegrityError(self.unfinished)
        if self.problems:
            more = f" (+{len(self.problems) - 1} more; `quantkit verify {self.dir}` lists them)" if len(self.problems) > 1 else ""
            raise IntegrityError(f"{self.problems[0]}{more}; the output was changed or damaged after convert: "
                                 "reconvert it (or restore it from a good copy)")
        return self

    def table(self):
        from rich.table import Table

        t = Table(title=f"quantkit verify: {self.dir}")
        t.add_column("checked")
        t.add_column("count", justify="right")
        t.add_row("folders", ", ".join(self.folders))
        t.add_row("files (sha256)", str(self.files_checked))
        t.add_row("tensors (sha256, dtype, shape)", str(self.tensors_checked))
        t.add_row("shared tensors identical across the pair (as the card counts them)",
                  f"{self.shared_tensors} ({self.shared_checked} stored: FP8 scales counted apart)")
        if self.pair_contract and self.pair_contract.get("counts"):
            c = self.pair_contract
            held = "holds" if c["holds"] else f"does not hold: {c['first_difference']}"
            t.add_row(f"pair contract (pair.json): {held}", str(sum(c["counts"].values())))
        t.caption = "OK" if self.ok else f"{len(self.problems)} problem(s)"
        return t


def verify(dir: str | Path) -> VerifyResult:
    """Re-hash a convert output (prefill/ + decode/ + convert-report.json) or one checkpoint folder
    against its manifest.json; check the pair's shared tensors are byte-identical. Returns a
    VerifyResult (`.ok`, `.problems`); `.raise_for_problems()` turns a difference into an error.

    Example:
        >>> qk.verify("out/glm").ok
        True
    """
    d = Path(dir)
    if not d.is_dir():
        raise IntegrityError(f"{d}: no such folder; pass a `quantkit convert` output or one of its checkpoints")
    finish_renames(d / RESULTS_PENDING)  # a validate killed while making its results visible: completed
    pair = (d / "prefill").is_dir() or (d / "decode").is_dir() or (d / REPORT).is_file() or is_unfinished(d)
    folders = ["prefill", "decode"] if pair else ["."]
    res = VerifyResult(d, folders)
    res.unfinished = unfinished(d)
    if pair:
        _check_complete(d, res)
    actual: dict[str, dict[str, dict]] = {}
    manifests: dict[str, dict] = {}
    for which in folders:
        folder = d / which
        if not folder.is_dir():
            continue
        m = _load_manifest(folder, res)
        if m is None:
            continue
        manifests[which] = m
        res.manifest_sha256[which] = manifest_digest(folder)
        actual[which] = _check_folder(folder, which, m, res)
    if pair and len(actual) == 2:
        _check_shared(manifests, actual, res)
        from quantkit.checkpoint.pair import check_contract

        res.pair_contract, found = check_contract(d, actual)
        res.problems += found
    return res


def _check_complete(d: Path, res: VerifyResult) -> None:
    if res.unfinished:
        res.problems.append(res.unfinished)
    elif (d / ".quantkit-convert").exists():
        res.problems.append(f"{d}: a convert into this folder did not finish (.quantkit-convert/ is there); "
                            f"continue it with: {resume_command(d)}")
    finished = (d / REPORT).is_file() and not res.unfinished and not (d / ".quantkit-convert").exists()
    for which in ("prefill", "decode"):
        if not (d / which).is_dir():
            res.problems.append(f"{d / which}: missing, removed after the convert finished (convert-report.json is "
                                "there); restore it from a copy, or convert again into another --out" if finished else
                                f"{d / which}: missing; the convert did not finish, continue it with --resume")
    if not (d / REPORT).is_file():
        res.problems.append(f"{d / REPORT}: missing (convert writes it last, so the convert did not finish); "
                            "continue it with --resume")
        return
    try:
        report = json.loads((d / REPORT).read_text())
        stated = {w: report["outputs"][w].get("manifest_sha256") for w in ("prefill", "decode")}
    except (ValueError, KeyError, TypeError, AttributeError):
        res.problems.append(f"{d / REPORT}: not a convert report (damaged); reconvert")
        return
    for which, digest in stated.items():
        path = d / which / MANIFEST
        if digest and path.is_file() and digest_bytes(path.read_bytes()) != digest:
            res.problems.append(f"{path}: sha256 differs from the one convert-report.json states (manifest replaced or damaged)")


def _load_manifest(folder: Path, res: VerifyResult) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        res.problems.append(f"{path}: missing; this folder was not written by quantkit convert (or by an older "
                            "version); reconvert to get one")
        return None
    try:
        m = json.loads(path.read_text())
        if m.get("format") != FORMAT or not isinstance(m.get("files"), dict) or not isinstance(m.get("tensors"), dict):
            raise ValueError
    except (ValueError, AttributeError):
        res.problems.append(f"{path}: not a {FORMAT} manifest (damaged); reconvert")
        return None
    return m


def _check_folder(folder: Path, which: str, m: dict, res: VerifyResult) -> dict[str, dict]:
    """Re-hash every file of one checkpoint; returns the tensors as found: {name: {file, sha256, ...}}."""
    label = lambda rel: (f"{which}/{rel}" if which != "." else rel)  # noqa: E731
    on_disk = set(_covered(folder))
    listed = set(m["files"])
    for rel in sorted(listed - on_disk):
        res.problems.append(f"{label(rel)}: missing (listed in {MANIFEST})")
    for rel in sorted(on_disk - listed):
        res.problems.append(f"{label(rel)}: not listed in {MANIFEST} (a file added after convert)")
    found: dict[str, dict] = {}
    expected_by_file: dict[str, dict[str, dict]] = {}
    for name, t in m["tensors"].items():
        expected_by_file.setdefault(t.get("file"), {})[name] = t
    for rel in sorted(on_disk & listed):
        info, tensors = hash_file(folder / rel)
        res.files_checked += 1
        want = m["files"][rel]
        if info["bytes"] != want.get("bytes"):
            res.problems.append(f"{label(rel)}: {info['bytes']} bytes, {MANIFEST} says {want.get('bytes')}")
        elif info["sha256"] != want.get("sha256"):
            bad = [n for n, t in expected_by_file.get(rel, {}).items() if tensors.get(n, {}).get("sha256") != t["sha256"]]
            where = f"tensor {bad[0]}" + (f" (+{len(bad) - 1} more tensors)" if len(bad) > 1 else "") if bad else "the header or padding"
            res.problems.append(f"{label(rel)}: sha256 differs from {MANIFEST}: {where} changed")
        for name, t in tensors.items():
            found[name] = {"file": rel, **t}
        for name, t in expected_by_file.get(rel, {}).items():
            res.tensors_checked += 1
            got = tensors.get(name)
            if got is None:
                res.problems.append(f"{label(rel)}: {name}: missing from the file")
            elif (got["dtype"], got["shape"]) != (t["dtype"], t["shape"]):
                res.problems.append(f"{label(rel)}: {name}: {got['dtype']}{got['shape']}, {MANIFEST} says {t['dtype']}{t['shape']}")
    return found


def _model_tensor(stored: str) -> str:
    """The model tensor a stored tensor belongs to: an FP8 block scale to its weight (the unit of
    convert-report.json's `shared_tensors` and the cards)."""
    base, _, last = stored.rpartition(".")
    return f"{base}.weight" if last in ("weight_scale_inv", "weight_scale") else stored


def _check_shared(manifests: dict[str, dict], actual: dict[str, dict[str, dict]], res: VerifyResult) -> None:
    lists = {w: [(s["prefill"], s["decode"], s["sha256"]) for s in manifests[w].get("shared", [])] for w in manifests}
    if lists["prefill"] != lists["decode"]:
        res.problems.append(f"prefill/{MANIFEST} and decode/{MANIFEST} list different shared tensors (manifests from two runs?)")
    res.shared_tensors = len({_model_tensor(p) for p, _, _ in lists["prefill"]})
    for pname, dname, digest in lists["prefill"]:
        res.shared_checked += 1
        p, q = actual["prefill"].get(pname), actual["decode"].get(dname)
        if p is None or q is None:
            res.problems.append(f"{'prefill' if p is None else 'decode'}: shared tensor {pname if p is None else dname} is missing")
        elif p["sha256"] != q["sha256"]:
            odd = "decode" if p["sha256"] == digest else "prefill"
            t = q if odd == "decode" else p
            res.problems.append(f"{odd}/{t['file']}: {dname if odd == 'decode' else pname}: differs from its twin in the "
                                f"other checkpoint (the pair promises identical bytes)")
        elif p["sha256"] != digest:
            res.problems.append(f"prefill/{p['file']} and decode/{q['file']}: {pname}: both differ from the digest in "
                                f"the shared list of {MANIFEST}")
