#!/usr/bin/env bash
# The wheels a GPU machine without network needs to run benchmarks/gpu_check.py (the runtime's small
# dependencies that its image lacks), at the versions requirements.lock pins, for CPython 3.12 on x86-64 Linux:
#
#     benchmarks/gpu_wheels.sh [FOLDER]      # default .gpu-wheels (git-ignored), about 5 MB
#
# On the GPU machine: python3 -m pip install -q --no-index --no-deps --target /tmp/site FOLDER/*.whl, then
# PYTHONPATH=/tmp/site (README.md, "On a GPU"). torch, numpy, pillow and PyYAML are there already.
set -euo pipefail
cd "$(dirname "$0")/.."
folder=${1:-.gpu-wheels}
packages="pydantic pydantic_core annotated-types typing-inspection typing_extensions orjson soundfile cffi pycparser"
pins=()
for name in $packages; do
    pattern="^${name//[-_]/[-_]}=="  # the lock spells some names with '-', others with '_'
    pin=$(grep -i -E "$pattern" requirements.lock) || { echo "requirements.lock pins no $name" >&2; exit 1; }
    pins+=("$pin")
done
mkdir -p "$folder"
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --dest "$folder" "${pins[@]}"
ls "$folder"
