"""Admission as one call (`Admission.enter`): the accepting check, the per-key pending limit, the
bound on samples in flight and the counting in one step, its release guaranteed. On the object
first, then through a live server on every face: the Tinker REST ops, the OpenAI face, the
Anthropic face."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mint_server.api.admission import Admission, Busy, ShuttingDown
from mint_server.api.auth.keys import owner_id
from mint_server.api.settings import Settings
from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, tiny_engine

PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}


def admission(tmp_path: Path, per_key: int = 2, samples: int = 3) -> Admission:
    return Admission(Settings(data_dir=tmp_path, max_pending_per_key=per_key, max_inflight_samples=samples))


def test_enter_counts_and_leaving_the_block_releases(tmp_path: Path) -> None:
    a = admission(tmp_path)
    with a.enter("k", samples=2):
        assert a.pending_by_owner == {"k": 1} and a.samples_inflight == 2
    assert a.pending_by_owner == {} and a.samples_inflight == 0


def test_a_refusal_inside_the_block_releases_the_ticket(tmp_path: Path) -> None:
    a = admission(tmp_path)
    with pytest.raises(ValueError), a.enter("k", samples=1):
        raise ValueError("bad input, found after admission")
    assert a.pending_by_owner == {} and a.samples_inflight == 0


def test_limits_refuse_with_429_and_count_nothing(tmp_path: Path) -> None:
    a = admission(tmp_path)
    first, second = a.enter("k"), a.enter("k", samples=1)
    with pytest.raises(Busy, match="per-key limit") as per_key:
        a.enter("k")
    assert per_key.value.retry_after >= 1
    assert a.queue_state("k") == "paused_rate_limit"
    with pytest.raises(Busy, match="in flight"):  # another key, but 1 + 3 samples pass the server's bound of 3
        a.enter("other", samples=3)
    assert a.pending_by_owner == {"k": 2} and a.samples_inflight == 1  # the refusals counted nothing
    first.release()
    second.release()
    second.release()  # once only
    assert a.pending_by_owner == {} and a.samples_inflight == 0
    with a.enter("other", samples=3):
        assert a.queue_state("other") == "paused_capacity"


def test_shutting_down_refuses_with_503(tmp_path: Path) -> None:
    a = admission(tmp_path)
    a.accepting = False
    with pytest.raises(ShuttingDown):
        a.enter("k")
    assert a.pending_by_owner == {}


def test_a_held_ticket_lasts_until_its_work_ends_however_it_ends(tmp_path: Path) -> None:
    a = admission(tmp_path, per_key=10, samples=10)

    async def burst() -> None:
        loop = asyncio.get_running_loop()
        works = [loop.create_future() for _ in range(6)]
        for work in works:
            with a.enter("k", samples=1) as ticket:
                ticket.hold(work)
        assert a.pending_by_owner == {"k": 6} and a.samples_inflight == 6  # leaving the blocks kept them
        works[0].set_result(1)
        works[1].set_exception(RuntimeError("failed"))
        works[2].cancel()
        await asyncio.sleep(0)  # the done callbacks run on the next loop pass
        assert a.pending_by_owner == {"k": 3} and a.samples_inflight == 3
        for work in works[3:]:
            work.set_result(1)
        await asyncio.sleep(0)
        works[1].exception()  # retrieved: no "never retrieved" warning

    asyncio.run(burst())
    assert a.pending_by_owner == {} and a.samples_inflight == 0


# --- through a live server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data = tmp_path_factory.mktemp("admission") / "data"
    with LiveServer(tiny_engine(tiny_dir), data, max_pending_per_key=2, long_poll_s=0.1) as server:
        yield server


def _tinker(server: LiveServer, key: str = KEY_A) -> tuple[httpx.Client, str]:
    client = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": key}, timeout=30)
    sid = client.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"}).json()
    r = client.post("create_sampling_session", json={"session_id": sid["session_id"], "sampling_session_seq_id": 0,
                                                     "base_model": BASE})  # fmt: skip
    return client, r.json()["sampling_session_id"]


def _sample(client: httpx.Client, sampler_id: str, seq: int, max_tokens: int = 2) -> httpx.Response:
    return client.post("asample", json={"sampling_session_id": sampler_id, "seq_id": seq, "num_samples": 1,
                                        "prompt": PROMPT, "sampling_params": {"max_tokens": max_tokens}})


def _result(client: httpx.Client, request_id: str) -> dict[str, Any]:
    while (out := client.post("retrieve_future", json={"request_id": request_id}).json()).get("type") == "try_again":
        pass
    return out


def _completion(server: LiveServer, key: str = KEY_A, **extra: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": BASE, "prompt": [1, 2, 3], "max_tokens": 2, **extra})


def _message(server: LiveServer) -> httpx.Response:
    return httpx.post(f"{server.url}/anthropic/api/v1/messages", headers={"X-API-Key": KEY_A}, timeout=60,
                      json={"model": BASE, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


def _settled(server: LiveServer) -> bool:
    """Every ticket released: no key has pending requests, no samples are in flight. Waited for with
    a deadline (a bound on an event, not a timing): a ticket leaves in its work's done callback."""
    a = server.service.core.admission
    deadline = time.monotonic() + 30
    while (a.pending_by_owner or a.samples_inflight) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not a.pending_by_owner and a.samples_inflight == 0


def test_every_face_is_refused_at_the_key_limit_and_the_counts_return_to_zero(live: LiveServer) -> None:
    """Two held Tinker samples fill key A's limit: A's next sample, completion and message get 429 with
    Retry-After; key B is still served; released, every count returns to zero."""
    a, sampler_a = _tinker(live)
    b, sampler_b = _tinker(live, KEY_B)
    live.engine.pause()
    try:
        held = [_sample(a, sampler_a, seq).json()["request_id"] for seq in (1, 2)]
        assert live.service.core.admission.pending_by_owner == {owner_id(KEY_A): 2}
        for refused in (_sample(a, sampler_a, 3), _completion(live), _message(live)):
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
        other = _sample(b, sampler_b, 1)
        assert other.status_code == 200
    finally:
        live.engine.resume()
    assert all(_result(a, rid)["sequences"] for rid in held)
    assert _result(b, other.json()["request_id"])["sequences"]
    assert _settled(live)
    assert _completion(live).status_code == 200 and _message(live).status_code == 200  # admitted again
    assert _settled(live)
    a.close()
    b.close()


def test_a_refused_request_and_a_stream_left_early_release_their_tickets(live: LiveServer) -> None:
    client, sampler = _tinker(live)
    bad = _sample(client, sampler, 1, max_tokens=10_000)  # past the context: refused after admission
    assert bad.status_code == 400, bad.text
    assert _completion(live, max_tokens=10_000).status_code == 400
    live.engine.pause()
    try:
        with httpx.stream("POST", f"{live.url}/v1/completions", headers={"Authorization": f"Bearer {KEY_A}"},
                          json={"model": BASE, "prompt": [1, 2, 3], "max_tokens": 4, "stream": True},
                          timeout=60) as stream:  # fmt: skip
            assert stream.status_code == 200  # admitted; the client leaves before any token
    finally:
        live.engine.resume()
    assert _settled(live)
    client.close()


def test_shutting_down_answers_503_on_every_face(live: LiveServer) -> None:
    client, sampler = _tinker(live)
    admission = live.service.core.admission
    admission.accepting = False
    try:
        for refused in (_sample(client, sampler, 1), _completion(live), _message(live)):
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
    finally:
        admission.accepting = True
    assert _settled(live)
    assert _sample(client, sampler, 1).status_code == 200
    client.close()
