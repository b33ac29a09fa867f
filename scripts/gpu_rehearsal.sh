#!/usr/bin/env bash
# Rehearse scripts/gpu_check.sh on a CPU machine, as the GPU machine will run it: a fresh
# interpreter with that machine's packages (not quantkit's venv), the install from .gpu-wheels/
# with no package index and no pip configuration, and every CUDA step on the CPU.
#
#   scripts/gpu_rehearsal.sh [OUT]     (QK_GPU_CHECK_SIZE=small by default: the real-shape models
#                                      with less data and a narrower GPTQ study; about 40 min on 2 cores)
#
# The venv gets the H200 image's packages (torch 2.13.0 here, the CPU build; the GPU machine has
# 2.11 + CUDA). pip brings pydantic in with typer 0.29 here; the H200 image has none, so it is
# removed again: the shipped wheels must provide it, as they will there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QK_REHEARSAL_VENV:-/tmp/gpu-rehearsal}
OUT=${1:-/tmp/qk-rehearsal-out}
WORK=${QK_GPU_CHECK_WORK:-/tmp/qk-rehearsal-work}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 transformers==5.17.0 safetensors huggingface-hub typer rich pyyaml \
    tokenizers matplotlib
fi
"$VENV/bin/pip" uninstall -q -y pydantic pydantic-core annotated-types typing-inspection 2>/dev/null || true
[ -f .gpu-wheels/requirements.txt ] || scripts/gpu_wheels.sh
rm -rf "$OUT" "$WORK"  # a bare machine: the models are built again, as there
PIP_CONFIG_FILE=/dev/null PY="$VENV/bin/python" QK_GPU_CHECK_DEVICE=cpu QK_GPU_CHECK_SIZE=${QK_GPU_CHECK_SIZE:-small} \
  QK_GPU_CHECK_WORK="$WORK" nice -n 10 scripts/gpu_check.sh "$OUT"
