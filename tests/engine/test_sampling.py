"""The continuous-batching sampler end to end, on tiny random checkpoints (fp32, CPU)."""

import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from tinker import types

from mint_server.engine.interface import EngineError
from mint_server.engine.records import SamplingRecords
from mint_server.model.loader import load_model
from mint_server.model.peft_io import load_peft, save_peft
from tests.engine.helpers import SamplerHarness, make_residency
from tests.model.test_parity import random_adapter
from tests.tolerance import for_model


@pytest.fixture(scope="module")
def tokenizer(sampling_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(sampling_llama_dir)


def make_sampler(model, residency, **kw) -> SamplerHarness:
    kw = {"kv_slots": 8, "max_seq_len": 96, "block_size": 8, "records": SamplingRecords(), **kw}
    return SamplerHarness(model, residency, **kw)


def install(residency, rank: int, seed: int) -> str:
    return residency.install(random_adapter(residency.cfg, rank, seed), trainable=False).id


def params(**kw) -> types.SamplingParams:
    return types.SamplingParams(**{"stop": [], "max_tokens": 12, "temperature": 0.0, **kw})


def drain(sampler: SamplerHarness, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not sampler.has_work():
            break
        sampler.step()
    assert not sampler.has_work()
    assert sampler.kv_blocks_in_use == 0  # every block came back


def prompt_of(seed: int, n: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logprobs(model, residency, adapter_id, tokens: list[int]) -> torch.Tensor:
    """The training view: log_softmax of one plain forward over the whole sequence (no cache)."""
    slot = -1 if adapter_id is None else residency.get(adapter_id).slot
    lora = None if slot < 0 else residency.bank.batch([slot])
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens]), lora=lora)[0].float(), -1)


def solo(model, residency, adapter_id, prompt, p, n=1, **kw):
    """The same request on a fresh sampler with nothing else running."""
    s = make_sampler(model, residency, **kw)
    f = s.submit(adapter_id, prompt, n, p)
    drain(s)
    return [q.tokens for q in f.result().sequences]


# --- correctness against transformers / PEFT ----------------------------------------------------


@pytest.mark.parametrize("fixture", ["sampling_llama_dir", "sampling_qwen3_dir"])
def test_greedy_matches_transformers_peft_in_one_mixed_batch(fixture, request, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(fixture)
    ours = load_model(model_dir, device="cpu")
    reg = make_residency(ours.config, num_slots=4, max_rank=8)
    names = []
    for i, (rank, seed) in enumerate([(4, 11), (8, 12)]):
        save_peft(random_adapter(ours.config, rank, seed), tmp_path / f"a{i}", base_model=str(model_dir))
        names.append(reg.install(load_peft(tmp_path / f"a{i}", ours.config.num_layers), trainable=False).id)
    prompts = [prompt_of(s, 9) for s in (1, 2, 3)]
    adapters = [None, names[0], names[1]]
    sampler = make_sampler(ours, reg)
    futures = [sampler.submit(a, p, 1, params(max_tokens=16)) for a, p in zip(adapters, prompts, strict=True)]
    drain(sampler)
    assert sampler.stats.forwards == 16 and sampler.stats.prompt_rows == 3  # all three together
    got = [f.result().sequences[0].tokens for f in futures]

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = PeftModel.from_pretrained(hf, tmp_path / "a0", adapter_name="a0")
    hf.load_adapter(tmp_path / "a1", adapter_name="a1")
    hf.eval()
    # Never stop at EOS, like stop=[] (min_new_tokens would instead forbid EOS, changing the argmax).
    hf.get_base_model().generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(prompts), attention_mask=torch.ones(3, 9, dtype=torch.long),
            adapter_names=["__base__", "a0", "a1"], do_sample=False, max_new_tokens=16, pad_token_id=0,
        )
    assert got == out[:, 9:].tolist()
    assert got[1] != got[0] and got[2] != got[1]  # the adapters really steer generation


def test_sampled_and_prompt_logprobs_equal_the_training_forward(model, residency):
    aid = install(residency, 4, seed=5)
    records = SamplingRecords()
    sampler = make_sampler(model, residency, records=records)
    prompt = prompt_of(7, 13)  # 13 = one full block of 8 and a partial one: forks copy the partial block
    f = sampler.submit(aid, prompt, 3, params(temperature=1.0, top_p=0.9, top_k=40, seed=3, max_tokens=20),
                       prompt_logprobs=True, topk_prompt_logprobs=3, record_stability_info=True)
    base = sampler.submit(None, prompt, 1, params(temperature=0.8, seed=4, max_tokens=20))
    scored = sampler.compute_logprobs(aid, prompt)
    drain(sampler)
    res = f.result()
    assert [s.sequence_id for s in res.sequences] == f.sequence_ids
    assert len({tuple(s.tokens) for s in res.sequences}) == 3  # three distinct samples
    for seq in res.sequences:
        ref = full_logprobs(model, residency, aid, prompt + seq.tokens)
        want = [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(seq.tokens)]
        for_model(model.config).check(seq.logprobs, want, "sampled logprobs")
        assert records.get(seq.sequence_id) == seq.logprobs
        rec = records.get_record(seq.sequence_id)
        assert rec.tokens.tolist() == seq.tokens and rec.prompt_tokens.tolist() == prompt and rec.adapter_id == aid
    seq = base.result().sequences[0]
    ref = full_logprobs(model, residency, None, prompt + seq.tokens)
    for_model(model.config).check(seq.logprobs, [ref[len(prompt) + i - 1, t].item() for i, t in enumerate(seq.tokens)], "base")
    assert records.get(seq.sequence_id) is None  # not asked to record

    ref = full_logprobs(model, residency, aid, prompt)
    want = [None] + [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    for got in (res.prompt_logprobs, scored.result()):
        assert got[0] is None
        for_model(model.config).check(got[1:], want[1:], "prompt logprobs")
    top = res.topk_prompt_logprobs
    assert top[0] is None and all(len(t) == 3 for t in top[1:])
    v, i = ref[:-1].topk(3, dim=-1)
    assert [[tok for tok, _ in t] for t in top[1:]] == i.tolist()
    for_model(model.config).check([[lp for _, lp in t] for t in top[1:]], v, "top prompt logprobs")
    assert base.result().prompt_logprobs is None and base.result().topk_prompt_logprobs is None


def test_first_token_frequencies_match_the_models_filtered_softmax(model, residency):
    """End to end: 6000 seeded samples of one token each, forked off one prefill."""
    draws, temperature, top_k, top_p = 6000, 0.5, 6, 0.8
    prompt = prompt_of(21, 10)
    sampler = make_sampler(model, residency, kv_slots=draws // 2 + 10, max_seq_len=16, max_num_samples=draws,
                           max_batch_rows=draws)
    f = sampler.submit(None, prompt, draws, params(temperature=temperature, top_k=top_k, top_p=top_p, seed=9,
                                                  max_tokens=1))
    drain(sampler)
    assert sampler.stats.prompt_rows == 1
    freq = np.bincount([s.tokens[0] for s in f.result().sequences], minlength=model.config.vocab_size) / draws

    from tests.engine.test_sampling_ops import filtered_softmax

    logits = full_logprobs(model, residency, None, prompt)[-1].double().numpy()
    expected = filtered_softmax(logits, temperature, top_k, top_p)
    # σ ≤ √(0.25 / 6000) ≈ 0.0065; 0.03 is > 4.5σ.
    assert np.abs(freq - expected).max() <= 0.03, (freq[expected > 0], expected[expected > 0])
    assert freq[expected == 0].sum() == 0


# --- stopping -----------------------------------------------------------------------------------


def test_stop_strings_spanning_token_boundaries(model, residency, tokenizer):
    prompt = prompt_of(31, 6)
    (gen,) = solo(model, residency, None, prompt, params(max_tokens=60))
    text = [tokenizer.decode(gen[:i]) for i in range(len(gen) + 1)]
    # A 3-character stop string made of the last two characters before token i and the first one of
    # token i: it spans a token boundary, and its first occurrence completes at token i.
    cases = []
    for i in range(2, len(gen)):
        a, b = text[i], text[i + 1]
        if not (b.startswith(a) and len(a) >= 2 and len(b) > len(a)):
            continue
        stop = a[-2:] + b[len(a)]
        if not stop.isprintable() or "\ufffd" in stop or stop in tokenizer.decode([gen[i]]):
            continue
        first = next(j for j in range(len(gen) + 1) if stop in text[j])
        if first == i + 1:
            cases.append((stop, i + 1))
    assert len(cases) >= 2, "the tiny model's greedy text should offer boundary-spanning stop strings"
    sampler = make_sampler(model, residency, tokenizer=tokenizer)
    (stop1, n1), (stop2, n2) = cases[0], cases[-1]
    f1 = sampler.submit(None, prompt, 1, params(max_tokens=60, stop=stop1))  # a bare string
    f2 = sampler.submit(None, prompt, 1, params(max_tokens=60, stop=["\x00never", stop2]))
    f3 = sampler.submit(None, prompt, 1, params(max_tokens=60, stop=[gen[4]]))  # token ids
    drain(sampler)
    s1, s2, s3 = (f.result().sequences[0] for f in (f1, f2, f3))
    assert (s1.tokens, s1.stop_reason) == (gen[:n1], "stop")
    assert (s2.tokens, s2.stop_reason) == (gen[:n2], "stop")
    assert (s3.tokens, s3.stop_reason) == (gen[: gen.index(gen[4]) + 1], "stop")


def test_default_stop_is_eos_and_empty_list_never_stops(model, residency):
    prompt = prompt_of(32, 6)
    (gen,) = solo(model, residency, None, prompt, params(max_tokens=30))
    eos = gen[7]
    sampler = make_sampler(model, residency, eos_token_ids=[eos])
    f_default = sampler.submit(None, prompt, 1, params(max_tokens=30, stop=None))
    f_never = sampler.submit(None, prompt, 1, params(max_tokens=30))
    drain(sampler)
    d, n = f_default.result().sequences[0], f_never.result().sequences[0]
    assert (d.tokens, d.stop_reason) == (gen[: gen.index(eos) + 1], "stop")
    assert (n.tokens, n.stop_reason) == (gen, "length")


# --- batching, determinism, memory --------------------------------------------------------------


def test_request_admitted_mid_decode_returns_what_it_returns_alone(model, residency):
    adapters = [install(residency, r, seed=40 + r) for r in (2, 4, 8)]
    target = dict(adapter_id=adapters[1], prompt=prompt_of(50, 11),
                  p=params(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=25))
    alone = solo(model, residency, target["adapter_id"], target["prompt"], target["p"], n=2)

    sampler = make_sampler(model, residency, kv_slots=24)
    others = [
        sampler.submit([None, *adapters][i % 4], prompt_of(100 + i, 5 + i % 7), 1,
                       params(temperature=[0.0, 1.0, 0.7][i % 3], seed=i, max_tokens=40))
        for i in range(16)
    ]
    for _ in range(6):
        sampler.step()
    assert len(sampler._rows) == 16  # all sixteen are mid-decode
    f = sampler.submit(target["adapter_id"], target["prompt"], 2, target["p"])
    drain(sampler)
    assert [s.tokens for s in f.result().sequences] == alone
    assert all(len(o.result().sequences[0].tokens) == 40 for o in others)
    # and the same seed reproduces, a different one does not
    again = solo(model, residency, target["adapter_id"], target["prompt"], target["p"], n=2)
    other = solo(model, residency, target["adapter_id"], target["prompt"], target["p"].model_copy(update={"seed": 99}), n=2)
    assert again == alone and other != alone


def test_more_work_than_the_kv_budget_is_queued_and_completes(model, residency):
    # Budget: 2 × 48 = 96 positions = 12 blocks of 8. Each sample needs ⌈(6 + 20) / 8⌉ = 4 blocks,
    # so three run at a time; the 5-sample request alone cannot fit at once and goes in waves.
    kw = dict(kv_slots=2, max_seq_len=48)
    prompts = [prompt_of(200 + i, 6) for i in range(10)]
    p = params(max_tokens=20)
    sampler = make_sampler(model, residency, **kw)
    assert sampler.cache.nbytes == 2 * sampler.cache.k.numel() * 4
    assert sampler.cache.k.shape[1] == 12 + 1  # + the scratch block
    futures = [sampler.submit(None, pr, 1, p) for pr in prompts]
    big = sampler.submit(None, prompts[0], 5, params(max_tokens=20, temperature=1.0, seed=5))
    sampler.step()
    assert sampler.has_work() and len(sampler._queue) == 8  # admitted what fits, queued the rest
    drain(sampler)
    assert sampler.pool.peak_used <= 12
    assert sampler.stats.peak_rows == 3
    for pr, f in zip(prompts, futures, strict=True):
        assert f.result().sequences[0].tokens == solo(model, residency, None, pr, p)[0]
    assert [s.tokens for s in big.result().sequences] == solo(
        model, residency, None, prompts[0], params(max_tokens=20, temperature=1.0, seed=5), n=5, kv_slots=8
    )


def test_shared_prefill_for_samples_and_identical_prompts(model, residency):
    aid = install(residency, 4, seed=60)
    prompt = prompt_of(61, 13)
    sampler = make_sampler(model, residency)
    n4 = sampler.submit(aid, prompt, 4, params(max_tokens=10))
    twin = sampler.submit(aid, prompt, 1, params(max_tokens=10))
    base = sampler.submit(None, prompt, 1, params(max_tokens=10))  # same prompt, other adapter: own prefill
    drain(sampler)
    assert sampler.stats.prompt_rows == 2 and sampler.stats.prefill_tokens == 26
    (one,) = solo(model, residency, aid, prompt, params(max_tokens=10))
    assert [s.tokens for s in n4.result().sequences] == [one] * 4
    assert twin.result().sequences[0].tokens == one
    assert n4.result().prompt_cache_hit_tokens == 0 and twin.result().prompt_cache_hit_tokens == 13
    assert base.result().sequences[0].tokens != one


def test_admitted_requests_finish_on_their_revision(model, residency):
    old = install(residency, 4, seed=70)
    prompt, p = prompt_of(71, 8), params(max_tokens=24)
    (reference,) = solo(model, residency, old, prompt, p)
    old_slot = residency.get(old).slot
    sampler = make_sampler(model, residency)
    f = sampler.submit(old, prompt, 1, p)
    for _ in range(5):
        sampler.step()
    new = install(residency, 4, seed=72)  # the next revision, installed while `old` is mid-decode
    residency.release(old)  # and the old one released: its slot must survive until the request ends
    assert residency.get(new).slot != old_slot
    with pytest.raises(EngineError, match="adapter"):
        sampler.submit(old, prompt, 1, p)
    g = sampler.submit(new, prompt, 1, p)
    drain(sampler)
    assert f.result().sequences[0].tokens == reference
    assert g.result().sequences[0].tokens != reference
    assert residency._slots[old_slot] is None  # freed once the last request on it finished


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("prompt", dict(prompt=[5, 320])),
        ("prompt", dict(prompt=[5, -1])),
        ("prompt", dict(prompt=[])),
        ("prompt", dict(prompt=list(range(3, 99)))),
        ("max_tokens", dict(p=params(max_tokens=90))),
        ("max_tokens", dict(p=params(max_tokens=0))),
        ("num_samples", dict(n=0)),
        ("num_samples", dict(n=-3)),
        ("temperature", dict(p=params(temperature=-0.5))),
        ("top_p", dict(p=params(top_p=0.0))),
        ("top_p", dict(p=params(top_p=1.5))),
        ("top_k", dict(p=params(top_k=-2))),
        ("stop", dict(p=params(stop=[320]))),
        ("stop", dict(p=params(stop=["ok", ""]))),
        ("topk_prompt_logprobs", dict(topk=-1)),
        ("top_logprobs", dict(opts={"top_logprobs": -1})),
        ("top_logprobs", dict(opts={"top_logprobs": 21})),  # the engine's max_top_logprobs is 20
        ("top_logprobs", dict(opts={"top_logprobs": True})),
        ("frequency_penalty", dict(opts={"frequency_penalty": float("nan")})),
        ("presence_penalty", dict(opts={"presence_penalty": "high"})),
        ("repetition_penalty", dict(opts={"repetition_penalty": 0.0})),
        ("repetition_penalty", dict(opts={"repetition_penalty": float("inf")})),
        ("min_p", dict(opts={"min_p": 1.5})),
        ("adapter", dict(adapter="no-such-adapter")),
    ],
)
def test_bad_input_names_the_field_and_leaves_the_batch_alone(model, residency, field, kwargs):
    aid = install(residency, 2, seed=80)
    prompt, p = prompt_of(81, 7), params(max_tokens=15, temperature=1.0, seed=2)
    (reference,) = solo(model, residency, aid, prompt, p)
    sampler = make_sampler(model, residency)
    f = sampler.submit(aid, prompt, 1, p)
    sampler.step()
    bad = dict(adapter=aid, prompt=prompt_of(82, 10), n=1, p=params(), topk=0, opts={}) | kwargs
    with pytest.raises(EngineError, match=field):
        sampler.submit(bad["adapter"], bad["prompt"], bad["n"], bad["p"], topk_prompt_logprobs=bad["topk"], **bad["opts"])
    assert residency.get(aid).refs == 1  # a refused request holds no pin
    drain(sampler)
    assert f.result().sequences[0].tokens == reference
    assert residency.get(aid).refs == 0


def test_stop_strings_without_a_tokenizer_are_refused(model, residency):
    with pytest.raises(EngineError, match="stop"):
        make_sampler(model, residency).submit(None, [5, 6], 1, params(stop=["\n"]))


def test_a_request_cancelled_while_queued_is_dropped(model, residency):
    aid = install(residency, 2, seed=90)
    sampler = make_sampler(model, residency)
    f: Future = sampler.submit(aid, [5, 6, 7], 1, params())
    assert residency.get(aid).refs == 1 and f.cancel()
    drain(sampler)
    assert residency.get(aid).refs == 0 and sampler.stats.forwards == 0


def test_submit_from_many_threads_while_the_worker_steps(model, residency):
    import threading

    aid = install(residency, 4, seed=95)
    sampler = make_sampler(model, residency, kv_slots=6)
    futures: list[Future] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(8):
            f = sampler.submit([None, aid][i % 2], prompt_of(300 + 8 * k + i, 4 + i), 1,
                               params(temperature=1.0, seed=k * 8 + i, max_tokens=6 + i))
            with lock:
                futures.append(f)

    clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in clients:
        t.start()
    while any(t.is_alive() for t in clients) or sampler.has_work():
        if sampler.has_work():
            sampler.step()
    for t in clients:
        t.join()
    drain(sampler)
    assert len(futures) == 32 and all(len(f.result().sequences[0].tokens) >= 6 for f in futures)
    assert residency.get(aid).refs == 0


def test_step_budget_chunks_prompts_beside_decode_and_tiny_temperatures_are_greedy(model, residency):
    prompts = [prompt_of(400 + i, 8) for i in range(3)] + [prompt_of(404, 30)]
    p = params(max_tokens=5)
    sampler = make_sampler(model, residency, max_step_tokens=20)
    futures = [sampler.submit(None, pr, 1, p) for pr in prompts]
    futures.append(sampler.submit(None, prompts[0], 1, params(max_tokens=5, temperature=1e-9, seed=1)))
    drain(sampler)
    # No step carries more than 20 tokens (decode rows and prompt chunks together): the 30-token
    # prompt is prefilled in pieces, next to the others' decode rows, and still gives its tokens.
    s = sampler.stats
    assert s.peak_step_tokens <= 20 and s.prefill_chunks > s.prompt_rows and s.prefill_tokens == 4 * 8 + 30
    for pr, f in zip(prompts, futures, strict=False):
        assert f.result().sequences[0].tokens == solo(model, residency, None, pr, p)[0]
    assert futures[-1].result().sequences[0].tokens == futures[0].result().sequences[0].tokens


def test_shutdown_without_drain_fails_running_samples(sampling_llama_dir):
    from mint_server.engine.local import LocalEngine
    from mint_server.engine.settings import EngineSettings

    engine = LocalEngine(sampling_llama_dir, "tiny", settings=EngineSettings(device_slots=2, max_rank=8,
                                                                             kv_budget_tokens=4096))
    params = types.SamplingParams(max_tokens=400, temperature=1.0, seed=1, stop=[])
    running = engine.submit(engine.prepare_sample(None, [5, 6, 7], 2, params))
    deadline = time.monotonic() + 30
    while engine.stats["sample_steps"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    queued = [engine.submit(engine.prepare_sample(None, [5, 6, 7], 1, params)) for _ in range(3)]
    engine.shutdown(drain=False)
    for fut in [running, *queued]:  # none is left pending forever
        with pytest.raises(EngineError, match="shut down"):
            fut.result(timeout=30)


# --- streaming: token callbacks, cancellation, EOS next to stop strings ---------------------------

def stream_job(sampler, adapter_id, prompt, n, p, on_token=None, cancel=None, stop_at_eos=False) -> Future:
    job = sampler.prep.sample(adapter_id, prompt, n, p, stop_at_eos=stop_at_eos).streaming(on_token, cancel)
    return sampler._queue_job(job, adapter_id)


def test_token_callback_sees_every_token_in_order(model, residency):
    sampler = make_sampler(model, residency)
    seen: list[tuple[int, int, float]] = []
    f = stream_job(sampler, None, [5, 6, 7], 3, params(temperature=1.0, seed=3),
                   on_token=lambda i, t, lp, top: seen.append((i, t, lp)))
    drain(sampler)
    for i, seq in enumerate(f.result().sequences):
        assert [t for j, t, _ in seen if j == i] == seq.tokens
        assert np.array_equal(np.asarray([lp for j, _, lp in seen if j == i], dtype=np.float32), seq.logprobs_np)


def test_top_logprobs_are_the_training_forwards_and_stream_as_they_are_returned(model, residency):
    aid = install(residency, 4, seed=6)
    sampler = make_sampler(model, residency)
    prompt = prompt_of(8, 11)
    seen: dict[int, list] = {0: [], 1: []}
    job = sampler.prep.sample(aid, prompt, 2, params(temperature=1.0, seed=9, max_tokens=10), top_logprobs=5)
    f = sampler._queue_job(job.streaming(lambda i, t, lp, top: seen[i].append((t, lp, top)), None), aid)
    plain = sampler.submit(aid, prompt, 2, params(temperature=1.0, seed=9, max_tokens=10))
    drain(sampler)
    for i, seq in enumerate(f.result().sequences):
        top = seq.topk_logprobs
        assert len(top) == len(seq.tokens) and all(len(t) == 5 for t in top)
        ref = full_logprobs(model, residency, aid, prompt + seq.tokens)[len(prompt) - 1 : -1]
        v, ids = ref.topk(5, dim=-1)
        assert [[tok for tok, _ in t] for t in top] == ids.tolist()
        lps = np.array([[lp for _, lp in t] for t in top])
        for_model(model.config).check(lps, v, "top logprobs")
        assert (lps[:, :-1] >= lps[:, 1:]).all()
        for tok, lp, alts in zip(seq.tokens, seq.logprobs, top, strict=True):
            assert dict(alts).get(tok, lp) == lp  # exactly its own logprob when listed
        assert [(t, lp, alts) for t, lp, alts in seen[i]] == list(zip(seq.tokens, seq.logprobs, top, strict=True))
        # Asking for alternatives changes nothing else (the two jobs' rows sit at other places in the
        # batch, so their logprobs agree within the tolerance policy; bitwise only in invariant mode).
        assert seq.tokens == plain.result().sequences[i].tokens
        for_model(model.config).check(seq.logprobs, plain.result().sequences[i].logprobs, "with vs without top")
    assert plain.result().sequences[0].topk_logprobs is None


def test_frequency_and_presence_penalties_steer_greedy_decoding(model, residency):
    prompt = prompt_of(12, 6)
    sampler = make_sampler(model, residency)
    p = params(max_tokens=40)
    (repeats,) = solo(model, residency, None, prompt, p)
    assert len(set(repeats)) < len(repeats)  # the tiny model repeats itself when greedy
    zero = sampler.submit(None, prompt, 1, p, frequency_penalty=0.0, presence_penalty=0.0)
    freq = sampler.submit(None, prompt, 1, p, frequency_penalty=2.0, top_logprobs=3)
    pres = sampler.submit(None, prompt, 1, p, presence_penalty=2.0)
    drain(sampler)
    assert zero.result().sequences[0].tokens == repeats  # zero penalties: the plain sampler's tokens
    for f in (freq, pres):
        seq = f.result().sequences[0]
        assert seq.tokens != repeats and len(set(seq.tokens)) > len(set(repeats))
        # Reported logprobs (and alternatives) stay the raw model's: what training computes.
        ref = full_logprobs(model, residency, None, prompt + seq.tokens)[len(prompt) - 1 : -1]
        want = ref.gather(1, torch.tensor(seq.tokens)[:, None]).squeeze(1).numpy()
        for_model(model.config).check(seq.logprobs, want, "penalised")
        if f is freq:
            assert [[tok for tok, _ in t] for t in seq.topk_logprobs] == ref.topk(3, dim=-1).indices.tolist()


def test_cancel_stops_running_and_queued_requests_and_frees_their_blocks(model, residency):
    import threading

    from mint_server.engine.values import SampleCancelled

    aid = install(residency, 2, seed=91)
    sampler = make_sampler(model, residency, kv_slots=2)
    cancel_running, cancel_queued = threading.Event(), threading.Event()
    running = stream_job(sampler, aid, [5, 6, 7], 2, params(max_tokens=80), cancel=cancel_running)
    queued = stream_job(sampler, None, [5, 6, 7], 1, params(max_tokens=80), cancel=cancel_queued)  # no room yet
    other = sampler.submit(None, [9, 10], 1, params(max_tokens=4))
    sampler.step()
    sampler.step()
    assert sampler.kv_blocks_in_use > 0 and not running.done()
    cancel_running.set()
    cancel_queued.set()
    sampler.step()
    with pytest.raises(SampleCancelled):
        running.result(timeout=0)
    drain(sampler)  # asserts every block came back
    with pytest.raises(SampleCancelled):
        queued.result(timeout=0)
    assert len(other.result().sequences[0].tokens) == 4
    assert residency.get(aid).refs == 0


def test_stop_at_eos_keeps_eos_next_to_stop_strings(model, residency, tokenizer):
    first = solo(model, residency, None, [5, 6, 7], params(max_tokens=1))[0][0]
    sampler = make_sampler(model, residency, tokenizer=tokenizer, eos_token_ids=[first])
    with_eos = stream_job(sampler, None, [5, 6, 7], 1, params(stop=["never-said"]), stop_at_eos=True)
    without = stream_job(sampler, None, [5, 6, 7], 1, params(stop=["never-said"]))
    drain(sampler)
    assert with_eos.result().sequences[0].tokens == [first]
    assert with_eos.result().sequences[0].stop_reason == "stop"
    assert len(without.result().sequences[0].tokens) == 12
