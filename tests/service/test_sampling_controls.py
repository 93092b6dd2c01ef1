"""Structured output and sampling controls on both faces, through the official `openai` and `tinker`
SDKs and raw HTTP, against a live server on a tiny random checkpoint (a tool-capable template).
A random model's free text is noise: what parses here parses because of the grammar."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
import tinker
import torch
from tinker import types

from mint_server.api.tinker.mint_types import EXTENSIONS_HEADER
from mint_server.engine.local import LocalEngine
from tests.service.live import BASE, ENGINE_SETTINGS, KEY_A, LiveServer
from tests.tiny import make_tiny_checkpoint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
AS_PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ADD_PARAMS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a", "b"], "additionalProperties": False}
NEG_PARAMS = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": False}
ADD = {"type": "function", "function": {"name": "add", "parameters": ADD_PARAMS}}
NEG = {"type": "function", "function": {"name": "negate", "parameters": NEG_PARAMS}}
HELLO = [{"role": "user", "content": "hello world"}]
PROMPT = [5, 17, 33, 60, 61]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("controls") / "llama", tools=True)
    # the whole context: two tools' listing is ~380 tokens of this byte-level tokenizer
    engine = LocalEngine(model_dir, base_model=BASE, device="cpu", dtype=torch.float32,
                         settings=dataclasses.replace(ENGINE_SETTINGS, max_context=512))
    with LiveServer(engine, tmp_path_factory.mktemp("controls-data") / "data") as server:
        yield server


@pytest.fixture
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY_A, max_retries=0)


def tokenizer(live: LiveServer) -> Any:
    return live.service.openai.tokenizer


def ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def openai_400(live: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{live.url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert r.status_code == 400, r.text
    return r.json()["error"]


# --- the OpenAI face --------------------------------------------------------------------------------

def test_json_schema_response_format_always_validates(live: LiveServer, oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(model=BASE, messages=HELLO, response_format=AS_PERSON, n=3, temperature=1.0,
                                      seed=5, max_tokens=100)
    contents = []
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        contents.append(choice.message.content)
    assert len(set(contents)) > 1  # each choice followed the grammar on its own draws
    # streamed: the same text, piece by piece
    stream = oai.chat.completions.create(model=BASE, messages=HELLO, response_format=AS_PERSON, n=3, temperature=1.0,
                                         seed=5, max_tokens=100, stream=True)
    pieces: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + (c.delta.content or "")
    assert [pieces[i] for i in range(3)] == contents


class Pet(pydantic.BaseModel):
    kind: str = pydantic.Field(pattern="^(cat|dog)$")
    legs: int = pydantic.Field(ge=0, le=4)


def test_the_sdks_parse_helper_gets_its_pydantic_model(live: LiveServer, oai: openai.OpenAI) -> None:
    out = oai.chat.completions.parse(model=BASE, messages=HELLO, response_format=Pet, temperature=0, max_tokens=60)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.legs <= 4


@pytest.mark.parametrize(
    ("fmt", "check"),
    [
        ({"type": "regex", "regex": "[a-c]{2,4}-[0-9]{2}"}, lambda t: len(t) in (5, 6, 7) and t[-3] == "-"),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 10, "maximum": 99}}},
         lambda t: 10 <= json.loads(t) <= 99),
    ],
)
def test_completions_take_response_format_too(oai: openai.OpenAI, fmt: dict, check: Any) -> None:
    out = oai.completions.create(model=BASE, prompt="x", max_tokens=20, temperature=1.0, seed=1, n=2,
                                 extra_body={"response_format": fmt})
    for c in out.choices:
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_tool_choice_forces_a_call_whose_arguments_validate(oai: openai.OpenAI) -> None:
    named = oai.chat.completions.create(model=BASE, messages=HELLO, tools=[ADD, NEG], temperature=1.0, seed=3,
                                        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD_PARAMS)
    schemas = {"add": ADD_PARAMS, "negate": NEG_PARAMS}
    for seed in range(4):  # "required": a call to one of the tools, with its own arguments
        out = oai.chat.completions.create(model=BASE, messages=HELLO, tools=[ADD, NEG], tool_choice="required",
                                          temperature=1.0, seed=seed, max_tokens=60)
        (call,) = out.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(oai.chat.completions.create(model=BASE, messages=HELLO, tools=[ADD], tool_choice="required",
                                              temperature=0, max_tokens=60, stream=True))
    deltas = [d for c in chunks for ch in c.choices if (d := ch.delta.tool_calls)]
    assert len(deltas) == 1 and deltas[0][0].function.name == "add"
    jsonschema.validate(json.loads(deltas[0][0].function.arguments), ADD_PARAMS)
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_logit_bias_stop_token_ids_and_seed(live: LiveServer, oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=BASE, prompt=PROMPT, max_tokens=8, logprobs=0,
                              extra_body={"return_tokens_as_token_ids": True})
    greedy = ids(oai.completions.create(**kw, temperature=0).choices[0].logprobs.tokens)
    forced = oai.completions.create(**kw, temperature=0, logit_bias={"77": 100})
    assert ids(forced.choices[0].logprobs.tokens) == [77] * 8
    banned = ids(oai.completions.create(**kw, temperature=0, logit_bias={str(greedy[0]): -100}).choices[0].logprobs.tokens)
    assert greedy[0] not in banned
    # stop_token_ids (vLLM's): the sequence ends at the first one, which it includes
    stop_at = next((i for i, t in enumerate(greedy) if i >= 1 and t not in greedy[:i]), 0)
    stopped = oai.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "stop_token_ids": [greedy[stop_at]]}},
                                     temperature=0)
    assert ids(stopped.choices[0].logprobs.tokens) == greedy[: stop_at + 1]
    assert stopped.choices[0].finish_reason == "stop"
    # seed: the same seed draws the same tokens and logprobs, n choices draw apart
    a, b = (oai.completions.create(**kw, temperature=1.0, seed=42, n=2) for _ in range(2))
    assert [c.logprobs.tokens for c in a.choices] == [c.logprobs.tokens for c in b.choices]
    assert [c.logprobs.token_logprobs for c in a.choices] == [c.logprobs.token_logprobs for c in b.choices]
    assert a.choices[0].logprobs.tokens != a.choices[1].logprobs.tokens


@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ("completions", {"logit_bias": {"5": 150}}, "logit_bias", "[-100, 100]"),
        ("completions", {"logit_bias": {"100000": 1}}, "logit_bias", "outside the vocabulary"),
        ("completions", {"stop_token_ids": [5000]}, "stop_token_ids", "outside the vocabulary"),
        ("completions", {"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
        ("completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": 3}}}},
         "response_format", "properties"),
        ("completions", {"response_format": {"type": "json_object", "schema": {}}}, "response_format",
         "response_format.schema: unknown field"),
        ("chat/completions", {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
         "tool_choice", "not among the tools"),
        ("chat/completions", {"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "forces a tool call"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "wat"}}}}}], "tool_choice": "required"}, "tools", "wat"),
    ],
)
def test_bad_controls_are_a_400_naming_the_field(live: LiveServer, path: str, body: dict, param: str,
                                                 fragment: str) -> None:
    base = {"model": BASE, "max_tokens": 4, **({"prompt": "x"} if path == "completions" else {"messages": HELLO})}
    error = openai_400(live, path, {**base, **body})
    assert error["param"] == param and fragment in error["message"], error


# --- the Tinker face --------------------------------------------------------------------------------

def sdk_sample(live: LiveServer, params: types.SamplingParams, n: int = 1, **controls: Any) -> list[list[int]]:
    """Sample through the tinker SDK, the controls in the header (its SamplingParams drops unknown fields)."""
    headers = {EXTENSIONS_HEADER: json.dumps(controls)} if controls else None
    client = tinker.ServiceClient(base_url=live.url, api_key=KEY_A, default_headers_overrides=headers)
    try:
        sc = client.create_sampling_client(base_model=BASE).result()
        return [list(s.tokens) for s in sc.sample(types.ModelInput.from_ints(PROMPT), n, params).result().sequences]
    finally:
        client.close("success")


def test_tinker_sdk_sampling_controls_by_header(live: LiveServer) -> None:
    tok = tokenizer(live)
    seeded = types.SamplingParams(max_tokens=100, temperature=1.0, seed=9)
    for tokens in sdk_sample(live, seeded, n=3, response_format=AS_PERSON):
        jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), PERSON)
    greedy_params = types.SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    (greedy,) = sdk_sample(live, greedy_params)
    assert sdk_sample(live, greedy_params, logit_bias={"77": 100.0}) == [[77] * 10]
    # min_p 1 keeps only the likeliest token: a seeded temperature-1 draw is the greedy one
    assert sdk_sample(live, types.SamplingParams(max_tokens=10, temperature=1.0, seed=3, stop=[]), min_p=1.0) == [greedy]
    assert len(set(greedy)) < len(greedy)  # the tiny model repeats itself …
    (steered,) = sdk_sample(live, greedy_params, repetition_penalty=100.0)
    assert len(set(steered)) == len(steered)  # … and a strong repetition penalty stops that
    for control in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        assert sdk_sample(live, greedy_params, **control) != [greedy], control


class RawTinker:
    """The Tinker face over raw HTTP: a session and a sampling session on the base model."""

    def __init__(self, live: LiveServer) -> None:
        self.http = httpx.Client(base_url=f"{live.url}/api/v1", headers={"X-API-Key": KEY_A}, timeout=60)
        sid = self.http.post("create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"}).json()
        self.sampler = self.http.post("create_sampling_session", json={
            "session_id": sid["session_id"], "sampling_session_seq_id": 0, "base_model": BASE}).json()["sampling_session_id"]
        self.seq = 0

    def post(self, sampling_params: dict[str, Any], n: int = 1, headers: dict[str, str] | None = None) -> httpx.Response:
        self.seq += 1
        return self.http.post("asample", headers=headers, json={
            "sampling_session_id": self.sampler, "seq_id": self.seq, "num_samples": n,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}, "sampling_params": sampling_params})

    def sample(self, sampling_params: dict[str, Any], n: int = 1) -> list[list[int]]:
        r = self.post(sampling_params, n)
        assert r.status_code == 200, r.text
        while (out := self.http.post("retrieve_future", json={"request_id": r.json()["request_id"]}).json()).get(
                "type") == "try_again":
            pass
        return [s["tokens"] for s in out["sequences"]]


def test_tinker_body_takes_the_controls_and_refuses_unknown_ones_by_name(live: LiveServer) -> None:
    raw = RawTinker(live)
    tok = tokenizer(live)
    fmt = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    for tokens in raw.sample({"max_tokens": 100, "temperature": 1.0, "seed": 4, "response_format": fmt}, n=2):
        jsonschema.validate(json.loads(tok.decode(tokens, skip_special_tokens=True)), PERSON)
    assert raw.sample({"max_tokens": 5, "temperature": 0.0, "stop": [], "logit_bias": {"77": 100}}) == [[77] * 5]
    for body, headers, fragment in (
        ({"max_tokens": 5, "grammar": "x"}, None, "sampling_params.grammar"),  # never silently ignored
        ({"max_tokens": 5, "min_p": 2.0}, None, "sampling_params.min_p"),
        ({"max_tokens": 5, "response_format": {"type": "regex"}}, None, "sampling_params.response_format.regex"),
        ({"max_tokens": 5, "min_p": 0.5}, {EXTENSIONS_HEADER: '{"min_p": 0.1}'}, "sampling_params.min_p: given both"),
        ({"max_tokens": 5}, {EXTENSIONS_HEADER: '{"grammar": 1}'}, f"{EXTENSIONS_HEADER} header"),
        ({"max_tokens": 5}, {EXTENSIONS_HEADER: "not json"}, f"{EXTENSIONS_HEADER} header"),
    ):
        r = raw.post(body, headers=headers)
        assert r.status_code == 400 and fragment in r.json()["detail"], (body, r.text)
    raw.http.close()
