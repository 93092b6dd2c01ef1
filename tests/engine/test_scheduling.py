"""The sampler under the scheduler: chunked prefill, preemption, cancellation, priorities and fair
shares, counted in steps (never in seconds)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from mint_server.engine.executor import Executor, StepBatch
from mint_server.engine.interface import EngineError, Priority
from mint_server.engine.kv import BlockPool, blocks_for
from mint_server.engine.step_costs import measure_chunk_tokens, measure_step_cost
from mint_server.model import invariant
from tests.engine.test_sampling import drain, install, make_sampler, params, prompt_of, solo
from tests.tolerance import for_model


def test_chunked_prefill_equals_one_pass(model, residency):
    """A prompt prefilled in chunks of any size, beside other sequences' decode rows, gives the
    logits and prompt scores of one pass over it, within the tolerance policy (here ≤ 1e-5)."""
    aid = install(residency, 8, seed=3)
    slot = residency.get(aid).slot
    n, bs = 90, 8
    prompt = prompt_of(5, n)
    tol = for_model(model.config)

    def prefill(chunks: list[int]) -> tuple[torch.Tensor, object]:
        ex = Executor(model, residency.bank, torch.device("cpu"), 64, bs)
        pool = BlockPool(64)
        blocks = pool.alloc(blocks_for(n, bs))
        other = pool.alloc(2)  # a decode row of another sequence rides along in every step
        start, logits, scores = 0, None, []
        for size in chunks:
            targets = [prompt[p + 1] if p + 1 < n else -1 for p in range(start, start + size)]
            batch = StepBatch(prompt[start : start + size] + [7], list(range(start, start + size)) + [start],
                              [size, 1], [slot, -1], [blocks, other], [0, 1], [(0, targets, 3)])
            out = ex.step(batch)
            logits, start = out.logits[0], start + size
            scores.append(out.scores[0])
        return logits, scores

    whole, whole_scores = prefill([n])
    for chunks in ([31, 31, 28], [1, 50, 39], [17] * 5 + [5]):
        logits, scores = prefill(chunks)
        tol.check(logits, whole, f"last logits, chunks {chunks}")
        assert float((logits - whole).abs().max()) <= 1e-5
        lps = np.concatenate([s[0] for s in scores])  # position p scores prompt[p + 1]; the last: none
        assert np.isnan(lps[-1]) and not np.isnan(lps[:-1]).any()
        tol.check(lps[:-1], whole_scores[0][0][:-1], f"prompt logprobs, chunks {chunks}")
        tol.check(np.concatenate([s[2] for s in scores])[:-1], whole_scores[0][2][:-1], "top-3 logprobs")


def test_a_prompt_longer_than_the_step_budget_runs_in_chunks_beside_streams(model, residency):
    """A prompt several step budgets long, next to running streams: same greedy tokens as alone."""
    long_prompt = prompt_of(9, 80)
    p = params(max_tokens=6)
    alone = solo(model, residency, None, long_prompt, p, max_seq_len=96)
    sampler = make_sampler(model, residency, max_step_tokens=16)
    streams = [sampler.submit(None, prompt_of(20 + i, 4), 1, params(max_tokens=30)) for i in range(3)]
    for _ in range(3):
        sampler.step()
    f = sampler.submit(None, long_prompt, 1, p)
    drain(sampler)
    assert [s.tokens for s in f.result().sequences] == alone
    assert sampler.stats.peak_step_tokens <= 16 and sampler.stats.prefill_chunks >= 80 // 16
    assert all(len(s.result().sequences[0].tokens) == 30 for s in streams)


def test_preempted_rows_resume_and_return_what_they_return_unpreempted(model, residency):
    """A less-served key's request finds the KV full of another key's rows: the most-served rows are
    swapped out, it runs, and they resume from the same KV, their tokens unchanged."""
    aid = install(residency, 4, seed=30)
    heavy_p = params(temperature=1.0, seed=11, max_tokens=40)
    heavy_prompts = [prompt_of(40 + i, 6) for i in range(3)]
    alone = [solo(model, residency, aid, pr, heavy_p)[0] for pr in heavy_prompts]
    quiet_alone = solo(model, residency, None, prompt_of(50, 5), params(max_tokens=8))[0]
    # 3 sequences of 6 + 40 tokens fill the pool (3 × 6 blocks of 8 = 18 of 18)
    sampler = make_sampler(model, residency, kv_slots=3, max_seq_len=48)
    heavy = [sampler.submit(aid, pr, 1, heavy_p, key="heavy") for pr in heavy_prompts]
    for _ in range(5):
        sampler.step()
    assert sampler.pool.available == 0 and len(sampler._rows) == 3
    quiet = sampler.submit(None, prompt_of(50, 5), 1, params(max_tokens=8), key="quiet")
    steps = 0
    while not quiet.done():
        sampler.step()
        steps += 1
    assert steps == 8  # one step per token: prefilled and decoded as if alone
    assert sampler.stats.preempted >= 1
    drain(sampler)
    assert sampler.stats.resumed == sampler.stats.preempted
    assert quiet.result().sequences[0].tokens == quiet_alone
    assert [f.result().sequences[0].tokens for f in heavy] == alone


def test_a_prompt_being_prefilled_is_preempted_and_resumes_where_it_was(model, residency):
    """A long prompt of a busy key is being prefilled in chunks when a less-served key's request
    finds no KV left: the prompt is swapped out (its computed KV to host memory, every block it held
    back), the quiet request runs, then the prompt resumes from that KV — no chunk recomputed — and
    samples what it samples unpreempted."""
    aid = install(residency, 4, seed=31)
    long_prompt, p = prompt_of(61, 60), params(temperature=1.0, seed=5, max_tokens=10)
    alone = solo(model, residency, aid, long_prompt, p, n=2, max_seq_len=88)
    quiet_alone = solo(model, residency, None, prompt_of(62, 5), params(max_tokens=8), max_seq_len=88)[0]
    # 11 blocks of 8: the prompt's 8 and its two samples' 3 more
    sampler = make_sampler(model, residency, kv_slots=1, max_seq_len=88, max_step_tokens=8)
    heavy = sampler.submit(aid, long_prompt, 2, p, key="heavy")
    sampler.step()
    sampler.step()
    assert sampler._groups and sampler._groups[0].computed == 16 and sampler.pool.available == 0
    quiet = sampler.submit(None, prompt_of(62, 5), 1, params(max_tokens=8), key="quiet")
    sampler.step()
    assert sampler.stats.preempted == 1 and sampler._groups[0].swapped is not None
    while not quiet.done():
        sampler.step()
    assert quiet.result().sequences[0].tokens == quiet_alone
    drain(sampler)
    assert sampler.stats.resumed == sampler.stats.preempted
    assert sampler.stats.prefill_tokens == 60 + 5  # every prompt token ran once: nothing recomputed
    assert [s.tokens for s in heavy.result().sequences] == alone


def test_preemption_round_trip_is_bitwise_in_batch_invariant_mode(sampling_llama_dir):
    from mint_server.model.invariant import enable_for_model
    from mint_server.model.loader import load_model
    from tests.engine.helpers import make_residency

    model = load_model(sampling_llama_dir, device="cpu")
    residency = make_residency(model.config, num_slots=2, max_rank=8)
    enable_for_model(model.config, 8, "cpu", torch.float32)
    try:
        p = params(temperature=0.8, seed=3, max_tokens=30)
        prompts = [prompt_of(70 + i, 7) for i in range(2)]
        alone = [solo(model, residency, None, pr, p)[0] for pr in prompts]
        sampler = make_sampler(model, residency, kv_slots=2, max_seq_len=40)
        fs = [sampler.submit(None, pr, 1, p, key="heavy") for pr in prompts]
        for _ in range(4):
            sampler.step()
        quiet = sampler.submit(None, [5, 6, 7], 1, params(max_tokens=3), key="quiet")
        drain(sampler)
        assert sampler.stats.preempted >= 1 and quiet.done()
        assert [f.result().sequences[0].tokens for f in fs] == alone
    finally:
        invariant.set_enabled(False)


def test_every_cancel_applies_at_the_next_step_and_frees_all_kv(model, residency):
    sampler = make_sampler(model, residency, kv_slots=40, max_seq_len=64)
    futures = [sampler.submit(None, prompt_of(i, 5), 1, params(max_tokens=50), key="flood") for i in range(30)]
    for _ in range(3):
        sampler.step()
    assert sampler.kv_blocks_in_use > 0
    cancellers = [threading.Thread(target=sampler.cancel, args=(f,)) for f in futures]
    for t in cancellers:
        t.start()
    for t in cancellers:
        t.join()
    sampler.step()
    assert sampler.kv_blocks_in_use == 0 and not sampler.has_work()
    for f in futures:
        with pytest.raises(EngineError, match="cancelled"):
            f.result(timeout=0)


def test_interactive_work_is_admitted_and_served_ahead_of_batch_work(model, residency):
    sampler = make_sampler(model, residency, kv_slots=4, max_seq_len=48)
    batch = [sampler.prep.sample(None, prompt_of(80 + i, 6), 1, params(max_tokens=40), key="k",
                                 priority=Priority.BATCH) for i in range(6)]
    futures = [sampler._queue_job(j, None) for j in batch]
    for _ in range(2):
        sampler.step()
    assert sampler.pool.available < blocks_for(6 + 8, 8)  # the pool is taken by batch rows
    job = sampler.prep.sample(None, prompt_of(90, 6), 1, params(max_tokens=8), key="k",
                              priority=Priority.INTERACTIVE)
    first = sampler._queue_job(job, None)
    steps = 0
    while not first.done():
        sampler.step()
        steps += 1
    assert steps == 8 and not any(f.done() for f in futures)  # a batch row made room for it
    drain(sampler)
    assert all(len(f.result().sequences[0].tokens) == 40 for f in futures)


def test_a_quiet_key_finishes_in_its_own_steps_under_another_keys_flood(model, residency):
    """200 rows of one key, then one 8-token request of another: it is admitted at once and runs in
    every step (least served), so it finishes in 8 steps, as alone."""
    sampler = make_sampler(model, residency, kv_slots=210, max_seq_len=40, max_batch_rows=256,
                           max_step_tokens=64)
    flood = [sampler.submit(None, prompt_of(i, 4), 1, params(max_tokens=30, temperature=1.0, seed=i), key="flood")
             for i in range(200)]
    for _ in range(6):
        sampler.step()
    quiet = sampler.submit(None, prompt_of(999, 4), 1, params(max_tokens=8), key="quiet")
    steps = 0
    while not quiet.done():
        sampler.step()
        steps += 1
    assert steps == 8
    drain(sampler)
    assert all(len(f.result().sequences[0].tokens) == 30 for f in flood)


def test_the_measured_cost_model_is_a_curve_and_leaves_the_pool_as_it_was(model, residency):
    """measure_step_cost (the scheduler's cost model, taken at start-up) runs real steps on scratch
    blocks: the curve rises with the tokens, the adapter and chunk costs are not negative, every block
    it took is back, and the probed bank slots are empty again."""
    sampler = make_sampler(model, residency, kv_slots=20, max_seq_len=40)
    free = sampler.pool.available
    cost = measure_step_cost(sampler, sizes=(1, 2, 4, 8), repeats=1)
    assert sampler.pool.available == free
    assert cost.tokens == (1, 2, 4, 8) and all(b > a for a, b in zip(cost.cost, cost.cost[1:], strict=False))
    assert cost.unit_s > 0 and min(cost.chunk, cost.adapter_first, cost.adapter_each) >= 0
    assert all(r == 0 and t == () for r, t in zip(residency.bank.rank, residency.bank.targets, strict=True))
    assert 1 <= cost.saturation() <= 8 and cost.tokens_within(cost.at(4)) >= 4


def test_measured_chunk_tokens_double_from_the_step_budget_within_the_pool(model, residency):
    """The start-up probe of prompt chunks: a doubling of its start that the KV pool holds, within its
    limit, and every block it took is back in the pool."""
    sampler = make_sampler(model, residency, kv_slots=4)  # 4 × 96 positions, blocks of 8
    free = sampler.pool.available
    chosen = measure_chunk_tokens(sampler, 12, limit=1000)
    assert chosen in (12, 24, 48, 96, 192, 384, 768) and chosen <= free * 8
    assert sampler.pool.available == free
    assert measure_chunk_tokens(sampler, 4096) == 4096  # nothing fits: the start stands


def test_a_lingering_keys_adapter_keeps_its_slot_through_a_storm_of_cold_adapters(model):
    """Between a closed-loop client's requests its adapter is idle and unpinned; with every other
    slot read by a storm's running work it was the one slot the storm's next cold adapter took, and
    each next request waited for its reload. While the key lingers its adapter is wanted first."""
    from tests.engine.helpers import make_residency

    residency = make_residency(model.config, num_slots=3, max_rank=8)
    quiet_id = install(residency, 4, seed=100)
    storm_ids = [install(residency, 4, seed=i) for i in range(6)]
    sampler = make_sampler(model, residency, kv_slots=16, max_seq_len=40, linger_s=600.0)

    def turn() -> None:  # the engine worker's turn: residency first, then the step
        residency.schedule(sampler.waiting_adapters(limit=12))
        sampler.step()

    storm = [sampler.submit(a, prompt_of(i, 4), 1, params(max_tokens=24), key="storm") for i, a in enumerate(storm_ids)]
    quiet = sampler.submit(quiet_id, prompt_of(99, 4), 1, params(max_tokens=3), key="quiet")
    while not quiet.done():
        turn()
    for _ in range(4):
        turn()
        assert residency.get(quiet_id).slot is not None
    for _ in range(200):
        if not sampler.has_work():
            break
        turn()
    assert all(len(f.result().sequences[0].tokens) == 24 for f in storm)
