"""Exact values or a clear refusal, and HTTP details right (issue 52, items 4 and 5), against a live
server: a JSON schema no text can satisfy is a 400 at admission on both faces (not a 200 with empty
text), and every 405 carries an `Allow` naming every method the path serves, on the Tinker routes
and the OpenAI face alike."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from mint_server.api.tinker.mint_types import EXTENSIONS_HEADER
from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine

CYCLES = {
    "self-ref": {"$ref": "#"},
    "defs-cycle": {"$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"},
    # text can start ("{"), but every value must hold itself: refused before sampling, not cut at max_tokens
    "requires-itself": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "A-requires-B-requires-A": {"$defs": {
        "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
        "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}}, "$ref": "#/$defs/A"},
}


@pytest.fixture(scope="module")
def live(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(tiny_engine(tiny_dir), tmp_path_factory.mktemp("refusals") / "data") as server:
        yield server


@pytest.mark.parametrize("schema", list(CYCLES.values()), ids=list(CYCLES))
@pytest.mark.parametrize("prefix", ["/v1", "/oai/api/v1"])
def test_unsatisfiable_schema_is_a_400_on_the_openai_face(live: LiveServer, schema: dict, prefix: str) -> None:
    body = {"model": BASE, "prompt": "x", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}}}
    r = httpx.post(f"{live.url}{prefix}/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "no text satisfies" in error["message"], error


@pytest.mark.parametrize("schema", list(CYCLES.values()), ids=list(CYCLES))
def test_unsatisfiable_schema_is_a_400_on_the_tinker_face(live: LiveServer, schema: dict) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}}
    client = tinker.ServiceClient(base_url=live.url, api_key=KEY_A,
                                  default_headers_overrides={EXTENSIONS_HEADER: json.dumps({"response_format": fmt})})
    try:
        sc = client.create_sampling_client(base_model=BASE).result()
        with pytest.raises(tinker.BadRequestError, match="no text satisfies"):
            sc.sample(types.ModelInput.from_ints([5, 17]), 1, types.SamplingParams(max_tokens=4)).result()
    finally:
        client.close("success")


def test_a_satisfiable_recursive_schema_still_samples(live: LiveServer) -> None:
    """Recursion with a base case (a tree whose children may be empty) is fine: only schemas no text
    can start are refused."""
    tree = {"$defs": {"node": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                                      "maxItems": 1}}, "additionalProperties": False}},
            "$ref": "#/$defs/node"}
    body = {"model": BASE, "prompt": "x", "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}}
    r = httpx.post(f"{live.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("{")


OTHER = ("GET", "POST", "PUT", "PATCH", "DELETE")


def test_every_405_has_a_complete_allow(live: LiveServer) -> None:
    """Every documented path, asked with a method it does not serve, answers 405 with an `Allow`
    that lists every method the spec documents for it (both faces)."""
    spec = httpx.get(f"{live.url}/openapi.json", timeout=30).json()
    checked: list[str] = []
    with httpx.Client(base_url=live.url, timeout=30) as http:
        for path, ops in spec["paths"].items():
            documented = {m.upper() for m in ops if m.upper() in OTHER}
            url = path.replace("{", "").replace("}", "")  # a value for each path parameter
            for method in (m for m in OTHER if m not in documented):
                r = http.request(method, url, headers={"X-API-Key": KEY_A})
                if r.status_code != 405:  # another route serves it (a wider pattern)
                    continue
                allow = {m.strip() for m in r.headers.get("allow", "").split(",") if m.strip()}
                assert documented <= allow, (method, path, r.headers.get("allow"), documented)
                checked.append(path)
                break
    assert len(checked) >= 30
    assert any(p.startswith("/v1/") for p in checked) and any(p.startswith("/oai/api/v1/") for p in checked)
    assert "/api/v1/mint/keys" in checked  # GET and POST: two routes on one path


def test_405_on_a_path_with_two_routes_lists_both(live: LiveServer) -> None:
    r = httpx.patch(f"{live.url}/api/v1/mint/keys", headers={"X-API-Key": KEY_A}, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST", r.headers
    r = httpx.put(f"{live.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert r.json()["error"]["type"] == "invalid_request_error"
