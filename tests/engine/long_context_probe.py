"""One long prompt through the sampler, measured in a process of its own (tests/engine/test_long_context.py).

`python -m tests.engine.long_context_probe KIND MODEL_DIR LENGTH ORACLE_LENGTH [CHUNK]` prints one JSON line:

- the engine's run at LENGTH tokens (chunked prefill at CHUNK tokens a step, default the Batcher's
  2,048, then 3 greedy tokens): seconds, and the peak memory above the KV blocks — the process's
  peak resident set (VmHWM, reset through /proc/self/clear_refs just before the run) minus its
  resident set just before, with the KV pool already written and every weight read (so both resident).
  A [T × T] float32 score tensor at 32K tokens alone is 4 GiB, so the 1 GB bound leaves no room for one;
- at ORACLE_LENGTH (0: none; LENGTH: the same run) our prompt logprobs of every position and the top-20
  logprobs of the 3 greedy tokens, and transformers' own model of the family loaded from the same
  checkpoint, in one forward over the same tokens: the largest difference and the tolerance policy's bound.

A separate process because the resident-set peak is per process: an earlier test's peak would hide ours.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

CHUNK = 2048  # Batcher's default max_step_tokens
NEW_TOKENS = 3
TOP = 20
# DSA: the indexer's top-k takes one of exactly tied keys (a tiny random indexer's relu gives many
# exact zeros) by where it sits in the row, so transformers runs the same chunks as we do, through its cache.
CHUNKED_ORACLE = ("deepseek_v32",)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def prompt_of(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_ours(model_dir: Path, length: int, measure: bool, chunk: int = CHUNK) -> dict:
    from tinker import types

    from mint_server.model.loader import load_model
    from tests.engine.helpers import AdapterRegistry, SamplerHarness

    model = load_model(model_dir, device="cpu")
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=1, max_rank=8, device="cpu", dtype=torch.float32)
    max_seq = length + NEW_TOKENS
    sampler = SamplerHarness(model, residency, kv_slots=1, max_seq_len=max_seq, block_size=16,
                             max_step_tokens=chunk, prefix_cache=False)
    prompt = prompt_of(length, cfg.vocab_size)
    params = types.SamplingParams(stop=[], max_tokens=NEW_TOKENS, temperature=0.0)
    kv_bytes = 0
    if measure:
        with torch.no_grad():  # weights loaded lazily (mapped from the file) become resident now, not in the run
            for p in model.parameters():
                p.sum()
        cache = sampler.sampler.cache
        for pool in cache.pools.values():  # resident from here on: the run's peak is what it adds
            pool.fill_(0.0)
        kv_bytes = cache.nbytes
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    future = sampler.submit(None, prompt, 1, params, prompt_logprobs=measure is False, top_logprobs=TOP)
    while sampler.has_work():
        sampler.step()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    response = future.result()
    seq = response.sequences[0]
    out = {"seconds": seconds, "kv_bytes": kv_bytes, "chunks": sampler.stats.prefill_chunks,
           "prompt": prompt, "tokens": list(seq.tokens),
           "top_ids": seq.topk_logprobs_np.token_ids.tolist(), "top_logprobs": seq.topk_logprobs_np.logprobs.tolist()}
    if measure:
        out["peak_above_kv_bytes"] = (peak - before) * 1024
    else:
        out["prompt_logprobs"] = list(response.prompt_logprobs[1:])
    return out


def oracle(kind: str, model_dir: Path, ours: dict, chunk: int = CHUNK) -> dict:
    """transformers' model of the family on prompt + the greedy tokens but the last, in one forward."""
    from transformers import AutoModelForCausalLM

    from mint_server.model.config import ModelConfig
    from tests.tolerance import for_model

    cfg = ModelConfig.from_hf_dir(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt, tokens = ours["prompt"], ours["tokens"]
    seq = torch.tensor([prompt + tokens[:-1]])
    t0 = time.perf_counter()
    with torch.no_grad():
        if kind in CHUNKED_ORACLE:
            from transformers import DynamicCache

            cache, pieces = DynamicCache(config=hf.config), []
            for a in range(0, seq.shape[1], chunk):
                pieces.append(hf(seq[:, a : a + chunk], past_key_values=cache, use_cache=True).logits[0])
            logits = torch.cat(pieces)
        else:
            logits = hf(seq).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
    seconds = time.perf_counter() - t0
    n = len(prompt)
    want_prompt = logp[torch.arange(n - 1), seq[0, 1:n]]
    got_prompt = torch.tensor(ours["prompt_logprobs"])
    ids = torch.tensor(ours["top_ids"])
    want_top = logp[n - 1 :].gather(1, ids)
    got_top = torch.tensor(ours["top_logprobs"])
    greedy = logp[n - 1 :].argmax(-1).tolist()
    tol = for_model(cfg)
    err_prompt = (got_prompt - want_prompt).abs().max().item()
    err_top = (got_top - want_top).abs().max().item()
    return {"hf_seconds": seconds, "err_prompt": err_prompt, "bound_prompt": tol.bound(want_prompt),
            "err_top": err_top, "bound_top": tol.bound(want_top), "hf_greedy": greedy,
            "greedy_equal": greedy == tokens}


def main(argv: list[str]) -> None:
    kind, model_dir, length, oracle_length = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    chunk = int(argv[4]) if len(argv) > 4 else CHUNK
    torch.manual_seed(0)
    result: dict = {"kind": kind, "length": length}
    if length:
        measured = run_ours(model_dir, length, measure=True, chunk=chunk)
        result.update(seconds=measured["seconds"], peak_above_kv_bytes=measured["peak_above_kv_bytes"],
                      kv_bytes=measured["kv_bytes"], chunks=measured["chunks"])
    if oracle_length:
        ours = run_ours(model_dir, oracle_length, measure=False, chunk=chunk)
        result.update(oracle_length=oracle_length, ours_seconds=ours["seconds"], **oracle(kind, model_dir, ours, chunk))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
