"""The one rule for which header carries the key (docs/security.md, "Which header"): every face takes
`X-API-Key: KEY`; the OpenAI and Anthropic faces also take `Authorization: Bearer KEY`, their SDKs'
header, and when both are sent the Bearer one is the key. Header names are case-insensitive
(Anthropic's SDK writes `x-api-key`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine

WRONG = "tml-not-a-key-of-this-server-0000"
COUNT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}]}
# One cheap authenticated request per face: (method, path, body)
FACES = {
    "tinker": ("GET", "/api/v1/training_runs", None),
    "catalog": ("GET", "/api/v1/mint/catalog/policies", None),
    "openai": ("GET", "/v1/models", None),
    "openai (oai prefix)": ("GET", "/oai/api/v1/models", None),
    "anthropic": ("POST", "/anthropic/api/v1/messages/count_tokens", COUNT),
}
TAKES_BEARER = {"openai", "openai (oai prefix)", "anthropic"}


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(tiny_engine(tiny_dir), tmp_path_factory.mktemp("auth-headers") / "data") as live:
        yield live


@pytest.mark.parametrize("face", list(FACES))
def test_which_header_each_face_takes(server: LiveServer, face: str) -> None:
    method, path, body = FACES[face]

    def status(headers: dict[str, str]) -> int:
        return httpx.request(method, f"{server.url}{path}", headers=headers, json=body, timeout=60).status_code

    assert status({}) == 401
    assert status({"X-API-Key": KEY_A}) == 200
    assert status({"x-api-key": KEY_A}) == 200
    assert status({"X-API-Key": WRONG}) == 401
    if face in TAKES_BEARER:
        assert status({"Authorization": f"Bearer {KEY_A}"}) == 200
        assert status({"Authorization": f"Bearer {WRONG}", "X-API-Key": KEY_A}) == 401  # the Bearer one is the key
        assert status({"Authorization": f"Bearer {KEY_A}", "X-API-Key": WRONG}) == 200
    else:
        assert status({"Authorization": f"Bearer {KEY_A}"}) == 401
        assert status({"Authorization": f"Bearer {WRONG}", "X-API-Key": KEY_A}) == 200
