"""The service's wiring of the policy catalog, beyond the end-to-end lifecycle (tests/lifecycle):
which saves become revisions and under which policy, failure without half state, policy
references in the mindlab extensions, and the `mint serve` key file."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker

from mint_server.api.auth.keys import load_or_create_key_file, owner_id
from tests.service.live import BASE, KEY_A, LiveServer, train


def _api(server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a future-returning request and wait for its result."""
    with httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": KEY_A}, timeout=60) as api:
        r = api.post(path, json=body)
        assert r.status_code == 200, r.text
        request_id = r.json()["request_id"]
        while True:
            out = api.post("retrieve_future", json={"request_id": request_id}).json()
            if out.get("type") != "try_again":
                return out


def test_sampler_saves_publish_to_the_runs_policy(server: LiveServer, client_a: tinker.ServiceClient) -> None:
    catalog = server.service.core.policies.catalog
    owner = owner_id(KEY_A)
    tc = client_a.create_lora_training_client(base_model=BASE, rank=2, seed=3).result()
    tc.save_weights_and_get_sampling_client().result()  # an unnamed snapshot: no revision
    assert catalog.list_policies(owner).items == []

    path = tc.save_weights_for_sampler("s").result().path
    (policy,) = catalog.list_policies(owner).items
    assert policy.name == tc.model_id.replace(":", "-")  # named after the run when the client names none
    (revision,) = catalog.list_revisions(owner, policy.name).items
    assert (revision.number, revision.step, revision.parent, revision.training_run) == (1, 0, None, tc.model_id)
    assert tc.save_state("state").result()  # training checkpoints are not revisions
    assert len(catalog.list_revisions(owner, policy.name).items) == 1

    # Policy references work in the mindlab extensions too: as the reverse-KL reference …
    ref = f"tinker://{policy.name}@1"
    out = _api(server, "mint/forward_backward_reverse_kl", {
        "model_id": tc.model_id, "reference_model_path": ref, "temperature": 1.0, "seq_id": None,
        "type": "mint_forward_backward_reverse_kl",
        "data": [{"student_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                  "reference_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                  "target_tokens": {"data": [2, 3, 4], "shape": [3], "dtype": "int64"},
                  "weights": {"data": [1.0, 1.0, 1.0], "shape": [3], "dtype": "float32"}}],
    })  # fmt: skip
    assert abs(out["metrics"]["loss:sum"]) < 1e-5, out  # the reference is these very weights
    # … and as an interpolation source (the first source must be a run checkpoint: the output goes there).
    out = _api(server, "mint/checkpoints/interpolate", {
        "source_paths": [path, ref], "coefficients": [0.5, 0.5], "output_path": "mix",
        "output_checkpoint_type": "sampler", "type": "mint_interpolate_checkpoints",
    })  # fmt: skip
    assert out["path"] == f"tinker://{tc.model_id}/sampler_weights/mix", out
    r = httpx.post(f"{server.url}/api/v1/mint/checkpoints/interpolate", headers={"X-API-Key": KEY_A}, json={
        "source_paths": [ref], "coefficients": [1.0], "type": "mint_interpolate_checkpoints"})  # fmt: skip
    assert r.status_code == 400 and "first source path" in r.json()["detail"]


def test_bad_policy_name_is_refused_at_create_model(client_a: tinker.ServiceClient) -> None:
    with pytest.raises(tinker.BadRequestError, match=r"user_metadata\['policy'\]"):
        client_a.create_lora_training_client(base_model=BASE, rank=2, user_metadata={"policy": "no spaces"}).result()


def test_failed_publish_fails_the_save_and_leaves_no_checkpoint(
    server: LiveServer, client_a: tinker.ServiceClient
) -> None:
    # The REST face refuses a policy for a base model this server does not serve...
    r = httpx.post(f"{server.url}/api/v1/mint/catalog/policies", headers={"X-API-Key": KEY_A},
                   json={"name": "taken", "base_model": "some/other-model"})  # fmt: skip
    assert r.status_code == 400 and r.json()["field"] == "base_model", r.text
    # ...but a catalog shared with another server may hold one (created there): the revision cannot be added.
    server.service.core.policies.catalog.create_policy(owner_id(KEY_A), "taken", "some/other-model")
    tc = client_a.create_lora_training_client(base_model=BASE, rank=2, user_metadata={"policy": "taken"}).result()
    train(tc, 1)
    with pytest.raises(tinker.RequestFailedError, match="cannot publish to policy 'taken'"):
        tc.save_weights_for_sampler("s").result()
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    run_dir = server.settings.data_dir / "runs" / tc.model_id.replace(":", "_")
    assert not (run_dir / "sampler_weights" / "s").exists()
    # The training client goes on working, and the name is free for a later save.
    train(tc, 1)
    assert tc.save_state("s").result().path.endswith("/weights/s")


def test_key_file_is_created_once(tmp_path: Path) -> None:
    path = tmp_path / "api_key"
    keys: list[str] = []
    threads = [threading.Thread(target=lambda: keys.append(load_or_create_key_file(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1 and keys[0].startswith("tml-") and len(keys[0]) > 40
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api_key"]  # no temp files left behind
    path.write_text("not a key\n")
    with pytest.raises(ValueError, match="must start with 'tml-'") as err:
        load_or_create_key_file(path)
    assert "not a key" not in str(err.value)
