"""The sampler on a DeepSeek-V4 base (the paged compressed cache): logprobs vs the training forward with forked
samples over shared and copied prompt blocks, greedy in one mixed batch vs transformers' generate with the LoRA
merged, and preempted rows resuming from their swapped-out state."""

import torch
from tinker import types

from mint_server.engine.records import SamplingRecords
from mint_server.model.loader import load_model
from tests.deepseek_v4.helpers import merge_in_place
from tests.engine.helpers import AdapterRegistry
from tests.engine.helpers import SamplerHarness as Sampler
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf
from tests.moe.test_moe_sampling import drain, prompt_of
from tests.tolerance import for_model


def test_sampled_logprobs_equal_the_training_forward(v4_dir):
    """Prompts of 13 (its last block partly filled: copied for the second sample) and 16 tokens (its blocks
    full: shared, the compressor state read from a shared block), two samples each, on two adapters and the
    base in one sampler; 14 new tokens cross several windows of both compressors."""
    model = load_model(v4_dir, device="cpu")
    residency = AdapterRegistry(model.config, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    ids = [residency.install(random_adapter(model.config, r, seed=s), trainable=False).id for r, s in ((4, 1), (8, 2))]
    sampler = Sampler(model, residency, kv_slots=12, max_seq_len=64, block_size=8, records=SamplingRecords())
    p = types.SamplingParams(stop=[], max_tokens=14, temperature=1.0, seed=3)
    futures = {(a, n): sampler.submit(a, prompt_of(7 + n, n), 2, p) for a in [None, *ids] for n in (13, 16)}
    drain(sampler)
    for (aid, n), f in futures.items():
        lora = None if aid is None else residency.bank.batch([residency.get(aid).slot])
        prompt = prompt_of(7 + n, n)
        seqs = f.result().sequences
        assert seqs[0].tokens != seqs[1].tokens
        for seq in seqs:
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([prompt + seq.tokens]), lora=lora)[0], -1)
            want = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(seq.tokens)]
            for_model(model.config).check(seq.logprobs, want, (aid, n))


def test_greedy_in_one_mixed_batch_matches_transformers_with_merged_lora(v4_dir):
    model = load_model(v4_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    adapter = random_adapter(cfg, 4, seed=11)
    ids = [None, residency.install(adapter, trainable=False).id]
    prompt = prompt_of(1, 9)
    sampler = Sampler(model, residency, kv_slots=8, max_seq_len=64, block_size=8, records=SamplingRecords())
    p = types.SamplingParams(stop=[], max_tokens=12, temperature=0.0)
    futures = [sampler.submit(a, prompt, 1, p) for a in ids]
    drain(sampler)
    got = [f.result().sequences[0].tokens for f in futures]
    for weights, tokens in zip([None, adapter], got, strict=True):
        hf = load_hf(v4_dir)
        if weights is not None:
            merge_in_place(hf, cfg, weights)
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                              do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert tokens == out[0, 9:].tolist()
    assert got[1] != got[0]


def test_preempted_rows_resume_from_their_swapped_compressor_state(v4_dir):
    """Three long sampled rows fill the pool; a request of a less-served key preempts one (its blocks —
    window K=V, entries and compressor state — go to host memory and come back into other blocks); every
    row's tokens equal its unpreempted run."""
    model = load_model(v4_dir, device="cpu")
    residency = AdapterRegistry(model.config, num_slots=2, max_rank=8, device="cpu", dtype=torch.float32)
    aid = residency.install(random_adapter(model.config, 4, seed=30), trainable=False).id
    p = types.SamplingParams(stop=[], max_tokens=22, temperature=1.0, seed=11)
    prompts = [prompt_of(40 + i, 6) for i in range(3)]

    def run(kv_slots):
        sampler = Sampler(model, residency, kv_slots=kv_slots, max_seq_len=32, block_size=8)
        heavy = [sampler.submit(aid, pr, 1, p, key="heavy") for pr in prompts]
        for _ in range(5):
            sampler.step()
        quiet = sampler.submit(None, prompt_of(50, 5), 1, types.SamplingParams(stop=[], max_tokens=4, temperature=0.0),
                                key="quiet")
        drain(sampler)
        return [f.result().sequences[0].tokens for f in heavy + [quiet]], sampler.stats

    roomy, stats = run(8)
    assert stats.preempted == 0
    tight, stats = run(3)  # 3 rows of 28 positions fill 3 × 4 blocks of 8 = 12 of 15; the quiet one needs 2
    assert stats.preempted >= 1 and stats.resumed == stats.preempted
    assert tight == roomy
