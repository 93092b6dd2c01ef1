"""Other client SDK versions, installed once per machine into a target dir and run as subprocesses.

mindlab-toolkit 0.2.0 pins tinker 0.22.0, which cannot share an interpreter with the tinker 0.38
this repo uses, so its tests run a script in a child process with the old packages first on
PYTHONPATH (their remaining dependencies — httpx, pydantic, numpy… — come from this venv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MINT_CLIENT = ("mindlab-toolkit==0.2.0", "tinker==0.22.0", "grpcio")  # tinker 0.22 imports grpc


def cache_root() -> Path:
    return Path(os.environ.get("MINT_TEST_CACHE") or Path.home() / ".cache" / "mint-test")


def mint_client_dir() -> Path:
    """The target dir holding mindlab-toolkit 0.2.0 + tinker 0.22.0; installs it on first use."""
    target = cache_root() / "clients" / "mint-0.2.0"
    if (target / "mint" / "__init__.py").is_file() and (target / "tinker" / "__init__.py").is_file():
        return target
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
         "--target", str(target), *MINT_CLIENT],
        capture_output=True, text=True, timeout=600,
    )
    if proc.returncode != 0:
        pytest.skip(f"could not install {' '.join(MINT_CLIENT)} from PyPI: {proc.stderr.strip()[-500:]}")
    return target


def run_script(script: Path, pythonpath: Path, env: dict[str, str], timeout: float = 240) -> dict:
    """Run `script`; it prints one JSON object as its last stdout line."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "MINT_"))}
    proc = subprocess.run(
        [sys.executable, str(script)],
        env={**clean, "PYTHONPATH": str(pythonpath), **env},
        capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"{script.name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
