"""`mint serve` as a user runs it, and shutdown behaviour."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.service.fake_engine import FakeEngine
from tests.service.live import KEY_A, LiveServer
from tests.tiny import make_tiny_checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mint_serve_process(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "tiny-llama")
    port = _free_port()
    env = {**os.environ, "MINT_API_KEYS": f"{KEY_A}, tml-second-key-0000"}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from mint_server.cli import main; main()", "serve", "--base-model", str(model_dir), "--port", str(port),
         "--data-dir", str(tmp_path / "data")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/api/v1"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.3)
        caps = httpx.get(f"{url}/get_server_capabilities", headers={"X-API-Key": "tml-second-key-0000"}).json()
        assert caps["supported_models"][0]["model_name"] == "tiny-llama"
        assert httpx.get(f"{url}/get_server_capabilities").status_code == 401
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        # uvicorn finishes the lifespan shutdown (our drain), then re-raises the signal.
        assert proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in out, out
        assert KEY_A not in out and "tml-second-key" not in out  # keys never reach the log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_no_auth_and_loopback_rule(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mint_server.cli import app

    result = CliRunner().invoke(app, ["serve", "--no-auth", "--host", "0.0.0.0"])
    assert result.exit_code != 0 and "loopback" in result.output
    with LiveServer(FakeEngine(tmp_path / "m"), tmp_path / "d", no_auth=True) as server:
        assert httpx.get(f"{server.url}/api/v1/training_runs").status_code == 200


def test_shutdown_drains_in_flight_work(tmp_path: Path) -> None:
    engine = FakeEngine(tmp_path / "m")
    server = LiveServer(engine, tmp_path / "d").start()
    api = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": KEY_A})
    session = api.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"}).json()
    fut = api.post("create_model", json={"session_id": session["session_id"], "model_seq_id": 0,
                                        "base_model": "fake/tiny", "lora_config": {"rank": 2}}).json()
    while api.post("retrieve_future", json={"request_id": fut["request_id"]}).json().get("type") == "try_again":
        pass
    engine.delay_s = 1.0
    r = api.post("optim_step", json={"model_id": f"{session['session_id']}:train:0", "seq_id": 1, "adam_params": {}})
    assert r.status_code == 200
    api.close()
    server.stop()
    assert engine.calls[-1] == "optim_step"  # accepted work finished before the engine stopped
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/api/v1/healthz")
