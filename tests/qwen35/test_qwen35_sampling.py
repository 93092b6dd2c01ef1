"""The sampler on Qwen3.5 bases: paged KV for the attention layers plus a recurrent-state slot per sequence
for the linear ones. Logprobs vs the training forward (forks copy the prompt's state), greedy vs
transformers, chunked prefill vs one pass, preempted (state swapped out and back) vs not, and every
slot back after cancels."""

import pytest
import torch
from tinker import types

from mint_server.engine.executor import Executor, StepBatch
from mint_server.engine.kv import BlockPool, blocks_for
from mint_server.engine.records import SamplingRecords
from mint_server.engine.state_cache import StateSlots
from mint_server.model.loader import load_model
from tests.engine.helpers import AdapterRegistry
from tests.engine.helpers import SamplerHarness as Sampler
from tests.model.test_parity import random_adapter
from tests.moe.helpers import load_hf
from tests.qwen35.helpers import merge_in_place
from tests.tolerance import for_model

FIXTURES = ["q35_dir", "q35_moe_dir"]


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drain(sampler) -> None:
    for _ in range(10_000):
        if not sampler.has_work():
            break
        sampler.step()
    assert not sampler.has_work() and sampler.kv_blocks_in_use == 0
    assert sampler.states.available == sampler.states.num_slots - 1  # every state slot came back


def setup(model_dir, adapters=((4, 1), (8, 2))):
    model = load_model(model_dir, device="cpu")
    residency = AdapterRegistry(model.config, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    ids = [residency.install(random_adapter(model.config, r, seed=s), trainable=False).id for r, s in adapters]
    return model, residency, ids


def sampler_of(model, residency, **kw) -> Sampler:
    return Sampler(model, residency, **{"kv_slots": 8, "max_seq_len": 96, "block_size": 8,
                                        "records": SamplingRecords(), **kw})


@pytest.mark.parametrize("fixture", FIXTURES)
def test_sampled_logprobs_equal_the_training_forward(fixture, request):
    """Samples forked off each prompt (the first continues its state, the others a copy), three
    adapters in one batch, prompts longer than a delta-rule chunk: every sampled token's logprob is the
    training forward's."""
    model, residency, ids = setup(request.getfixturevalue(fixture))
    sampler = sampler_of(model, residency)
    prompt = prompt_of(7, 70)
    p = types.SamplingParams(stop=[], max_tokens=10, temperature=1.0, seed=3)
    futures = {a: sampler.submit(a, prompt, 3 if a is None else 2, p) for a in [None, *ids]}
    scored = sampler.compute_logprobs(ids[0], prompt)
    drain(sampler)
    tol = for_model(model.config)
    for aid, f in futures.items():
        lora = None if aid is None else residency.bank.batch([residency.get(aid).slot])
        seqs = f.result().sequences
        assert len({tuple(s.tokens) for s in seqs}) > 1  # the forks really sample apart
        for seq in seqs:
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([prompt + seq.tokens]), lora=lora)[0], -1)
            tol.check(seq.logprobs, [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(seq.tokens)], aid)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt]), lora=residency.bank.batch([residency.get(ids[0]).slot]))[0], -1)
    tol.check(scored.result()[1:], [ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)], "prompt scores")


@pytest.mark.parametrize("fixture", FIXTURES)
def test_greedy_in_one_mixed_batch_matches_transformers_with_merged_lora(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    model = load_model(model_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=4, max_rank=8, device="cpu", dtype=torch.float32)
    adapters = [random_adapter(cfg, 4, seed=11), random_adapter(cfg, 8, seed=12)]
    ids = [None] + [residency.install(w, trainable=False).id for w in adapters]
    prompt = prompt_of(1, 9)
    sampler = sampler_of(model, residency)
    p = types.SamplingParams(stop=[], max_tokens=10, temperature=0.0)
    futures = [sampler.submit(a, prompt, 1, p) for a in ids]
    drain(sampler)
    got = [f.result().sequences[0].tokens for f in futures]
    for weights, tokens in zip([None, *adapters], got, strict=True):
        hf = load_hf(model_dir)
        if weights is not None:
            merge_in_place(hf, cfg, weights)
        hf.generation_config.eos_token_id = None
        with torch.no_grad():  # transformers decodes with its recurrent form and cache
            out = hf.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, 9, dtype=torch.long),
                              do_sample=False, max_new_tokens=10, pad_token_id=0)
        assert tokens == out[0, 9:].tolist()
    assert got[1] != got[0] and got[2] != got[0]


def test_chunked_prefill_equals_one_pass(q35_dir):
    """A prompt prefilled in chunks (each continuing the state its slot holds) beside another sequence's
    decode row, gives the logits and prompt scores of one pass."""
    model, residency, ids = setup(q35_dir, adapters=((8, 3),))
    slot = residency.get(ids[0]).slot
    n, bs = 90, 8
    prompt = prompt_of(5, n)
    tol = for_model(model.config)

    def prefill(chunks: list[int]):
        ex = Executor(model, residency.bank, torch.device("cpu"), 64, bs, state_slots=4)
        pool = BlockPool(64)
        blocks, other = pool.alloc(blocks_for(n, bs)), pool.alloc(2)
        start, logits, scores = 0, None, []
        for size in chunks:
            targets = [prompt[p + 1] if p + 1 < n else -1 for p in range(start, start + size)]
            batch = StepBatch(prompt[start : start + size] + [7], list(range(start, start + size)) + [start],
                              [size, 1], [slot, -1], [blocks, other], [0, 1], [(0, targets, 3)], states=[2, 3])
            out = ex.step(batch)
            logits, start = out.logits[0], start + size
            scores.append(out.scores[0][0])
        return logits, torch.cat([torch.as_tensor(s) for s in scores])[:-1]

    whole, whole_scores = prefill([n])
    for chunks in ([31, 31, 28], [1, 50, 39], [17] * 5 + [5], [64, 1, 25]):
        logits, scores = prefill(chunks)
        tol.check(logits, whole, f"last logits, chunks {chunks}")
        tol.check(scores, whole_scores, f"prompt logprobs, chunks {chunks}")


def test_preempted_and_forked_samples_equal_unpreempted(q35_dir):
    """A quiet key's request finds the KV full of a heavy key's forked samples: the most-served ones are
    swapped out (KV and recurrent state to host), the quiet one runs, and they resume in other slots,
    their tokens those of an undisturbed run; a long prompt prefilled in chunks rides along."""
    model, residency, ids = setup(q35_dir, adapters=((4, 30),))
    heavy_p = types.SamplingParams(stop=[], max_tokens=24, temperature=1.0, seed=11)
    quiet_p = types.SamplingParams(stop=[], max_tokens=8, temperature=0.0)
    heavy_prompts = [prompt_of(40 + i, 6) for i in range(2)]

    def solo(aid, prompt, p, n):
        s = sampler_of(model, residency, kv_slots=8, max_seq_len=32)
        f = s.submit(aid, prompt, n, p)
        drain(s)
        return [q.tokens for q in f.result().sequences]

    alone = [solo(ids[0], pr, heavy_p, 2) for pr in heavy_prompts]
    quiet_alone = solo(None, prompt_of(50, 5), quiet_p, 1)
    # 2 prompts × 2 samples of 6 + 24 tokens fill the pool (4 × 4 blocks of 8 = 16 of 16)
    sampler = sampler_of(model, residency, kv_slots=4, max_seq_len=32)
    heavy = [sampler.submit(ids[0], pr, 2, heavy_p, key="heavy") for pr in heavy_prompts]
    for _ in range(5):
        sampler.step()
    assert sampler.pool.available == 0 and len(sampler._rows) == 4
    quiet = sampler.submit(None, prompt_of(50, 5), 1, quiet_p, key="quiet")
    drain(sampler)
    assert sampler.stats.preempted >= 1 and sampler.stats.resumed == sampler.stats.preempted
    assert [s.tokens for s in quiet.result().sequences] == quiet_alone
    assert [[s.tokens for s in f.result().sequences] for f in heavy] == alone


def test_a_prompt_preempted_mid_prefill_resumes_from_its_state(q35_dir):
    """A long prompt of a busy key is preempted between two of its chunks (its computed KV and its
    recurrent state go to host memory, its blocks and state slot back); after the quiet request, it
    resumes from that state, no chunk recomputed, and samples what it samples unpreempted."""
    model, residency, ids = setup(q35_dir, adapters=((4, 31),))
    long_prompt = prompt_of(61, 60)
    p = types.SamplingParams(stop=[], max_tokens=10, temperature=1.0, seed=5)
    quiet_p = types.SamplingParams(stop=[], max_tokens=8, temperature=0.0)

    def solo(aid, prompt, params, n):
        s = sampler_of(model, residency, kv_slots=1, max_seq_len=88)
        f = s.submit(aid, prompt, n, params)
        drain(s)
        return [q.tokens for q in f.result().sequences]

    alone, quiet_alone = solo(ids[0], long_prompt, p, 2), solo(None, prompt_of(62, 5), quiet_p, 1)
    sampler = sampler_of(model, residency, kv_slots=1, max_seq_len=88, max_step_tokens=8)  # 11 blocks
    heavy = sampler.submit(ids[0], long_prompt, 2, p, key="heavy")
    sampler.step()
    sampler.step()
    assert sampler._groups[0].computed == 16 and sampler.pool.available == 0
    quiet = sampler.submit(None, prompt_of(62, 5), 1, quiet_p, key="quiet")
    sampler.step()
    assert sampler.stats.preempted == 1 and sampler._groups[0].swapped is not None
    drain(sampler)
    assert sampler.stats.resumed == sampler.stats.preempted and sampler.stats.prefill_tokens == 60 + 5
    assert [s.tokens for s in quiet.result().sequences] == quiet_alone
    assert [s.tokens for s in heavy.result().sequences] == alone


def test_chunked_prompts_and_cancels_give_every_slot_back(q35_dir):
    """Prompts longer than the step budget (prefilled in chunks beside decode rows), identical prompts
    sharing one prefill, a score-only request and a cancelled one: greedy tokens as alone, and every
    KV block and state slot returns."""
    model, residency, ids = setup(q35_dir, adapters=((4, 5),))
    p = types.SamplingParams(stop=[], max_tokens=6, temperature=0.0)
    long_prompt = prompt_of(9, 80)
    alone = sampler_of(model, residency)
    f = alone.submit(ids[0], long_prompt, 1, p)
    drain(alone)
    want = f.result().sequences[0].tokens
    sampler = sampler_of(model, residency, max_step_tokens=16, max_batch_rows=4)
    streams = [sampler.submit(None, prompt_of(20 + i, 4), 1, types.SamplingParams(stop=[], max_tokens=16))
               for i in range(2)]
    for _ in range(3):
        sampler.step()
    twins = [sampler.submit(ids[0], long_prompt, 1, p) for _ in range(2)]
    score = sampler.compute_logprobs(None, long_prompt)
    doomed = sampler.submit(ids[0], prompt_of(3, 40), 2, p)
    sampler.step()
    sampler.cancel(doomed)
    drain(sampler)
    assert [t.result().sequences[0].tokens for t in twins] == [want, want]
    assert sampler.stats.prefill_chunks >= 80 // 16 and len(score.result()) == 80
    assert all(len(s.result().sequences[0].tokens) == 16 for s in streams)


def test_state_slots_are_bounded_by_batch_rows(q35_dir):
    """A hybrid sampler holds max_batch_rows slots (+ scratch): prompts being prefilled count as rows."""
    model, residency, _ = setup(q35_dir, adapters=())
    sampler = sampler_of(model, residency, max_batch_rows=3)
    assert sampler.states.num_slots == 4 and sampler.executor.states.recurrent.shape[1] == 4
    futures = [sampler.submit(None, prompt_of(i, 5), 2, types.SamplingParams(stop=[], max_tokens=4))
               for i in range(4)]
    for _ in range(200):
        if not sampler.has_work():
            break
        sampler.step()
        in_flight = sum(1 for r in sampler._rows if r.running) + len(sampler._groups)
        assert in_flight <= 3 and sampler.states.available == 3 - in_flight
    assert all(len(f.result().sequences) == 2 for f in futures)
    with pytest.raises(ValueError, match="max_batch_rows"):
        sampler_of(model, residency, max_batch_rows=1)
    slots = StateSlots(3)
    assert [slots.alloc(), slots.alloc()] == [1, 2]
    with pytest.raises(RuntimeError, match="exhausted"):
        slots.alloc()
