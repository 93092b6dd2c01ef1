"""The OpenAI-compatible face through the official `openai` SDK (sync, async, streaming) and raw
HTTP, against a live server on the real engine over a tiny random checkpoint."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from tinker import types

from mint_server.api.auth.keys import owner_id
from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, datum, tiny_engine, train
from tests.tiny import make_tiny_checkpoint

POLICY = "pol"
PROMPT = [5, 17, 33, 60, 61]
HELLO = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def live(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server for the module, holding policy `pol` with revisions 1 and 2 and `pol@prod` → 1."""
    with LiveServer(tiny_engine(tiny_dir), tmp_path_factory.mktemp("oai") / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1, user_metadata={"policy": POLICY}).result()
        train(tc, 2)
        tc.save_weights_for_sampler("r1").result()
        train(tc, 2)
        tc.save_weights_for_sampler("r2").result()
        catalog(server).set_alias(owner_id(KEY_A), POLICY, "prod", 1, actor="test")
        client.close("success")
        yield server


def catalog(server: LiveServer) -> Any:
    return server.service.core.policies.catalog


@pytest.fixture
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY_A, max_retries=0)


def tinker_sample(server: LiveServer, path: str, prompt: list[int], n: int, params: types.SamplingParams) -> Any:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    try:
        sc = client.create_sampling_client(model_path=path).result()
        return sc.sample(types.ModelInput.from_ints(prompt), n, params).result()
    finally:
        client.close("success")


def ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def metric(server: LiveServer, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


# --- models, auth, ownership ----------------------------------------------------------------------

def test_models_auth_and_ownership(live: LiveServer, oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list()] == [BASE, POLICY, f"{POLICY}@prod"]
    assert oai.models.retrieve(f"{POLICY}@prod").id == f"{POLICY}@prod"
    assert oai.models.retrieve(BASE).id == BASE  # a name with a '/'
    # Both prefixes serve the face.
    same = openai.OpenAI(base_url=f"{live.url}/oai/api/v1", api_key=KEY_A, max_retries=0)
    assert [m.id for m in same.models.list()] == [BASE, POLICY, f"{POLICY}@prod"]

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="tml-not-a-known-key", max_retries=0).models.list()
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": BASE, "messages": HELLO})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key" and "Bearer" in r.json()["error"]["message"]

    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="no-such-policy", messages=HELLO, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"

    # Another key's policy is invisible: not listed, not resolvable, not by any reference form.
    other = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY_B, max_retries=0)
    assert [m.id for m in other.models.list()] == [BASE]
    for ref in (POLICY, f"{POLICY}@prod", f"{POLICY}@1", f"tinker://{POLICY}@prod"):
        with pytest.raises(openai.NotFoundError):
            other.completions.create(model=ref, prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            other.models.retrieve(ref)


# --- numerics: the Tinker sampler's -----------------------------------------------------------------

@pytest.mark.parametrize("model", [f"{POLICY}@prod", f"{POLICY}@2", BASE])
def test_completion_tokens_and_logprobs_equal_the_tinker_sampling_clients(
    live: LiveServer, oai: openai.OpenAI, model: str
) -> None:
    path = f"tinker://{model}" if model != BASE else None
    params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=7, n=2,
                                 logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    if path is None:
        client = tinker.ServiceClient(base_url=live.url, api_key=KEY_A)
        ref = client.create_sampling_client(base_model=BASE).result().sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
        client.close("success")
    else:
        ref = tinker_sample(live, path, PROMPT, 2, params)
    for choice, seq in zip(out.choices, ref.sequences, strict=True):
        assert ids(choice.logprobs.tokens) == list(seq.tokens)
        assert choice.logprobs.token_logprobs == pytest.approx(list(seq.logprobs), abs=1e-4)
    assert out.usage.prompt_tokens == len(PROMPT)
    assert out.usage.completion_tokens == sum(len(s.tokens) for s in ref.sequences)


def test_chat_logprobs_equal_the_tinker_sampling_clients(live: LiveServer, oai: openai.OpenAI) -> None:
    face = live.service.openai
    prompt = face.template.render(HELLO)
    out = oai.chat.completions.create(model=f"{POLICY}@prod", messages=HELLO, max_tokens=8, seed=3, logprobs=True,
                                      extra_body={"return_tokens_as_token_ids": True})
    ref = tinker_sample(live, f"tinker://{POLICY}@prod", prompt, 1, types.SamplingParams(max_tokens=8, seed=3))
    (seq,) = ref.sequences
    entries = out.choices[0].logprobs.content
    assert ids([e.token for e in entries]) == list(seq.tokens)
    assert [e.logprob for e in entries] == pytest.approx(list(seq.logprobs), abs=1e-4)
    assert out.choices[0].message.content == face.decode(list(seq.tokens))
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(seq.tokens)


def check_alternatives(tokens: list[int], logprobs: list[float], tops: list[list[tuple[int, float]]], k: int) -> None:
    """k alternatives per token, best first; the chosen token, when among them, with its own logprob."""
    for token, lp, top in zip(tokens, logprobs, tops, strict=True):
        assert len(top) == k and [a for a, _ in top] != [] and len({a for a, _ in top}) == k
        assert all(x >= y for (_, x), (_, y) in zip(top, top[1:], strict=False))
        assert dict(top).get(token, lp) == lp and lp <= top[0][1]


def test_chat_top_logprobs_streamed_equal_non_streamed(live: LiveServer, oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=f"{POLICY}@prod", messages=HELLO, max_tokens=10, seed=3, logprobs=True,
                              top_logprobs=4, n=2, extra_body={"return_tokens_as_token_ids": True})
    whole = oai.chat.completions.create(**kw)
    ref = tinker_sample(live, f"tinker://{POLICY}@prod", live.service.openai.template.render(HELLO), 2,
                        types.SamplingParams(max_tokens=10, seed=3))
    for choice, seq in zip(whole.choices, ref.sequences, strict=True):
        entries = choice.logprobs.content
        assert ids([e.token for e in entries]) == list(seq.tokens)  # alternatives change nothing else
        tops = [[(ids([a.token])[0], a.logprob) for a in e.top_logprobs] for e in entries]
        check_alternatives(list(seq.tokens), [e.logprob for e in entries], tops, 4)
        assert all(a.bytes == list(a.token.encode()) for e in entries for a in e.top_logprobs)
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.logprobs.content if c.logprobs else []
    assert {i: [e.model_dump() for e in v] for i, v in streamed.items()} == {
        c.index: [e.model_dump() for e in c.logprobs.content] for c in whole.choices}
    # Without token ids, each entry (and each alternative) is its token's own text.
    tok = live.service.openai.tokenizer
    plain = oai.chat.completions.create(**{**kw, "extra_body": {}, "n": 1}).choices[0].logprobs.content
    assert [e.token for e in plain] == [tok.decode([t]) for t in ref.sequences[0].tokens]
    assert all(len(e.top_logprobs) == 4 for e in plain)


def test_completion_top_logprobs_streamed_equal_non_streamed(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=POLICY, prompt=PROMPT, max_tokens=8, seed=6, logprobs=3,
                              extra_body={"return_tokens_as_token_ids": True})
    whole = oai.completions.create(**kw).choices[0].logprobs
    tops = [[(int(a.removeprefix("token_id:")), lp) for a, lp in top.items()] for top in whole.top_logprobs]
    check_alternatives(ids(whole.tokens), whole.token_logprobs, tops, 3)
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in oai.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for name, values in streamed.items():
                values += getattr(c.logprobs, name) if c.logprobs else []
    assert streamed == {name: getattr(whole, name) for name in streamed}
    assert oai.completions.create(**{**kw, "logprobs": 0}).choices[0].logprobs.top_logprobs is None


def test_frequency_penalty_steers_greedy_output_and_keeps_raw_logprobs(live: LiveServer, oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=BASE, prompt=PROMPT, max_tokens=30, temperature=0, logprobs=2,
                              extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    plain = oai.completions.create(**kw).choices[0].logprobs
    assert len(set(plain.tokens)) < len(plain.tokens)  # the tiny model repeats itself
    assert oai.completions.create(**kw, frequency_penalty=0, presence_penalty=0).choices[0].logprobs == plain
    for penalty in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5}):
        out = oai.completions.create(**kw, **penalty)
        got = out.choices[0].logprobs
        assert got.tokens != plain.tokens and len(set(got.tokens)) > len(set(plain.tokens)), penalty
        assert out.usage.completion_tokens == len(got.tokens) == 30
        # The reported logprobs are the raw model's for the tokens drawn: the Tinker face scores the
        # same sequence to the same numbers, and the alternatives are consistent with them.
        client = tinker.ServiceClient(base_url=live.url, api_key=KEY_A)
        scored = client.create_sampling_client(base_model=BASE).result().compute_logprobs(
            types.ModelInput.from_ints(PROMPT + ids(got.tokens))).result()
        client.close("success")
        assert got.token_logprobs == pytest.approx(scored[len(PROMPT):], abs=1e-4)
        tops = [[(int(a.removeprefix("token_id:")), lp) for a, lp in top.items()] for top in got.top_logprobs]
        check_alternatives(ids(got.tokens), got.token_logprobs, tops, 2)
        chat = oai.chat.completions.create(model=BASE, messages=HELLO, max_tokens=12, temperature=0, **penalty)
        assert chat.choices[0].message.content is not None


def test_processed_logprobs_opt_in_equals_the_tinker_faces(live: LiveServer, oai: openai.OpenAI) -> None:
    """`logprobs_mode: "processed_logprobs"` (extra_body) reports the distribution the token was drawn
    from: at temperature 0.5 and top_k 3 not the raw model's, and the Tinker face's numbers for the
    same request. The same seed draws the same tokens in either mode."""
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True, "top_k": 3}
    kw: dict[str, Any] = dict(model=BASE, prompt=PROMPT, max_tokens=8, temperature=0.5, seed=11, logprobs=0)
    raw = oai.completions.create(**kw, extra_body=extra).choices[0].logprobs
    processed = oai.completions.create(**kw, extra_body={**extra, "logprobs_mode": "processed_logprobs"})
    got = processed.choices[0].logprobs
    assert got.tokens == raw.tokens and len(got.tokens) == 8
    assert oai.completions.create(**kw, extra_body={**extra, "logprobs_mode": "raw_logprobs"}).choices[0].logprobs == raw
    assert all(p > r + 1e-3 for p, r in zip(got.token_logprobs, raw.token_logprobs, strict=True))  # sharper, renormalised

    h = {"X-API-Key": KEY_A}
    sid = httpx.post(f"{live.url}/api/v1/create_session", headers=h, timeout=30, json={
        "type": "create_session", "tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()["session_id"]
    sampler = httpx.post(f"{live.url}/api/v1/create_sampling_session", headers=h, timeout=30, json={
        "type": "create_sampling_session", "session_id": sid, "sampling_session_seq_id": 0, "base_model": BASE,
    }).json()["sampling_session_id"]
    future = httpx.post(f"{live.url}/api/v1/asample", headers=h, timeout=30, json={
        "type": "sample", "sampling_session_id": sampler, "seq_id": 1, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 8, "temperature": 0.5, "top_k": 3, "seed": 11,
                            "logprobs_mode": "processed_logprobs"}})
    assert future.status_code == 200, future.text
    ref = httpx.post(f"{live.url}/api/v1/retrieve_future", headers=h, timeout=60,
                     json={"request_id": future.json()["request_id"]}).json()["sequences"][0]
    assert ids(got.tokens) == ref["tokens"]  # neither stops at EOS (ignore_eos here; the Tinker face never does)
    assert got.token_logprobs == pytest.approx(ref["logprobs"], abs=1e-4)

    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(**kw, extra_body={**extra, "logprobs_mode": "final"})
    assert e.value.body["param"] == "logprobs_mode", e.value.body


# --- streaming ------------------------------------------------------------------------------------

def collect(stream: Any) -> tuple[dict[int, str], dict[int, str], Any]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_streamed_text_equals_non_streamed(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=f"{POLICY}@prod", messages=HELLO, max_tokens=24, seed=11, n=3)
    whole = oai.chat.completions.create(**kw)
    texts, reasons, usage = collect(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage == whole.usage and usage.completion_tokens == sum(
        len(c.logprobs.content) for c in oai.chat.completions.create(**kw, logprobs=True).choices
    )
    assert len(set(texts.values())) == 3  # n samples, each on its own stream

    kw = dict(model=POLICY, prompt=["hello world", "the quick"], max_tokens=12, seed=5, n=2)
    whole_c = oai.completions.create(**kw)
    texts, reasons, _ = collect(oai.completions.create(**kw, stream=True))
    assert texts == {c.index: c.text for c in whole_c.choices} and len(texts) == 4
    assert reasons == {c.index: c.finish_reason for c in whole_c.choices}


def test_async_client(live: LiveServer) -> None:
    async def main() -> tuple[Any, str]:
        client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=KEY_A, max_retries=0)
        kw: dict[str, Any] = dict(model=f"{POLICY}@2", messages=HELLO, max_tokens=16, seed=2)
        whole, stream = await asyncio.gather(
            client.chat.completions.create(**kw), client.chat.completions.create(**kw, stream=True)
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return whole, text

    whole, text = asyncio.run(main())
    assert whole.choices[0].message.content == text and whole.system_fingerprint.startswith(f"{POLICY}@2:")


def test_stop_strings_cut_across_token_boundaries(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=BASE, prompt="hello world", max_tokens=40, temperature=0.0,
                              extra_body={"return_tokens_as_token_ids": True}, logprobs=0)
    full = oai.completions.create(**kw).choices[0]
    text = full.text
    # A stop string that ends inside the text, starting past its first characters (and not at a
    # replacement character, which only marks bytes that never formed a character).
    start = next(i for i in range(2, len(text) - 3) if "\ufffd" not in text[i : i + 3] and text[:i].find(text[i : i + 3]) < 0)
    stop = text[start : start + 3]
    cut = oai.completions.create(**kw, stop=[stop, "never-generated"]).choices[0]
    assert cut.text == text[:start] and cut.finish_reason == "stop"
    assert len(cut.logprobs.tokens) < len(full.logprobs.tokens)  # the engine stopped there too
    texts, reasons, _ = collect(oai.completions.create(**kw, stop=stop, stream=True))
    assert texts == {0: text[:start]} and reasons == {0: "stop"}


# --- SSE framing, disconnects, alias moves ------------------------------------------------------------

def test_raw_sse_framing(live: LiveServer) -> None:
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 5, "stream": True, "seed": 1,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{live.url}/oai/api/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"


def test_client_disconnect_cancels_the_stream_and_frees_its_kv(live: LiveServer) -> None:
    engine = live.engine
    decoded_before = engine.sampler.stats.decode_tokens
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # tokens are flowing
        engine.pause()  # hold the worker before its next turn, so the stream cannot finish on its own
        assert metric(live, "mint_kv_blocks_in_use") > 0
    # The connection is closed: the server notices, closes the stream and sets its cancel event.
    wait_for(lambda: metric(live, "mint_openai_streams") == 0)
    engine.resume()
    wait_for(lambda: metric(live, "mint_kv_blocks_in_use") == 0)
    assert engine.sampler.stats.decode_tokens - decoded_before < 199  # it stopped early


def test_client_disconnect_cancels_a_non_streamed_request_and_frees_its_kv(live: LiveServer) -> None:
    engine = live.engine
    decoded_before = engine.sampler.stats.decode_tokens
    body = json.dumps({"model": BASE, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "n": 2}).encode()
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as conn:  # a client that will hang up
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY_A.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        wait_for(lambda: metric(live, "mint_kv_blocks_in_use") > 0)  # its sequences are running
        engine.pause()  # hold the worker before its next turn, so the request cannot finish on its own
    # The connection is closed: the server notices and cancels the request's engine work.
    wait_for(lambda: metric(live, "mint_openai_streams") == 0)
    engine.resume()
    wait_for(lambda: metric(live, "mint_kv_blocks_in_use") == 0)
    assert engine.sampler.stats.decode_tokens - decoded_before < 2 * 199  # it stopped early


def wait_for(condition: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_alias_move_during_a_stream(live: LiveServer, oai: openai.OpenAI) -> None:
    owner = owner_id(KEY_A)
    catalog(live).set_alias(owner, POLICY, "live", 1, actor="test")
    kw: dict[str, Any] = dict(model=f"{POLICY}@live", messages=HELLO, max_tokens=30, seed=4, extra_body={"ignore_eos": True})
    rev1 = oai.chat.completions.create(**{**kw, "model": f"{POLICY}@1"})
    rev2 = oai.chat.completions.create(**{**kw, "model": f"{POLICY}@2"})
    assert rev1.choices[0].message.content != rev2.choices[0].message.content

    stream = oai.chat.completions.create(**kw, stream=True)
    first = next(stream)  # admitted: the alias is resolved, the revision pinned
    assert first.system_fingerprint.startswith(f"{POLICY}@1:")
    catalog(live).set_alias(owner, POLICY, "live", 2, actor="test")
    after = oai.chat.completions.create(**kw)  # a new request sees the move
    assert after.choices[0].message.content == rev2.choices[0].message.content
    assert after.system_fingerprint.startswith(f"{POLICY}@2:")
    rest = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert rest == rev1.choices[0].message.content  # the running stream kept its revision


# --- tools ----------------------------------------------------------------------------------------

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "add 2 and 3"}]


def test_tool_call_round_trip(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tiny model with a tool-capable template, taught one tool call and one answer, is asked
    through the SDK: the call comes back parsed, its result goes back as a `tool` message, and the
    model answers."""
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("tools") / "llama", tools=True)
    with LiveServer(tiny_engine(model_dir), tmp_path_factory.mktemp("tools-data") / "data") as server:
        tok = server.service.openai.tokenizer
        call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        answered = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "5"}]  # fmt: skip
        face = server.service.openai
        examples = []
        for messages, reply in ((ASK, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'),
                                (answered, "the answer is 5")):  # fmt: skip
            prompt = face.template.render(messages, [ADD])
            completion = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            tokens = prompt + completion
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
            examples.append(datum(tokens, weights))
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=BASE, rank=8, seed=0,
                                                user_metadata={"policy": "tooly"}).result()  # fmt: skip
        for _ in range(30):  # memorize both replies, so greedy decoding says them back
            steps = [(tc.forward_backward(examples, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=5e-3)))
                     for _ in range(10)]  # fmt: skip
            losses = [fb.result().metrics["loss:sum"] for fb, opt in steps if opt.result()]
            if losses[-1] < 0.5:
                break
        tc.save_weights_for_sampler("taught").result()
        client.close("success")

        oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY_A, max_retries=0)
        out = oai.chat.completions.create(model="tooly", messages=ASK, tools=[ADD], temperature=0, max_tokens=40)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (got,) = choice.message.tool_calls
        assert got.function.name == "add" and json.loads(got.function.arguments) == {"a": 2, "b": 3}
        assert got.id.startswith("call_") and choice.message.content is None

        # Streamed: the same call arrives as a tool_calls delta.
        chunks = list(oai.chat.completions.create(model="tooly", messages=ASK, tools=[ADD], temperature=0,
                                                  max_tokens=40, stream=True))  # fmt: skip
        deltas = [d for c in chunks for ch in c.choices if (d := ch.delta.tool_calls)]
        assert len(deltas) == 1 and deltas[0][0].function.name == "add"
        assert json.loads(deltas[0][0].function.arguments) == {"a": 2, "b": 3}
        assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]

        back = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": got.id, "content": "5"}]  # fmt: skip
        final = oai.chat.completions.create(model="tooly", messages=back, tools=[ADD], temperature=0, max_tokens=20)
        assert final.choices[0].message.content == "the answer is 5"
        assert final.choices[0].finish_reason == "stop" and final.choices[0].message.tool_calls is None

        # tool_choice "none": the text is not parsed into calls.
        plain = oai.chat.completions.create(model="tooly", messages=ASK, tools=[ADD], tool_choice="none",
                                            temperature=0, max_tokens=40)  # fmt: skip
        assert plain.choices[0].finish_reason == "stop" and "<tool_call>" in plain.choices[0].message.content


# --- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("path", "body", "param", "fragment"),
    [
        ("chat/completions", {"model": BASE}, "messages", "missing field 'messages'"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "max_tokens": "many"}, "max_tokens", "max_tokens"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "n": 0}, "n", "n"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "temperature": 3}, "temperature", "temperature"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "presence_penalty": 2.5}, "presence_penalty",
         "presence_penalty"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "frequency_penalty": "lots"}, "frequency_penalty",
         "frequency_penalty"),
        ("completions", {"model": BASE, "prompt": "x", "frequency_penalty": -3}, "frequency_penalty",
         "frequency_penalty"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "tools": [ADD]}, "tools", "does not support tools"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "max_tokens": 10_000}, "max_tokens", "context"),
        ("chat/completions", {"model": BASE, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role",
         "role"),
        ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content", "only text parts"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
         "0..20"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "logprobs": True, "top_logprobs": -1}, "top_logprobs",
         "top_logprobs"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ("completions", {"model": BASE, "prompt": "x", "logprobs": 21}, "logprobs", "0..20"),
        ("completions", {"model": BASE, "prompt": "x", "logprobs": -1}, "logprobs", "logprobs"),
        ("completions", {"model": BASE, "prompt": "x", "logprobs": "some"}, "logprobs", "logprobs"),
        ("chat/completions", {"model": "bad name!", "messages": HELLO}, "model", "model"),
        ("completions", {"model": BASE, "prompt": [1, 2, 10_000]}, "prompt", "outside the vocabulary"),
        ("completions", {"model": BASE, "prompt": []}, "prompt", "empty"),
        ("completions", {"model": BASE, "prompt": "x", "stop": [""]}, "stop", "stop"),
        ("completions", {"model": BASE, "prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ("completions", {"model": BASE, "prompt": "x", "priority": "urgent"}, "priority", "interactive, rollout, batch"),
        # strict types, as OpenAI answers them: no string → int or string → bool coercion
        ("completions", {"model": BASE, "prompt": "x", "max_tokens": "4"}, "max_tokens", "integer"),
        ("completions", {"model": BASE, "prompt": "x", "max_tokens": 4.0}, "max_tokens", "integer"),
        ("completions", {"model": BASE, "prompt": "x", "max_tokens": 4, "stream": "yes"}, "stream", "boolean"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "n": True}, "n", "integer"),
        ("chat/completions", {"model": BASE, "messages": HELLO, "temperature": "0.5"}, "temperature", "number"),
        ("completions", {"model": BASE, "prompt": "x", "stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
        ("completions", {"model": BASE, "prompt": [7] * 200, "max_tokens": 100}, "max_tokens", "exceeds the context"),
        # a prompt that fills the context is the prompt's fault, whether max_tokens is given or not
        ("completions", {"model": BASE, "prompt": [7] * 256}, "prompt", "no room"),
        ("completions", {"model": BASE, "prompt": [7] * 256, "max_tokens": 1}, "prompt", "no room"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(live: LiveServer, path: str, body: dict, param: str, fragment: str) -> None:
    r = httpx.post(f"{live.url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and fragment in error["message"], error
    assert metric(live, "mint_kv_blocks_in_use") == 0


def test_only_sampler_weights_and_revisions_are_served(live: LiveServer, oai: openai.OpenAI) -> None:
    """A training-state checkpoint (tinker://RUN/weights/NAME) resumes training; it is not servable."""
    client = tinker.ServiceClient(base_url=live.url, api_key=KEY_A)
    try:
        tc = client.create_lora_training_client(base_model=BASE, rank=2).result()
        state = tc.save_state("resume-me").result().path
        sampler = tc.save_weights_for_sampler("serve-me").result().path
    finally:
        client.close("success")
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=state, prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model" and "sampler weights" in e.value.body["message"]
    assert oai.completions.create(model=sampler, prompt="x", max_tokens=2).usage.completion_tokens == 2
    assert metric(live, "mint_kv_blocks_in_use") == 0


def test_repetition_penalty_and_min_p_are_honoured(live: LiveServer, oai: openai.OpenAI) -> None:
    """vLLM's extensions change what is drawn (never answered 200 and ignored): min_p 1 keeps only the
    likeliest token, so a seeded temperature-1 sample equals greedy; a strong repetition penalty
    steers greedy off the tokens it has seen."""
    kw: dict[str, Any] = dict(model=BASE, prompt="one two three", max_tokens=24)
    greedy = oai.completions.create(**kw, temperature=0).choices[0].text
    drawn = [oai.completions.create(**kw, temperature=1, seed=s).choices[0].text for s in range(3)]
    assert any(d != greedy for d in drawn)  # a plain seeded draw wanders off greedy
    for s in range(3):
        kept = oai.completions.create(**kw, temperature=1, seed=s, extra_body={"min_p": 1.0}).choices[0].text
        assert kept == greedy
    steered = oai.completions.create(**kw, temperature=0, extra_body={"repetition_penalty": 50.0}).choices[0].text
    assert steered != greedy
    plain = oai.completions.create(**kw, temperature=0, extra_body={"repetition_penalty": 1.0}).choices[0].text
    assert plain == greedy  # 1 = off
    for body, param in (({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
                        ({"repetition_penalty": 1000}, "repetition_penalty")):
        r = httpx.post(f"{live.url}/v1/completions", json={**kw, **body}, headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_request_may_lower_its_priority(live: LiveServer, oai: openai.OpenAI) -> None:
    plain = oai.completions.create(model=BASE, prompt="x", max_tokens=4, temperature=0)
    low = oai.completions.create(model=BASE, prompt="x", max_tokens=4, temperature=0, extra_body={"priority": "batch"})
    assert low.choices[0].text == plain.choices[0].text
    assert 'mint_time_to_first_token_seconds_count{priority="batch"}' in httpx.get(f"{live.url}/metrics").text


def test_unknown_fields_are_refused_by_name_and_bodies_must_be_json(live: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    for path, body in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": HELLO})):
        for field, value in (("some_new_openai_field", {"x": 1}), ("typical_p", 0.9), ("functions", [])):
            r = httpx.post(f"{live.url}/v1/{path}", headers=headers, timeout=30,
                           json={"model": BASE, "max_tokens": 1, **body, field: value})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field and f"unknown field {field!r}" in error["message"], error
        # bookkeeping fields that change no output are accepted; an SDK's echoed assistant message may
        # carry keys of its own
        r = httpx.post(f"{live.url}/v1/{path}", headers=headers, timeout=30,
                       json={"model": BASE, "max_tokens": 1, **body, "user": "u", "store": False,
                             "metadata": {"k": "v"}, "service_tier": "auto"})
        assert r.status_code == 200, r.text
    echoed = [*HELLO, {"role": "assistant", "content": "hi", "refusal": None, "annotations": []},
              {"role": "user", "content": "again"}]
    r = httpx.post(f"{live.url}/v1/chat/completions", headers=headers, timeout=30,
                   json={"model": BASE, "max_tokens": 1, "messages": echoed})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{live.url}/v1/completions", headers=headers, content=b"{nope", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


# --- mint chat ------------------------------------------------------------------------------------

def test_mint_chat_streams_a_conversation(live: LiveServer, oai: openai.OpenAI) -> None:
    from typer.testing import CliRunner

    from mint_server.cli import app

    kw: dict[str, Any] = dict(max_tokens=6, temperature=0.0)
    first = oai.chat.completions.create(model=f"{POLICY}@prod", messages=HELLO, **kw).choices[0].message.content
    history = [*HELLO, {"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
    second = oai.chat.completions.create(model=f"{POLICY}@prod", messages=history, **kw).choices[0].message.content
    result = CliRunner().invoke(app, ["chat", f"{POLICY}@prod", "--server", live.url, "--api-key", KEY_A,
                                      "--max-tokens", "6", "--temperature", "0"],
                                input="hello world\nagain\n/exit\n")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"> {first}\n> {second}\n> " in result.stdout
    result = CliRunner().invoke(app, ["chat", "nope", "--server", live.url, "--api-key", KEY_A], input="hi\n")
    assert "error: 404" in result.output


def test_metrics_show_what_the_engine_calibrated(live: LiveServer) -> None:
    """/metrics carries the start-up measurements the scheduler runs on (its step budget, latency cap,
    the skinny-product rule), so an operator can see why steps are the size they are."""
    text = httpx.get(f"{live.url}/metrics").text
    values = {line.split('quantity="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("mint_engine_calibration{")}
    assert values["max_step_tokens"] >= 1 and values["max_slowdown"] >= 1 and values["skinny_rows"] >= 0


def test_metrics_count_how_steps_and_passes_ran(live: LiveServer, oai: openai.OpenAI) -> None:
    """/metrics counts the decode steps by how they ran (this suite's server runs with compile off,
    tests/conftest.py: every step eager, none compiled) and the training passes (the fixture's four
    steps packed, no padding computed)."""
    oai.completions.create(model=BASE, prompt="hello", max_tokens=3, temperature=0)
    text = httpx.get(f"{live.url}/metrics").text
    values = {line.split('event="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("mint_compile_total{")}
    assert values["eager_steps"] >= 3 and values.get("compiled_steps", 0) == 0 and values.get("graphs", 0) == 0
    training = {line.split('kind="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("mint_training_total{")}
    assert training["packed_passes"] >= 4 and training["tokens"] > 0 and training.get("padding_tokens", 0) == 0
