"""Tensor parallelism at the model level: two gloo ranks vs one process, same weights and adapters,
dense (Qwen3, tied embeddings) and MoE (Qwen3-MoE, untied), both kernel paths."""

from __future__ import annotations

from pathlib import Path

from tests.tiny import make_tiny_checkpoint
from tests.tp.harness import run_ranks
from tests.tp.workers import parity_all


def test_tp2_matches_tp1_logits_loss_grads_greedy(tmp_path: Path) -> None:
    ckpts = {"qwen3": str(make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", tie=True)),
             "qwen3_moe": str(make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", tie=False))}
    fused = make_tiny_checkpoint(tmp_path / "moe-fused", "qwen3_moe", tie=True, fused_experts=True)
    results = run_ranks(parity_all, ckpts, ("fast", "reference"), str(fused))
    assert results.pop("fused_sliced_load_equal")
    for family, by_mode in results.items():
        assert by_mode.pop("sliced_load_equal"), family
        vocab = by_mode.pop("vocab_parallel_logprobs")
        assert vocab["values"] <= 1e-5 and vocab["grad"] <= 1e-5, (family, vocab)
        for mode, r in by_mode.items():
            where = (family, mode, r)
            assert r["lora_effect"] > 1e-3, where  # the adapters really change the output
            assert r["logits"] <= 1e-5, where
            assert r["loss"] <= 1e-5 * max(1.0, abs(r["loss_value"])), where
            assert r["grads"] <= 1e-5 * max(1.0, r["grad_scale"]), where
            assert r["decode_logits"] <= 1e-5, where
            assert r["greedy_equal"], where
