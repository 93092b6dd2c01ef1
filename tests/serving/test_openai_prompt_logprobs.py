"""Prompt logprobs on the OpenAI face (`/completions` with `echo` + `logprobs`, as evaluation harnesses
score loglikelihoods), through the real `openai` SDK against a loopback server on the tiny model:
the numbers are the Tinker face's prompt logprobs for the same prompt."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest
import tinker
from tinker import types

from tests.service.live import BASE, KEY_A, LiveServer, tiny_engine
from tests.tiny import make_tiny_checkpoint

PROMPT = [5, 17, 33, 60, 61, 7, 90]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", tie=True)
    with LiveServer(tiny_engine(model_dir), tmp_path_factory.mktemp("echo") / "data") as server:
        yield server


@pytest.fixture
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY_A, max_retries=0)


def tinker_prompt_scores(live: LiveServer, prompt: list[int], k: int) -> types.SampleResponse:
    client = tinker.ServiceClient(base_url=live.url, api_key=KEY_A)
    try:
        sc = client.create_sampling_client(base_model=BASE).result()
        return sc.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                         topk_prompt_logprobs=k).result()  # fmt: skip
    finally:
        client.close("success")


def ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_equal_the_tinker_faces_prompt_logprobs(live: LiveServer, oai: openai.OpenAI,
                                                              max_tokens: int) -> None:  # fmt: skip
    ref = tinker_prompt_scores(live, PROMPT, 4)
    out = oai.completions.create(model=BASE, prompt=PROMPT, echo=True, logprobs=4, max_tokens=max_tokens, seed=1,
                                 extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    (choice,) = out.choices
    lp = choice.logprobs
    n = len(PROMPT)
    assert ids(lp.tokens[:n]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing scores the first token
    assert lp.token_logprobs[1:n] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)
    for got, want in zip(lp.top_logprobs[1:n], ref.topk_prompt_logprobs[1:], strict=True):
        assert [int(t.removeprefix("token_id:")) for t in got] == [t for t, _ in want]
        assert list(got.values()) == pytest.approx([x for _, x in want], abs=1e-4)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == n + out.usage.completion_tokens
    face = live.service.openai
    assert choice.text.startswith(face.decode(PROMPT))
    if max_tokens == 0:  # the prompt alone: nothing generated, nothing counted
        assert choice.text == face.decode(PROMPT) and out.usage.completion_tokens == 0
        assert choice.finish_reason == "length"
    else:  # the completion's own entries follow the prompt's
        assert out.usage.completion_tokens >= 1 and all(x is not None for x in lp.token_logprobs[n:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_logprobs_of_a_text_prompt_streamed_and_not(live: LiveServer, oai: openai.OpenAI) -> None:
    text = "the quick brown fox"
    tokens = list(live.service.openai.tokenizer(text)["input_ids"])
    ref = tinker_prompt_scores(live, tokens, 1)
    kw = dict(model=BASE, prompt=text, echo=True, logprobs=1, max_tokens=0)
    out = oai.completions.create(**kw)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)
    assert out.choices[0].text == text and out.usage.prompt_tokens == len(tokens)
    # lm-evaluation-harness's greedy check: the token's logprob is the best of its position's alternatives
    greedy = [math.isclose(x, max(top.values()), abs_tol=1e-6) for x, top in zip(lp.token_logprobs[1:],
                                                                                 lp.top_logprobs[1:], strict=True)]
    assert greedy == [ref.topk_prompt_logprobs[i][0][0] == tokens[i] for i in range(1, len(tokens))]
    streamed = [c for chunk in oai.completions.create(**kw, stream=True) for c in chunk.choices]
    assert [c.text for c in streamed] == [text]
    assert streamed[0].logprobs.model_dump() == lp.model_dump()


def test_max_tokens_zero_needs_echo(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=BASE, prompt=PROMPT, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
