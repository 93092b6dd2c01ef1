"""Run the real app under uvicorn on a loopback port, in a background thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from mint_server.api.app import create_app
from mint_server.api.settings import Settings

KEY_A = "tml-test-key-alpha-0001"
KEY_B = "tml-test-key-bravo-0002"
KEY_SK = "sk-test-key-charlie-0003"


class LiveServer:
    def __init__(self, engine: Any, data_dir: Path, **settings: Any) -> None:
        self.engine = engine
        self.settings = Settings(data_dir=data_dir, api_keys=(KEY_A, KEY_B, KEY_SK), **settings)
        self.app = create_app(engine, self.settings)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=30)
        self._server = uvicorn.Server(config)
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
