"""Tensor parallelism at the model level: two gloo ranks vs one process, same weights and adapters,
dense (Qwen3, tied embeddings) and MoE (Qwen3-MoE, untied), both kernel paths."""

from __future__ import annotations

from pathlib import Path

from tests.tiny import make_tiny_checkpoint
from tests.tp.harness import run_ranks
from tests.tp.workers import parity_all, parity_mla


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


def test_tp2_mla_matches_tp1_logits_loss_grads_latent_decode(tmp_path: Path) -> None:
    """MLA bases split by heads (q_b / q_proj and kv_b_proj column-parallel, o_proj row-parallel, the shared
    experts like a dense MLP) with the latent cache replicated: DeepSeek-V3 (q_a/q_b, yarn, a dense layer),
    a q_proj variant (rotate-half rope, two shared experts) and V3.2 (the indexer, replicated)."""
    from tests.mla.tiny_deepseek import YARN, make_tiny_deepseek

    ckpts = {"v3": str(make_tiny_deepseek(tmp_path / "v3", "v3", rope_parameters=YARN)),
             "v3_q_proj": str(make_tiny_deepseek(tmp_path / "v3q", "v3", seed=1, q_lora_rank=None,
                                                 rope_interleave=False, n_shared_experts=2)),
             "v32": str(make_tiny_deepseek(tmp_path / "v32", "v32", seed=2))}
    results = run_ranks(parity_mla, ckpts)
    for family, by_mode in results.items():
        assert by_mode.pop("sliced_load_equal"), family
        vocab = by_mode.pop("vocab_parallel_logprobs")
        assert vocab["values"] <= 1e-5 and vocab["grad"] <= 1e-5, (family, vocab)
        r = by_mode["fast"]
        where = (family, r)
        assert r["lora_effect"] > 1e-3, where
        assert r["logits"] <= 1e-5 and r["decode_logits"] <= 1e-5 and r["greedy_equal"], where
        assert r["loss"] <= 1e-5 * max(1.0, abs(r["loss_value"])), where
        assert r["grads"] <= 1e-5 * max(1.0, r["grad_scale"]), where


def test_tp_refuses_what_it_cannot_split_by_name(tmp_path: Path) -> None:
    import pytest

    from mint_server.model.config import ModelConfig
    from mint_server.model.tp import TPNotSupportedError, check_supported
    from tests.deepseek_v4.tiny_v4 import tiny_v4_kwargs
    from tests.mla.tiny_deepseek import tiny_deepseek_kwargs

    biased = ModelConfig.from_hf_dict({**tiny_deepseek_kwargs(attention_bias=True), "model_type": "deepseek_v3"})
    check_supported(biased, 1)
    with pytest.raises(TPNotSupportedError, match="DeepseekV3ForCausalLM with attention_bias"):
        check_supported(biased, 2)
    v4 = ModelConfig.from_hf_dict({**tiny_v4_kwargs(), "model_type": "deepseek_v4", "head_dim": 32})
    with pytest.raises(TPNotSupportedError, match="DeepseekV4ForCausalLM"):
        check_supported(v4, 2)
    with pytest.raises(TPNotSupportedError, match="num_attention_heads \\(4\\)"):
        check_supported(ModelConfig.from_hf_dict({**tiny_deepseek_kwargs(), "model_type": "deepseek_v3"}), 3)
