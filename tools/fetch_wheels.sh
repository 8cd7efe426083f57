#!/usr/bin/env bash
# Run HERE (a machine with PyPI) before a GPU check on an offline GPU machine: downloads, into .whl/ (git-ignored),
# the Python 3.12 x86-64 wheels that such a machine's image lacks for the `gpu` tests: megatron-core and pydantic
# with their small dependencies (about 6 MB). Carry .whl to the GPU machine; tools/gpu_check.sh installs from it
# without a network. Official vLLM (~400 MB, built against one torch) and Transformer Engine (built against the
# local torch and CUDA) cannot travel that way: where they are missing, the tests that need them skip and say so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "megatron-core==0.16.1" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types>=0.6" \
    "typing-inspection>=0.4.4" "typing-extensions>=4.16" "packaging>=24.2"
ls -la .whl
