"""Auth, ownership, and bad input: each refused with a 4xx naming the problem, nothing else changes."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, datum, tiny_engine


def _api(server: LiveServer, method: str, path: str, key: str | None = KEY_A, **kw: object) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.request(method, f"{server.url}/api/v1/{path}", headers=headers, timeout=30, **kw)  # type: ignore[arg-type]


def test_auth_required(server: LiveServer) -> None:
    assert _api(server, "GET", "get_server_capabilities", key=None).status_code == 401
    r = _api(server, "GET", "get_server_capabilities", key="tml-not-a-known-key")
    assert r.status_code == 401 and "unknown API key" in r.json()["detail"]
    assert _api(server, "GET", "training_runs", key="eyJhbGciOi.bad.token").status_code == 401
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=server.url, api_key="tml-wrong-key-xyz").list_training_runs().result()


def test_other_key_sees_nothing(server: LiveServer) -> None:
    a = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = a.create_lora_training_client(base_model=BASE, rank=4).result()
    state = tc.save_state("mine").result().path
    sampler_path = tc.save_weights_for_sampler("mine-s").result().path
    b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    rest_b = tinker.RestClient(base_url=server.url, api_key=KEY_B)

    assert rest_b.list_training_runs().result().training_runs == []
    assert rest_b.list_user_checkpoints().result().checkpoints == []
    with pytest.raises(tinker.NotFoundError):
        rest_b.list_checkpoints(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        b.create_sampling_client(model_path=sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        b.create_training_client_from_state(state).result()
    r = _api(server, "POST", "forward_backward", key=KEY_B, json={
        "forward_backward_input": {"data": [], "loss_fn": "cross_entropy"}, "model_id": tc.model_id, "seq_id": 99})
    assert r.status_code == 404
    # A's own things are all still there.
    rest_a = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    assert len(rest_a.list_checkpoints(tc.model_id).result().checkpoints) == 2

    # Published: B may sample and load it, but still not delete it.
    rest_a.publish_checkpoint_from_tinker_path(sampler_path).result()
    sc = b.create_sampling_client(model_path=sampler_path).result()
    assert sc.sample(types.ModelInput.from_ints([1]), 1, types.SamplingParams(max_tokens=1)).result().sequences
    with pytest.raises(tinker.NotFoundError):
        rest_b.delete_checkpoint_from_tinker_path(sampler_path).result()
    a.close("success")
    b.close("success")


def _bad(
    tc: tinker.TrainingClient, data: list[types.Datum], loss_fn: str = "cross_entropy", config: dict | None = None
) -> str:
    with pytest.raises(tinker.BadRequestError) as err:
        tc.forward_backward(data, loss_fn, config).result()  # type: ignore[arg-type]
    return str(err.value)


def test_bad_training_input(client_a: tinker.ServiceClient, server: LiveServer) -> None:
    tc = client_a.create_lora_training_client(base_model=BASE, rank=4).result()
    before = tc.forward([datum([1, 2, 3])], "cross_entropy").result().metrics["loss:sum"]
    engine_requests = server.engine.stats["fused_requests"]

    mismatch = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [1, 2]})
    assert "target_tokens: length 2 does not match the model_input length 3" in _bad(tc, [mismatch])
    vocab = server.engine.vocab_size
    assert f"token id {vocab} is outside the vocabulary [0, {vocab})" in _bad(tc, [datum([1, 2, vocab])])
    rl = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [-1.0, -1.0], "advantages": [math.nan, 1.0]},
    )
    assert "loss_fn_inputs.advantages.data': contains NaN" in _bad(tc, [rl], "importance_sampling")
    assert "unknown loss function 'nope'" in _bad(tc, [datum([1, 2])], "nope")
    targets_only = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    assert "logprobs is required for loss 'ppo'" in _bad(tc, [targets_only], "ppo")
    assert "loss_fn_config: unknown key 'beta'" in _bad(tc, [datum([1, 2])], "cross_entropy", {"beta": 1.0})

    # Still serving, the client's later requests are not stuck behind the refused ones, none of
    # the refused ones reached the engine, and the model is exactly as before.
    # (A timeout: were a refused request's seq_id not released, this would wait forever.)
    assert tc.forward([datum([1, 2, 3])], "cross_entropy").result(timeout=60).metrics["loss:sum"] == before
    assert server.engine.stats["fused_requests"] == engine_requests + 1  # only that forward

    r = _api(server, "POST", "optim_step", json={"adam_params": {"learning_rate": 0.1}, "model_id": "f" * 32 + ":train:7", "seq_id": 1})
    assert r.status_code == 404 and "model_id" in r.json()["detail"]
    r = _api(server, "POST", "optim_step", json={"model_id": tc.model_id, "seq_id": 50})
    assert r.status_code == 400 and r.json()["detail"] == "missing field 'optim_params'"
    r = _api(server, "POST", "save_weights", json={"model_id": tc.model_id, "path": "../escape", "seq_id": 51})
    assert r.status_code == 400 and "invalid checkpoint name '../escape'" in r.json()["detail"]
    r = _api(server, "POST", "create_session", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]


@pytest.mark.parametrize(
    "path",
    [
        "tinker://../../etc/passwd",
        "tinker://" + "a" * 32 + ":train:0/weights/../x",
        "tinker://" + "a" * 32 + ":train:0/weights/x/y",
        "tinker://" + "a" * 32 + ":train:0/other/x",
        "file:///etc/passwd",
        "mint://" + "a" * 32 + ":train:0/weights/",
    ],
)
def test_malformed_paths(server: LiveServer, path: str) -> None:
    r = _api(server, "POST", "weights_info", json={"tinker_path": path})
    assert r.status_code == 400 and "invalid" in r.json()["detail"]


def test_unknown_paths_and_routes(server: LiveServer) -> None:
    r = _api(server, "POST", "weights_info", json={"tinker_path": "mint://" + "a" * 32 + ":train:0/weights/x"})
    assert r.status_code == 404
    assert _api(server, "DELETE", "training_runs/x/checkpoints/weights/y").status_code == 400
    assert _api(server, "GET", "training_runs/" + "a" * 32 + ":train:0/checkpoints/weights/%2E%2E/archive").status_code in (400, 404)


def test_oversize_body(tiny_dir: Path, tmp_path: Path) -> None:
    with LiveServer(tiny_engine(tiny_dir), tmp_path / "d", max_body_bytes=10_000) as server:
        r = _api(server, "POST", "telemetry", content=b"x" * 20_000)
        assert r.status_code == 413 and "limit" in r.json()["detail"]

        def chunks():
            for _ in range(20):
                yield b"y" * 1000

        r = _api(server, "POST", "create_session", content=chunks())  # chunked: no Content-Length
        assert r.status_code == 413
        assert _api(server, "GET", "healthz").status_code == 200
