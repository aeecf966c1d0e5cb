#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the wheels benchmarks/gpu_check.sh installs on a GPU machine
# that has no package index: the pins of benchmarks/gpu_wheels.txt, for CPython 3.12 on Linux
# x86_64, whatever this machine is. Then checks the set is complete and closed
# (benchmarks/gpu_wheels.py check). Needs pip access to PyPI here. docs/gpu.md says how to carry
# the folder to the GPU machine (the device tool's run with carry [".whl"]).
# Usage: bash benchmarks/gpu_wheels.sh [FOLDER]   (default: .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
folder=${1:-.whl}
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$folder"
pins=$(sed 's/#.*//' benchmarks/gpu_wheels.txt | awk 'NF')
for pin in $pins; do
    name=${pin%%==*}
    version=${pin#*==}
    # Wheel file names spell the project with underscores; skip what is already there.
    stem=$(echo "$name" | tr '.-' '__')
    if compgen -G "$folder/${stem}-${version}-*.whl" >/dev/null \
        || compgen -G "$folder/${name}-${version}-*.whl" >/dev/null; then
        continue
    fi
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$folder" "$pin"
done
"$py" benchmarks/gpu_wheels.py check "$folder"
