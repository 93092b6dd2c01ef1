"""Scoped API keys through a real server and the real SDKs: a `serve` key samples and uses the
OpenAI face but cannot train or read; only `admin` manages keys; revocation holds on the next request
(JWTs and download links included); keys made by `mint key` on the data dir work on a running server;
tenants never see each other's keys."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import openai
import pytest
import tinker
from tinker import types

from mint_server.api import KEYS_PREFIX
from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, train

PROMPT = types.ModelInput.from_ints([5, 6, 7])
GREEDY = types.SamplingParams(max_tokens=3, temperature=0.0)


def make_key(server: LiveServer, admin: str, name: str, scopes: list[str]) -> str:
    r = httpx.post(server.url + KEYS_PREFIX, headers={"X-API-Key": admin}, json={"name": name, "scopes": scopes})
    assert r.status_code == 201, r.text
    return r.json()["key"]


def key_ids(server: LiveServer, admin: str, **params: object) -> list[str]:
    r = httpx.get(server.url + KEYS_PREFIX, headers={"X-API-Key": admin}, params=params)
    assert r.status_code == 200, r.text
    return [k["key_id"] for k in r.json()["keys"]]


def runs(server: LiveServer, key: str) -> list[str]:
    r = httpx.get(server.url + "/api/v1/training_runs", headers={"X-API-Key": key})
    assert r.status_code == 200, r.text
    return [run["training_run_id"] for run in r.json()["training_runs"]]


def test_serve_key_samples_but_cannot_train_or_read(server: LiveServer, client_a: tinker.ServiceClient) -> None:
    tc = client_a.create_lora_training_client(base_model=BASE, rank=4).result()
    train(tc, 1)
    path = tc.save_weights_for_sampler("s0").result().path
    expected = client_a.create_sampling_client(model_path=path).result().sample(PROMPT, 1, GREEDY).result()
    serve_key = make_key(server, KEY_A, "app", ["serve"])
    before = runs(server, KEY_A)

    app = tinker.ServiceClient(base_url=server.url, api_key=serve_key)
    got = app.create_sampling_client(model_path=path).result().sample(PROMPT, 1, GREEDY).result()
    assert got.sequences[0].tokens == expected.sequences[0].tokens  # the owner's checkpoint, sampled
    with pytest.raises(tinker.PermissionDeniedError, match="'train' scope"):
        app.create_lora_training_client(base_model=BASE, rank=4).result()
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=serve_key, max_retries=0)
    done = oai.completions.create(model=path, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert done.choices[0].text is not None
    for method, route in [("GET", "/api/v1/training_runs"), ("GET", "/api/v1/checkpoints"),
                          ("GET", "/api/v1/mint/catalog/policies"), ("GET", KEYS_PREFIX),
                          ("DELETE", f"/api/v1/training_runs/{tc.model_id}/checkpoints/sampler_weights/s0")]:
        r = httpx.request(method, server.url + route, headers={"X-API-Key": serve_key})
        assert r.status_code == 403 and "scope" in r.json()["detail"], (route, r.text)
    app.close("success")
    assert runs(server, KEY_A) == before  # nothing deleted, nothing made


def test_only_admin_manages_keys_and_tenants_stay_apart(server: LiveServer) -> None:
    train_key = make_key(server, KEY_A, "trainer", ["train"])
    assert runs(server, train_key) == runs(server, KEY_A)  # acts as its owner
    r = httpx.post(server.url + KEYS_PREFIX, headers={"X-API-Key": train_key}, json={"name": "x", "scopes": ["admin"]})
    assert r.status_code == 403 and "'admin' scope" in r.json()["detail"]
    mine = key_ids(server, KEY_A)
    assert len(mine) == 1 and key_ids(server, KEY_B) == []  # B's admin sees none of A's keys
    r = httpx.delete(f"{server.url}{KEYS_PREFIX}/{mine[0]}", headers={"X-API-Key": KEY_B})
    assert r.status_code == 404
    assert runs(server, train_key) == runs(server, KEY_A)  # B's attempt changed nothing


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "x", "scopes": ["root"]}, "scopes"), ({"name": "x", "scopes": []}, "scopes"),
    ({"name": "x", "scopes": "serve"}, "scopes"), ({"name": "", "scopes": ["serve"]}, "name"),
    ({"name": "x" * 129, "scopes": ["serve"]}, "name"), ({"name": "x", "scopes": ["serve"], "owner": "b"}, "owner"),
    ({"scopes": ["serve"]}, "name"),
])  # fmt: skip
def test_bad_key_requests_name_the_field_and_make_nothing(server: LiveServer, body: dict, field: str) -> None:
    r = httpx.post(server.url + KEYS_PREFIX, headers={"X-API-Key": KEY_A}, json=body)
    assert r.status_code == 400 and field in r.json()["detail"], r.text
    assert key_ids(server, KEY_A, include_revoked=True) == []


def test_revocation_holds_on_the_next_request(server: LiveServer, client_a: tinker.ServiceClient) -> None:
    key = make_key(server, KEY_A, "doomed", ["train"])
    headers = {"X-API-Key": key}
    jwt = httpx.post(server.url + "/api/v1/auth/token", headers=headers).json()["jwt"]
    tc = client_a.create_lora_training_client(base_model=BASE, rank=4).result()
    train(tc, 1)
    tc.save_state("w0").result()
    archive = httpx.get(f"{server.url}/api/v1/training_runs/{tc.model_id}/checkpoints/weights/w0/archive",
                        headers=headers)
    assert archive.status_code == 302
    for credential in (key, jwt):
        assert httpx.get(server.url + "/api/v1/training_runs", headers={"X-API-Key": credential}).status_code == 200

    key_id = key_ids(server, KEY_A)[0]
    assert httpx.delete(f"{server.url}{KEYS_PREFIX}/{key_id}", headers={"X-API-Key": KEY_A}).status_code == 204
    for credential in (key, jwt):
        r = httpx.get(server.url + "/api/v1/training_runs", headers={"X-API-Key": credential})
        assert r.status_code == 401 and "revoked" in r.json()["detail"], r.text
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(archive.headers["location"]).status_code == 404  # its download link died with it
    assert key_ids(server, KEY_A) == [] and key_ids(server, KEY_A, include_revoked=True) == [key_id]


def test_keys_made_on_the_data_dir_work_on_a_running_server(server: LiveServer) -> None:
    """`mint key` in another process, on the server's data dir, while it serves."""
    from mint_server.api.auth.keys import owner_id

    data = str(server.settings.data_dir)
    mint = [shutil.which("mint", path=os.path.dirname(sys.executable)) or "mint"]
    made = subprocess.run([*mint, "key", "create", "cli-app", "--scope", "serve", "--data-dir", data,
                           "--owner", owner_id(KEY_A), "--json"], capture_output=True, text=True, check=True)
    record = json.loads(made.stdout)
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=record["key"], max_retries=0)
    assert [m.id for m in oai.models.list()][0] == BASE
    subprocess.run([*mint, "key", "revoke", record["key_id"], "--data-dir", data, "--owner", owner_id(KEY_A)],
                   capture_output=True, check=True)
    with pytest.raises(openai.AuthenticationError, match="revoked"):
        oai.models.list()


PUBLIC = {("get", "/api/v1/healthz"), ("get", "/metrics"), ("get", "/api/v1/external_weights/{token}/{file}"),
          ("get", "/api/v1/archives/{token}")}


def test_every_route_names_its_scope_in_the_served_spec(server: LiveServer) -> None:
    """A new route cannot ship without a scope: only the four public routes take no key."""
    spec = httpx.get(server.url + "/openapi.json").json()
    ops = {(m, p): op for p, methods in spec["paths"].items() for m, op in methods.items()}
    assert {k for k, op in ops.items() if not op.get("security")} == PUBLIC
    for (method, path), op in ops.items():
        if (method, path) in PUBLIC:
            assert {"401", "403"}.isdisjoint(op["responses"]), path
            continue
        [requirement] = op["security"]
        [scopes] = requirement.values()
        assert len(scopes) == 1 and scopes[0] in ("serve", "train", "admin"), (path, scopes)
        assert {"401", "403"} <= set(op["responses"]), path
