#!/usr/bin/env bash
# The first command to run on a GPU machine: installs quantkit from this working tree into that
# machine's python (no network), then runs scripts/gpu_check.py, which measures CUDA against the
# CPU on the real-shape models and writes everything into one folder (docs/benchmarks.md, "GPU check").
#
#   1. install: `pip install --no-deps` of this tree and of the wheels in .gpu-wheels/ (made here
#      by scripts/gpu_wheels.sh: pydantic and its needs, setuptools for the offline build) into
#      $WORK/site, put first on PYTHONPATH; then every module the run uses is imported from there
#      (not from the tree), and the packages quantkit declares but the run does not import
#      (compressed-tensors, llmcompressor, datasets) are listed as absent
#   2. scripts/gpu_check.py run: builds realshape:glm-5.2 and realshape:kimi-k2.6, and measures
#      CUDA vs CPU (reference-forward logits, every non-expert tensor byte for byte, decode
#      KL(cpu || cuda)), a GPTQ convert and a validate on CUDA (per-phase times, peak device and
#      host memory, the planner's prediction beside each), GPTQ time per expert at real width for
#      1, 16 and 64 experts per call, and whether the bytes depend on the experts per call
#
# Usage: scripts/gpu_check.sh [OUT]          (default OUT: $OUT, else a new /tmp/quantkit-gpu-check.out.XXXX)
#   PY=python3                the interpreter to install into and run with
#   QK_GPU_CHECK_DEVICE=cuda  cpu: the same run with every CUDA step on the CPU (the rehearsal)
#   QK_GPU_CHECK_SIZE=full    small: the real-shape models with less data and a narrower GPTQ
#                             study; tiny: the tiny models (tests/test_gpu_check.py)
#   QK_GPU_CHECK_MODELS       a subset of the size's models, e.g. "realshape:glm-5.2"
#   QK_GPU_CHECK_WORK=/tmp/quantkit-gpu-check   work folder (models, outputs: ~12 GB at full size)
#   QK_GPU_CHECK_BUDGET_S     seconds for step 2 (default 420 at full size); steps not started by
#                             then are recorded as skipped, so the folder always has a summary
# On the device tool: run(command="scripts/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=600).
# OUT gets at most 6 files: summary.json, summary.md, reports.json, log.txt, install.log, env.json.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PY:-python3}
OUT=${1:-${OUT:-$(mktemp -d /tmp/quantkit-gpu-check.out.XXXX)}}
WORK=${QK_GPU_CHECK_WORK:-/tmp/quantkit-gpu-check}
WHEELS=${QK_GPU_WHEELS:-$ROOT/.gpu-wheels}
export QK_GPU_CHECK_DEVICE=${QK_GPU_CHECK_DEVICE:-cuda}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
WORK=$(cd "$WORK" && pwd)
SITE=$WORK/site
t0=$(date +%s)

fail() {  # a summary even when the install fails: the folder is all that comes back
  echo "gpu_check: $1" | tee -a "$OUT/install.log" >&2
  printf '{"passed": false, "stage": "install", "error": "%s", "install_log": "install.log"}\n' "$1" > "$OUT/summary.json"
  exit 2
}

# ---- 1. install --------------------------------------------------------------------------------
(
  echo "== $(date -u +%FT%TZ) install into $SITE with $PY ($("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)'))"
  df -h "$WORK" "$OUT" 2>/dev/null; free -g 2>/dev/null; nproc
  # the models and four outputs take about 12 GB at full size (2 GB at tiny)
  free_gb=$(df -Pk "$WORK" | awk 'NR == 2 {print int($4 / 1048576)}')
  min_free=${QK_GPU_CHECK_MIN_FREE_GB:-$([ "${QK_GPU_CHECK_SIZE:-full}" = tiny ] && echo 1 || echo 16)}
  [ "${free_gb:-0}" -ge "$min_free" ] || { echo "only ${free_gb} GB free in $WORK, need $min_free"; exit 6; }
  [ -f "$WHEELS/requirements.txt" ] || { echo "no $WHEELS/requirements.txt: run scripts/gpu_wheels.sh first"; exit 3; }
  rm -rf "$SITE" "$ROOT/build"
  "$PY" -m pip --version || exit 3
  if grep -q '[^[:space:]]' "$WHEELS/requirements.txt"; then
    "$PY" -m pip install --no-deps --no-index --find-links "$WHEELS" --no-cache-dir --no-compile \
      --target "$SITE" -r "$WHEELS/requirements.txt" || exit 4
  fi
  # the tree, built by pip in an isolated environment whose setuptools comes from $WHEELS
  # (QK_GPU_CHECK_NO_BUILD_ISOLATION=1: with the interpreter's own setuptools, as the tests do)
  isolation=()
  [ "${QK_GPU_CHECK_NO_BUILD_ISOLATION:-0}" = 1 ] && isolation=(--no-build-isolation)
  "$PY" -m pip install --no-deps --no-index --find-links "$WHEELS" --no-cache-dir --no-compile \
    "${isolation[@]}" --target "$SITE" "$ROOT" || exit 5
) > "$OUT/install.log" 2>&1
rc=$?
case $rc in
  0) ;;
  3) fail "no pip or no wheels (.gpu-wheels/requirements.txt): run scripts/gpu_wheels.sh here and carry .gpu-wheels" ;;
  6) fail "too little free disk in $WORK (QK_GPU_CHECK_WORK; see install.log)" ;;
  4) fail "pip could not install the wheels in $WHEELS (see install.log)" ;;
  *) fail "pip could not build and install quantkit from $ROOT (see install.log)" ;;
esac
rm -rf "$ROOT/build"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
# from $WORK, so that `import quantkit` finds the installed copy and not the tree
cd "$WORK"
"$PY" "$ROOT/scripts/gpu_check.py" imports --site "$SITE" --out "$OUT/env.json" >> "$OUT/install.log" 2>&1 \
  || fail "the import check failed: $(tail -1 "$OUT/install.log" | tr -d '"\\')"
echo "gpu_check: installed in $(( $(date +%s) - t0 )) s; $(tail -1 "$OUT/install.log")"

# ---- 2. the measurements -----------------------------------------------------------------------
"$PY" "$ROOT/scripts/gpu_check.py" run --out "$OUT" --work "$WORK" --install-seconds $(( $(date +%s) - t0 ))
rc=$?
echo "gpu_check: total $(( $(date +%s) - t0 )) s, exit $rc; results in $OUT"
exit $rc
