"""Run the real app under uvicorn on a loopback port, in a background thread of the test process,
on the real LocalEngine over a tiny random checkpoint (see conftest.py's `tiny_dir`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from tinker import types

from mint_server.api.http.app import create_app
from mint_server.api.http.server import ConnectionLimits, Server, uvicorn_config
from mint_server.api.settings import Settings
from mint_server.engine.local import LocalEngine
from mint_server.engine.settings import EngineSettings

KEY_A = "tml-test-key-alpha-0001"
KEY_B = "tml-test-key-bravo-0002"
KEY_SK = "sk-test-key-charlie-0003"

BASE = "tiny/llama"  # the name clients use for the tiny checkpoint
LR = 2e-2  # big enough that a few Adam steps visibly lower the tiny model's loss
# Small, so that an engine starts in well under a second and holds little memory.
ENGINE_SETTINGS = EngineSettings(device_slots=8, max_rank=16, kv_budget_tokens=4096, max_context=256)


def tiny_engine(model_dir: Path) -> LocalEngine:
    return LocalEngine(model_dir, base_model=BASE, device="cpu", dtype=torch.float32, settings=ENGINE_SETTINGS)


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    """Next-token cross-entropy over `tokens`."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights or [1.0] * (len(tokens) - 1)},
    )


def batch() -> list[types.Datum]:
    return [datum([5, 17, 33, 60, 61, 62, 63, 9]), datum([100, 101, 102, 103, 104, 105])]


def train(tc: Any, steps: int, data: list[types.Datum] | None = None) -> list[float]:
    """`steps` forward_backward + optim_step rounds on a tinker TrainingClient; the losses before each step."""
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data or batch(), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=LR))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


class LiveServer:
    def __init__(self, engine: Any, data_dir: Path, limits: ConnectionLimits | None = None, **settings: Any) -> None:
        self.engine = engine
        self.settings = Settings(data_dir=data_dir, api_keys=(KEY_A, KEY_B, KEY_SK), **settings)
        self.app = create_app(engine, self.settings)
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP,
        # and without it every response's body waits ~40 ms behind its headers (Nagle + delayed ACK).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(
            self.app, limits or ConnectionLimits(), log_level="warning", lifespan="on", timeout_graceful_shutdown=30
        )
        self._server = Server(config, self.app.state.service.begin_shutdown)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def service(self) -> Any:
        return self.app.state.service

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self._sock.close()

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServeProcess:
    """`mint serve ARGS` as a user runs it: a subprocess on a free loopback port, healthy on entry.

    `stop()` ends it as an operator does (SIGTERM: drain, then exit) and returns its output; leaving
    the block any other way kills it."""

    def __init__(self, *args: str, keys: str = KEY_A, ready_timeout_s: float = 180.0,
                 preexec_fn: Any = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.keys, self.ready_timeout_s, self.preexec_fn = args, keys, ready_timeout_s, preexec_fn
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServeProcess:
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-c", "from mint_server.cli import main; main()", "serve", "--port", str(self.port),
             *self.args], env={**os.environ, "MINT_API_KEYS": self.keys},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=self.preexec_fn,
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/api/v1/healthz").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"mint serve did not become healthy:\n{proc.communicate()[0]}")
            time.sleep(0.3)

    def stop(self) -> str:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode in (0, -signal.SIGTERM), out
        return out

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
