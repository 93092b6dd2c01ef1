"""The Anthropic Messages face through the real `anthropic` SDK (2.x) against a loopback server on a
tiny model with a tool-capable chat template: messages, streaming, tool use, count_tokens, errors,
and greedy text equal to the OpenAI chat face's for the same conversation."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.service.live import BASE, ENGINE_SETTINGS, KEY_A, KEY_B, LiveServer
from tests.tiny import make_tiny_checkpoint

ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
ADD = {"name": "add", "description": "add two digits", "input_schema": ADD_SCHEMA}
HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    import torch

    from mint_server.engine.local import LocalEngine

    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("claude") / "llama", tools=True)
    engine = LocalEngine(model_dir, base_model=BASE, device="cpu", dtype=torch.float32,
                         settings=dataclasses.replace(ENGINE_SETTINGS, max_context=512))  # fmt: skip
    with LiveServer(engine, tmp_path_factory.mktemp("claude-data") / "data") as server:
        yield server


@pytest.fixture
def claude(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{live.url}/anthropic/api", api_key=KEY_A, max_retries=0)


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_greedy_text_equals_the_openai_chat_faces(live: LiveServer, claude: anthropic.Anthropic) -> None:
    system = "you are terse"
    turns = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi"},
             {"role": "user", "content": [{"type": "text", "text": "say "}, {"type": "text", "text": "more"}]}]  # fmt: skip
    got = claude.messages.create(model=BASE, max_tokens=12, system=system, messages=turns,
                                 extra_body={"temperature": 0})  # fmt: skip
    oai = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY_A, max_retries=0)
    want = oai.chat.completions.create(model=BASE, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "say more"}])  # fmt: skip
    assert got.type == "message" and got.role == "assistant" and got.model == BASE
    assert text_of(got) == want.choices[0].message.content
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.usage.output_tokens == want.usage.completion_tokens
    assert got.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert got.id.startswith("msg_")
    # system as blocks is the same prompt
    blocks = claude.messages.create(model=BASE, max_tokens=12, system=[{"type": "text", "text": system}],
                                    messages=turns, extra_body={"temperature": 0})  # fmt: skip
    assert text_of(blocks) == text_of(got)


def test_streamed_events_build_the_non_streamed_message(claude: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(model=BASE, max_tokens=16, messages=HELLO, extra_body={"temperature": 0})
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # raw framing: Anthropic's event names, no [DONE]
    raw = httpx.post(f"{claude.base_url}v1/messages",
                     json={"model": BASE, "max_tokens": 3, "messages": HELLO, "stream": True},
                     headers={"x-api-key": KEY_A}, timeout=60)  # fmt: skip
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    lines = raw.text.strip().split("\n\n")
    assert lines[0].startswith("event: message_start\ndata: {") and lines[-1].startswith("event: message_stop")
    assert "[DONE]" not in raw.text


def test_sampling_controls_and_stop_sequences(claude: anthropic.Anthropic) -> None:
    base = claude.messages.create(model=BASE, max_tokens=30, messages=HELLO, extra_body={"temperature": 0})
    text = text_of(base)
    assert len(text) > 2, text
    stop = text[1:3]
    cut = claude.messages.create(model=BASE, max_tokens=30, messages=HELLO, stop_sequences=[stop],
                                 extra_body={"temperature": 0})  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == text[: text.find(stop)]
    short = claude.messages.create(model=BASE, max_tokens=2, messages=HELLO, extra_body={"temperature": 0})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    # top_k 1 is greedy, whatever the temperature
    k1 = claude.messages.create(model=BASE, max_tokens=30, messages=HELLO, extra_body={"temperature": 1, "top_k": 1})
    assert text_of(k1) == text
    p0 = claude.messages.create(model=BASE, max_tokens=30, messages=HELLO, extra_body={"temperature": 1, "top_p": 1e-6})
    assert text_of(p0) == text


def test_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    """A forced call (tool_choice "tool") comes back as a tool_use block whose input follows the
    schema; it goes back with a tool_result, and the model answers in text."""
    ask = [{"role": "user", "content": "add 2 and 3"}]
    out = claude.messages.create(model=BASE, max_tokens=80, messages=ask, tools=[ADD],
                                 tool_choice={"type": "tool", "name": "add"}, extra_body={"temperature": 0})  # fmt: skip
    assert out.stop_reason == "tool_use", out
    (call,) = [b for b in out.content if b.type == "tool_use"]
    assert call.name == "add" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, ADD_SCHEMA)
    # streamed: the same call, whole, as an input_json_delta
    with claude.messages.stream(model=BASE, max_tokens=80, messages=ask, tools=[ADD],
                                tool_choice={"type": "tool", "name": "add"}, extra_body={"temperature": 0}) as stream:  # fmt: skip
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == call.input and final.stop_reason == "tool_use"
    # "any": a call to one of the tools
    anyone = claude.messages.create(model=BASE, max_tokens=80, messages=ask, tools=[ADD], tool_choice={"type": "any"},
                                    extra_body={"temperature": 0})  # fmt: skip
    assert anyone.stop_reason == "tool_use"
    back = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "5"},
                                         {"type": "text", "text": "so?"}]}]  # fmt: skip
    answer = claude.messages.create(model=BASE, max_tokens=8, messages=back, tools=[ADD],
                                    tool_choice={"type": "none"}, extra_body={"temperature": 0})  # fmt: skip
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    # the tool result reached the prompt: it counts as the rendered chat does
    with_result = claude.messages.count_tokens(model=BASE, messages=back, tools=[ADD])
    without = claude.messages.count_tokens(model=BASE, messages=back[:-1] + [{"role": "user", "content": "so?"}],
                                           tools=[ADD])  # fmt: skip
    assert with_result.input_tokens > without.input_tokens


def test_count_tokens_is_the_rendered_prompts_length(live: LiveServer, claude: anthropic.Anthropic) -> None:
    counted = claude.messages.count_tokens(model=BASE, system="be brief", messages=HELLO)
    face = live.service.openai
    want = face.template.render([{"role": "system", "content": "be brief"}, *HELLO])
    assert counted.input_tokens == len(want)
    sent = claude.messages.create(model=BASE, max_tokens=1, system="be brief", messages=HELLO)
    assert sent.usage.input_tokens == counted.input_tokens


def test_errors_in_anthropics_shape(live: LiveServer, claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-policy", max_tokens=4, messages=HELLO)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=f"{live.url}/anthropic/api", api_key="nope", max_retries=0).messages.create(
            model=BASE, max_tokens=4, messages=HELLO)
    url = f"{live.url}/anthropic/api/v1/messages"
    cases = [
        ({"model": BASE, "messages": HELLO}, "max_tokens"),  # required
        ({"model": BASE, "max_tokens": 4, "messages": HELLO, "temperature": 1.5}, "temperature"),
        ({"model": BASE, "max_tokens": 4, "messages": HELLO, "frobnicate": 1}, "frobnicate"),
        ({"model": BASE, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "video"),
        ({"model": BASE, "max_tokens": 4, "messages": HELLO, "tools": [{"type": "web_search_20250305",
                                                                         "name": "web_search"}]}, "server tools"),
        ({"model": BASE, "max_tokens": 4, "messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 9}},
         "thinking"),
    ]  # fmt: skip
    for body, fragment in cases:
        r = httpx.post(url, json=body, headers={"x-api-key": KEY_A}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert fragment in err["error"]["message"], err
    # the x-api-key header and a Bearer token both authenticate; another key's policy is a 404
    assert httpx.post(url, json={"model": BASE, "max_tokens": 1, "messages": HELLO},
                      headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30).status_code == 200  # fmt: skip
    r = httpx.post(url, json={"model": BASE, "max_tokens": 1, "messages": HELLO}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_a_policy_revision_is_named_as_on_the_openai_face(live: LiveServer, claude: anthropic.Anthropic) -> None:
    import tinker

    from tests.service.live import train

    client = tinker.ServiceClient(base_url=live.url, api_key=KEY_A)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1, user_metadata={"policy": "pol"}).result()
    train(tc, 2)
    tc.save_weights_for_sampler("r1").result()
    client.close("success")
    oai = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY_A, max_retries=0)
    for model in ("pol", "pol@1", "tinker://pol@1"):
        got = claude.messages.create(model=model, max_tokens=10, messages=HELLO, extra_body={"temperature": 0})
        want = oai.chat.completions.create(model=model, max_tokens=10, messages=HELLO, temperature=0)
        assert got.model == model and text_of(got) == want.choices[0].message.content
    other = anthropic.Anthropic(base_url=f"{live.url}/anthropic/api", api_key=KEY_B, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        other.messages.create(model="pol", max_tokens=2, messages=HELLO)
    assert json.loads(json.dumps(other.messages.count_tokens(model=BASE, messages=HELLO).model_dump()))["input_tokens"] > 0
