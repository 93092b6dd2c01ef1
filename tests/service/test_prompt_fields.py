"""tinker 0.38's prompt fields and processed logprobs on the Tinker face of a live server (tiny
checkpoint): 400s naming the field, the proto encoding the SDK reads back, and tinker-cookbook
0.6.1's `recipes/decisions` run offline against the server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import deserialize_sample_response

from mint_server.api.tinker.codec import encode_prompt_extras
from mint_server.api.tinker.mint_types import EXTENSIONS_HEADER
from mint_server.engine.local import LocalEngine
from tests.service.live import BASE, ENGINE_SETTINGS, KEY_A, LiveServer

PROMPT = [5, 17, 33, 60, 61]


def session(server: LiveServer) -> str:
    h = {"X-API-Key": KEY_A}
    sid = httpx.post(f"{server.url}/api/v1/create_session", headers=h, timeout=30, json={
        "type": "create_session", "tags": [], "user_metadata": None, "sdk_version": "0.38.0"}).json()["session_id"]
    r = httpx.post(f"{server.url}/api/v1/create_sampling_session", headers=h, timeout=30, json={
        "type": "create_sampling_session", "session_id": sid, "sampling_session_seq_id": 0, "base_model": BASE})
    return r.json()["sampling_session_id"]


def asample(server: LiveServer, sampler: str, headers: dict[str, str] | None = None, **fields: Any) -> httpx.Response:
    body = {"type": "sample", "sampling_session_id": sampler, "seq_id": 1, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 2}, **fields}
    return httpx.post(f"{server.url}/api/v1/asample", headers={"X-API-Key": KEY_A, **(headers or {})},
                      json=body, timeout=30)


@pytest.mark.parametrize(("field", "fields"), [
    ("target_prompt_logprobs", {"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [1, 2]}}),
    ("target_prompt_logprobs", {"target_prompt_logprobs": {"data": [-1] * 4, "dtype": "int64", "shape": [4, 1]}}),
    ("target_prompt_logprobs", {"target_prompt_logprobs": {"data": [10**7] * 4, "dtype": "int64", "shape": [4, 1]}}),
    ("target_prompt_logprobs", {"target_prompt_logprobs": {
        "data": [7], "dtype": "int64", "shape": [4, 2], "sparse_crow_indices": [0, 1, 1, 1, 1], "sparse_col_indices": [5]}}),
    ("prompt_alt_tokens_k", {"prompt_alt_tokens_k": -2}),
    ("prompt_logprobs_last_n", {"prompt_logprobs": True, "prompt_logprobs_last_n": 5}),
    ("prompt_logprobs_last_n", {"prompt_logprobs_last_n": 2}),
    ("logprobs_mode", {"sampling_params": {"max_tokens": 2, "logprobs_mode": "final"}}),
])
def test_out_of_range_prompt_fields_are_a_400_naming_the_field(server: LiveServer, field: str, fields: dict) -> None:
    r = asample(server, session(server), **fields)
    assert r.status_code == 400, r.text
    assert field in r.json()["detail"], r.text


def test_logprobs_mode_in_the_extensions_header(server: LiveServer) -> None:
    bad = asample(server, session(server), headers={EXTENSIONS_HEADER: json.dumps({"logprobs_mode": "final"})})
    assert bad.status_code == 400 and "logprobs_mode" in bad.text
    ok = asample(server, session(server), headers={EXTENSIONS_HEADER: json.dumps({"logprobs_mode": "processed_logprobs"})})
    assert ok.status_code == 200, ok.text


def test_the_new_response_fields_round_trip_through_the_sdks_proto_reader() -> None:
    values = torch.zeros(4, 3)
    values[2] = torch.tensor([-1.5, -2.5, -0.5])
    sparse = types.TensorData.from_torch_sparse(values)
    assert sparse.sparse_crow_indices is not None
    dense = types.TensorData.from_numpy(np.arange(12, dtype=np.float32).reshape(4, 3) / -7)
    alt = types.PromptAltTokens(tokens=types.TensorData.from_numpy(np.arange(8, dtype=np.int64).reshape(4, 2)),
                                logprobs=types.TensorData.from_numpy(np.full((4, 2), -0.25, dtype=np.float32)))
    for target in (sparse, dense):
        msg = pb.SampleResponse()
        encode_prompt_extras(types.SampleResponse(sequences=[], target_prompt_logprobs=target, prompt_alt_tokens=alt), msg)
        back = deserialize_sample_response(msg.SerializeToString())
        assert back.target_prompt_logprobs.sparse_crow_indices == target.sparse_crow_indices
        assert back.target_prompt_logprobs.sparse_col_indices == target.sparse_col_indices
        assert np.array_equal(back.target_prompt_logprobs.to_numpy(), target.to_numpy())
        assert np.array_equal(back.prompt_alt_tokens.tokens.to_numpy(), alt.tokens.to_numpy())
        assert np.array_equal(back.prompt_alt_tokens.logprobs.to_numpy(), alt.logprobs.to_numpy())


def test_the_new_response_fields_reach_the_sdk_and_json_clients(server: LiveServer) -> None:
    """The SDK (protobuf answer) and a JSON client see target_prompt_logprobs (sparse CSR stays
    sparse) and prompt_alt_tokens; both carry the same values."""
    ids = torch.full((len(PROMPT) - 1, 8), -1, dtype=torch.int64)
    ids[1, 0], ids[3, 1], ids[3, 6] = 9, 40, 41
    target = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert target.sparse_crow_indices is not None
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    try:
        sampler = client.create_sampling_client(base_model=BASE).result()
        got = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2, seed=3),
                             target_prompt_logprobs=target, prompt_alt_tokens_k=2).result()
    finally:
        client.close("success")
    assert got.target_prompt_logprobs is not None and got.prompt_alt_tokens is not None
    assert got.target_prompt_logprobs.sparse_crow_indices == target.sparse_crow_indices
    assert got.target_prompt_logprobs.sparse_col_indices == target.sparse_col_indices
    assert got.prompt_alt_tokens.tokens.shape == [len(PROMPT) - 1, 2]

    body = {"target_prompt_logprobs": {"data": target.data, "dtype": "int64", "shape": target.shape,
                                       "sparse_crow_indices": target.sparse_crow_indices,
                                       "sparse_col_indices": target.sparse_col_indices},
            "prompt_alt_tokens_k": 2, "sampling_params": {"max_tokens": 2, "seed": 3}}
    future = asample(server, session(server), **body)
    assert future.status_code == 200, future.text
    r = httpx.post(f"{server.url}/api/v1/retrieve_future", headers={"X-API-Key": KEY_A, "Accept": "application/json"},
                   json={"request_id": future.json()["request_id"]}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    tpl = out["target_prompt_logprobs"]
    assert (tpl["sparse_crow_indices"], tpl["sparse_col_indices"]) == (target.sparse_crow_indices,
                                                                      target.sparse_col_indices)
    assert np.allclose(tpl["data"], got.target_prompt_logprobs.data, atol=1e-6)
    assert out["prompt_alt_tokens"]["tokens"]["data"] == got.prompt_alt_tokens.tokens.to_numpy().ravel().tolist()
    assert np.allclose(out["prompt_alt_tokens"]["logprobs"]["data"],
                       got.prompt_alt_tokens.logprobs.to_numpy().ravel(), atol=1e-6)


def test_cookbook_decisions_recipe_runs_against_the_server(tiny_dir, tmp_path) -> None:
    """tinker-cookbook 0.6.1's recipes/decisions, offline: its tokenizer is the tiny checkpoint's, its
    renderer the ChatML one the examples give SmolLM2; the probabilities it returns are the softmax
    of the label tokens' logprobs at the answer position (target_prompt_logprobs, sparse CSR)."""
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.decisions import Decision, DecisionRenderer, sample_decision
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    renderer = renderers.get_renderer("qwen3_instruct", tokenizer)
    rendering = DecisionRenderer(renderer).render(Decision("Which team answers SDK questions?",
                                                           [("billing", "payments"), ("sdk", "the package"),
                                                            ("docs", "the docs")]))
    # the rendered conversation is ~330 tokens of this byte-level tokenizer: a wider context
    engine = LocalEngine(tiny_dir, base_model=BASE, device="cpu", dtype=torch.float32,
                         settings=dataclasses.replace(ENGINE_SETTINGS, max_context=1024))
    with LiveServer(engine, tmp_path / "data") as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            sampler = client.create_sampling_client(base_model=BASE)
            probabilities = asyncio.run(sample_decision(sampler, rendering))
            scored, others = sampler.compute_logprobs(types.ModelInput.from_ints(rendering.with_label("sdk"))).result(), [
                sampler.compute_logprobs(types.ModelInput.from_ints(rendering.with_label(label))).result()
                for label in ("billing", "docs")]
        finally:
            client.close("success")
    assert list(probabilities) == ["billing", "sdk", "docs"] and abs(sum(probabilities.values()) - 1) < 1e-5
    lps = torch.tensor([others[0][rendering.choice_pos], scored[rendering.choice_pos], others[1][rendering.choice_pos]])
    want = torch.softmax(lps, 0).tolist()
    assert np.allclose(list(probabilities.values()), want, atol=1e-5)
