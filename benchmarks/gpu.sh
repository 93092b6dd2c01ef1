#!/usr/bin/env bash
# The prepared GPU check (issue: compiled serving step): one table on one H100/H200, no network, in a
# few minutes. Run from the repository root with the project's venv (torch with CUDA, triton,
# transformers installed): `bash benchmarks/gpu.sh`. On a machine without a GPU it runs the same
# logic at tiny size on the CPU (what CI checks).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    exec timeout 480 "$PY" -m benchmarks.gpu_check "$@"
fi
exec "$PY" -m benchmarks.gpu_check --tiny "$@"
