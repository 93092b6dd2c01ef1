"""The prepared GPU check (benchmarks/gpu.sh) runs its logic on the CPU at tiny size: a session that is
lent a GPU runs it once, so it must not first fail on a typo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_at_tiny_size():
    env = {**os.environ, "PY": sys.executable}
    out = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "## tiny" in lines
    rows = [line for line in lines if line.startswith(("| 1 row", "| 2 rows"))]
    assert len(rows) == 3, out.stdout
    assert any("prefill" in line for line in lines)
    assert any(line.startswith("| training step") and "x PEFT" in line for line in lines), out.stdout
    assert any(line.startswith("| 4 policies fused vs in turn") for line in lines), out.stdout
    assert "'recompiles': 0" in out.stdout and "'failures': 0" in out.stdout
