"""Under /anthropic/api, what fails outside the face's routes — an unknown path (404), a method no
route takes (405, with its Allow) and a body over the server's byte limit (413, refused by
BodyLimit before any route runs) — answers in Anthropic's error shape, through a loopback server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine
from tests.tiny import make_tiny_checkpoint

LIMIT = 4096


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model_dir: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", tie=True)
    with LiveServer(tiny_engine(model_dir), tmp_path_factory.mktemp("data") / "data", max_body_bytes=LIMIT) as s:
        yield s


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}, body
    return body["error"]["message"]


@pytest.mark.parametrize("path", ["/anthropic/api/v1/nope", "/anthropic/api", "/anthropic/api/v2/messages"])
def test_unknown_paths_are_anthropic_404s(live: LiveServer, path: str) -> None:
    r = httpx.post(live.url + path, headers={"x-api-key": KEY_A}, json={}, timeout=30)
    anthropic_error(r, 404, "not_found_error")


def test_a_method_no_route_takes_is_an_anthropic_405_with_allow(live: LiveServer) -> None:
    r = httpx.get(f"{live.url}/anthropic/api/v1/messages", headers={"x-api-key": KEY_A}, timeout=30)
    anthropic_error(r, 405, "invalid_request_error")
    assert r.headers["allow"] == "POST"


def test_a_body_over_the_limit_is_an_anthropic_413(live: LiveServer) -> None:
    big = {"model": BASE, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (2 * LIMIT)}]}
    r = httpx.post(f"{live.url}/anthropic/api/v1/messages", headers={"x-api-key": KEY_A}, json=big, timeout=30)
    assert f"{LIMIT}-byte limit" in anthropic_error(r, 413, "request_too_large")
    # the SDK reads it as Anthropic's own 413
    claude = anthropic.Anthropic(base_url=f"{live.url}/anthropic/api", api_key=KEY_A, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as e:
        claude.messages.create(**big)
    assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large", e.value.body


def test_other_paths_keep_their_shapes(live: LiveServer) -> None:
    """The Tinker face's `{"detail"}` and the OpenAI face's `{"error": {...}}` are unchanged."""
    tinker = httpx.post(f"{live.url}/api/v1/nope", json={}, headers={"X-API-Key": KEY_A}, timeout=30)
    assert tinker.status_code == 404 and "detail" in tinker.json()
    big = httpx.post(f"{live.url}/api/v1/asample", content=b"x" * (2 * LIMIT), headers={"X-API-Key": KEY_A}, timeout=30)
    assert big.status_code == 413 and "detail" in big.json()
    oai = httpx.get(f"{live.url}/v1/nope", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert oai.status_code == 404 and oai.json()["error"]["type"] == "not_found_error"
