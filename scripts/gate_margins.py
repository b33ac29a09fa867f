"""The tiny recipes' gates against what validate measures under engine numerics, over tiny builds and CPU ISA paths.

    python scripts/gate_margins.py [--seeds 0,1,2,3,4] [--isas default,native] [--models glm-5.2,kimi-k2.6,qwen3-moe]
                                   [--out margins.jsonl]

For every (model, seed, ISA) one subprocess (QUANTKIT_TINY_SEED=seed; ATEN_CPU_CAPABILITY=default for the
scalar path, unset for the machine's widest, each ISA with its own QUANTKIT_CACHE so the tiny model is also
trained on that path) converts the tiny model with its recipe (and RTN for the GLM, whose recipe has a gate
that must reject RTN-level experts), validates the pair with the recipe's settings, engine numerics and
the FP8 KV rows, then validates two damaged copies of the GLM pair (one routed expert's INT4 scales x8 at
layer 2, the decode/ indexer's heads permuted at layer 2) against the same gates. One JSON line per
validate; at the end a table per gate of the recipe as it is now (re-checked on the recorded metrics, so
`--table-only` re-reads a sweep after a recipe changes): the worst intact value, the bound, the margin, and
whether every damaged copy fails a gate. The tiny recipes' gate comments quote its output.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DAMAGED_LAYER = 2  # an MoE layer of the tiny GLM that owns an indexer


def _reseal(out: Path, changed: str) -> None:
    """Manifests and report digests rewritten to agree with the damage, as a converter that wrote it would."""
    from quantkit.checkpoint.manifest import MANIFEST, build_manifest, write_manifest

    report = json.loads((out / "convert-report.json").read_text())
    for which in ("prefill", "decode"):
        shared = [e for e in json.loads((out / which / MANIFEST).read_text())["shared"] if e["decode"] != changed]
        report["outputs"][which]["manifest_sha256"] = write_manifest(out / which, build_manifest(out / which, shared))
    (out / "convert-report.json").write_text(json.dumps(report))


def _damaged(pair: Path, dst: Path, kind: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(pair, dst)
    if kind == "expert":
        report = json.loads((pair / "convert-report.json").read_text())
        e = max((x for x in report["experts"] if x["layer"] == DAMAGED_LAYER), key=lambda x: x["tokens"])["expert"]
        name = f"model.layers.{DAMAGED_LAYER}.mlp.experts.{e}.down_proj.weight_scale"
    else:
        name = f"model.layers.{DAMAGED_LAYER}.self_attn.indexer.weights_proj.weight"
    index = json.loads((dst / "decode" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = dst / "decode" / index[name]
    t = load_file(str(shard))
    t[name] = t[name] * 8 if kind == "expert" else t[name].roll(1, dims=0)
    save_file(t, str(shard), metadata={"format": "pt"})
    for stale in ("validation.json", "validation.md", "validation.png"):
        (dst / stale).unlink(missing_ok=True)
    _reseal(dst, name)
    return dst


def one(model: str, out: Path) -> None:
    """Runs in the subprocess: convert(s), validate(s), print JSON lines."""
    import torch

    import quantkit as qk
    from quantkit.synthetic.tiny import tiny_seed

    torch.set_num_threads(1)
    isa = torch.backends.cpu.get_cpu_capability()
    methods = ["gptq", "rtn"] if model == "glm-5.2" else ["gptq"]
    for m in methods:
        res = qk.convert(f"tiny:{model}", out / m, method=m, validate=False, progress=False)
        cases = [("intact", res.out)]
        if model == "glm-5.2" and m == "gptq":
            cases += [(f"damaged-{k}", _damaged(res.out, out / f"{m}-{k}", k)) for k in ("expert", "indexer")]
        for case, folder in cases:
            d = qk.validate(folder, device="cpu", progress=False, write=False, kv_cache_dtype="fp8_e4m3").data
            rows = d["rows"] | ((d.get("long_context") or {}).get("rows") or {})
            print(json.dumps({"model": model, "seed": tiny_seed(), "isa": isa, "method": m, "case": case,
                              "numerics": d["numerics"]["mode"], "passed": d["passed"],
                              "failed": sorted({f"{g['gate']}@{g['row']}" for g in d["gates"] if g["passed"] is False}),
                              "gates": [{k: g[k] for k in ("gate", "row", "value", "bound")} for g in d["gates"]],
                              "metrics": {r: v["metrics"] for r, v in rows.items()}}), flush=True)


def table(lines: list[dict]) -> None:
    """Per model and gate of the recipe as it is now (re-checked on the recorded metrics): the worst intact value
    over every build, method and ISA, and the margin; then whether every damaged copy fails a gate."""
    from quantkit.recipe import load_recipe
    from quantkit.validation.gates import check_gates

    for model in sorted({x["model"] for x in lines}):
        gates = load_recipe(f"tiny-{model}").validate.gates
        mine = [x for x in lines if x["model"] == model]
        for x in mine:
            x["gates"] = check_gates(gates, {r: {"metrics": m} for r, m in x["metrics"].items()})
            x["passed"] = all(g["passed"] is not False for g in x["gates"])
            x["failed"] = sorted({f"{g['gate']}@{g['row']}" for g in x["gates"] if g["passed"] is False})
        builds = sorted({(x["seed"], x["isa"]) for x in mine})
        print(f"\n{model}: {len(builds)} builds (seed, ISA): {builds}")
        for method in sorted({x["method"] for x in mine}):
            intact = [x for x in mine if x["method"] == method and x["case"] == "intact"]
            worst: dict[str, tuple] = {}
            for x in intact:
                for g in x["gates"]:
                    if g["value"] is None:
                        continue
                    key = f"{g['gate']}@{g['row']}"
                    mx = g["gate"].endswith("_max")
                    if key not in worst or (g["value"] > worst[key][0] if mx else g["value"] < worst[key][0]):
                        worst[key] = (g["value"], g["bound"], mx)
            print(f"  {method}: {sum(x['passed'] for x in intact)}/{len(intact)} pass"
                  + "".join(f"; fails {x['seed']}/{x['isa']}: {x['failed']}" for x in intact if not x["passed"]))
            for key, (v, b, mx) in sorted(worst.items()):
                margin = (b - v) if mx else (v - b)
                print(f"    {key:48s} worst {v:.4g}  bound {b:g}  margin {margin:+.3g}" + ("" if margin >= 0 else "  FAILS"))
        for case in sorted({x["case"] for x in mine} - {"intact"}):
            hurt = [x for x in mine if x["case"] == case]
            print(f"  {case}: {sum(not x['passed'] for x in hurt)}/{len(hurt)} fail; gates failed: "
                  f"{sorted({f for x in hurt for f in x['failed']})}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--isas", default="default,native", help="default: ATEN_CPU_CAPABILITY=default; native: unset")
    ap.add_argument("--models", default="glm-5.2,kimi-k2.6,qwen3-moe")
    ap.add_argument("--out", default="margins.jsonl", help="JSON lines, appended; --table-only reads it back")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory(prefix="gate-margins-") as d:
            one(args.one, Path(d))
        return
    out = Path(args.out)
    if not args.table_only:
        for isa in args.isas.split(","):
            for seed in args.seeds.split(","):
                for model in args.models.split(","):
                    env = dict(os.environ, QUANTKIT_TINY_SEED=seed, OMP_NUM_THREADS="1")
                    env.pop("ATEN_CPU_CAPABILITY", None)
                    if isa != "native":
                        env["ATEN_CPU_CAPABILITY"] = isa
                        env["QUANTKIT_CACHE"] = str(Path(env.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit")) / f"isa-{isa}")
                    r = subprocess.run([sys.executable, __file__, "--one", model], env=env, capture_output=True, text=True)
                    if r.returncode:
                        print(f"{model} seed {seed} {isa}: failed\n{r.stderr[-3000:]}", file=sys.stderr)
                        continue
                    with out.open("a") as f:
                        f.write(r.stdout)
                    print(f"{model} seed {seed} {isa}: done", file=sys.stderr, flush=True)
    table([json.loads(x) for x in out.read_text().splitlines() if x.strip()])


if __name__ == "__main__":
    main()
