"""The sampler on gpt-oss and GLM-5 bases: logprobs of sampled tokens vs the training forward with prompts
prefilled in chunks and decoding past gpt-oss's sliding window (its paged, ragged path honours the
window and the sinks), and greedy tokens vs transformers with the LoRA merged, in one mixed batch."""

import pytest
import torch
from tinker import types

from mint_server.engine.records import SamplingRecords
from mint_server.model.kv_cache import KVCache, RaggedView
from mint_server.model.loader import load_model
from mint_server.model.lora import LoraBank
from tests.engine.helpers import AdapterRegistry
from tests.engine.helpers import SamplerHarness as Sampler
from tests.families.helpers import merge_in_place
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf
from tests.moe.test_moe_sampling import drain, prompt_of
from tests.tolerance import for_model

FIXTURES = ["gpt_oss_dir", "glm_dir"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_sampled_logprobs_equal_the_training_forward_with_chunked_prefill(fixture, request):
    model = load_model(request.getfixturevalue(fixture), device="cpu")
    residency = AdapterRegistry(model.config, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    ids = [residency.install(random_adapter(model.config, r, seed=s), trainable=False).id for r, s in ((4, 1), (8, 2))]
    # 6 tokens a step: the 13-token prompts run in chunks, beside other rows' decode tokens
    sampler = Sampler(model, residency, kv_slots=8, max_seq_len=64, block_size=4, records=SamplingRecords(),
                      max_step_tokens=6)
    prompt = prompt_of(7, 13)
    p = types.SamplingParams(stop=[], max_tokens=10, temperature=1.0, seed=3)
    futures = {a: sampler.submit(a, prompt, 1, p) for a in [None, *ids]}
    drain(sampler)
    assert sampler.stats.prefill_chunks >= 3
    for aid, f in futures.items():
        lora = None if aid is None else residency.bank.batch([residency.get(aid).slot])
        for seq in f.result().sequences:
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([prompt + seq.tokens]), lora=lora)[0], -1)
            want = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(seq.tokens)]
            for_model(model.config).check(seq.logprobs, want, aid)


def test_ragged_step_of_decode_rows_and_chunks_honours_window_and_sinks(gpt_oss_dir):
    """One ragged step: two decode rows far past the window and a prefill chunk starting mid-prompt
    (past the window too), each on its own adapter — equal to the full forward of each sequence. The
    sliding layer reads only the blocks the window reaches: NaN in the others changes nothing."""
    model = load_model(gpt_oss_dir, device="cpu")
    cfg = model.config
    bank = LoraBank(cfg, num_slots=2, max_rank=4, device="cpu", dtype=torch.float32)
    bank.write(1, random_adapter(cfg, 4, seed=3).weights, 4, 8.0)
    seqs = [prompt_of(s, n) for s, n in ((1, 12), (2, 17), (3, 20))]
    slots = [1, -1, 1]
    bs = 4
    cache = KVCache(cfg, 1 + 3 * 5, bs, "cpu", torch.float32)
    tables = [[1 + i + 3 * b for b in range(5)] for i in range(3)]  # interleaved: a wrong table reads a neighbour
    starts = [11, 16, 12]  # rows 0, 1 decode their last token; row 2 runs positions 12..19 as one chunk
    with torch.no_grad():
        for seq, slot, table, start in zip(seqs, slots, tables, starts, strict=True):  # fill what came before
            pos = torch.arange(start)[None]
            view = RaggedView(cache, torch.tensor([table]), pos.T, [(0, start, 0)])
            lora = None if slot < 0 else bank.batch([slot] * start)
            model.hidden_states(torch.tensor(seq[:start])[:, None], pos.T, lora, view)
        # the sliding layer (0) never reads blocks wholly before a row's window: poison them there
        for table, unread in zip(tables, [1, 3, 2], strict=True):  # row 0 at 11, row 1 at 16, row 2 from 12
            for pool in (cache.k, cache.v):
                pool[0, table[:unread]] = float("nan")
        tokens = [t for seq, start in zip(seqs, starts, strict=True) for t in seq[start:]]
        positions = [p for seq, start in zip(seqs, starts, strict=True) for p in range(start, len(seq))]
        lengths = [len(seq) - start for seq, start in zip(seqs, starts, strict=True)]
        segments = [(sum(lengths[:i]), n, i) for i, n in enumerate(lengths)]
        pos = torch.tensor(positions)[:, None]
        lora = bank.batch([s for s, n in zip(slots, lengths, strict=True) for _ in range(n)])
        h = model.hidden_states(torch.tensor(tokens)[:, None], pos, lora, RaggedView(cache, torch.tensor(tables), pos,
                                                                                     segments))[:, 0]
        for (first, n, i), seq, slot in zip(segments, seqs, slots, strict=True):
            full = model.hidden_states(torch.tensor([seq]), lora=None if slot < 0 else bank.batch([slot]))[0]
            for_model(cfg).check(h[first : first + n], full[starts[i]:], (i, "ragged vs full forward"))


@pytest.mark.parametrize("fixture", ["gpt_oss_dir", pytest.param("glm_dir", marks=pytest.mark.slow)])
def test_greedy_in_one_mixed_batch_matches_transformers_with_merged_lora(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    adapters = [random_adapter(cfg, 4, seed=11), random_adapter(cfg, 8, seed=12)]
    ids = [None] + [residency.install(w, trainable=False).id for w in adapters]
    prompt = prompt_of(1, 9)
    sampler = Sampler(model, residency, kv_slots=8, max_seq_len=64, block_size=4, records=SamplingRecords())
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
