"""The sampler on a Qwen3-MoE base with expert LoRA: logprobs vs the training forward, greedy vs transformers."""

import torch
from tinker import types

from mint_server.engine.records import SamplingRecords
from mint_server.model.loader import load_model
from tests.engine.helpers import AdapterRegistry
from tests.engine.helpers import SamplerHarness as Sampler
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf, merge_in_place
from tests.tolerance import for_model


def drain(sampler: Sampler) -> None:
    for _ in range(10_000):
        if not sampler.has_work():
            break
        sampler.step()
    assert not sampler.has_work() and sampler.kv_blocks_in_use == 0


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_sampled_logprobs_equal_the_training_forward(moe_dir):
    model = load_model(moe_dir, device="cpu")
    residency = AdapterRegistry(model.config, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    ids = [residency.install(random_adapter(model.config, r, seed=s), trainable=False).id for r, s in ((4, 1), (8, 2))]
    sampler = Sampler(model, residency, kv_slots=8, max_seq_len=96, block_size=8, records=SamplingRecords())
    prompt = prompt_of(7, 13)
    p = types.SamplingParams(stop=[], max_tokens=16, temperature=1.0, seed=3)
    futures = {a: sampler.submit(a, prompt, 2, p) for a in [None, *ids]}
    drain(sampler)
    for aid, f in futures.items():
        lora = None if aid is None else residency.bank.batch([residency.get(aid).slot])
        for seq in f.result().sequences:
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([prompt + seq.tokens]), lora=lora)[0], -1)
            want = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(seq.tokens)]
            for_model(model.config).check(seq.logprobs, want, aid)


def test_greedy_in_one_mixed_batch_matches_transformers_with_merged_lora(moe_dir):
    model = load_model(moe_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    adapters = [random_adapter(cfg, 4, seed=11), random_adapter(cfg, 8, seed=12)]
    ids = [None] + [residency.install(w, trainable=False).id for w in adapters]
    prompts = [prompt_of(1, 9)] * 3  # one prompt: the rows differ only by adapter
    sampler = Sampler(model, residency, kv_slots=8, max_seq_len=96, block_size=8, records=SamplingRecords())
    p = types.SamplingParams(stop=[], max_tokens=12, temperature=0.0)
    futures = [sampler.submit(a, pr, 1, p) for a, pr in zip(ids, prompts, strict=True)]
    drain(sampler)
    got = [f.result().sequences[0].tokens for f in futures]
    for prompt, weights, tokens in zip(prompts, [None, *adapters], got, strict=True):
        hf = load_hf(moe_dir)
        if weights is not None:
            merge_in_place(hf, cfg, weights)
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                              do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert tokens == out[0, 9:].tolist()
    assert got[1] != got[0] and got[2] != got[0]  # the expert-LoRA adapters really steer generation
