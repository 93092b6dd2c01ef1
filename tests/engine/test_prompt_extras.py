"""tinker 0.38's prompt fields (target_prompt_logprobs dense and CSR, prompt_alt_tokens_k,
prompt_logprobs_last_n) and processed logprobs (opt-in), against transformers on the tiny
checkpoint (fp32, CPU), within the tolerance policy (tests/tolerance.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from mint_server.engine.interface import EngineError
from tests.engine.helpers import SamplerHarness
from tests.tolerance import for_model

VOCAB_USED = 320


@pytest.fixture(scope="module")
def hf(sampling_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sampling_llama_dir, dtype=torch.float32).eval()


def oracle_logits(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' next-token logits [len(tokens), V] (row i: the logits after tokens[:i + 1])."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB_USED, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make(model, residency, **kw) -> SamplerHarness:
    return SamplerHarness(model, residency, **{"kv_slots": 8, "max_seq_len": 96, "block_size": 8, **kw})


def run(sampler: SamplerHarness, prompt, p=None, n=1, **kw) -> types.SampleResponse:
    p = p or types.SamplingParams(max_tokens=2, temperature=0.0, stop=[])
    f = sampler.submit(None, prompt, n, p, **kw)
    for _ in range(10_000):
        if not sampler.has_work():
            break
        sampler.step()
    assert sampler.kv_blocks_in_use == 0
    return f.result()


def targets_of(prompt: list[int], width: int, seed: int, empty: float = 0.5) -> torch.Tensor:
    """[len(prompt) - 1, width] ids with -1 in about `empty` of the cells (and row 0 all -1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB_USED, (len(prompt) - 1, width), generator=g)
    ids[torch.rand(ids.shape, generator=g) < empty] = -1
    ids[0] = -1
    return ids


@pytest.mark.parametrize("layout", ["dense", "sparse"])
def test_target_prompt_logprobs_equal_transformers_in_the_requests_layout(model, residency, hf, layout):
    prompt = prompt_of(3, 21)
    ids = targets_of(prompt, 5, seed=4, empty=0.85)  # few cells: from_torch_sparse then keeps CSR
    td = types.TensorData.from_torch(ids) if layout == "dense" else types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert (td.sparse_crow_indices is not None) == (layout == "sparse")
    # a small step budget: the prompt's cells arrive over several prefill chunks
    res = run(make(model, residency, max_step_tokens=8), prompt, target_prompt_logprobs=td)
    out = res.target_prompt_logprobs
    assert out is not None and out.dtype == "float32" and out.shape == list(ids.shape)
    if layout == "sparse":  # the same cells listed, in the same order
        assert out.sparse_crow_indices == td.sparse_crow_indices and out.sparse_col_indices == td.sparse_col_indices
    got = out.to_torch()  # densified: unlisted cells 0.0
    ref = torch.log_softmax(oracle_logits(hf, prompt), -1)[: len(prompt) - 1]
    want = torch.where(ids >= 0, ref.gather(1, ids.clamp(min=0)), torch.zeros(()))
    for_model(model.config).check(got, want, "target prompt logprobs")
    assert (got[ids < 0] == 0).all()
    assert res.prompt_logprobs is None and res.prompt_alt_tokens is None


def test_target_prompt_logprobs_beside_prompt_logprobs_and_a_shared_prefill(model, residency, hf):
    """Two identical prompts share one prefill: one asks for prompt logprobs, one for target cells."""
    prompt = prompt_of(5, 17)
    ids = targets_of(prompt, 3, seed=6)
    s = make(model, residency)
    p = types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])
    a = s.submit(None, prompt, 1, p, target_prompt_logprobs=types.TensorData.from_torch(ids))
    b = s.submit(None, prompt, 2, p, prompt_logprobs=True, topk_prompt_logprobs=2)
    while s.has_work():
        s.step()
    assert s.stats.prompt_rows == 1
    ref = torch.log_softmax(oracle_logits(hf, prompt), -1)
    tol = for_model(model.config)
    tol.check(a.result().target_prompt_logprobs.to_torch(),
              torch.where(ids >= 0, ref[:-1].gather(1, ids.clamp(min=0)), torch.zeros(())), "targets")
    tol.check(b.result().prompt_logprobs[1:], [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))], "prompt")
    assert a.result().prompt_logprobs is None


def test_prompt_logprobs_last_n_scores_only_the_suffix(model, residency, hf):
    prompt = prompt_of(8, 19)
    n = 5
    res = run(make(model, residency, max_step_tokens=8), prompt, prompt_logprobs=True, topk_prompt_logprobs=3,
              prompt_logprobs_last_n=n)
    ref = torch.log_softmax(oracle_logits(hf, prompt), -1)
    got = res.prompt_logprobs
    assert got[: len(prompt) - n] == [None] * (len(prompt) - n)
    for_model(model.config).check(got[-n:], [ref[i - 1, prompt[i]].item() for i in range(len(prompt) - n, len(prompt))],
                                  "last n")
    top = res.topk_prompt_logprobs
    assert top[: len(prompt) - n] == [None] * (len(prompt) - n)
    v, i = ref[len(prompt) - n - 1 : -1].topk(3, dim=-1)
    assert [[t for t, _ in row] for row in top[-n:]] == i.tolist()
    for_model(model.config).check([[lp for _, lp in row] for row in top[-n:]], v, "last n top-k")


def test_prompt_alt_tokens_are_draws_at_the_requests_temperature(model, residency, hf):
    prompt = prompt_of(9, 6)
    k, temperature = 4000, 0.3
    p = types.SamplingParams(max_tokens=1, temperature=temperature, seed=11, stop=[])
    res = run(make(model, residency, max_step_tokens=4), prompt, p, prompt_alt_tokens_k=k)
    alt = res.prompt_alt_tokens
    assert alt is not None and alt.tokens.shape == [len(prompt) - 1, k] and alt.logprobs.shape == [len(prompt) - 1, k]
    tokens, lps = alt.tokens.to_torch(), alt.logprobs.to_torch()
    logits = oracle_logits(hf, prompt)[:-1]
    raw = torch.log_softmax(logits, -1)
    for_model(model.config).check(lps, raw.gather(1, tokens), "alt logprobs are the model's raw logprobs")
    # The draws follow softmax(logits / T): per row, the mean logit of the drawn tokens is that
    # distribution's expectation within 5 standard errors (a fixed seed: deterministic), and many
    # standard errors away from what temperature 1 would give.
    for row in range(len(prompt) - 1):
        drawn = logits[row][tokens[row]].double()
        for t, near in ((temperature, True), (1.0, False)):
            q = torch.softmax(logits[row].double() / t, -1)
            mean = (q * logits[row]).sum()
            se = ((q * (logits[row] - mean) ** 2).sum() / k).sqrt()
            z = ((drawn.mean() - mean) / se).abs().item()
            assert (z < 5) if near else (z > 10), (row, t, z)
    # The same seed gives the same draws however the prompt is chunked; greedy gives the argmax.
    again = run(make(model, residency, max_step_tokens=64), prompt, p, prompt_alt_tokens_k=k)
    assert torch.equal(again.prompt_alt_tokens.tokens.to_torch(), tokens)
    greedy = run(make(model, residency), prompt, types.SamplingParams(max_tokens=1, temperature=0.0, stop=[]),
                 prompt_alt_tokens_k=3)
    assert greedy.prompt_alt_tokens.tokens.to_torch().tolist() == [[t] * 3 for t in logits.argmax(-1).tolist()]


def csr(rows: int, width: int, crow, col, data) -> types.TensorData:
    return types.TensorData(data=np.asarray(data, dtype=np.int64), dtype="int64", shape=[rows, width],
                            sparse_crow_indices=crow, sparse_col_indices=col)


@pytest.mark.parametrize(("field", "kwargs"), [
    ("target_prompt_logprobs", dict(target_prompt_logprobs=types.TensorData.from_torch(torch.zeros(3, 2, dtype=torch.int64)))),
    ("target_prompt_logprobs", dict(target_prompt_logprobs=types.TensorData.from_torch(torch.zeros(4, 2)))),
    ("target_prompt_logprobs", dict(target_prompt_logprobs=types.TensorData.from_torch(torch.full((4, 2), -1)))),
    ("target_prompt_logprobs", dict(target_prompt_logprobs=types.TensorData.from_torch(torch.full((4, 2), 10**6)))),
    ("target_prompt_logprobs", dict(target_prompt_logprobs=types.TensorData.from_torch(torch.zeros(4, dtype=torch.int64)))),
    ("target_prompt_logprobs", dict(target_prompt_logprobs=csr(4, 2, [0, 1, 1, 1], [0], [7]))),
    ("target_prompt_logprobs", dict(target_prompt_logprobs=csr(4, 2, [0, 2, 2, 2, 2], [1, 0], [7, 8]))),
    ("target_prompt_logprobs", dict(target_prompt_logprobs=csr(4, 2, [0, 1, 1, 1, 1], [2], [7]))),
    ("prompt_alt_tokens_k", dict(prompt_alt_tokens_k=-1)),
    ("prompt_alt_tokens_k", dict(prompt_alt_tokens_k=10**9)),
    ("prompt_logprobs_last_n", dict(prompt_logprobs=True, prompt_logprobs_last_n=0)),
    ("prompt_logprobs_last_n", dict(prompt_logprobs=True, prompt_logprobs_last_n=5)),
    ("prompt_logprobs_last_n", dict(prompt_logprobs_last_n=2)),
    ("sampling_params.logprobs_mode", dict(logprobs_mode="final")),
])
def test_out_of_range_prompt_fields_are_refused_by_name(model, residency, field, kwargs):
    s = make(model, residency)
    with pytest.raises(EngineError, match=f"^{field}: "):
        s.prep.sample(None, [5, 6, 7, 8, 9], 1, types.SamplingParams(max_tokens=2), **kwargs)


# --- processed logprobs -------------------------------------------------------------------------


def reference_processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """A plain reference sampler's distribution, as log-probabilities: logits / T, keep the k
    likeliest, then the smallest set of likeliest tokens whose mass reaches top_p, renormalise."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    mass = probs[keep].sum()
    kept, total = [], 0.0
    for t in keep:
        kept.append(t)
        total += (probs[t] / mass).item()
        if total >= top_p:
            break
    out = torch.full_like(probs, float("-inf"))
    out[kept] = torch.log(probs[kept] / probs[kept].sum())
    return out


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 50, 0.9), (1.3, -1, 0.8), (0.5, 20, 1.0)])
def test_processed_logprobs_are_the_reference_samplers_distribution(model, residency, hf, temperature, top_k, top_p):
    prompt = prompt_of(12, 7)
    p = types.SamplingParams(max_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p, seed=5, stop=[])
    s = make(model, residency)
    processed = s.submit(None, prompt, 2, p, top_logprobs=5, logprobs_mode="processed_logprobs")
    raw = s.submit(None, prompt, 2, p, top_logprobs=5)
    while s.has_work():
        s.step()
    tol = for_model(model.config)
    for seq, raw_seq in zip(processed.result().sequences, raw.result().sequences, strict=True):
        assert seq.tokens == raw_seq.tokens  # the opt-in changes what is reported, never what is drawn
        logits = oracle_logits(hf, prompt + seq.tokens)[len(prompt) - 1 : -1]
        for i, t in enumerate(seq.tokens):
            ref = reference_processed(logits[i], temperature, top_k, top_p)
            tol.check([seq.logprobs[i]], [ref[t].item()], f"processed logprob of token {i}")
            top = seq.topk_logprobs[i]
            finite = [(tok, lp) for tok, lp in top if lp > float("-inf")]
            want = ref.topk(len(finite))
            assert [tok for tok, _ in finite] == want.indices.tolist()
            tol.check([lp for _, lp in finite], want.values, f"processed top logprobs at {i}")
            tol.check([raw_seq.logprobs[i]], [torch.log_softmax(logits[i], -1)[t].item()], "raw stays the default")
        assert seq.logprobs != raw_seq.logprobs
