#!/usr/bin/env bash
# specc on an NVIDIA machine, in one go: the GPU test suite, tiny and SmolLM2 bundles for every
# CUDA backend present (AOTInductor; TensorRT and Torch-TensorRT if installed), speculative vs
# target-only benchmarks, and a Markdown report in gpu-check/report.md.
#
#   scripts/gpu_check.sh                 # needs a CUDA build of torch (pip install torch==2.13.0)
#   scripts/gpu_check.sh --device cpu --backends torch --models tiny --no-pytest   # dry run
#   scripts/gpu_check.sh --help
#
# PYTHON selects the interpreter (default: .venv/bin/python if present, else python3); specc and
# its test dependencies are installed into it (editable) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! "$PY" -c "import specc, pytest, scipy" 2>/dev/null; then
    "$PY" -m pip install -q -e '.[test]'
fi
exec "$PY" scripts/gpu_check.py "$@"
