"""Sampler building blocks: token choice statistics, stop conditions, recorded sampling info."""

import numpy as np
import pytest
import torch

from mint_server.engine.kv import BlockPool
from mint_server.engine.records import SamplingRecord, SamplingRecords
from mint_server.engine.sampler_ops import (
    StopCondition,
    choose_tokens,
    inverse_cdf,
    penalties,
    sample_seed,
    seen_tokens,
    uniforms,
)


def filtered_softmax(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference: softmax(logits / T), keep the top k, renormalise, keep the smallest top set with mass ≥ p."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    kept = order[: top_k if top_k > 0 else len(p)]
    q = p[kept] / p[kept].sum()
    n = int(np.searchsorted(np.cumsum(q), top_p - 1e-12) + 1)  # first prefix whose mass reaches top_p
    keep[kept[:n]] = True
    out = np.where(keep, p, 0.0)
    return out / out.sum()


# Draws per case and the tolerance on each token's frequency: σ ≤ √(0.25 / 40000) = 0.0025, so 0.012
# is ~5σ for the worst token (a flaky failure is ~1e-6 per token).
DRAWS, TOL = 40_000, 0.012


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, -1, 1.0), (0.6, -1, 1.0), (1.0, 4, 1.0), (1.5, -1, 0.7), (0.8, 6, 0.75), (2.0, 1, 1.0)],
)
def test_draw_frequencies_match_filtered_softmax(temperature, top_k, top_p):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 1.5
    gen = torch.Generator().manual_seed(1)
    u = torch.rand(DRAWS, generator=gen, dtype=torch.float64)
    tokens, logprobs, _, _ = choose_tokens(
        logits.expand(DRAWS, -1),
        torch.full((DRAWS,), temperature),
        torch.full((DRAWS,), max(top_k, 0)),
        torch.full((DRAWS,), top_p),
        u,
    )
    freq = np.bincount(tokens.numpy(), minlength=12) / DRAWS
    expected = filtered_softmax(logits.double().numpy(), temperature, top_k, top_p)
    assert np.abs(freq - expected).max() <= TOL, (freq.round(3), expected.round(3))
    assert (freq[expected == 0] == 0).all()  # filtered tokens are never drawn
    # Reported logprobs are the raw model's (T = 1, unfiltered), whatever shaped the draw.
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(logprobs, raw[tokens])


def test_greedy_rows_ignore_uniform_and_mixed_rows_are_independent():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    temp = torch.tensor([0.0, 1.0, 0.0, 0.7, 1.2])
    top_k, top_p = torch.tensor([0, 0, 3, 10, 0]), torch.tensor([1.0, 1.0, 1.0, 0.9, 0.5])
    u = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.77], dtype=torch.float64)
    tokens = choose_tokens(logits, temp, top_k, top_p, u).tokens
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    for i in range(5):  # each row alone picks what it picked in the batch
        alone = choose_tokens(logits[i : i + 1], temp[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], u[i : i + 1]).tokens
        assert alone.item() == tokens[i].item()


def test_top_logprobs_come_from_the_chosen_tokens_distribution():
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(5)) * 2
    temp, top_k, top_p = torch.tensor([0.0, 1.0, 0.7, 1.3]), torch.tensor([0, 0, 5, 0]), torch.tensor([1.0, 1.0, 1.0, 0.8])
    u = torch.tensor([0.0, 0.3, 0.6, 0.9], dtype=torch.float64)
    plain = choose_tokens(logits, temp, top_k, top_p, u)
    chosen = choose_tokens(logits, temp, top_k, top_p, u, top_n=7)
    assert plain.top_ids is None and torch.equal(plain.tokens, chosen.tokens) and torch.equal(plain.logprobs, chosen.logprobs)
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(chosen.top_ids, raw.topk(7, dim=-1).indices)
    assert (chosen.top_logprobs[:, :-1] >= chosen.top_logprobs[:, 1:]).all()  # best first
    for i, t in enumerate(chosen.tokens.tolist()):
        listed = chosen.top_ids[i].tolist()
        if t in listed:  # the very same number, not a recomputation
            assert chosen.top_logprobs[i, listed.index(t)].item() == chosen.logprobs[i].item()
    assert chosen.tokens[0].item() == chosen.top_ids[0, 0].item()  # greedy: the best one


def test_penalties_shape_the_draw_and_not_the_reported_logprobs():
    assert penalties([[], [3, 3, 1]], [0.5, 0.5], [0.0, 0.25], 5, torch.device("cpu")).tolist() == [
        [0.0] * 5, [0.0, 0.75, 0.0, 1.25, 0.0]]
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0], [1.0, 2.0, 0.0, 0.0]])
    penalty = penalties([[1], [0]], [1.0, 0.0], [0.0, 2.0], 4, torch.device("cpu"))
    greedy = torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.zeros(2, dtype=torch.float64)
    chosen = choose_tokens(logits, *greedy, penalty=penalty, top_n=2)
    assert chosen.tokens.tolist() == [2, 1]  # 3 - 1 < 2.5: the repeated token lost its lead
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(chosen.logprobs, raw.gather(1, chosen.tokens[:, None]).squeeze(1))
    assert torch.equal(chosen.top_logprobs, raw.topk(2, dim=-1).values)  # alternatives: the raw model's too
    zero = penalties([[1, 2]], [0.0], [0.0], 4, torch.device("cpu"))
    assert torch.equal(choose_tokens(logits[:1], *(g[:1] for g in greedy), penalty=zero).tokens, logits[:1].argmax(-1))


def test_inverse_cdf_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.2, 0.0, 0.8, 0.0]])
    for u in (0.0, 0.4999, 0.5, 1.0 - 1e-16):
        idx = inverse_cdf(probs, torch.tensor([u, u], dtype=torch.float64))
        assert all(probs[i, j] > 0 for i, j in enumerate(idx.tolist()))


def test_sample_seeds_and_uniforms_are_per_stream():
    assert sample_seed(5, 1) != sample_seed(6, 0) and sample_seed(5, 1) == sample_seed(5, 1)
    g1, g2 = torch.Generator().manual_seed(sample_seed(9, 0)), torch.Generator().manual_seed(sample_seed(9, 0))
    a = uniforms([g1, None, g2])
    assert a[0] == a[2] and a[1] == 0.0 and 0 <= a[0] < 1


def test_stop_condition_tokens_and_strings():
    text = {1: "ab", 2: "c", 3: "d\n", 4: "\nUs", 5: "er:"}

    def decode(ids: list[int]) -> str:
        return "".join(text[i] for i in ids)

    cond = StopCondition(token_ids=frozenset({2}), strings=("\n\nUser:",), decode=decode)
    assert cond.hit([1, 2])
    seq = [1, 3, 4, 5]  # "ab" "d\n" "\nUs" "er:" — the stop string spans three tokens
    assert [cond.hit(seq[: i + 1]) for i in range(4)] == [False, False, False, True]
    assert not StopCondition().hit([1, 2, 3])


def test_block_pool_refcounts():
    pool = BlockPool(6)  # block 0 is scratch: 5 usable
    a = pool.alloc(3)
    assert 0 not in a and pool.available == 2
    pool.share(a[:2])
    pool.release(a)
    assert pool.available == 3  # the shared two are still held
    pool.release(a[:2])
    assert pool.available == 5 and pool.peak_used == 3
    with pytest.raises(RuntimeError):
        pool.alloc(6)


def _record(n: int) -> SamplingRecord:
    return SamplingRecord(np.arange(3, dtype=np.int32), np.arange(n, dtype=np.int32),
                          np.linspace(-1, -0.1, n).astype(np.float32), None)


def test_records_expire_after_inactivity_and_stay_bounded():
    now = [0.0]
    rec = SamplingRecords(ttl_s=10, max_records=3, clock=lambda: now[0])
    rec.put("a", _record(4))
    rec.put("b", _record(4))
    assert rec.get("a") == pytest.approx(np.linspace(-1, -0.1, 4).tolist())
    now[0] = 8.0
    assert rec.get("a") is not None  # reading refreshes: "a" now lives until 18
    now[0] = 12.0
    assert rec.get("b") is None and rec.get("a") is not None
    assert rec.get("missing") is None
    for sid in "cdef":
        rec.put(sid, _record(2))
    assert len(rec) == 3 and rec.get("a") is None  # least recently used go first
    small = SamplingRecords(ttl_s=10, max_tokens=12)
    small.put("x", _record(4))  # 3 prompt + 4 sampled = 7 tokens
    small.put("y", _record(4))
    assert small.get("x") is None and small.get_record("y") is not None


def test_repetition_penalty_and_min_p_shape_the_draw_as_their_reference_formulas():
    """Against the formulas written out: a seen token's logit is divided by the penalty when
    positive and multiplied when negative (transformers' RepetitionPenaltyLogitsProcessor), and
    min_p drops tokens below min_p × the likeliest token's probability; reported logprobs stay raw."""
    logits = torch.tensor([[4.0, 3.0, -1.0, 0.5], [2.0, -2.0, 1.9, 0.0]])
    seen = seen_tokens([[0, 2], [2]], 4, torch.device("cpu"))
    assert seen.tolist() == [[True, False, True, False], [False, False, True, False]]
    factor = torch.tensor([2.0, 1.5])
    ref = logits.clone()
    for i, toks in enumerate(([0, 2], [2])):
        for t in toks:
            ref[i, t] = ref[i, t] / factor[i] if ref[i, t] > 0 else ref[i, t] * factor[i]
    greedy = torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.zeros(2, dtype=torch.float64)
    chosen = choose_tokens(logits, *greedy, repetition=(seen, factor))
    assert chosen.tokens.tolist() == ref.argmax(-1).tolist() == [1, 0]  # 4 / 2 < 3; 1.9 / 1.5 < 2
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(chosen.logprobs, raw.gather(1, chosen.tokens[:, None]).squeeze(1))
    # min_p: with p = softmax(logits[0]) ≈ [.69, .25, .01, .04], min_p 0.2 keeps tokens 0 and 1 only
    probs = torch.softmax(logits[0], -1)
    keep = probs >= 0.2 * probs.max()
    assert keep.tolist() == [True, True, False, False]
    row = logits[:1].expand(64, 4)
    uniform = torch.linspace(0, 1 - 1e-9, 64, dtype=torch.float64)
    drawn = choose_tokens(row, torch.ones(64), torch.zeros(64, dtype=torch.long), torch.ones(64), uniform,
                          min_p=torch.full((64,), 0.2)).tokens
    assert set(drawn.tolist()) == {0, 1}  # never a dropped token, and both survivors drawn
    # the survivors keep their relative odds: the share of uniforms landing on token 0 is p0 / (p0 + p1)
    share = (drawn == 0).double().mean().item()
    assert abs(share - (probs[0] / probs[:2].sum()).item()) <= 1 / 64 + 1e-9
    unfiltered = choose_tokens(row, torch.ones(64), torch.zeros(64, dtype=torch.long), torch.ones(64), uniform).tokens
    assert 3 in unfiltered.tolist()  # without min_p a dropped token (p ≈ 0.04 > 1/64) is drawn


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_inverse_cdf_equals_one_cumulative_sum(vocab):
    """The two-level search picks the index one float64 cumulative sum over the whole vocabulary
    picks (unnormalised probabilities, zeros, a vocabulary not a multiple of the block, u near 0
    and 1)."""
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=g) * (torch.rand(64, vocab, generator=g) > 0.3)
    probs[0] = 0.0
    probs[0, vocab // 2] = 2.5  # one token with all the mass
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[1], u[2] = 0.0, 1.0 - 1e-12
    cdf = probs.double().cumsum(-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    expected = torch.minimum(expected, vocab - 1 - (probs > 0).flip(-1).int().argmax(-1))
    got = inverse_cdf(probs, u)
    assert torch.equal(got, expected)
    assert bool((probs.gather(1, got[:, None]) > 0).all())
def reference_shaped(logits: np.ndarray, allowed: np.ndarray | None, bias: dict[int, float], seen: set[int],
                     repetition: float, generated: list[int], frequency: float, presence: float) -> np.ndarray:
    """The logits a row's draw sees, written out token by token (float64): the grammar's mask, then
    logit_bias, then the repetition penalty, then the presence and frequency penalties."""
    z = logits.astype(np.float64).copy()
    for t in range(len(z)):
        if allowed is not None and not allowed[t]:
            z[t] = -np.inf
            continue
        z[t] += bias.get(t, 0.0)
        if t in seen:
            z[t] = z[t] / repetition if z[t] > 0 else z[t] * repetition
        count = generated.count(t)
        z[t] -= frequency * count + presence * (count > 0)
    return z


def reference_probs(z: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """softmax(z / T), then the top k, then the smallest top set with mass ≥ top_p, then the tokens
    with at least min_p × the likeliest one's probability; renormalised."""
    p = np.exp(z / temperature - (z / temperature).max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), dtype=bool)
    kept = order[: top_k if top_k > 0 else len(p)]
    q = p[kept] / p[kept].sum()
    n = int(np.searchsorted(np.cumsum(q), top_p - 1e-12) + 1)
    keep[kept[:n]] = True
    keep &= p >= min_p * p[order[0]]
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def test_every_control_per_row_in_one_mixed_batch_matches_its_reference_formula():
    """Eight rows, each with its own mix of grammar mask, logit_bias, repetition / presence /
    frequency penalties, temperature, top-k, top-p and min-p (greedy and drawn), chosen in one
    batch: a greedy row picks the reference's argmax; a drawn row's token is the one whose slice of
    the reference CDF holds its uniform number. Reported logprobs and alternatives stay the raw
    model's, and rows without a control are untouched by the others'."""
    from mint_server.engine.sampler_ops import logit_biases

    vocab, rows = 70, 8
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(rows, vocab, generator=g) * 2
    allowed = torch.rand(rows, vocab, generator=g) < 0.4
    allowed[:, 5] = True  # every mask allows something
    cases = [  # grammar, bias, repetition, frequency, presence, temperature, top_k, top_p, min_p
        (False, {}, 1.0, 0.0, 0.0, 0.0, 0, 1.0, 0.0),  # plain greedy
        (True, {}, 1.0, 0.0, 0.0, 0.0, 0, 1.0, 0.0),  # grammar, greedy
        (True, {3: 5.0, 9: -100.0}, 1.3, 0.5, 0.2, 0.9, 0, 1.0, 0.0),
        (False, {int(logits[3].argmax()): -100.0, 11: 2.5}, 1.0, 0.0, 0.0, 0.0, 0, 1.0, 0.0),
        (False, {}, 2.0, 0.0, 0.0, 1.2, 10, 0.9, 0.05),
        (True, {7: 100.0}, 1.0, 0.0, 1.5, 1.0, 0, 0.8, 0.1),  # +100 on a token the grammar may forbid
        (False, {1: 0.7}, 1.0, 1.0, 0.0, 0.7, 4, 1.0, 0.0),
        (False, {}, 1.0, 0.0, 0.0, 1.0, 0, 1.0, 0.0),  # plain draw
    ]
    prompts = [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in range(rows)]
    generated = [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(rows)]
    uniform = torch.rand(rows, generator=g, dtype=torch.float64)
    grammar_rows = [i for i, c in enumerate(cases) if c[0]]
    packed = torch.zeros(len(grammar_rows), (vocab + 31) // 32, dtype=torch.int64)
    for j, i in enumerate(grammar_rows):
        for t in allowed[i].nonzero().flatten().tolist():
            packed[j, t // 32] |= 1 << (t % 32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # as an int32 bit pattern
    cpu = torch.device("cpu")
    chosen = choose_tokens(
        logits, torch.tensor([c[5] for c in cases]), torch.tensor([c[6] for c in cases]),
        torch.tensor([c[7] for c in cases]), uniform,
        penalty=penalties(generated, [c[3] for c in cases], [c[4] for c in cases], vocab, cpu), top_n=3,
        repetition=(seen_tokens([p + h for p, h in zip(prompts, generated, strict=True)], vocab, cpu),
                    torch.tensor([c[2] for c in cases])),
        min_p=torch.tensor([c[8] for c in cases]),
        allowed=(torch.tensor(grammar_rows), packed),
        bias=logit_biases([tuple(c[1].items()) for c in cases], cpu),
    )
    raw = torch.log_softmax(logits, -1)
    for i, (grammar, bias, rep, freq, pres, temp, k, top_p, min_p) in enumerate(cases):
        z = reference_shaped(logits[i].numpy(), allowed[i].numpy() if grammar else None, bias,
                             set(prompts[i] + generated[i]), rep, generated[i], freq, pres)
        t = chosen.tokens[i].item()
        assert np.isfinite(z[t]), (i, t)  # never a token the grammar forbids
        if temp == 0:
            assert z[t] >= z.max() - 1e-5, (i, t)
        else:
            p = reference_probs(z, temp, k, top_p, min_p)
            # inverse CDF: over the tokens best first when a filter is on, in vocabulary order otherwise
            order = np.argsort(-z, kind="stable") if (k > 0 or top_p < 1 or min_p > 0) else np.arange(vocab)
            cdf = dict(zip(order.tolist(), np.cumsum(p[order]).tolist(), strict=True))
            assert p[t] > 0 and cdf[t] - p[t] - 1e-6 <= uniform[i].item() <= cdf[t] + 1e-6, (i, t)
        assert chosen.logprobs[i].item() == raw[i, t].item()
    assert torch.equal(chosen.top_ids, raw.topk(3, dim=-1).indices)
    # each row alone, with only its own controls, picks the same token
    for i, (grammar, bias, rep, freq, pres, temp, k, top_p, min_p) in enumerate(cases):
        one = slice(i, i + 1)
        alone = choose_tokens(
            logits[one], torch.tensor([temp]), torch.tensor([k]), torch.tensor([top_p]), uniform[one],
            penalty=penalties(generated[one], [freq], [pres], vocab, cpu),
            repetition=(seen_tokens([prompts[i] + generated[i]], vocab, cpu), torch.tensor([rep])),
            min_p=torch.tensor([min_p]), bias=logit_biases([tuple(bias.items())], cpu),
            allowed=(torch.tensor([0]), packed[grammar_rows.index(i)][None]) if grammar else None,
        )
        assert alone.tokens.item() == chosen.tokens[i].item(), i


def test_logit_bias_bans_and_forces_tokens():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    greedy = torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.zeros(2, dtype=torch.float64)
    from mint_server.engine.sampler_ops import logit_biases

    chosen = choose_tokens(logits, *greedy, bias=logit_biases([((0, -100.0),), ((3, 100.0),)], torch.device("cpu")))
    assert chosen.tokens.tolist() == [1, 3]
    assert logit_biases([(), ()], torch.device("cpu")) is None
    drawn = choose_tokens(logits[1:].expand(50, 4), torch.ones(50), torch.zeros(50, dtype=torch.long), torch.ones(50),
                          torch.linspace(0, 1 - 1e-9, 50, dtype=torch.float64),
                          bias=logit_biases([((2, -100.0),)] * 50, torch.device("cpu"))).tokens
    assert 2 not in drawn.tolist() and set(drawn.tolist()) == {0, 1, 3}
