"""Futures, ordering and the raw wire: what the SDKs rely on but rarely show."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.service.live import BASE, KEY_A, KEY_B, KEY_SK, LiveServer, tiny_engine

SDK = {"sdk_version": "test"}


class Api:
    def __init__(self, server: LiveServer, key: str = KEY_A) -> None:
        self.http = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": key}, timeout=30)

    def post(self, path: str, body: dict | None = None, **kw: object) -> httpx.Response:
        return self.http.post(path, json=body, **kw) if body is not None else self.http.post(path, **kw)  # type: ignore[arg-type]

    def ok(self, path: str, body: dict) -> dict:
        r = self.post(path, body)
        assert r.status_code == 200, r.text
        return r.json()

    def result(self, request_id: str, accept: str = "application/json", timeout: float = 30) -> httpx.Response:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.http.post("retrieve_future", json={"request_id": request_id}, headers={"Accept": accept})
            if not (r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again"):
                return r
        raise TimeoutError(request_id)

    def model(self) -> str:
        session = self.ok("create_session", {"tags": [], "user_metadata": None, **SDK})["session_id"]
        fut = self.ok("create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                       "lora_config": {"rank": 2}})
        return self.result(fut["request_id"]).json()["model_id"]


def fb_datum() -> types.Datum:
    """What fb_json sends, as the engine sees it."""
    return types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})


def fb_json(model_id: str, seq_id: int) -> dict:
    return {"model_id": model_id, "seq_id": seq_id, "forward_backward_input": {"loss_fn": "cross_entropy", "data": [
        {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
         "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [2]}}}]}}


def test_seq_order_try_again_and_dedupe(tiny_dir: Path, tmp_path: Path) -> None:
    with LiveServer(tiny_engine(tiny_dir), tmp_path / "d", long_poll_s=0.5) as server:
        api = Api(server)
        model_id = api.model()
        # seq 2 arrives first: it genuinely waits for seq 1, and retrieve_future long-polls on it.
        opt = api.ok("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}})
        t0 = time.monotonic()
        r = api.post("retrieve_future", {"request_id": opt["request_id"]})
        assert r.json() == {"type": "try_again", "request_id": opt["request_id"], "queue_state": "active"}
        assert time.monotonic() - t0 >= 0.45  # held for the long-poll, not answered at once
        fb = api.ok("forward_backward", fb_json(model_id, 1))
        assert api.ok("forward_backward", fb_json(model_id, 1)) == fb  # a resubmission is the same request
        step = api.result(opt["request_id"])
        assert step.status_code == 200
        # Seq order, not arrival order: the step found seq 1's gradient (none would give norm 0).
        assert step.json()["metrics"]["grad_norm:mean"] > 0
        out = api.result(fb["request_id"]).json()
        logprobs = out["loss_fn_outputs"][0]["logprobs"]
        assert logprobs["shape"] == [2] and all(x <= 0 for x in logprobs["data"])
        # A new adapter starts as the identity (LoRA B = 0): its loss is the bare base model's.
        base = server.engine.submit(server.engine.prepare_train([fb_datum()], "cross_entropy", None, backward=False)).result()
        assert out["metrics"]["loss:sum"] == pytest.approx(base.metrics["loss:sum"], rel=1e-5)
        assert out["metrics"]["loss:sum"] == pytest.approx(-sum(logprobs["data"]), rel=1e-5)
        # Another key cannot read the result; a seq_id seen before answers with its first request.
        assert Api(server, KEY_B).post("retrieve_future", {"request_id": fb["request_id"]}).status_code == 404
        assert api.ok("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {}}) == fb


def test_protobuf_zstd_forward_backward(server: LiveServer) -> None:
    api = Api(server)
    model_id = api.model()
    data = [types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 0.5, 0.0]})]
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id=model_id,
        seq_id=1,
    )
    body = zstandard.ZstdCompressor().compress(forward_backward_request_to_proto(req).SerializeToString())
    r = api.post("forward_backward", content=body,
                 headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
    assert r.status_code == 200, r.text
    res = api.result(r.json()["request_id"], accept="application/x-protobuf")
    assert res.headers["content-type"] == "application/x-protobuf"
    out = deserialize_forward_backward_output(res.content)
    loss, logprobs = (out.loss_fn_outputs[0][k].to_numpy() for k in ("elementwise_loss", "logprobs"))
    assert loss.shape == logprobs.shape == (3,)
    assert np.isfinite(logprobs).all() and (logprobs <= 0).all()
    # The weights travelled through proto + zstd intact: loss = -weight · logprob per token.
    np.testing.assert_allclose(loss, -np.array([1.0, 0.5, 0.0]) * logprobs, rtol=1e-6)
    assert loss[2] == 0 and out.metrics["loss:sum"] == pytest.approx(float(loss.sum()), rel=1e-5)

    bad = api.post("forward_backward", content=b"\x00garbage", headers={"Content-Type": "application/x-protobuf",
                                                                       "Content-Encoding": "zstd"})
    assert bad.status_code == 400 and "zstd" in bad.json()["detail"]
    bomb = zstandard.ZstdCompressor().compress(pb.ForwardBackwardRequest(model_id="x" * 10).SerializeToString()
                                               + b"\x00" * (server.settings.max_body_bytes + 1))
    r = api.post("forward_backward", content=bomb, headers={"Content-Type": "application/x-protobuf",
                                                            "Content-Encoding": "zstd"})
    assert r.status_code == 413


def test_sk_keys_use_jwt_exchange(server: LiveServer) -> None:
    api = Api(server, KEY_SK)
    assert api.ok("client/config", SDK)["pjwt_auth_enabled"] is True
    assert Api(server, KEY_A).ok("client/config", SDK)["pjwt_auth_enabled"] is False
    jwt = api.ok("auth/token", {})["jwt"]
    with_jwt = Api(server, jwt)
    session = with_jwt.ok("create_session", {"tags": [], "user_metadata": None, **SDK})["session_id"]
    # The JWT stands for the sk- key: both see the same session, other keys do not.
    assert api.http.get(f"sessions/{session}").status_code == 200
    assert Api(server, KEY_A).http.get(f"sessions/{session}").status_code == 404
    forged = jwt[:-4] + ("AAAA" if not jwt.endswith("AAAA") else "BBBB")
    assert Api(server, forged).http.get("sessions").status_code == 401


def test_metrics_and_session_expiry(tiny_dir: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_dir)
    with LiveServer(engine, tmp_path / "d", session_ttl_s=0.5, upkeep_interval_s=0.1) as server:
        api = Api(server)
        model_id = api.model()
        assert len(engine.residency) == 1
        text = httpx.get(f"{server.url}/metrics").text
        assert 'mint_adapters_resident{tier="device"} 1.0' in text
        assert "mint_engine_step_seconds_count" in text and "mint_requests_waiting_for_adapter 0.0" in text
        assert "mint_operation_seconds_count" in text
        deadline = time.monotonic() + 5
        while len(engine.residency) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(engine.residency) == 0  # the expired session's adapter was released
        assert api.post("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {}}).status_code == 404
        assert api.post("session_heartbeat", {"session_id": model_id.split(":")[0]}).status_code == 410


def test_unload_and_extension_inputs(server: LiveServer) -> None:
    api = Api(server)
    model_id = api.model()
    tokens = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    rkl = {"model_id": model_id, "reference_model_path": BASE, "data": [{
        "student_input": tokens, "reference_input": tokens,
        "target_tokens": {"data": [2, 3, 4], "dtype": "int64"}, "weights": {"data": [1.0, 1.0, 0.0]}}]}
    out = api.result(api.ok("mint/forward_backward_reverse_kl", rkl)["request_id"]).json()
    kl = out["outputs"][0]["loss"]["data"]
    # A fresh adapter is the identity (LoRA B = 0), so the student is the base model itself: the
    # KL to the base is 0 everywhere (and weighted to exactly 0 where the weight is 0).
    assert len(kl) == 3 and kl[2] == 0 and kl == pytest.approx([0.0] * 3, abs=1e-5)
    assert out["metrics"]["loss:sum"] == pytest.approx(0.0, abs=1e-5)
    # Against a different reference input the student does differ: a positive KL.
    shifted = {**rkl, "data": [{**rkl["data"][0], "reference_input": {
        "chunks": [{"type": "encoded_text", "tokens": [9, 1, 2, 3]}]}}]}
    out = api.result(api.ok("mint/forward_backward_reverse_kl", shifted)["request_id"]).json()
    assert out["metrics"]["loss:sum"] > 1e-4 and min(out["outputs"][0]["loss"]["data"]) >= 0

    r = api.post("mint/forward_backward_reverse_kl", {**rkl, "reference_model_path": "other/model"})
    assert r.status_code == 400 and "reference_model_path" in r.json()["detail"]
    bad = {**rkl, "data": [{**rkl["data"][0], "weights": {"data": [1.0]}}]}
    r = api.post("mint/forward_backward_reverse_kl", bad)
    assert r.status_code == 400 and "weights: shape [1] does not match the student_input length 3" in r.json()["detail"]
    r = api.post("mint/checkpoints/interpolate", {"source_paths": ["tinker://x"], "coefficients": [1.0]})
    assert r.status_code == 400 and "invalid checkpoint path" in r.json()["detail"]
    r = api.post("mint/checkpoints/interpolate", {"source_paths": [], "coefficients": []})
    assert r.status_code == 400

    done = api.result(api.ok("unload_model", {"model_id": model_id})["request_id"]).json()
    assert done["model_id"] == model_id and len(server.engine.residency) == 0
    assert api.post("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {}}).status_code == 404
