"""The end of a convert, made so it cannot half-happen: stage, place, report, with a journal.

    stage prefill   in prefill.partial/: part-* -> model-*-of-N, index, config.json, carried files,
                    manifest.json (last). Every file is written under a temporary name and renamed,
                    and every sub-step can run again, so staging is simply redone after a crash.
    stage decode    the same; its manifest lists the shared tensors with prefill's digests, and
                    staging checks the decode bytes match them.
    place prefill   one rename prefill.partial/ -> prefill/
    place decode    one rename decode.partial/ -> decode/
    report          pair.json (the pair's contract, quantkit.checkpoint.pair), then convert-report.json
                    (stating both manifests' digests and pair.json's), written last
    done            the state folder is removed

`finish.json` in the state folder records which of these steps completed, so `--resume` picks up
at the first step not done. A folder under its final name is therefore always complete, and the
pair is complete exactly when convert-report.json exists (verify and validate check this).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from quantkit.checkpoint.manifest import MANIFEST, build_manifest, shared_pairs, write_manifest
from quantkit.checkpoint.pair import write_contract
from quantkit.errors import OutputError
from quantkit.runtime import faults
from quantkit.runtime.files import atomic_write_text

JOURNAL = "finish.json"
PAIR = ("prefill", "decode")


def journal(state_dir: Path) -> dict | None:
    """The finish journal of an interrupted run, or None when the finish never started."""
    path = Path(state_dir) / JOURNAL
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise OutputError(f"{path}: damaged finish journal; remove {Path(state_dir).parent} and convert again") from None


def _mark(state_dir: Path, j: dict, step: str) -> None:
    j["done"].append(step)
    atomic_write_text(Path(state_dir) / JOURNAL, json.dumps(j))
    faults.point(f"finish:{step}")


def finish_pair(
    out: Path,
    state_dir: Path,
    parts: dict[str, list[str]] | None,
    digits: int,
    configs: dict[str, dict],
    carried: list[Path],
    differ: set[str],
    make_report: Callable[[dict[str, str]], dict],
) -> dict:
    """Complete (or continue) the finish. `parts`: each output's part files in order (only read
    when the finish starts; the journal keeps them). Returns the report."""
    from quantkit.checkpoint.manifest import REPORT

    out, state_dir = Path(out), Path(state_dir)
    j = journal(state_dir)
    if j is None:
        j = {"parts": parts, "digits": digits, "done": []}
        _mark(state_dir, j, "begin")
    done = j["done"]
    tmp = {w: out / f"{w}.partial" for w in PAIR}
    shared: list[dict] = []
    for which in PAIR:
        if f"staged:{which}" not in done:
            if not tmp[which].is_dir():
                raise OutputError(f"{tmp[which]}: missing, though the interrupted finish had not staged it; "
                                  f"remove {out} and convert again")
            _stage(tmp[which], which, j["parts"][which], j["digits"], configs[which], carried, differ, shared)
            _mark(state_dir, j, f"staged:{which}")
        elif which == "prefill":
            shared[:] = _read_manifest(tmp[which] if tmp[which].is_dir() else out / which)["shared"]
    for which in PAIR:
        final = out / which
        if f"placed:{which}" not in done:
            if tmp[which].is_dir():
                if final.exists():
                    raise OutputError(f"{final}: exists beside {tmp[which].name}; remove {final} and rerun with --resume")
                os.replace(tmp[which], final)
                faults.point("finish:replace")
            elif not final.is_dir():
                raise OutputError(f"{final}: missing after a staged finish; remove {out} and convert again")
            _mark(state_dir, j, f"placed:{which}")
        elif not (final / MANIFEST).is_file():
            raise OutputError(f"{final}: the interrupted finish had put it in place but it is gone or incomplete; "
                              f"remove {out} and convert again")
    digests = {w: _digest(out / w) for w in PAIR}
    report = make_report(digests)
    report["pair_contract"] = write_contract(out)  # pair.json: what the phases share for a KV cache to cross them
    atomic_write_text(out / REPORT, json.dumps(report, indent=2) + "\n")
    _mark(state_dir, j, "report")
    trash = state_dir.with_name(state_dir.name + ".done")  # one rename ends the run; then tidy up
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(state_dir, trash)
    faults.point("finish:cleanup")
    shutil.rmtree(trash)
    return report


def _stage(folder: Path, which: str, parts: list[str], digits: int, config: dict, carried: list[Path],
           differ: set[str], shared: list[dict]) -> None:
    from quantkit.checkpoint.index import INDEX, read_header

    for stale in folder.glob("*.tmp"):
        stale.unlink()
    n = len(parts)
    finals = [f"model-{i + 1:0{digits}d}-of-{n:0{digits}d}.safetensors" for i in range(n)]
    for part, final in zip(parts, finals):
        if (folder / part).is_file():
            os.replace(folder / part, folder / final)
            faults.point("finish:rename")
        elif not (folder / final).is_file():
            raise OutputError(f"{folder / part}: missing (and not yet renamed {final}); remove {folder.parent} and convert again")
    weight_map, total = {}, 0
    for final in finals:
        for t, v in read_header(folder / final).items():
            weight_map[t] = final
            total += v["data_offsets"][1] - v["data_offsets"][0]
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(folder / INDEX, json.dumps(index, indent=2) + "\n")
    faults.point("finish:index")
    atomic_write_text(folder / "config.json", json.dumps(config, indent=2) + "\n")
    faults.point("finish:config")
    for f in carried:
        shutil.copyfile(f, folder / (f.name + ".tmp"))
        os.replace(folder / (f.name + ".tmp"), folder / f.name)
    faults.point("finish:carried")
    m = build_manifest(folder)
    if which == "prefill":
        shared[:] = [{"prefill": p, "decode": d, "sha256": m["tensors"][p]["sha256"]}
                     for p, d in shared_pairs(list(m["tensors"]), differ)]
    else:
        for s in shared:
            got = m["tensors"].get(s["decode"], {}).get("sha256")
            if got != s["sha256"]:  # a bug, not a user error: the pair must share these bytes
                raise RuntimeError(f"decode tensor {s['decode']} differs from prefill's {s['prefill']}")
    m["shared"] = shared
    write_manifest(folder, m)
    faults.point("finish:manifest")


def _read_manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def _digest(folder: Path) -> str:
    from quantkit.checkpoint.manifest import manifest_digest

    return manifest_digest(folder)
