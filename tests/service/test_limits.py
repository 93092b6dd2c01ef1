"""Connection limits: oversized request heads (431), oversized bodies (413), slow heads and stalled
bodies (408), all answered in JSON; the server keeps serving everyone else."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mint_server.api.http.server import ConnectionLimits
from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, tiny_engine

LIMITS = ConnectionLimits(max_header_bytes=8 * 1024, header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=5)


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("limits") / "data"
    with LiveServer(tiny_engine(tiny_dir), data, limits=LIMITS, max_body_bytes=10_000, body_timeout_s=0.5,
                    max_pending_per_key=3, long_poll_s=0.1) as s:
        yield s


def _raw(server: LiveServer, *parts: bytes) -> tuple[int, dict]:
    """Send `parts` on one connection (stopping early if the server hangs up), read the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:
                break
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def _still_serves(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/api/v1/training_runs", headers={"X-API-Key": KEY_A}, timeout=30)
    assert r.status_code == 200


def test_oversized_headers_431(server: LiveServer) -> None:
    head = b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * 20_000 + b"\r\n\r\n"
    status, body = _raw(server, head)
    assert status == 431 and "header" in body["detail"]
    r = httpx.get(f"{server.url}/api/v1/healthz", headers={"X-Junk": "a" * 4000})  # under the limit: fine
    assert r.status_code == 200
    _still_serves(server)


def test_oversized_body_413(server: LiveServer) -> None:
    r = httpx.post(f"{server.url}/api/v1/create_session", headers={"X-API-Key": KEY_A}, content=b"x" * 20_000)
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    r = httpx.post(f"{server.url}/api/v1/create_session", headers={"X-API-Key": KEY_A},
                   content=iter([b"y" * 1000] * 20))  # chunked: no Content-Length  # fmt: skip
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    _still_serves(server)


def test_slow_head_408(server: LiveServer) -> None:
    # Half a request head, then nothing: the server answers and hangs up instead of waiting for ever.
    status, body = _raw(server, b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n")
    assert status == 408 and "headers" in body["detail"]
    _still_serves(server)


def test_an_unread_body_arriving_after_the_answer_leaves_no_connection_open(server: LiveServer) -> None:
    """The SDK's telemetry and session-finish bodies are never read by their routes; when the rest of
    such a body reaches the server after its answer, the connection must still close once idle for
    keep_alive_s (uvicorn alone left it open for good: one socket per SDK client)."""
    body = b'{"events": []}'
    head = (f"POST /api/v1/telemetry HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY_A}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            answer += sock.recv(65536)  # the route answered without reading the body
        assert answer.startswith(b"HTTP/1.1 200")
        sock.sendall(body)  # now the body: it ends the request cycle after its answer
        # Idle from here; the server hangs up after keep_alive_s (the 30 s socket timeout is a guard).
        assert sock.recv(65536) == b""
    _still_serves(server)


def test_stalled_body_408(server: LiveServer) -> None:
    head = (
        f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY_A}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    status, body = _raw(server, head, b'{"tags": [')  # 10 of the 100 bytes promised
    assert status == 408 and "stalled" in body["detail"]
    _still_serves(server)


def test_client_leaving_mid_body_is_no_server_error(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mint_server.api.http.plumbing")
    head = (
        f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY_A}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + b'{"tags": [')  # 10 of the 100 bytes promised, then the client is gone

    def seen() -> bool:
        return any("client disconnected" in r.getMessage() or r.levelno >= logging.ERROR for r in caplog.records)

    deadline = time.monotonic() + 60
    while not seen():
        assert time.monotonic() < deadline, "the server never noticed the client leave"
        time.sleep(0.01)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # quiet: not an unhandled error
    _still_serves(server)


def test_per_key_pending_limit_429_and_queue_state(server: LiveServer) -> None:
    """A key at its limit of pending requests gets 429 + Retry-After and its futures report
    paused_rate_limit; another key is still served; once work finishes the key is admitted again."""

    def api(key: str) -> httpx.Client:
        return httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": key}, timeout=30)

    def sampler(client: httpx.Client) -> str:
        sid = client.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"}).json()
        r = client.post("create_sampling_session", json={"session_id": sid["session_id"], "sampling_session_seq_id": 0,
                                                         "base_model": BASE})  # fmt: skip
        return r.json()["sampling_session_id"]

    def sample(client: httpx.Client, sampler_id: str, seq: int) -> httpx.Response:
        return client.post("asample", json={"sampling_session_id": sampler_id, "seq_id": seq, "num_samples": 1,
                                            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                            "sampling_params": {"max_tokens": 2}})  # fmt: skip

    def result(client: httpx.Client, request_id: str) -> dict:
        while (out := client.post("retrieve_future", json={"request_id": request_id}).json()).get("type") == "try_again":
            pass
        return out

    a, b = api(KEY_A), api(KEY_B)
    sa, sb = sampler(a), sampler(b)
    server.engine.pause()
    try:
        held = [sample(a, sa, seq).json()["request_id"] for seq in range(1, 4)]
        refused = sample(a, sa, 4)
        assert refused.status_code == 429 and "per-key limit" in refused.json()["detail"]
        assert int(refused.headers["Retry-After"]) >= 1
        poll = a.post("retrieve_future", json={"request_id": held[0]}).json()
        assert poll["type"] == "try_again" and poll["queue_state"] == "paused_rate_limit", poll
        assert sample(b, sb, 1).status_code == 200  # the other key is not held back by A's limit
    finally:
        server.engine.resume()
    assert all(result(a, rid)["sequences"] for rid in held)
    assert sample(a, sa, 4).status_code == 200  # the same request, resubmitted, is admitted now
    a.close()
    b.close()


def test_a_tinker_sample_may_lower_its_priority_by_header_never_raise_it(server: LiveServer) -> None:
    client = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": KEY_A}, timeout=30)
    sid = client.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"}).json()
    sampler_id = client.post("create_sampling_session", json={
        "session_id": sid["session_id"], "sampling_session_seq_id": 0, "base_model": BASE}).json()["sampling_session_id"]

    def sample(seq: int, priority: str) -> httpx.Response:
        return client.post("asample", headers={"X-Mint-Priority": priority}, json={
            "sampling_session_id": sampler_id, "seq_id": seq, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}, "sampling_params": {"max_tokens": 2}})

    raised = sample(1, "interactive")
    assert raised.status_code == 400 and "X-Mint-Priority" in raised.json()["detail"], raised.text
    assert sample(2, "soon").status_code == 400
    lowered = sample(3, "batch")
    assert lowered.status_code == 200, lowered.text
    rid = lowered.json()["request_id"]
    while (out := client.post("retrieve_future", json={"request_id": rid}).json()).get("type") == "try_again":
        pass
    assert len(out["sequences"][0]["tokens"]) == 2
    client.close()


def test_the_tinker_sdk_retries_past_the_per_key_limit_and_finishes(server: LiveServer) -> None:
    """Twice the key's limit of samples at once through the real SDK while the engine is held: three
    are admitted and the rest get 429 + Retry-After, which the SDK backs off from and resubmits;
    released, every one returns its tokens."""
    import tinker
    from tinker import types

    from mint_server.api.auth.keys import owner_id

    core = server.app.state.service.core
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    sampler = client.create_sampling_client(base_model=BASE)
    params = types.SamplingParams(max_tokens=3, stop=[])
    server.engine.pause()
    try:
        futures = [sampler.sample(types.ModelInput.from_ints([1, 2, i]), 1, params) for i in range(3, 9)]
        deadline = time.monotonic() + 60  # a bound on a wait for an event, not a timing
        while core.admission.pending_by_owner.get(owner_id(KEY_A), 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core.admission.pending_by_owner[owner_id(KEY_A)] == 3 and not any(f.done() for f in futures)
    finally:
        server.engine.resume()
    assert all(len(f.result(timeout=120).sequences[0].tokens) == 3 for f in futures)
    client.close("success")
