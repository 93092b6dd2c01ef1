"""A revision records the precision of the base it was trained on, and a server whose base runs in
another precision warns once per revision when it is resolved (api/catalog/policies.py), on the real
catalog."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from mint_server.api.catalog.policies import Policies, served_base_precision
from mint_server.catalog import Catalog
from mint_server.catalog.errors import InvalidArgument
from tests.catalog.helpers import BASE_MODEL, LORA, write_peft

OWNER = "alice"


def publish_on(catalog: Catalog, tmp_path: Path, precision: str | None, seed: int) -> None:
    """What save_weights_for_sampler does on a server whose base runs in `precision`."""
    trainer = Policies(catalog, BASE_MODEL, precision)
    asyncio.run(trainer.publish(OWNER, "p", write_peft(tmp_path / f"peft-{seed}", seed), lora_config=LORA,
                                parent=None, training_run="run", step=seed))


def test_serving_on_another_precision_warns_once_per_revision(catalog: Catalog, tmp_path: Path, caplog) -> None:
    publish_on(catalog, tmp_path, "fp32", 1)
    publish_on(catalog, tmp_path, "int8", 2)
    publish_on(catalog, tmp_path, None, 3)  # a server that cannot tell (a fleet): nothing recorded
    assert [catalog.get_revision(OWNER, "p", n).base_precision for n in (1, 2, 3)] == ["fp32", "int8", None]

    server = Policies(catalog, BASE_MODEL, "int8")
    with caplog.at_level(logging.WARNING, logger="mint_server.api.catalog.policies"):
        for ref in ("p@1", "p@1", "p@2", "p@3", "p@1"):
            revision, _ = server.resolve(ref, OWNER)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and server.precision_mismatches == 1, warnings
    assert "p@1 was trained on a fp32 base" in warnings[0] and "runs in int8" in warnings[0]
    # the same revision on a base of its own precision: no warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mint_server.api.catalog.policies"):
        Policies(catalog, BASE_MODEL, "fp32").resolve("p@1", OWNER)
    assert not caplog.records


def test_base_precision_is_validated(catalog: Catalog, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="base_precision") as e:
        catalog.publish_revision(OWNER, "p", write_peft(tmp_path / "peft"), base_model=BASE_MODEL,
                                 base_precision="x" * 33)
    assert e.value.field == "base_precision"
    assert catalog.list_policies(OWNER).items == []  # nothing half-written


def test_the_served_precision_names_dtype_runtime_and_stored_quantization(tmp_path: Path) -> None:
    """What a real engine reports: its dtype, or its quantized base after how the checkpoint was stored."""
    from mint_server.engine.local import LocalEngine
    from mint_server.engine.settings import EngineSettings
    from tests.model.test_prequantized import fp8_pair
    from tests.tiny import make_tiny_checkpoint

    plain = make_tiny_checkpoint(tmp_path / "tiny", "qwen3", tie=False)
    fp8_dir, _ = fp8_pair(plain, tmp_path)
    settings = EngineSettings(device_slots=1, max_rank=4, kv_budget_tokens=256, max_context=64)
    for model_dir, quantize, want in ((plain, "none", "fp32"), (fp8_dir, "none", "fp8-dequantized-fp32"),
                                      (fp8_dir, "int8", "fp8-dequantized-int8")):  # requantized after load
        engine = LocalEngine(model_dir, "tiny", device="cpu", dtype=torch.float32,
                             settings=dataclasses.replace(settings, quantize=quantize))
        try:
            assert served_base_precision(engine) == want
        finally:
            engine.shutdown()
