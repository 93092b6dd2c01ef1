"""The prefix cache on SmolLM2 (in process, fp32): a chat's second turn and multi-turn GRPO groups.

    python -m benchmarks.prefix_cache [--conversation 2000] [--groups 8 --samples 4 --turns 4] [--parts grpo]

1. **Second turn.** Turn 1 is a `--conversation`-token prompt answered with `--reply` tokens; turn 2
   is turn 1's prompt, its reply and a 64-token user message. Time to the first token of each (submit
   to the first drawn token, the same sampler), with the cache on, and turn 2 again with the cache
   off on a sampler that saw turn 1 too (the "before"); turn 2's `prompt_cache_hit_tokens`.
   Goal: TTFT(turn 2) / TTFT(turn 1) ≤ 0.15, ≥ 2,000 tokens cached.
2. **GRPO on a multi-turn environment.** `--groups` groups of `--samples` rollouts; turn 1 is one
   request per group (its samples share the prefill), each later turn one request per rollout whose
   prompt is the last one plus the rollout's `--action` sampled tokens and an observation that makes
   the turn add 64 tokens in all. Prefill tokens computed ÷ naive (every request prefilling its whole
   prompt, the n samples of one request sharing theirs as without the cache). Goal ≤ 0.2.

Prints results as they come, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tinker import types

from benchmarks.common import load_average, smollm2_dir
from mint_server.engine.records import SamplingRecords
from mint_server.model.loader import load_model
from tests.engine.helpers import AdapterRegistry, SamplerHarness


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make(model, residency, cache: bool, max_seq_len: int) -> SamplerHarness:
    s = SamplerHarness(model, residency, kv_slots=max(4, 32768 // max_seq_len), max_seq_len=max_seq_len,
                       records=SamplingRecords(), max_step_tokens=128, prefix_cache=cache)
    s.sampler.scheduler.max_chunk_tokens = 256  # the measured default here (docs/engine.md)
    return s


def turn(sampler: SamplerHarness, prompt: list[int], max_tokens: int, seed: int = 0) -> tuple[float, types.SampleResponse]:
    """(seconds from submit to the first token, the response)."""
    first: list[float] = []
    job = sampler.prep.sample(None, prompt, 1, types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[],
                                                                     seed=seed))
    job = job.streaming(lambda *_: first.append(time.perf_counter()) if not first else None, None)
    t0 = time.perf_counter()
    f = sampler.sampler.submit(job, None)
    while sampler.has_work():
        sampler.step()
    return first[0] - t0, f.result()


def second_turn(model, residency, conversation: int, reply: int) -> dict[str, float]:
    vocab = model.config.vocab_size
    p1 = tokens(conversation, vocab, 1)
    on = make(model, residency, True, conversation + reply + 64 + reply + 16)
    off = make(model, residency, False, conversation + reply + 64 + reply + 16)
    turn(on, tokens(32, vocab, 9), 2)  # warm-up (first-call allocations)
    turn(off, tokens(32, vocab, 9), 2)
    ttft1, r1 = turn(on, p1, reply)
    p2 = p1 + list(r1.sequences[0].tokens) + tokens(64, vocab, 2)
    ttft2, r2 = turn(on, p2, reply)
    turn(off, p1, reply)
    ttft2_off, r2_off = turn(off, p2, reply)
    same = r2.sequences[0].tokens == r2_off.sequences[0].tokens
    out = {"turn1_ttft_s": ttft1, "turn2_ttft_s": ttft2, "turn2_ttft_cache_off_s": ttft2_off,
           "ratio": ttft2 / ttft1, "ratio_cache_off": ttft2_off / ttft1, "turn2_prompt_tokens": len(p2),
           "cached_tokens": r2.prompt_cache_hit_tokens, "greedy_tokens_equal_cache_off": same}
    print(f"second turn: TTFT {ttft1:.3f} s → {ttft2:.3f} s (÷ {out['ratio']:.3f}; cache off {ttft2_off:.3f} s, "
          f"÷ {out['ratio_cache_off']:.3f}); {r2.prompt_cache_hit_tokens} of {len(p2)} prompt tokens cached; "
          f"greedy tokens equal the cache off's: {same}", flush=True)
    return out


def grpo(model, residency, groups: int, samples: int, turns: int, prompt_len: int, action: int) -> dict[str, float]:
    vocab = model.config.vocab_size
    observation = 64 - action
    sampler = make(model, residency, True, prompt_len + turns * 64 + action)
    before = sampler.stats.prefill_tokens
    naive = 0
    # turn 1: one request per group, its samples share the prompt row
    prompts = [tokens(prompt_len, vocab, 100 + g) for g in range(groups)]
    futures = [sampler.submit(None, p, samples, types.SamplingParams(max_tokens=action, temperature=1.0, seed=g, stop=[]),
                              key="trainer") for g, p in enumerate(prompts)]
    naive += sum(len(p) for p in prompts)
    while sampler.has_work():
        sampler.step()
    rollouts = [p + list(s.tokens) + tokens(observation, vocab, 1000 + g * samples + i)
                for g, (p, f) in enumerate(zip(prompts, futures, strict=True))
                for i, s in enumerate(f.result().sequences)]
    for t in range(1, turns):
        naive += sum(len(p) for p in rollouts)
        futures = [sampler.submit(None, p, 1, types.SamplingParams(max_tokens=action, temperature=1.0, seed=t * 1000 + i,
                                                                   stop=[]), key="trainer")
                   for i, p in enumerate(rollouts)]
        while sampler.has_work():
            sampler.step()
        rollouts = [p + list(f.result().sequences[0].tokens) + tokens(observation, vocab, 10_000 * t + i)
                    for i, (p, f) in enumerate(zip(rollouts, futures, strict=True))]
    computed = sampler.stats.prefill_tokens - before
    out = {"prefill_tokens_computed": computed, "prefill_tokens_naive": naive, "ratio": computed / naive,
           "hit_tokens": sampler.stats.prefix_hit_tokens, "evictions": sampler.pool.evictions}
    print(f"GRPO {groups} groups × {samples} rollouts × {turns} turns (+64 tokens a turn, {prompt_len}-token task): "
          f"prefill tokens {computed} of {naive} naive (÷ {out['ratio']:.3f}), {out['hit_tokens']} from the cache, "
          f"{out['evictions']} evictions", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversation", type=int, default=2000)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256, help="the environment's task prompt, in tokens")
    ap.add_argument("--action", type=int, default=32, help="tokens sampled per turn (the rest of 64: observation)")
    ap.add_argument("--parts", default="second_turn,grpo", help="which measurements, comma-separated")
    args = ap.parse_args()
    print(f"load average at the start: {load_average()}", flush=True)
    model = load_model(smollm2_dir(), device="cpu", dtype=torch.float32)
    residency = AdapterRegistry(model.config, num_slots=1, max_rank=8)
    parts = args.parts.split(",")
    result: dict[str, object] = {"load_average_start": load_average()}
    if "second_turn" in parts:
        result["second_turn"] = second_turn(model, residency, args.conversation, args.reply)
    if "grpo" in parts:
        result["grpo"] = grpo(model, residency, args.groups, args.samples, args.turns, args.prompt, args.action)
    result["load_average_end"] = load_average()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
