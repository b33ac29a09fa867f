#!/usr/bin/env bash
# Prepare .gpu-wheels/: the packages quantkit's GPU check needs that the GPU machine's python lacks,
# as wheels, so that scripts/gpu_check.sh installs them there with no network.
#
# What is needed, and why only this: the H200 image (its python3 is 3.12, /opt/torch/.venv) has
# torch, transformers, safetensors, huggingface-hub, typer, rich, pyyaml, tokenizers, numpy, httpx
# and matplotlib, and no pydantic. quantkit.recipe imports pydantic at the top (every convert and
# validate loads a recipe), so pydantic and its own needs travel. compressed-tensors, llmcompressor
# and datasets do not: convert/validate with synthetic: data import none of them (quantkit imports
# datasets only for hf: data specs, compressed_tensors only in `check-serving`), and
# scripts/gpu_check.sh checks that at run time. setuptools travels so that the working tree's
# quantkit builds offline in pip's isolated build environment (pyproject: setuptools>=77, whatever
# the machine has).
#
# pydantic-core is compiled: one wheel per Python version, for the GPU machine (3.12) and for the
# interpreter that rehearses the check on a CPU machine (3.11 here); QK_WHEEL_PYTHONS to change.
#
# Usage: scripts/gpu_wheels.sh [DIR]      (default .gpu-wheels, ignored by git; the device run
#        names it in `carry`)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu-wheels}
PYTHONS=${QK_WHEEL_PYTHONS:-"3.12 3.11"}
PY=${PY:-python3}
# name==version: the versions the project's tests run with (pydantic 2.14 needs typing-extensions >= 4.14.1)
PURE="pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0"
COMPILED="pydantic-core==2.50.5"
BUILD="setuptools==84.2.1"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

rm -rf "$DIR"
mkdir -p "$DIR"
# shellcheck disable=SC2086  # word splitting of the lists is intended
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" $PURE $BUILD
for v in $PYTHONS; do
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
    "${PLATFORMS[@]}" -d "$DIR" $COMPILED
done
# what gpu_check.sh installs by name (pip picks the pydantic-core wheel of the running interpreter)
for spec in $PURE $COMPILED; do echo "$spec"; done > "$DIR/requirements.txt"
ls -l "$DIR"
du -sh "$DIR"
