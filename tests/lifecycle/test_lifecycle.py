"""A LoRA policy's whole life through the real tinker SDK, the real `mint` CLI and a live server:
train → save_weights_for_sampler (= a catalog revision) → alias → sample by alias → rollback →
export → load with PEFT. Plus ownership, and what a corrupted blob does to sampling."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from tinker import types

from mint_server.api.auth.keys import owner_id
from tests.lifecycle.helpers import PROMPT, RemoteCli, greedy
from tests.service.live import BASE, KEY_A, KEY_B, LiveServer, tiny_engine, train
from tests.tiny import TINY_VOCAB

CATALOG = "/api/v1/mint/catalog"


def test_policy_lifecycle(tiny_dir: Path, tmp_path: Path, db_url: str | None) -> None:
    with LiveServer(tiny_engine(tiny_dir), tmp_path / "data", db_url=db_url) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0, user_metadata={"policy": "chat"}).result()
        train(tc, 2)
        path1 = tc.save_weights_for_sampler("first").result().path
        train(tc, 4)
        path2 = tc.save_weights_for_sampler("second").result().path
        # The SDK sees exactly what it saw before the catalog existed.
        assert path2 == f"tinker://{tc.model_id}/sampler_weights/second"

        cli = RemoteCli(server.url, KEY_A)
        revisions = cli("revision", "list", "chat")["items"]
        assert [(r["number"], r["step"], r["parent"], r["training_run"], r["rank"]) for r in revisions] == [
            (2, 6, "chat@1", tc.model_id, 4),
            (1, 2, None, tc.model_id, 4),
        ]
        policy = cli("policy", "show", "chat")
        assert policy["base_model"] == BASE and policy["owner"] == owner_id(KEY_A)
        assert policy["lora_config"] == {"rank": 4, "train_mlp": True, "train_attn": True, "train_unembed": True}

        out1 = greedy(client.create_sampling_client(model_path=path1).result())
        out2 = greedy(client.create_sampling_client(model_path=path2).result())
        assert out1[0] != out2[0], "the two revisions must sample differently for this test to mean anything"

        assert cli("alias", "set", "chat", "prod", "2")["revision"] == 2
        pinned = client.create_sampling_client(model_path="tinker://chat@prod").result()
        assert greedy(pinned) == out2
        # Every reference form names the same revision.
        sha2 = revisions[0]["sha256"]
        for ref in ("tinker://chat@2", f"tinker://chat@{sha2[:10]}", f"tinker://chat@sha256:{sha2[:8]}"):
            assert greedy(client.create_sampling_client(model_path=ref).result()) == out2, ref

        assert cli("alias", "rollback", "chat", "prod")["revision"] == 1
        assert greedy(client.create_sampling_client(model_path="tinker://chat@prod").result()) == out1
        assert greedy(pinned) == out2  # resolved when it was created: the rollback does not move it
        history = cli("alias", "history", "chat", "prod")["items"]
        assert [(e["action"], e["from_revision"], e["to_revision"]) for e in history] == [
            ("rollback", 2, 1),
            ("set", None, 2),
        ]

        rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
        info = rest.get_weights_info_by_tinker_path("tinker://chat@prod").result()
        assert (info.base_model, info.lora_rank, info.train_unembed) == (BASE, 4, True)
        # mint:// is a synonym (the tinker SDK only sends tinker://, so this one goes by hand).
        r = httpx.post(f"{server.url}/api/v1/weights_info", json={"tinker_path": "mint://chat@1"},
                       headers={"X-API-Key": KEY_A}, timeout=30)  # fmt: skip
        assert r.status_code == 200 and r.json()["lora_rank"] == 4, r.text

        # Unknown → 404; malformed → 400 naming the reference; never mistaken for a run path.
        with pytest.raises(tinker.NotFoundError, match="no alias 'staging'"):
            client.create_sampling_client(model_path="tinker://chat@staging").result()
        with pytest.raises(tinker.NotFoundError, match="policy 'nope' not found"):
            client.create_sampling_client(model_path="tinker://nope@prod").result()
        with pytest.raises(tinker.BadRequestError, match="chat@0"):
            client.create_sampling_client(model_path="tinker://chat@0").result()
        with pytest.raises(tinker.BadRequestError, match="invalid checkpoint name 'a@b'"):  # still a run path
            client.create_sampling_client(model_path=f"tinker://{tc.model_id}/sampler_weights/a@b").result()

        # Export: a PEFT dir that peft loads over the transformers model, computing what the engine does.
        export_dir = tmp_path / "chat-1"
        assert cli("export", "chat@1", str(export_dir))["number"] == 1
        engine_logprobs = _full_prompt_logprobs(client.create_sampling_client(model_path="tinker://chat@1").result())
        peft_logprobs = _peft_prompt_logprobs(tiny_dir, export_dir)
        torch.testing.assert_close(engine_logprobs, peft_logprobs, atol=1e-4, rtol=0)
        client.close("success")


def _full_prompt_logprobs(sc: tinker.SamplingClient) -> torch.Tensor:
    """The engine's log-softmax over the whole vocabulary at prompt positions 1…n-1: its logits up
    to a constant per position, which is all the wire carries of them."""
    out = sc.sample(PROMPT, 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=TINY_VOCAB).result()
    rows = out.topk_prompt_logprobs
    assert rows is not None and rows[0] is None
    dense = torch.full((len(rows) - 1, TINY_VOCAB), float("nan"))
    for i, row in enumerate(rows[1:]):
        assert row is not None and len(row) == TINY_VOCAB
        for token, logprob in row:
            dense[i, token] = logprob
    return dense


def _peft_prompt_logprobs(model_dir: Path, peft_dir: Path) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), peft_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT.to_ints()])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def test_other_keys_cannot_see_or_use_a_policy(tiny_dir: Path, tmp_path: Path) -> None:
    with LiveServer(tiny_engine(tiny_dir), tmp_path / "data") as server:
        a = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = a.create_lora_training_client(base_model=BASE, rank=2, user_metadata={"policy": "secret"}).result()
        tc.save_weights_for_sampler("s").result()
        RemoteCli(server.url, KEY_A)("alias", "set", "secret", "prod", "1")

        def api(method: str, path: str, key: str | None, **kw: object) -> httpx.Response:
            headers = {"X-API-Key": key} if key else {}
            return httpx.request(method, f"{server.url}{CATALOG}{path}", headers=headers, timeout=30, **kw)  # type: ignore[arg-type]

        assert api("GET", "/policies", None).status_code == 401
        assert api("GET", "/policies", "tml-not-a-known-key").status_code == 401
        assert [p["name"] for p in api("GET", "/policies", KEY_A).json()["items"]] == ["secret"]
        assert api("GET", "/policies", KEY_B).json()["items"] == []
        for method, path, body in [
            ("GET", "/policies/secret", None),
            ("GET", "/policies/secret/revisions", None),
            ("GET", "/revisions/secret@prod", None),
            ("GET", "/revisions/secret@1/archive", None),
            ("PUT", "/policies/secret/aliases/prod", {"revision": 1}),
            ("POST", "/policies/secret/aliases/prod/rollback", {}),
        ]:
            r = api(method, path, KEY_B, json=body)
            assert r.status_code == 404 and "not found" in r.json()["detail"], (method, path, r.text)
        assert "not found" in RemoteCli(server.url, KEY_B).fails("alias", "set", "secret", "prod", "1")

        b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
        with pytest.raises(tinker.NotFoundError):
            b.create_sampling_client(model_path="tinker://secret@prod").result()
        with pytest.raises(tinker.NotFoundError):
            tinker.RestClient(base_url=server.url, api_key=KEY_B).get_weights_info_by_tinker_path(
                "tinker://secret@prod"
            ).result()
        # B's own policy of the same name is B's alone.
        tb = b.create_lora_training_client(base_model=BASE, rank=2, user_metadata={"policy": "secret"}).result()
        tb.save_weights_for_sampler("s").result()
        assert api("GET", "/revisions/secret@1", KEY_B).json()["training_run"] == tb.model_id
        assert api("GET", "/revisions/secret@1", KEY_A).json()["training_run"] == tc.model_id
        a.close("success")
        b.close("success")


def test_corrupt_blob_fails_sampling_with_an_integrity_error(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with LiveServer(tiny_engine(tiny_dir), data) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=BASE, rank=2, user_metadata={"policy": "fragile"}).result()
        train(tc, 1)
        tc.save_weights_for_sampler("one").result()
        train(tc, 1)
        tc.save_weights_for_sampler("two").result()

        catalog = server.service.core.policies.catalog
        revision = catalog.resolve(owner_id(KEY_A), "fragile@2")
        weights = next(e for e in catalog.manifest(revision) if e.name == "adapter_model.safetensors")
        blob = catalog.blobs.path(weights.sha256)
        raw = bytearray(blob.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        blob.chmod(0o644)
        blob.write_bytes(bytes(raw))
        shutil.rmtree(data / "checkouts", ignore_errors=True)

        sc = client.create_sampling_client(model_path="tinker://fragile@2").result()
        with pytest.raises(tinker.RequestFailedError) as failure:
            sc.sample(PROMPT, 1, types.SamplingParams(max_tokens=2)).result()
        message = str(failure.value)
        assert "fragile@2" in message and "integrity" in message and weights.sha256 in message, message
        # Refused again on a retry (a failed load is not cached), and revision 1 is unaffected.
        with pytest.raises(tinker.RequestFailedError, match="integrity"):
            sc.sample(PROMPT, 1, types.SamplingParams(max_tokens=2)).result()
        ok = client.create_sampling_client(model_path="tinker://fragile@1").result()
        assert len(greedy(ok)[0]) == 8
        client.close("success")
