"""DeepSeek-V4 in our model code vs the transformers oracle: config parsing, base logits, LoRA on every target,
training gradients, the compressed cache (chunked prefill and decode) vs the whole-sequence forward, PEFT files."""

import dataclasses
import json

import pytest
import torch
from tinker import types

from mint_server.model.config import ModelConfig, ModelError, UnsupportedModelError
from mint_server.model.deepseek_v4 import V4Attention
from mint_server.model.kv_cache import CacheView, KVCache, kv_bytes_per_token
from mint_server.model.loader import load_model
from mint_server.model.lora import COMPRESSOR_TARGETS, V4_TARGETS, LoraBank, target_layers
from mint_server.model.peft_io import load_peft, save_peft
from mint_server.model.v4_spec import CSA, HCA, SLIDING
from tests.deepseek_v4.helpers import merged_logits
from tests.deepseek_v4.tiny_v4 import LAYER_TYPES
from tests.engine.helpers import AdapterRegistry, TrainRequest
from tests.engine.helpers import TrainerHarness as Trainer
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf
from tests.moe.test_moe_model import sft_datums
from tests.tolerance import for_model

FIXTURES = ["v4_dir", "v4_yarn_dir"]


def tokens_of(seed, rows, length, vocab=320):
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_config_reads_v4_fields_and_legacy_spellings(v4_dir):
    cfg = ModelConfig.from_hf_dir(v4_dir)
    v = cfg.v4
    assert cfg.architecture == "DeepseekV4ForCausalLM" and cfg.mla is None
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.sparse_layers) == (1, 32, 32, (0, 1, 2, 3))
    assert v.layer_types == tuple(LAYER_TYPES) and (v.csa_rate, v.hca_rate, v.rope_dim, v.hash_layers) == (4, 8, 8, (0,))
    layers = target_layers(cfg)
    assert layers["csa_kv_proj"] == (1, 3) and layers["hca_gate_proj"] == (2,) and layers["kv_proj"] == (0, 1, 2, 3)
    assert "o_a_proj" not in layers and "q_proj" not in layers and "gate_proj" not in layers
    # the checkpoint's legacy spellings (DeepSeek's published config.json) give the same spec
    hf = json.loads((v4_dir / "config.json").read_text())
    legacy = {k: x for k, x in hf.items() if k not in ("layer_types", "mlp_layer_types", "partial_rotary_factor",
                                                       "rope_parameters", "compress_rates")}
    legacy.update(compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1, qk_rope_head_dim=8, compress_rate_hca=8,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    old = ModelConfig.from_hf_dict(legacy).v4
    assert dataclasses.replace(old, compress_rope=None) == v
    assert old.compress_rope["rope_type"] == "yarn" and old.compress_rope["attention_factor"] == 1.0
    with pytest.raises(UnsupportedModelError, match="compress_ratios holds \\[16\\]"):
        ModelConfig.from_hf_dict({**legacy, "compress_ratios": [0, 16, 4, 4]})
    with pytest.raises(UnsupportedModelError, match="scoring_func 'tanh'"):
        ModelConfig.from_hf_dict({**hf, "scoring_func": "tanh"})


@pytest.mark.parametrize("fixture", FIXTURES)
def test_base_logits_match_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    tokens = tokens_of(1, 3, 29)
    with torch.no_grad():
        for_model(model.config).check(model(tokens), load_hf(model_dir)(tokens).logits, "logits vs transformers")


def test_the_indexer_and_the_window_shape_the_output(v4_dir):
    """The parity above exercises the top-k selection and the window: widening either changes the logits."""
    model = load_model(v4_dir, device="cpu")
    tokens = tokens_of(1, 2, 29)
    indexers = [b.self_attn.compressor.indexer for b in model.layers if b.self_attn.kind == CSA]
    with torch.no_grad():
        base = model(tokens)
        for ix in indexers:
            ix.top_k = 64
        wide_topk = model(tokens)
        for ix in indexers:
            ix.top_k = model.config.v4.index_topk
        wide = dataclasses.replace(model.config.v4, sliding_window=64)
        for block in model.layers:
            block.self_attn.spec = wide
        wide_window = model(tokens)
    assert (wide_topk - base).abs().max().item() > 1e-3 and (wide_window - base).abs().max().item() > 1e-3


@pytest.mark.parametrize("fixture", FIXTURES)
def test_lora_on_every_target_matches_merged_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    adapter = random_adapter(cfg, rank=4, seed=3)
    assert set(adapter.weights) == set(target_layers(cfg))
    attn = random_adapter(cfg, rank=4, seed=4, targets=V4_TARGETS + COMPRESSOR_TARGETS + ("q_a_proj", "q_b_proj"))
    bank = LoraBank(cfg, num_slots=3, max_rank=8, device="cpu", dtype=torch.float32)
    bank.write(1, adapter.weights, adapter.rank, adapter.alpha)
    bank.write(2, attn.weights, attn.rank, attn.alpha)
    tokens = tokens_of(2, 3, 23)
    hf = load_hf(model_dir)
    with torch.no_grad():
        ours, base = model(tokens, lora=bank.batch([1, 2, -1])), model(tokens)
        ref = torch.cat([merged_logits(hf, cfg, adapter, tokens[:1]), merged_logits(hf, cfg, attn, tokens[1:2])])
    assert (ours[0] - base[0]).abs().max().item() > 1e-2 and (ours[1] - base[1]).abs().max().item() > 1e-3
    for_model(cfg).check(ours[:2], ref, "mixed-adapter LoRA logits")
    for_model(cfg).check(ours[2], base[2], "base row")


def test_compressor_lora_alone_changes_only_compressed_layers(v4_dir):
    """csa_/hca_ targets exist only in their layers and steer the output through the compressed entries."""
    model = load_model(v4_dir, device="cpu")
    cfg = model.config
    comp = random_adapter(cfg, rank=4, seed=7, targets=COMPRESSOR_TARGETS)
    assert {t: a.shape[0] for t, (a, _) in comp.weights.items()} == {
        "csa_kv_proj": 2, "csa_gate_proj": 2, "hca_kv_proj": 1, "hca_gate_proj": 1}
    bank = LoraBank(cfg, num_slots=1, max_rank=4, device="cpu", dtype=torch.float32)
    bank.write(0, comp.weights, 4, comp.alpha)
    tokens = tokens_of(3, 1, 27)
    with torch.no_grad():
        ours = model(tokens, lora=bank.batch([0]))
        for_model(cfg).check(ours, merged_logits(load_hf(v4_dir), cfg, comp, tokens), "compressor LoRA")
        # before the first window closes (position rate - 1), no compressed entry is visible
        for_model(cfg).check(ours[:, :3], model(tokens)[:, :3], "no entry visible yet")
    assert (ours - model(tokens)).abs().max().item() > 1e-3


@pytest.mark.parametrize("fixture", ["v4_dir", pytest.param("v4_yarn_dir", marks=pytest.mark.slow)])
def test_training_grads_match_autograd_through_merged_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    trainer = Trainer(model, residency, base_model="tiny-v4")
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
    worst = 0.0
    for t, (gA, gB) in adapter.grads.items():
        for g, want in ((gA, ref.weights[t][0].grad), (gB, ref.weights[t][1].grad)):
            assert want.norm() > 0, t
            worst = max(worst, ((g - want).norm() / want.norm()).item())
    assert worst <= 1e-5, worst  # the bar (the tolerance policy's bound is wider)
    assert all(p.grad is None for p in model.parameters())  # base, routers, indexer, hyper-connections frozen


def test_train_switches_cover_v4_attention_and_compressors(v4_dir):
    model = load_model(v4_dir, device="cpu")
    trainer = Trainer(model, AdapterRegistry(model.config, 3, 8, "cpu", torch.float32), base_model="tiny-v4")
    full = trainer.residency.get(trainer.create_adapter(types.LoraConfig(rank=4, seed=1)))
    assert set(full.targets) == set(target_layers(model.config))
    attn = trainer.residency.get(trainer.create_adapter(types.LoraConfig(rank=4, seed=1, train_mlp=False,
                                                                        train_unembed=False)))
    assert set(attn.targets) == {"q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", *COMPRESSOR_TARGETS}


def decode_all(model, tokens, lora, block_size=8, steps=((0, 7), (7, 16))):
    """Prefill chunks `steps` ((start, end) positions) into a paged cache, then decode the rest one
    token per step; the logits of every position [B, T, V]."""
    B, T = tokens.shape
    n_blocks = -(-T // block_size)
    cache = KVCache(model.config, 1 + B * n_blocks, block_size, "cpu", torch.float32)
    # rows own interleaved blocks (row b: 1 + b, 1 + B + b, …) so a wrong table reads a neighbour's
    table = torch.tensor([[1 + b + B * i for i in range(n_blocks)] for b in range(B)])
    spans = list(steps) + [(t, t + 1) for t in range(steps[-1][1], T)]
    out = []
    for a, e in spans:
        pos = torch.arange(a, e).expand(B, e - a)
        out.append(model(tokens[:, a:e], pos, lora, CacheView(cache, table, pos)))
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("fixture", FIXTURES)
def test_compressed_cache_prefill_chunks_and_decode_equal_the_whole_forward(fixture, request):
    model = load_model(request.getfixturevalue(fixture), device="cpu")
    cfg = model.config
    bank = LoraBank(cfg, num_slots=3, max_rank=8, device="cpu", dtype=torch.float32)
    bank.write(0, random_adapter(cfg, 8, seed=1).weights, 8, 16.0)
    bank.write(2, random_adapter(cfg, 4, seed=2, targets=COMPRESSOR_TARGETS).weights, 4, 32.0)
    tokens = tokens_of(9, 4, 37)
    lora = bank.batch([0, -1, 2, 0])
    with torch.no_grad():
        full = model(tokens, lora=lora)
        # chunks that start and end mid-window and mid-block, and one that is whole windows; blocks of 4
        # positions: an HCA window (8) spans two blocks, its state handed from block to block
        cases = (((0, 7), (7, 16)), 8), (((0, 8), (8, 11), (11, 24)), 8), (((0, 5), (5, 14)), 4)
        for steps, bs in cases if cfg.v4.compress_rope is None else cases[:1]:
            cached, _ = decode_all(model, tokens, lora, block_size=bs, steps=steps)
            for_model(cfg).check(cached, full, ("cached vs whole forward", steps, bs))
    cache = KVCache(cfg, 3, 8, "cpu", torch.float32)
    assert set(cache.pools) == {"kv", "csa_entry", "csa_state", "csa_ientry", "csa_istate", "hca_entry", "hca_state"}
    assert cache.pools["csa_state"].dtype == torch.float32 and cache.pools["csa_entry"].shape[2] == 2  # 8 / 4
    assert cache.pools["hca_entry"].shape[2] == 1


def test_decode_rows_at_different_positions_in_one_batch(v4_dir):
    """Decode rows of one step sit at different positions (one mid-window, one closing a window, one
    opening one): each equals its own whole forward."""
    model = load_model(v4_dir, device="cpu")
    cfg = model.config
    lengths = [13, 15, 16]
    seqs = [tokens_of(20 + i, 1, n + 1)[0] for i, n in enumerate(lengths)]
    cache = KVCache(cfg, 1 + 3 * 3, 8, "cpu", torch.float32)
    table = torch.tensor([[1 + b + 3 * i for i in range(3)] for b in range(3)])
    with torch.no_grad():
        for b, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            pos = torch.arange(n)[None]
            model(seq[None, :n], pos, None, CacheView(cache, table[b : b + 1], pos))
        pos = torch.tensor(lengths)[:, None]
        step = model(torch.stack([s[n] for s, n in zip(seqs, lengths, strict=True)])[:, None], pos, None,
                     CacheView(cache, table, pos))[:, 0]
        for b, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            for_model(cfg).check(step[b], model(seq[None, : n + 1])[0, -1], ("row", b))


def test_cache_bytes_per_token_count_every_pool(v4_dir):
    cfg = ModelConfig.from_hf_dir(v4_dir)
    cache = KVCache(cfg, 5, 8, "cpu", torch.float32)
    per_block = cache.nbytes // 5
    assert kv_bytes_per_token(cfg, torch.float32, block_size=8) == -(-per_block // 8)
    # sliding K=V for every position and layer; compressed entries per window; fp32 state per block
    D, Di = cfg.head_dim, cfg.v4.index_head_dim
    csa, hca = 2, 1
    want = 4 * (4 * 8 * D + csa * 2 * (D + Di) + hca * 1 * D) + 4 * (csa * 4 * (D + Di) + hca * 2 * D)
    assert per_block == want
    bf16 = KVCache(cfg, 2, 8, "cpu", torch.bfloat16)
    assert bf16.pools["kv"].dtype == torch.bfloat16 and bf16.pools["hca_state"].dtype == torch.float32


def test_layer_kinds(v4_dir):
    model = load_model(v4_dir, device="cpu")
    kinds = [(b.self_attn.kind, hasattr(b.self_attn, "compressor")) for b in model.layers]
    assert kinds == [(SLIDING, False), (CSA, True), (HCA, True), (CSA, True)]
    assert isinstance(model.layers[1].self_attn, V4Attention) and hasattr(model.layers[1].self_attn.compressor, "indexer")
    assert not hasattr(model.layers[2].self_attn.compressor, "indexer")


def test_peft_export_loads_in_transformers_peft(v4_dir, tmp_path):
    """An exported adapter (attention, compressors, shared experts, lm_head) loads with PEFT onto transformers'
    model and gives our logits; every target (experts too) round-trips through our own reader."""
    from peft import PeftModel

    model = load_model(v4_dir, device="cpu")
    cfg = model.config
    everything = random_adapter(cfg, rank=4, seed=11)
    save_peft(everything, tmp_path / "all", "tiny-v4", cfg)
    back = load_peft(tmp_path / "all", cfg)
    for t, (a, b) in everything.weights.items():
        assert torch.equal(back.weights[t][0], a) and torch.equal(back.weights[t][1], b), t
    config = json.loads((tmp_path / "all" / "adapter_config.json").read_text())
    assert {"kv_proj", "gate_proj", "o_b_proj", "q_a_proj"} <= set(config["target_modules"])

    targets = tuple(t for t in target_layers(cfg) if not t.startswith("expert_"))
    adapter = random_adapter(cfg, rank=4, seed=12, targets=targets)
    save_peft(adapter, tmp_path / "peft", "tiny-v4", cfg)
    hf = PeftModel.from_pretrained(load_hf(v4_dir), str(tmp_path / "peft")).eval()
    bank = LoraBank(cfg, num_slots=1, max_rank=4, device="cpu", dtype=torch.float32)
    bank.write(0, adapter.weights, adapter.rank, adapter.alpha)
    tokens = tokens_of(5, 2, 26)
    with torch.no_grad():
        ours, theirs = model(tokens, lora=bank.batch([0, 0])), hf(tokens).logits
    assert (ours - model(tokens)).abs().max().item() > 1e-2
    for_model(cfg).check(ours, theirs, "our LoRA vs transformers + PEFT")


def test_o_a_proj_lora_is_refused_by_name(v4_dir, tmp_path):
    """The grouped o_a_proj has no PEFT LoRA form (PEFT's LoRA on it fails), so it is no target: a file with
    one is refused naming the tensor."""
    from safetensors.torch import save_file

    cfg = ModelConfig.from_hf_dir(v4_dir)
    save_peft(random_adapter(cfg, rank=2, seed=1, targets=("kv_proj",)), tmp_path / "a", "tiny-v4", cfg)
    f = tmp_path / "a" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(str(f))
    tensors["base_model.model.model.layers.0.self_attn.o_a_proj.lora_A.weight"] = torch.zeros(2, 64)
    tensors["base_model.model.model.layers.0.self_attn.o_a_proj.lora_B.weight"] = torch.zeros(32, 2)
    save_file(tensors, str(f))
    with pytest.raises(ModelError, match="o_a_proj"):
        load_peft(tmp_path / "a", cfg)
