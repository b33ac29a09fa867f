#!/usr/bin/env bash
# Convert one model to the FP8 prefill / INT4 decode pair, validate it against its gates, summarise.
# The CI workflow (.github/workflows/quantize.yml) runs exactly this; so can you, locally:
#
#   scripts/ci_quantize.sh tiny:glm-5.2 tiny-glm-5.2 out/ci
#   scripts/ci_quantize.sh hf://zai-org/GLM-5.2-FP8@main glm-5.2 /data/out/glm 128
#
# usage: scripts/ci_quantize.sh MODEL RECIPE OUTDIR [GROUP_SIZE]
#   MODEL       a folder, hf://org/repo@rev, or tiny:kimi-k2.6 / tiny:glm-5.2 / tiny:qwen3-moe
#   RECIPE      a recipe name (recipes/*.yaml) or file; "" for the model family's default
#   OUTDIR      where the artifacts go (must not already hold prefill/ or decode/)
#   GROUP_SIZE  optional INT4 group size override (32, 64, 128)
#
# environment (all optional):
#   QK_GATE           a gate file (YAML/JSON, e.g. `kl_max: 0.05`) instead of the recipe's gates
#   QK_DEVICE         auto (default), cpu or cuda
#   QK_CONVERT_ARGS   extra `quantkit convert` options, e.g. "--method rtn" or "--delete-source-after"
#   QK_VALIDATE_ARGS  extra `quantkit validate` options, e.g. "--num-samples 2 --seq-len 16"
#   QUANTKIT          the quantkit command (default: quantkit on PATH)
#   PYTHON            the Python that has quantkit installed (default: python on PATH)
#
# Writes, in OUTDIR:
#   prefill/ decode/          the checkpoint pair (model cards README.md written by validate)
#   convert-report.json       what convert did (quantkit convert --json prints the same object)
#   validation.json .md .png  what validate measured, the gates and their verdicts
#   validation-experts.png    every routed expert's output error, layers x experts
#   ci-summary.md             the short summary printed at the end (CI appends it to the job page)
#
# Exit status: 0 when converted and every gate passed; quantkit's exit status otherwise
# (3: a validation gate failed, 1: bad input, other: a crash), so CI publishes nothing.
set -euo pipefail

if [[ $# -lt 3 || $# -gt 4 ]]; then
    sed -n '8,13p' "$0" >&2
    exit 2
fi
MODEL=$1
RECIPE=$2
OUT=$3
GROUP_SIZE=${4:-}
QUANTKIT=${QUANTKIT:-quantkit}
PYTHON=${PYTHON:-python}
DEVICE=${QK_DEVICE:-auto}

read -r -a convert_extra <<< "${QK_CONVERT_ARGS:-}"
read -r -a validate_extra <<< "${QK_VALIDATE_ARGS:-}"

convert_args=(convert "$MODEL" --out "$OUT" --device "$DEVICE" --no-validate --json)
[[ -n "$RECIPE" ]] && convert_args+=(--recipe "$RECIPE")
[[ -n "$GROUP_SIZE" ]] && convert_args+=(--group-size "$GROUP_SIZE")
validate_args=(validate "$OUT" --device "$DEVICE" --json)
if [[ -n "${QK_GATE:-}" ]]; then
    [[ -f "$QK_GATE" ]] || { echo "ci_quantize: QK_GATE=$QK_GATE: no such file" >&2; exit 2; }
    validate_args+=(--gate "$QK_GATE")
fi

mkdir -p "$OUT"
group() { [[ -n "${GITHUB_ACTIONS:-}" ]] && echo "::group::$*" || echo "+ $*" >&2; }  # folds the log on GitHub
endgroup() { [[ -n "${GITHUB_ACTIONS:-}" ]] && echo "::endgroup::" || true; }

# 1. convert: the pair and convert-report.json (validation is its own step below). --json keeps the
#    log free of progress bars; what it prints is convert-report.json, already on disk.
group "$QUANTKIT ${convert_args[*]} ${convert_extra[*]}"
t0=$SECONDS
rc=0
"$QUANTKIT" "${convert_args[@]}" "${convert_extra[@]}" > /dev/null || rc=$?
convert_s=$((SECONDS - t0))
endgroup
if [[ $rc -ne 0 ]]; then
    echo "ci_quantize: convert failed (exit $rc)" >&2
    exit "$rc"
fi
for f in prefill/config.json decode/config.json convert-report.json; do
    [[ -f "$OUT/$f" ]] || { echo "ci_quantize: convert exited 0 but $OUT/$f is missing" >&2; exit 1; }
done

# 2. validate: exit 3 when a gate fails; the summary is still printed, then the script fails
group "$QUANTKIT ${validate_args[*]} ${validate_extra[*]}"
rm -f "$OUT/validation.json" "$OUT/validation.md" "$OUT/validation.png"  # never report a stale verdict
t0=$SECONDS
rc=0
"$QUANTKIT" "${validate_args[@]}" "${validate_extra[@]}" > /dev/null || rc=$?
validate_s=$((SECONDS - t0))
endgroup
if [[ ! -f "$OUT/validation.json" ]]; then
    echo "ci_quantize: validate failed (exit $rc) before writing $OUT/validation.json" >&2
    exit $((rc == 0 ? 1 : rc))
fi

# 3. summary: sizes, experts, every row's numbers and the gate verdicts
"$PYTHON" - "$OUT" "$convert_s" "$validate_s" <<'EOF' | tee "$OUT/ci-summary.md"
import json, sys
from pathlib import Path

out, convert_s, validate_s = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
r = json.loads((out / "convert-report.json").read_text())
v = json.loads((out / "validation.json").read_text())
gb = lambda n: f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
e = r["experts_summary"]
print(f"## quantkit: {r['source']['spec']} -> {out}  **{'PASSED' if v['passed'] else 'FAILED'}**\n")
print(f"recipe `{r['recipe'].get('name')}`, method {r['method']}, INT4 group {r['group_size']}; "
      f"convert {convert_s}s, validate {validate_s}s on {v['device']}\n")
print(f"- prefill/: {gb(r['outputs']['prefill']['bytes'])}; decode/: {gb(r['outputs']['decode']['bytes'])}")
print(f"- routed experts: {e['total']} ({e['gptq']} GPTQ, {e.get('awq', 0)} AWQ, {e['rtn']} RTN, {e['reused']} reused, "
      f"{e['fallbacks']} fallbacks)")
s = r["shared_tensors"]
print(f"- shared tensors: {s['identical']} byte-identical, {s['differ']} differ ({', '.join(s['differ_classes'])})")
ed = v["eval_data"]
print(f"- eval data: {ed['spec']}, {ed['num_samples']} x {ed['seq_len']} tokens, sha256 {ed['sha256'][:12]}\n")
print("| row | KL | top-1 | ppl delta | layer err | greedy |")
print("|---|---|---|---|---|---|")
fmt = lambda x, f: "-" if x is None else format(x, f)
for row, d in v["rows"].items():
    m = d["metrics"]
    print(f"| {row} | {fmt(m.get('kl'), '.4g')} | {fmt(m.get('top1'), '.3f')} | {fmt(m.get('ppl_delta'), '+.2%')} "
          f"| {fmt(m.get('layer_rel_err'), '.3g')} | {fmt(m.get('greedy_agree'), '.3f')} |")
print(f"\ngates ({v['gates_from']}):\n")
for g in v["gates"]:
    verdict = {True: "pass", False: "**FAIL**", None: "n/a"}[g["passed"]]
    print(f"- {g['gate']} on {g['row']}: {fmt(g['value'], '.4g')} (bound {g['bound']:g}) {verdict}")
for n in v.get("notes", []):
    print(f"\nnote: {n}")
EOF

if [[ $rc -ne 0 ]]; then
    echo "ci_quantize: validation failed (exit $rc): see $OUT/validation.md; nothing is published" >&2
    exit "$rc"
fi
echo "ci_quantize: OK, artifacts in $OUT (prefill/ decode/ convert-report.json validation.*)" >&2
