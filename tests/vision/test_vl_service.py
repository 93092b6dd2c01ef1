"""Images end to end on a live server over a tiny Qwen3-VL: the tinker SDK trains on and samples
with image chunks, the OpenAI face takes image_url data URLs, and remote image URLs are refused."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tinker
import torch
from tinker import types

from mint_server.engine.local import LocalEngine
from tests.service.live import ENGINE_SETTINGS, KEY_A, LR, LiveServer
from tests.vision.helpers import image_input
from tests.vision.tiny_qwen3vl import png

BASE = "tiny/qwen3-vl"
TEXT = [[5, 6, 7], [8, 9, 10, 11]]


@pytest.fixture(scope="module")
def live(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine = LocalEngine(vl_dir, base_model=BASE, device="cpu", dtype=torch.float32, settings=ENGINE_SETTINGS)
    with LiveServer(engine, tmp_path_factory.mktemp("vl-serve") / "data") as server:
        yield server


@pytest.fixture
def client(live: LiveServer) -> Iterator[tinker.ServiceClient]:
    c = tinker.ServiceClient(base_url=live.url, api_key=KEY_A)
    yield c
    c.close("success")


def image_datum(cfg, seed: int) -> types.Datum:
    mi = image_input(cfg, TEXT, [(40, 24, seed)])
    g = torch.Generator().manual_seed(seed)
    return types.Datum(model_input=mi, loss_fn_inputs={"target_tokens": torch.randint(3, 300, (mi.length,), generator=g)})


def test_tinker_sdk_trains_and_samples_with_image_chunks(live: LiveServer, client: tinker.ServiceClient) -> None:
    cfg = live.engine.model.config
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    assert tc.get_info().model_data.arch == "Qwen3VLForConditionalGeneration"
    data = [image_datum(cfg, 1), image_datum(cfg, 2)]
    losses = []
    for _ in range(6):  # forward_backward travels as protobuf, its image chunks as bytes
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0], losses
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = image_input(cfg, TEXT, [(40, 24, 1)])
    res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, stop=[], temperature=0.0)).result()
    assert len(res.sequences) == 2 and all(len(s.tokens) == 4 for s in res.sequences)
    seq = res.sequences[0]
    # the sampled tokens' logprobs are the model's on prompt + tokens, image included
    scored = sampler.compute_logprobs(prompt.append(types.EncodedTextChunk(tokens=list(seq.tokens)))).result()
    assert scored[-4:] == pytest.approx(seq.logprobs, abs=1e-4)
    # training's forward and the sampler score the same model input alike: targets = its next tokens
    ids = [t for c in prompt.chunks for t in (c.tokens if isinstance(c, types.EncodedTextChunk)
                                               else [cfg.vision.image_token_id] * c.expected_tokens)]
    nexts = types.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": ids[1:] + [0]})
    forward = tc.forward([nexts], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(forward[:-1], abs=1e-4)


def test_a_text_only_base_refuses_image_chunks_by_name(tiny_text_server: LiveServer) -> None:
    client = tinker.ServiceClient(base_url=tiny_text_server.url, api_key=KEY_A)
    try:
        sc = client.create_sampling_client(base_model="tiny/llama").result()
        with pytest.raises(tinker.BadRequestError, match="image chunks need a vision-language base model"):
            sc.sample(types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5]), types.ImageChunk(
                data=png(16, 16, 1), format="png", expected_tokens=4)]), 1, types.SamplingParams(max_tokens=2)).result()
    finally:
        client.close("success")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(oai: openai.OpenAI, image: str, **kw):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                              {"type": "image_url", "image_url": {"url": image}}]}]
    return oai.chat.completions.create(model=BASE, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                       extra_body={"return_tokens_as_token_ids": True}, **kw)


def test_openai_chat_takes_image_url_data_urls(live: LiveServer, client: tinker.ServiceClient) -> None:
    cfg = live.engine.model.config
    oai = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY_A, max_retries=0)
    one = chat(oai, data_url(png(40, 24, 1)))
    tokens = [int(t.token.removeprefix("token_id:")) for t in one.choices[0].logprobs.content]
    # the same prompt through the Tinker face: the chat template's text, the image as an image chunk
    tok = live.service.openai.tokenizer
    v = cfg.vision
    head = tok.apply_chat_template([{"role": "user", "content": "hello<|vision_start|><|image_pad|><|vision_end|>"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(head, add_special_tokens=False)["input_ids"]
    at = ids.index(v.image_token_id)
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=ids[:at]),
                                      types.ImageChunk(data=png(40, 24, 1), format="png", expected_tokens=15),
                                      types.EncodedTextChunk(tokens=ids[at + 1:])])
    sc = client.create_sampling_client(base_model=BASE).result()
    ref = sc.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])).result().sequences[0]
    assert tokens == list(ref.tokens)
    assert one.usage.prompt_tokens == len(ids) - 1 + 15  # the image counts as its 15 tokens
    other = chat(oai, data_url(png(40, 24, 2)))
    assert [t.logprob for t in other.choices[0].logprobs.content] != [t.logprob for t in one.choices[0].logprobs.content]


@pytest.mark.parametrize(("url", "names"), [
    ("https://example.com/cat.png", "not fetched"),
    ("http://127.0.0.1:1/cat.png", "not fetched"),
    ("data:image/png,notbase64", "base64"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/gif;base64,R0lGODlh", "image/gif"),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not a readable png image"),
])
def test_openai_refuses_remote_and_bad_image_urls_by_name(live: LiveServer, url: str, names: str) -> None:
    body = {"model": BASE, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert names in err["message"] and err["param"].startswith("messages"), err
