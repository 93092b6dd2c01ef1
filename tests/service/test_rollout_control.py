"""Rollout control for asynchronous RL (api/tinker/rollouts.py): pause a policy or a sampling session,
move the alias meanwhile, resume; abort a target's pending requests at once. Driven as a trainer
does: the tinker SDK samples, the MinT routes pause, resume and abort."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.service.live import BASE, KEY_A, KEY_B, LiveServer

WAIT = 120  # seconds: a failure bound only
PARAMS = types.SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = types.ModelInput.from_ints([5, 17, 33])


def _post(server: LiveServer, route: str, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/mint/sampling/{route}", json=body, headers={"X-API-Key": key},
                      timeout=60)  # fmt: skip


def _pauses(server: LiveServer) -> list[dict[str, Any]]:
    return httpx.get(f"{server.url}/api/v1/mint/sampling/pauses", headers={"X-API-Key": KEY_A}).json()["paused"]


def _until_held(server: LiveServer, count: int) -> None:
    """Wait until the pause holds `count` requests: the clients send theirs on their own threads. The
    deadline is a failure bound only; a pass returns as soon as they are all held."""
    deadline = time.monotonic() + WAIT
    while _pauses(server)[0]["held"] < count:
        assert time.monotonic() < deadline, _pauses(server)


def _publish(client: tinker.ServiceClient) -> str:
    """A policy with one revision; its name."""
    tc = client.create_lora_training_client(base_model=BASE, rank=2, seed=3).result()
    tc.save_weights_for_sampler("s").result()
    return tc.model_id.replace(":", "-")


def test_a_paused_policy_holds_new_samples_until_resumed(server: LiveServer, client_a: tinker.ServiceClient) -> None:
    policy = _publish(client_a)
    on_policy = client_a.create_sampling_client(model_path=f"tinker://{policy}@1").result()
    on_base = client_a.create_sampling_client(base_model=BASE).result()
    r = _post(server, "pause", {"policy": policy, "timeout_s": 600})
    assert r.status_code == 200 and r.json()["paused"] and r.json()["kind"] == "policy", r.text
    assert [(p["kind"], p["name"], p["held"]) for p in _pauses(server)] == [("policy", policy, 0)]
    held = on_policy.sample(PROMPT, 1, PARAMS).future()
    with ThreadPoolExecutor(1) as pool:  # the OpenAI face's requests on the policy are held the same way
        completion = pool.submit(httpx.post, f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY_A}"},
                                 json={"model": policy, "prompt": [5, 17, 33], "max_tokens": 4, "temperature": 0},
                                 timeout=120)  # fmt: skip
        _until_held(server, 2)  # both faces' requests were accepted, and wait before the engine
        assert on_base.sample(PROMPT, 1, PARAMS).result(timeout=120).sequences  # the engine runs others meanwhile
        assert not held.done() and not completion.done()
        assert _post(server, "resume", {"policy": policy}).json()["paused"] is False
        assert len(held.result(timeout=120).sequences[0].tokens) == PARAMS.max_tokens
        assert completion.result().status_code == 200, completion.result().text
    assert _pauses(server) == []


def test_abort_cancels_a_sessions_held_requests_and_a_pause_ends_at_its_timeout(
        server: LiveServer, client_a: tinker.ServiceClient) -> None:  # fmt: skip
    sampler = client_a.create_sampling_client(base_model=BASE).result()
    session = sampler._sampling_session_id  # the SDK keeps it private; the server knows it as this
    assert session in server.service.core.stores.samplers
    assert _post(server, "pause", {"sampling_session_id": session}).status_code == 200
    held = [sampler.sample(PROMPT, 1, PARAMS).future() for _ in range(3)]
    pending = server.service.core.stores.samplers[session].pending
    _until_held(server, 3)
    out = _post(server, "abort", {"sampling_session_id": session}).json()
    assert out == {"kind": "session", "name": session, "aborted": 3}
    for f in held:
        with pytest.raises(Exception):  # noqa: B017 - the SDK surfaces a cancelled request as its own error type
            f.result(timeout=120)
    assert not pending
    # A pause nobody resumes ends by itself: the held request runs once its timeout has passed.
    assert _post(server, "pause", {"sampling_session_id": session, "timeout_s": 0.2}).status_code == 200
    assert sampler.sample(PROMPT, 1, PARAMS).result(timeout=120).sequences


def test_rollout_control_refusals(server: LiveServer, client_a: tinker.ServiceClient) -> None:
    policy = _publish(client_a)
    both = _post(server, "pause", {"policy": policy, "sampling_session_id": "x"})
    assert both.status_code == 400 and "exactly one of policy and sampling_session_id" in both.text
    assert _post(server, "pause", {}).status_code == 400
    too_long = _post(server, "pause", {"policy": policy, "timeout_s": 10**6})
    assert too_long.status_code == 400 and "timeout_s" in too_long.text
    partial = _post(server, "pause", {"policy": policy, "in_flight": "continue_on_new"})
    assert partial.status_code == 400 and "in_flight" in partial.text and "not supported" in partial.text
    # Another key's policy or session looks absent, and nothing is paused for it.
    assert _post(server, "pause", {"policy": policy}, key=KEY_B).status_code == 404
    assert _post(server, "abort", {"sampling_session_id": "nope:sample:0"}).status_code == 404
    assert _post(server, "pause", {"policy": "no-such-policy"}).status_code == 404
