"""Tensor parallelism at the model level: two gloo ranks vs one process, same weights and adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny import make_tiny_checkpoint
from tests.tp.harness import run_ranks
from tests.tp.workers import parity


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_tp2_matches_tp1_logits_loss_grads_greedy(tmp_path: Path, family: str) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / family, family, tie=family == "qwen3")
    results = run_ranks(parity, str(ckpt), ("fast", "reference"))
    for mode, r in results.items():
        assert r["lora_effect"] > 1e-3, mode  # the adapters really change the output
        assert r["logits"] <= 1e-5, (mode, r)
        assert r["loss"] <= 1e-5 * max(1.0, abs(r["loss_value"])), (mode, r)
        assert r["grads"] <= 1e-5 * max(1.0, r["grad_scale"]), (mode, r)
        assert r["decode_logits"] <= 1e-5, (mode, r)
        assert r["greedy_equal"], (mode, r)
