"""Prefix-cache hits as clients read them: the OpenAI face's `usage.prompt_tokens_details.cached_tokens`
and tinker's `SampleResponse.prompt_cache_hit_tokens`, through the real SDKs against a live server;
another owner's identical prompt gets no hit; /metrics counts the hits."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tinker
from tinker import types

from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, tiny_engine

PROMPT = [5 + (7 * i) % 250 for i in range(60)]  # 60 tokens: 3 full blocks of 16 may be served from the cache


@pytest.fixture(scope="module")
def live(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(tiny_engine(tiny_dir), tmp_path_factory.mktemp("pc") / "data") as server:
        yield server


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)} (\S+)$", text, re.M))


def test_openai_usage_reports_cached_tokens(live: LiveServer) -> None:
    a = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY_A, max_retries=0)
    b = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY_B, max_retries=0)
    first = a.completions.create(model=BASE, prompt=PROMPT, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = a.completions.create(model=BASE, prompt=PROMPT, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 48 and second.usage.prompt_tokens == 60
    assert second.choices[0].text == first.choices[0].text
    other = b.completions.create(model=BASE, prompt=PROMPT, max_tokens=4, temperature=0)  # salted per owner
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    stream = a.completions.create(model=BASE, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == 48
    assert metric(live, 'mint_prefix_cache_total{phase="hit_tokens"}') >= 96
    assert metric(live, "mint_prefix_cache_blocks") >= 3


def test_tinker_sample_response_reports_prompt_cache_hit_tokens(live: LiveServer) -> None:
    prompt = types.ModelInput.from_ints([p + 1 for p in PROMPT])
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    hits = {}
    for key in (KEY_A, KEY_A, KEY_B):
        client = tinker.ServiceClient(base_url=live.url, api_key=key)
        try:
            sc = client.create_sampling_client(base_model=BASE).result()
            hits.setdefault(key, []).append(sc.sample(prompt, 1, params).result().prompt_cache_hit_tokens)
        finally:
            client.close("success")
    assert hits == {KEY_A: [0, 48], KEY_B: [0]}
