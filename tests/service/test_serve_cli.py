"""`mint serve` as a user runs it, and shutdown behaviour."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from mint_server.api.auth.keys import owner_id
from tests.service.live import BASE, KEY_A, LiveServer, ServeProcess, tiny_engine


def test_mint_serve_process(tiny_dir: Path, tmp_path: Path) -> None:
    with ServeProcess("--base-model", str(tiny_dir), "--data-dir", str(tmp_path / "data"), "--device-slots", "4",
                      "--max-rank", "8", "--kv-budget-tokens", "512", "--max-seq-len", "128",
                      keys=f"{KEY_A}, tml-second-key-0000") as served:
        url = f"{served.url}/api/v1"
        caps = httpx.get(f"{url}/get_server_capabilities", headers={"X-API-Key": "tml-second-key-0000"}).json()
        assert caps["supported_models"][0]["model_name"] == tiny_dir.name  # a plain dir is named after itself
        assert caps["supported_models"][0]["max_context_length"] == 128  # --max-seq-len reached the engine
        assert httpx.get(f"{url}/get_server_capabilities").status_code == 401
        out = served.stop()
        # uvicorn finishes the lifespan shutdown (our drain), then re-raises the signal.
        assert "Application shutdown complete" in out, out
        assert KEY_A not in out and "tml-second-key" not in out  # keys never reach the log


def test_no_auth_and_loopback_rule(tiny_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mint_server.cli import app

    result = CliRunner().invoke(app, ["serve", "--no-auth", "--host", "0.0.0.0"])
    assert result.exit_code != 0 and "loopback" in result.output
    # (A missing model dir: were the flag not checked first, this would fail on --base-model instead.)
    result = CliRunner().invoke(app, ["serve", "--no-auth", "--kv-budget-tokens", "0", "--base-model", str(tmp_path / "none")])
    assert result.exit_code != 0 and "--kv-budget-tokens" in result.output
    with LiveServer(tiny_engine(tiny_dir), tmp_path / "d", no_auth=True) as server:
        assert httpx.get(f"{server.url}/api/v1/training_runs").status_code == 200


def test_unusable_db_url_is_a_one_line_error(tiny_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mint_server.cli import app

    args = ["serve", "--base-model", str(tiny_dir), "--data-dir", str(tmp_path / "d"), "--kv-budget-tokens", "16",
            "--max-seq-len", "16", "--api-key", KEY_A]  # fmt: skip
    for url, needle in [("sqlite://", "file-backed"), ("postgresql+psycopg://nobody@127.0.0.1:1/none", "127.0.0.1")]:
        result = CliRunner().invoke(app, [*args, "--db-url", url])
        assert result.exit_code == 2 and "--db-url" in result.output and needle in result.output, result.output
        assert "Traceback" not in result.output and KEY_A not in result.output


def test_shutdown_drains_in_flight_work(tiny_dir: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_dir)
    server = LiveServer(engine, tmp_path / "d").start()
    api = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": KEY_A}, timeout=30)

    def submit(path: str, body: dict) -> str:
        r = api.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["request_id"]

    def result(request_id: str) -> dict:
        while (out := api.post("retrieve_future", json={"request_id": request_id}).json()).get("type") == "try_again":
            pass
        return out

    session = api.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"}).json()
    session_id = session["session_id"]
    model_id = result(submit("create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": BASE,
                                              "lora_config": {"rank": 2}}))["model_id"]
    sampler = api.post("create_sampling_session", json={"session_id": session_id, "sampling_session_seq_id": 0,
                                                        "base_model": BASE}).json()["sampling_session_id"]
    # The engine is held (an explicit gate, not slow work): everything below is accepted and queued,
    # none of it can finish until the server is shutting down.
    engine.pause()
    tokens = [(7 * i) % 300 + 10 for i in range(33)]
    fb_input = {"loss_fn": "cross_entropy", "data": [{
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"}}}] * 2}
    sample = submit("asample", {"sampling_session_id": sampler, "seq_id": 1, "num_samples": 2,
                                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                                "sampling_params": {"max_tokens": 20, "stop": []}})
    for seq in range(1, 3):
        submit("forward_backward", {"model_id": model_id, "seq_id": seq, "forward_backward_input": fb_input})
    step = submit("optim_step", {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": 0.01}})
    futures = server.service.core.stores.futures
    pending = [futures.get(rid, owner_id(KEY_A)).future for rid in (sample, step)]
    assert not any(f.done() for f in pending)
    api.close()
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    # Once the service has stopped accepting work (the drain has begun), let the engine go.
    while server.service.core.admission.accepting:
        time.sleep(0.01)
    assert not any(f.done() for f in pending)
    engine.resume()
    stopping.join()
    # Accepted work finished (not cancelled) before the engine stopped: full samples, and the
    # optimizer step, which ran last, applied the queued steps' gradient.
    done_sample, done_step = (f.result() for f in pending)
    assert [len(s.tokens) for s in done_sample.sequences] == [20] * 2
    assert done_step.metrics["grad_norm:mean"] > 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/api/v1/healthz")
