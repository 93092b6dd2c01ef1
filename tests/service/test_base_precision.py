"""End to end: an adapter trained and published on an fp32 base, then served by a server whose base
is quantized to int8 (`mint serve --quantize int8`) on the same data dir, is warned about once per
revision (the catalog records the precision it was trained on: api/catalog/policies.py)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from tinker import types

from mint_server.api.auth.keys import owner_id
from mint_server.engine.local import LocalEngine
from tests.service.live import BASE, ENGINE_SETTINGS, KEY_A, LiveServer

POLICIES_LOG = "mint_server.api.catalog.policies"


@pytest.mark.slow  # two engines start and a round of training: ~60 s on 2 busy cores (the logic: tests/catalog)
def test_serving_a_revision_on_an_int8_base_warns_once(tiny_dir: Path, tmp_path: Path, caplog) -> None:
    data = tmp_path / "data"
    engine = LocalEngine(tiny_dir, base_model=BASE, device="cpu", dtype=torch.float32, settings=ENGINE_SETTINGS)
    with LiveServer(engine, data) as trainer:
        client = tinker.ServiceClient(base_url=trainer.url, api_key=KEY_A)
        tc = client.create_lora_training_client(base_model=BASE, rank=2, seed=3).result()
        tc.save_weights_for_sampler("s").result()
        policy = tc.model_id.replace(":", "-")
        (revision,) = trainer.service.core.policies.catalog.list_revisions(owner_id(KEY_A), policy).items
        assert revision.base_precision == "fp32"
        client.close("success")

    int8 = dataclasses.replace(ENGINE_SETTINGS, quantize="int8")
    engine = LocalEngine(tiny_dir, base_model=BASE, device="cpu", dtype=torch.float32, settings=int8)
    with LiveServer(engine, data) as server, caplog.at_level(logging.WARNING, logger=POLICIES_LOG):
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        for _ in range(2):
            sampler = client.create_sampling_client(model_path=f"tinker://{policy}@1").result()
            sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=2, temperature=0.0)).result()
        assert server.service.core.policies.precision_mismatches == 1
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert "mint_adapter_precision_mismatches 1.0" in metrics
        client.close("success")
    warnings = [r.getMessage() for r in caplog.records if r.name == POLICIES_LOG]
    assert len(warnings) == 1, warnings
    assert f"{policy}@1 was trained on a fp32 base" in warnings[0] and "runs in int8" in warnings[0]
