#!/usr/bin/env bash
# The first command to run on a fresh GPU machine (docs/quickstart.md). No internet, nothing
# installed beyond the project's venv; about 5-8 minutes on one H200.
#
#   1. builds (or finds) the real-shape models realshape:glm-5.2 and realshape:kimi-k2.6
#   2. converts each on CUDA and on the CPU (GPTQ, 4 x 256 synthetic tokens; Kimi at group 128 so
#      its experts go through GPTQ), and validates the CUDA pair on CUDA
#   3. compares the CUDA outputs with the CPU outputs: every tensor byte for byte; where bytes
#      differ (GPTQ's float reductions run in another order), the decode logits' KL between the
#      two must be <= 1e-6
#   4. prints each layer's phase times, the planner's prediction for the same run, and the
#      full-scale GLM 5.2 / Kimi K2.6 predictions scaled by the measured/predicted ratio
#
# Usage: scripts/gpu_check.sh [OUT_DIR]      (PY=path/to/python to use another interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-$(mktemp -d /tmp/quantkit-gpu-check.XXXX)}
export HF_HUB_OFFLINE=1
mkdir -p "$OUT"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
"$PY" scripts/build_realshape.py

for m in glm-5.2 kimi-k2.6; do
  extra=()
  [ "$m" = kimi-k2.6 ] && extra=(--group-size 128)
  for dev in cuda cpu; do
    rm -rf "$OUT/$m-$dev"
    /usr/bin/env time -f "$m $dev: %e s wall, %M KB peak RSS" \
      "$PY" -m quantkit.cli convert "realshape:$m" --out "$OUT/$m-$dev" --calib synthetic:train \
      --num-samples 4 --seq-len 256 --method gptq --device "$dev" --no-validate "${extra[@]}" --json > "$OUT/$m-$dev.json"
  done
  "$PY" -m quantkit.cli validate "$OUT/$m-cuda" --device cuda --eval-data synthetic:heldout --num-samples 2 \
    --seq-len 128 --gen-tokens 2 --json > "$OUT/$m-validate.json" || echo "validate $m: gates failed (exit $?)"
done

"$PY" scripts/gpu_compare.py "$OUT" glm-5.2 kimi-k2.6
