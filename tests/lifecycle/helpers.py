"""The pieces the lifecycle tests drive: the `mint` CLI and `mint serve` as subprocesses, and greedy
sampling through the tinker SDK."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import tinker
from tinker import types

# The `mint` next to this interpreter (the venv's), not whatever is first on PATH.
MINT = shutil.which("mint", path=os.path.dirname(sys.executable)) or "mint"
PROMPT = types.ModelInput.from_ints([5, 17, 33, 60])  # the start of a training sequence (live.batch)
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without MinT/Tinker settings, so a developer's own keys and URLs never leak in;
    servers run eagerly (MINT_COMPILE=off, as tests/conftest.py sets) unless `extra` says otherwise."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    return {**env, "MINT_COMPILE": "off", **extra}


def mint(*args: str, expect: int = 0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([MINT, *args], capture_output=True, text=True, env=env or clean_env(), timeout=120)
    assert proc.returncode == expect, f"mint {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


class RemoteCli:
    """`mint … --server URL --api-key KEY --json`, parsed."""

    def __init__(self, url: str, key: str) -> None:
        self.remote = ["--server", url, "--api-key", key, "--json"]

    def __call__(self, *args: str) -> Any:
        return json.loads(mint(*args, *self.remote).stdout)

    def fails(self, *args: str) -> str:
        """The one-line error of a command that must fail."""
        return mint(*args, *self.remote, expect=2).stderr


def greedy(sc: tinker.SamplingClient) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs: what a revision's weights do to one prompt."""
    seq = sc.sample(PROMPT, 1, GREEDY).result().sequences[0]
    assert seq.logprobs is not None
    return list(seq.tokens), list(seq.logprobs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`mint serve` on the tiny checkpoint, as a user runs it (no key given unless in `env`)."""

    def __init__(self, model_dir: Path, data_dir: Path, log: Path, env: dict[str, str] | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [
            MINT, "serve", "--base-model", str(model_dir), "--port", str(self.port), "--data-dir", str(data_dir),
            "--device-slots", "4", "--max-rank", "8", "--kv-budget-tokens", "512", "--max-seq-len", "128",
            "--log-level", "warning", *extra,
        ]  # fmt: skip
        with open(log, "w") as out:
            self.proc = subprocess.Popen(args, env=env or clean_env(), stdout=out, stderr=subprocess.STDOUT)
        self._wait_healthy()

    def _wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"mint serve did not come up:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # say what it was doing: SIGUSR1 dumps its threads' stacks
            self.proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 10
            while "most recent call first" not in self.output() and time.monotonic() < deadline:
                time.sleep(0.1)
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"mint serve did not exit within 60 s of signal {sig}:\n{self.output()[-20000:]}") from None
