"""The sampler on DeepSeek bases (latent KV cache, absorbed decode, V3.2 indexer): logprobs vs the training
forward, greedy vs transformers with the LoRA merged, and the KV budget in bytes."""

import pytest
import torch
from tinker import types

from mint_server.engine.records import SamplingRecords
from mint_server.engine.settings import EngineSettings
from mint_server.model.config import ModelConfig
from mint_server.model.kv_cache import kv_bytes_per_token
from mint_server.model.loader import load_model
from tests.engine.helpers import AdapterRegistry
from tests.engine.helpers import SamplerHarness as Sampler
from tests.mla.helpers import merge_in_place
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf
from tests.moe.test_moe_sampling import drain, prompt_of
from tests.tolerance import for_model


@pytest.mark.parametrize("fixture", ["v3_dir", "v32_dir"])
def test_sampled_logprobs_equal_the_training_forward(fixture, request):
    model = load_model(request.getfixturevalue(fixture), device="cpu")
    residency = AdapterRegistry(model.config, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    ids = [residency.install(random_adapter(model.config, r, seed=s), trainable=False).id for r, s in ((4, 1), (8, 2))]
    sampler = Sampler(model, residency, kv_slots=8, max_seq_len=64, block_size=8, records=SamplingRecords())
    prompt = prompt_of(7, 13)
    p = types.SamplingParams(stop=[], max_tokens=14, temperature=1.0, seed=3)
    futures = {a: sampler.submit(a, prompt, 2, p) for a in [None, *ids]}
    drain(sampler)
    for aid, f in futures.items():
        lora = None if aid is None else residency.bank.batch([residency.get(aid).slot])
        for seq in f.result().sequences:
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([prompt + seq.tokens]), lora=lora)[0], -1)
            want = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(seq.tokens)]
            for_model(model.config).check(seq.logprobs, want, aid)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["v3_dir", "v32_dir"])
def test_greedy_in_one_mixed_batch_matches_transformers_with_merged_lora(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    adapters = [random_adapter(cfg, 4, seed=11), random_adapter(cfg, 8, seed=12)]
    ids = [None] + [residency.install(w, trainable=False).id for w in adapters]
    prompt = prompt_of(1, 9)
    sampler = Sampler(model, residency, kv_slots=8, max_seq_len=64, block_size=8, records=SamplingRecords())
    p = types.SamplingParams(stop=[], max_tokens=10, temperature=0.0)
    futures = [sampler.submit(a, prompt, 1, p) for a in ids]
    drain(sampler)
    got = [f.result().sequences[0].tokens for f in futures]
    for weights, tokens in zip([None, *adapters], got, strict=True):
        hf = load_hf(model_dir)
        if weights is not None:
            merge_in_place(hf, cfg, weights)
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                              do_sample=False, max_new_tokens=10, pad_token_id=0)
        assert tokens == out[0, 9:].tolist()
    assert got[1] != got[0] and got[2] != got[0]


def test_kv_budget_in_bytes_holds_more_positions_with_the_latent_cache(v3_dir):
    cfg = ModelConfig.from_hf_dir(v3_dir)
    latent = kv_bytes_per_token(cfg, torch.bfloat16)
    m = cfg.mla
    full = cfg.num_layers * cfg.num_heads * (m.qk_head_dim + m.v_head_dim) * 2
    s = EngineSettings(kv_budget_mb=1.0)
    assert s.kv_tokens(latent) == 2**20 // latent and s.kv_tokens(latent) > s.kv_tokens(full) * 4
    assert EngineSettings(kv_budget_tokens=100).kv_tokens(latent) == 100
    with pytest.raises(ValueError, match="kv_budget_mb"):
        EngineSettings(kv_budget_mb=0).check()
