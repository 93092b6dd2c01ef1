"""DeepSeek-V3 / V3.2 in our model code vs the transformers oracle: base, LoRA on every target, gradients,
and the latent-cache absorbed decode vs the naive expanded path."""

import pytest
import torch
from tinker import types

from mint_server.model.config import ModelConfig
from mint_server.model.deepseek import MLAttention
from mint_server.model.kv_cache import CacheView, KVCache, kv_bytes_per_token
from mint_server.model.loader import load_model
from mint_server.model.lora import ALL_TARGETS, MLA_TARGETS, SHARED_TARGETS, LoraBank, target_layers
from tests.engine.helpers import AdapterRegistry, TrainRequest
from tests.engine.helpers import TrainerHarness as Trainer
from tests.mla.helpers import merged_logits
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf
from tests.moe.test_moe_model import sft_datums
from tests.tolerance import for_model


def tokens_of(seed, rows, length, vocab=320):
    """Random tokens above the pad id (0): a pad token's embedding is zero, so V3.2's indexer scores every
    key 0 for it and top-k between exact ties is arbitrary (in transformers too)."""
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))

FIXTURES = ["v3_dir", "v3_qproj_dir", "v32_dir"]


def test_config_reads_deepseek_fields(v3_dir, v3_qproj_dir, v32_dir):
    cfg = ModelConfig.from_hf_dir(v3_dir)
    m = cfg.mla
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.num_experts == 8
    assert cfg.dense_layers == (0,) and cfg.sparse_layers == (1, 2)
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.v_head_dim, m.n_group, m.topk_group) == (24, 16, 24, 12, 4, 2)
    assert cfg.rope_scaling["rope_type"] == "yarn" and m.softmax_scale != pytest.approx(24**-0.5)
    assert set(target_layers(cfg)) >= {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                       *SHARED_TARGETS, "gate_proj", "expert_gate_proj"}
    assert "q_proj" not in target_layers(cfg) and "k_proj" not in target_layers(cfg)
    q = ModelConfig.from_hf_dir(v3_qproj_dir)
    assert q.mla.q_lora_rank is None and "q_proj" in target_layers(q) and "q_a_proj" not in target_layers(q)
    v32 = ModelConfig.from_hf_dir(v32_dir)
    assert v32.mla.dsa and (v32.mla.index_topk, v32.mla.index_n_heads, v32.mla.index_head_dim) == (6, 8, 16)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_base_logits_match_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    tokens = tokens_of(1, 3, 29)
    with torch.no_grad():
        for_model(model.config).check(model(tokens), load_hf(model_dir)(tokens).logits, "logits vs transformers")


@pytest.mark.parametrize("fixture", FIXTURES)
def test_lora_on_every_target_matches_merged_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    adapter = random_adapter(cfg, rank=4, seed=3)
    assert set(adapter.weights) == set(target_layers(cfg))  # every target of this base, shared experts too
    bank = LoraBank(cfg, num_slots=3, max_rank=8, device="cpu", dtype=torch.float32)
    bank.write(1, adapter.weights, adapter.rank, adapter.alpha)
    tokens = tokens_of(2, 2, 23)
    hf = load_hf(model_dir)
    with torch.no_grad():
        ours, base = model(tokens, lora=bank.batch([1, 1])), model(tokens)
        ref = merged_logits(hf, cfg, adapter, tokens)
        # MLA projections alone (kv_b_proj included) steer the logits too
        attn = random_adapter(cfg, rank=4, seed=4, targets=MLA_TARGETS + ("q_proj", "o_proj"))
        bank.write(2, attn.weights, 4, attn.alpha)
        ours_a, ref_a = model(tokens, lora=bank.batch([2, 2])), merged_logits(hf, cfg, attn, tokens)
    assert (ours - base).abs().max().item() > 1e-2 and (ours_a - base).abs().max().item() > 1e-3
    for_model(cfg).check(ours, ref, "LoRA logits")
    for_model(cfg).check(ours_a, ref_a, "MLA-only LoRA logits")


@pytest.mark.parametrize("fixture", ["v3_dir", pytest.param("v32_dir", marks=pytest.mark.slow)])
def test_training_grads_match_autograd_through_merged_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    trainer = Trainer(model, residency, base_model="tiny-deepseek")
    weights = random_adapter(cfg, rank=4, seed=5)
    adapter = residency.install(weights, trainable=True)
    other = residency.install(random_adapter(cfg, rank=2, seed=6), trainable=True)  # fused with another adapter
    datums = sft_datums([17, 9, 21], seed=1)
    outs = trainer.run([TrainRequest(adapter.id, datums, "cross_entropy"),
                        TrainRequest(other.id, sft_datums([11], seed=2), "cross_entropy")])
    assert not isinstance(outs[0], Exception), outs[0]

    hf = load_hf(model_dir)
    hf.requires_grad_(False)
    ref = type(weights)({t: (a.clone().requires_grad_(True), b.clone().requires_grad_(True))
                         for t, (a, b) in weights.weights.items()}, weights.rank, weights.alpha)
    total = 0.0
    for d in datums:
        toks = torch.tensor([d.model_input.to_ints()])
        lp = torch.log_softmax(merged_logits(hf, cfg, ref, toks)[0], -1)
        lp = lp.gather(-1, d.loss_fn_inputs["target_tokens"].to_torch()[:, None])[:, 0]
        loss = -(d.loss_fn_inputs["weights"].to_torch() * lp).sum()
        loss.backward()
        total += loss.item()
    for_model(cfg).check_scalar(outs[0].metrics["loss:sum"], total, sum(len(d.model_input.to_ints()) for d in datums))
    assert set(adapter.grads) == set(weights.weights)
    for t, (gA, gB) in adapter.grads.items():
        for_model(cfg).check_rel(gA, ref.weights[t][0].grad, (t, "A"))
        for_model(cfg).check_rel(gB, ref.weights[t][1].grad, (t, "B"))
    assert all(p.grad is None for p in model.parameters())  # base, router and indexer stay frozen


def test_train_switches_cover_mla_and_shared_experts(v3_dir):
    model = load_model(v3_dir, device="cpu")
    trainer = Trainer(model, AdapterRegistry(model.config, 3, 8, "cpu", torch.float32), base_model="tiny-deepseek")
    full = trainer.residency.get(trainer.create_adapter(types.LoraConfig(rank=4, seed=1)))
    assert set(full.targets) == set(target_layers(model.config))
    attn = trainer.residency.get(trainer.create_adapter(types.LoraConfig(rank=4, seed=1, train_mlp=False,
                                                                        train_unembed=False)))
    assert set(attn.targets) == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert set(ALL_TARGETS) >= set(full.targets)


def decode_all(model, tokens, lora, absorb: bool, block_size=4, prefill=7):
    """Prefill `prefill` tokens into a paged latent cache, then decode the rest one token per step;
    each step's logits [B, T - prefill + 1, V]."""
    B, T = tokens.shape
    n_blocks = -(-T // block_size)
    cache = KVCache(model.config, 1 + B * n_blocks, block_size, "cpu", torch.float32)
    # rows own interleaved blocks (row b: 1 + b, 1 + B + b, …) so a wrong table would read a neighbour
    table = torch.tensor([[1 + b + B * i for i in range(n_blocks)] for b in range(B)])
    MLAttention.absorb = absorb
    try:
        pos = torch.arange(prefill).expand(B, prefill)
        out = [model(tokens[:, :prefill], pos, lora, CacheView(cache, table, pos))[:, -1]]
        for t in range(prefill, T):
            pos = torch.full((B, 1), t)
            out.append(model(tokens[:, t : t + 1], pos, lora, CacheView(cache, table, pos))[:, 0])
    finally:
        MLAttention.absorb = True
    return torch.stack(out, 1), cache


@pytest.mark.parametrize("fixture", FIXTURES)
def test_absorbed_latent_decode_equals_naive_expanded_path_with_kv_b_lora_mixed_batch(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    bank = LoraBank(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    bank.write(0, random_adapter(cfg, 8, seed=1).weights, 8, 16.0)  # every target
    bank.write(2, random_adapter(cfg, 4, seed=2, targets=("kv_b_proj",)).weights, 4, 32.0)  # kv_b_proj alone
    row_slots = [0, -1, 2, 0, 2]
    tokens = tokens_of(9, len(row_slots), 19)
    lora = bank.batch(row_slots)
    with torch.no_grad():
        absorbed, cache = decode_all(model, tokens, lora, absorb=True)
        naive, _ = decode_all(model, tokens, lora, absorb=False)
        full = model(tokens, lora=lora)  # no cache: the training forward
        bare, _ = decode_all(model, tokens, None, absorb=True)
    assert set(cache.pools) == ({"latent", "k_rope", "index_k"} if cfg.mla.dsa else {"latent", "k_rope"})
    for_model(cfg).check(absorbed, naive, "absorbed vs naive decode")
    for_model(cfg).check(absorbed, full[:, 6:], "absorbed decode vs training forward")
    # the kv_b_proj-only adapter changes the absorbed products (row 2 differs from the base)
    assert (absorbed[2] - bare[2]).abs().max().item() > 1e-3
    for_model(cfg).check(absorbed[1], bare[1], "base row")


def test_latent_cache_bytes_per_token(v3_dir):
    cfg = ModelConfig.from_hf_dir(v3_dir)
    m = cfg.mla
    assert kv_bytes_per_token(cfg, torch.float32) == cfg.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    cache = KVCache(cfg, 5, 4, "cpu", torch.float32)
    assert cache.nbytes == 5 * 4 * kv_bytes_per_token(cfg, torch.float32)


def test_peft_round_trip_keeps_every_deepseek_target(v3_dir, tmp_path):
    from mint_server.model.peft_io import load_peft, save_peft

    cfg = ModelConfig.from_hf_dir(v3_dir)
    adapter = random_adapter(cfg, rank=2, seed=8)
    save_peft(adapter, tmp_path / "a", "tiny-deepseek", cfg)
    back = load_peft(tmp_path / "a", cfg)
    assert set(back.weights) == set(adapter.weights)
    for t, (a, b) in adapter.weights.items():
        assert torch.equal(back.weights[t][0], a) and torch.equal(back.weights[t][1], b), t
