"""The prefix cache across requests (engine/kv.py, prefix_keys.py): a later request with the same
prefix takes its full KV blocks instead of computing them, and gets what it gets with the cache off.
Counted in prefill tokens and hit tokens (never in seconds)."""

from __future__ import annotations

import numpy as np

from mint_server.engine.kv import BlockPool
from mint_server.engine.values import AdapterSource
from tests.engine.test_sampling import drain, install, make_sampler, params, prompt_of
from tests.tolerance import for_model


def run(sampler, adapter_id, prompt, p, n=1, **kw):
    f = sampler.submit(adapter_id, prompt, n, p, **kw)
    drain(sampler)
    return f.result()


def off(model, residency, adapter_id, prompt, p, n=1, **kw):
    """The same request on a fresh sampler with the cache off."""
    s = make_sampler(model, residency, prefix_cache=False, **{k: v for k, v in kw.items() if k in ("max_seq_len",)})
    return run(s, adapter_id, prompt, p, n, **{k: v for k, v in kw.items() if k != "max_seq_len"})


def test_block_pool_keeps_registered_blocks_until_needed():
    pool = BlockPool(5)  # 4 usable blocks
    a = pool.alloc(2)
    assert pool.register(b"k0", a[0]) and not pool.register(b"k0", a[1])  # a key names one block
    pool.release(a)
    assert pool.available == 4 and pool.used == 0 and pool.cached == 1
    assert pool.lookup([b"k0", b"k1"]) == [a[0]]
    pool.share([a[0]])  # a hit takes it out of the idle list: never evicted while in use
    assert pool.available == 3 and pool.used == 1
    pool.alloc(3)
    assert pool.evictions == 0 and pool.lookup([b"k0"]) == [a[0]]
    pool.release([a[0]])
    pool.alloc(1)  # the only block left is the kept one: evicted, its key forgotten
    assert pool.evictions == 1 and pool.lookup([b"k0"]) == [] and pool.cached == 0


def test_a_second_turn_reuses_the_first_turns_blocks_and_equals_the_cache_off(model, residency):
    """Turn 2 (turn 1's prompt, its completion and a new message) computes only what turn 1's blocks
    (its prompt's and its completion's full ones) do not hold; its tokens are bitwise and its
    logprobs within the tolerance policy of the same request with the cache off."""
    aid = install(residency, 4, seed=80)
    sampler = make_sampler(model, residency)
    first = prompt_of(81, 37)
    t1 = run(sampler, aid, first, params(max_tokens=14))
    assert t1.prompt_cache_hit_tokens == 0 and sampler.stats.prefill_tokens == 37
    second = first + list(t1.sequences[0].tokens) + prompt_of(82, 9)  # 37 + 14 + 9 = 60
    t2 = run(sampler, aid, second, params(max_tokens=10))
    # 50 of turn 1's positions are in the cache (its last drawn token never was): 6 full blocks of 8
    assert t2.prompt_cache_hit_tokens == 48
    assert sampler.stats.prefill_tokens == 37 + 60 - 48
    assert sampler.stats.prefix_hit_tokens == 48 and sampler.stats.prefix_query_tokens == 37 + 60
    want = off(model, residency, aid, second, params(max_tokens=10))
    assert want.prompt_cache_hit_tokens == 0
    assert t2.sequences[0].tokens == want.sequences[0].tokens
    for_model(model.config).check(t2.sequences[0].logprobs, want.sequences[0].logprobs, "logprobs with a hit")
    # the same prompt again: everything but its last block (the last token is always computed)
    t3 = run(sampler, aid, second, params(max_tokens=10))
    assert t3.prompt_cache_hit_tokens == 56 and t3.sequences[0].tokens == want.sequences[0].tokens


def test_n_samples_and_prompt_scores_with_a_hit(model, residency):
    """n samples fork off a prompt row that started from cached blocks; a request asking for the last
    n prompt logprobs takes only the blocks before the first scored position, and its scores equal
    the cache off's; a request scoring the whole prompt takes nothing."""
    sampler = make_sampler(model, residency)
    prompt = prompt_of(83, 41)
    run(sampler, None, prompt, params(max_tokens=2))
    p = params(max_tokens=8, temperature=1.0, seed=3)
    got = run(sampler, None, prompt, p, n=3)
    assert got.prompt_cache_hit_tokens == 40
    want = off(model, residency, None, prompt, p, n=3)
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    tol = for_model(model.config)
    for g, w in zip(got.sequences, want.sequences, strict=True):
        tol.check(g.logprobs, w.logprobs, "sampled logprobs")
    # last 12 prompt logprobs: positions 29.. are scored, so blocks 0..2 (positions < 24) may be hits
    before = sampler.stats.prefill_tokens
    last = {"prompt_logprobs": True, "topk_prompt_logprobs": 2, "prompt_logprobs_last_n": 12}
    scored = run(sampler, None, prompt, params(max_tokens=2), **last)
    assert scored.prompt_cache_hit_tokens == 24 and sampler.stats.prefill_tokens - before == 41 - 24
    ref = off(model, residency, None, prompt, params(max_tokens=2), **last)
    got_lp, want_lp = (np.asarray(r.prompt_logprobs_np, dtype=float) for r in (scored, ref))
    assert (np.isnan(got_lp) == np.isnan(want_lp)).all() and np.isfinite(want_lp[-12:]).all()
    tol.check(got_lp[-12:], want_lp[-12:], "last-n prompt logprobs")
    tol.check(scored.topk_prompt_logprobs_np.logprobs, ref.topk_prompt_logprobs_np.logprobs, "last-n top-k")
    assert (scored.topk_prompt_logprobs_np.token_ids == ref.topk_prompt_logprobs_np.token_ids).all()
    whole = run(sampler, None, prompt, params(max_tokens=2), prompt_logprobs=True)
    assert whole.prompt_cache_hit_tokens == 0


def test_another_owners_identical_prompt_gets_no_hit(model, residency):
    """Salted per owner: key B's identical prompt finds none of key A's blocks (nor joins A's prompt
    being prefilled); A's own next request does."""
    sampler = make_sampler(model, residency)
    prompt = prompt_of(84, 33)
    run(sampler, None, prompt, params(max_tokens=4), key="owner-a")
    other = run(sampler, None, prompt, params(max_tokens=4), key="owner-b")
    assert other.prompt_cache_hit_tokens == 0 and sampler.stats.prefill_tokens == 66
    mine = run(sampler, None, prompt, params(max_tokens=4), key="owner-a")
    assert mine.prompt_cache_hit_tokens == 32 and sampler.stats.prefill_tokens == 66 + 1
    # concurrent: B does not join A's prompt row either
    fresh = prompt_of(85, 20)
    fa = sampler.submit(None, fresh, 1, params(max_tokens=2), key="owner-a")
    fb = sampler.submit(None, fresh, 1, params(max_tokens=2), key="owner-b")
    drain(sampler)
    assert fb.result().prompt_cache_hit_tokens == 0 and fa.result().prompt_cache_hit_tokens == 0
    assert sampler.stats.prompt_rows == 5


def test_another_adapter_or_revision_gets_no_hit(model, residency, tmp_path):
    """KV depends on the adapter: the same prompt on another adapter, on the base, or on a trainable
    adapter (its weights change with every step) takes no cached block; two catalog revisions of the
    same content share them, two of different content do not."""
    a, b = install(residency, 4, seed=86), install(residency, 4, seed=87)
    sampler = make_sampler(model, residency)
    prompt = prompt_of(88, 30)
    run(sampler, a, prompt, params(max_tokens=3))
    assert run(sampler, b, prompt, params(max_tokens=3)).prompt_cache_hit_tokens == 0
    assert run(sampler, None, prompt, params(max_tokens=3)).prompt_cache_hit_tokens == 0
    assert run(sampler, a, prompt, params(max_tokens=3)).prompt_cache_hit_tokens == 24
    from tests.model.test_parity import random_adapter

    trainable = residency.install(random_adapter(residency.cfg, 4, 89), trainable=True).id
    run(sampler, trainable, prompt, params(max_tokens=3))
    assert run(sampler, trainable, prompt, params(max_tokens=3)).prompt_cache_hit_tokens == 0
    # revisions: the root names a catalog revision by its content key
    s = sampler.sampler
    req = sampler.prep.sample(None, prompt, 1, params(max_tokens=1))

    class Rev:
        def __init__(self, key, id_):
            self.trainable, self.id, self.source = False, id_, AdapterSource(key)

    def root(adapter):
        from mint_server.engine.sample_request import SampleRequest

        return s.prefix.prefix(SampleRequest(None, adapter, req, 0, 0.0))[0]

    assert root(Rev("rev:abc", "s1")) == root(Rev("rev:abc", "s2")) != root(Rev("rev:abd", "s1"))
    assert root(Rev("/peft/dir", "s1")) != root(Rev("/peft/dir", "s2")) != root(None)


def test_eviction_under_a_small_kv_budget_never_fails_a_request(model, residency):
    """A pool that holds two sequences: distinct prompts, then their second turns, then a burst of
    all at once. Kept blocks are evicted least recently used when room is needed, never while a
    sequence reads them; every request completes with its cache-off tokens."""
    sampler = make_sampler(model, residency, kv_slots=2, max_seq_len=48)
    prompts = [prompt_of(90 + i, 25) for i in range(6)]
    p = params(max_tokens=12)
    want = [off(model, residency, None, pr, p, max_seq_len=48).sequences[0].tokens for pr in prompts]
    for pr, w in zip(prompts, want, strict=True):
        assert run(sampler, None, pr, p).sequences[0].tokens == w
    assert sampler.pool.evictions > 0
    for _ in range(2):
        futures = [sampler.submit(None, pr, 1, p) for pr in prompts]
        drain(sampler)
        assert [f.result().sequences[0].tokens for f in futures] == want
    # a cyclic scan of more than the pool holds evicts each prompt before its turn comes back (LRU);
    # the most recent one is still there
    again = run(sampler, None, prompts[-1], p)
    assert again.prompt_cache_hit_tokens == 24 and again.sequences[0].tokens == want[-1]
    assert sampler.pool.used == 0 and sampler.pool.cached <= sampler.pool.capacity


def test_preempted_rows_that_read_cached_blocks_resume_correctly(model, residency):
    """Rows started from cached blocks fill the pool; a less-served key's request preempts them
    (their KV to host memory, the cached blocks back to the idle list, where the quiet request's
    blocks may evict them); they resume and return their cache-off tokens."""
    heavy_prompts = [prompt_of(95 + i, 9) for i in range(3)]
    heavy_p = params(temperature=1.0, seed=11, max_tokens=38)
    alone = [off(model, residency, None, pr, heavy_p, max_seq_len=48).sequences[0].tokens for pr in heavy_prompts]
    quiet_alone = off(model, residency, None, prompt_of(99, 5), params(max_tokens=8), max_seq_len=48)
    sampler = make_sampler(model, residency, kv_slots=3, max_seq_len=48)  # 18 blocks of 8
    for pr in heavy_prompts:  # turn 1: one full block of each prompt is kept
        run(sampler, None, pr, params(max_tokens=1), key="heavy")
    assert sampler.pool.cached == 3
    heavy = [sampler.submit(None, pr, 1, heavy_p, key="heavy") for pr in heavy_prompts]
    for _ in range(5):
        sampler.step()
    assert sampler.pool.available == 0 and len(sampler._rows) == 3 and sampler.stats.prefix_hit_tokens == 24
    quiet = sampler.submit(None, prompt_of(99, 5), 1, params(max_tokens=8), key="quiet")
    drain(sampler)
    assert sampler.stats.preempted >= 1 and sampler.stats.resumed == sampler.stats.preempted
    assert quiet.result().sequences[0].tokens == quiet_alone.sequences[0].tokens
    assert [f.result().sequences[0].tokens for f in heavy] == alone


def test_cache_off_and_hybrid_bases_cache_nothing(model, residency, tmp_path, caplog):
    sampler = make_sampler(model, residency, prefix_cache=False)
    prompt = prompt_of(100, 30)
    run(sampler, None, prompt, params(max_tokens=2))
    assert run(sampler, None, prompt, params(max_tokens=2)).prompt_cache_hit_tokens == 0
    assert sampler.pool.cached == 0 and sampler.totals()["prefix_cache"]["hit_tokens"] == 0
    # a hybrid base's recurrent state is not in the blocks: the cache turns itself off, saying why
    from mint_server.model.loader import load_model
    from tests.engine.helpers import make_residency
    from tests.qwen35.tiny_qwen35 import make_tiny_qwen35

    q35 = load_model(make_tiny_qwen35(tmp_path / "q35"), device="cpu")
    with caplog.at_level("INFO", logger="mint_server.engine.prefix_keys"):
        hybrid = make_sampler(q35, make_residency(q35.config, num_slots=2, max_rank=8))
    assert not hybrid.prefix.on and "hybrid" in caplog.text
    run(hybrid, None, prompt, params(max_tokens=2))
    assert run(hybrid, None, prompt, params(max_tokens=2)).prompt_cache_hit_tokens == 0
