"""What the service costs on top of the engine: real tinker SDK clients against the app on loopback.

    python -m benchmarks.service [--repeats 5] [--samples 100] [--max-tokens 32] [--tiny]

Starts the app in-process on a free loopback port over LocalEngine on SmolLM2 (prepared on first
use; a tiny random Llama with --tiny), with `mint serve`'s default engine sizes, then measures:

1. forward_backward of ROWS × SEQ tokens (8 × 256): through the SDK (proto + zstd, HTTP, seq
   ordering, long-poll retrieval, decoding) vs the same call on the engine directly, alternating
   the two so that load from other processes hits both alike. Medians; the ratio's goal is ≤ 1.15.
2. --samples concurrent sample requests through the SDK (one thread each, so all are in flight
   at once): requests/s, sampled tokens/s, p50/p99 latency; and the same burst on the engine
   directly, for reference; the engine's own decode-step throughput during the SDK burst (sampler
   decode tokens / decode seconds) and the SDK's tokens/s as a fraction of it (goal ≥ 0.8).
3. one sample request at a time (--single times), through the SDK and on the engine directly,
   alternated: seconds per sampled token, and as a multiple of the memory floor per token (every
   weight read once / the measured read bandwidth; goal ≤ 1.5).

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tinker
from tinker import types

from benchmarks.common import decode_floor, load_average, machine_floors
from tests.service.live import KEY_A, LiveServer

ROWS, SEQ, RANK = 8, 256, 16


def fb_batch(vocab: int) -> list[types.Datum]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(ROWS):
        seq = rng.integers(0, vocab, SEQ + 1).tolist()
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * SEQ},
        ))
    return out


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


def bench_forward_backward(server: LiveServer, base: str, repeats: int) -> dict:
    engine = server.engine
    data = fb_batch(engine.vocab_size)
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = client.create_lora_training_client(base_model=base, rank=RANK, seed=0).result()
    direct_adapter = engine.create_adapter(types.LoraConfig(rank=RANK, seed=0)).result()

    def via_sdk() -> object:
        return tc.forward_backward(data, "cross_entropy").result()

    def direct() -> object:
        return engine.submit(engine.prepare_train(data, "cross_entropy", None).on(direct_adapter)).result()

    via_sdk(), direct()  # warm-up: allocator, first-call paths, SDK connection pool
    sdk_s, direct_s = [], []
    for _ in range(repeats):  # alternate, so a noisy neighbour slows both sides alike
        sdk_s.append(seconds(via_sdk))
        direct_s.append(seconds(direct))
    client.close("success")
    sdk, eng = statistics.median(sdk_s), statistics.median(direct_s)
    return {"fb_sdk_s": sdk, "fb_engine_s": eng, "fb_ratio": sdk / eng,
            "fb_sdk_all_s": sdk_s, "fb_engine_all_s": direct_s}


def bench_sampling(server: LiveServer, base: str, n: int, max_tokens: int, single: int = 3) -> dict:
    engine = server.engine
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    sampler = client.create_sampling_client(base_model=base).result()
    # stop=[]: every request samples exactly max_tokens, so runs are comparable.
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
    prompts = [[10 + i % 50, 11, 12, 13, 14, 15, 16, 17] for i in range(n)]

    def burst(one: Callable[[list[int]], int]) -> dict:
        latencies: list[float] = []

        def timed(prompt: list[int]) -> int:
            t0 = time.perf_counter()
            tokens = one(prompt)
            latencies.append(time.perf_counter() - t0)
            return tokens

        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            tokens = sum(pool.map(timed, prompts))
        wall = time.perf_counter() - t0
        return {"requests_per_s": n / wall, "tokens_per_s": tokens / wall,
                "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99), "wall_s": wall}

    def via_sdk(prompt: list[int]) -> int:
        res = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
        return len(res.sequences[0].tokens)

    def direct(prompt: list[int]) -> int:
        return len(engine.submit(engine.prepare_sample(None, prompt, 1, params)).result().sequences[0].tokens)

    via_sdk(prompts[0])  # warm-up
    before = engine.sampler.totals()
    sdk = burst(via_sdk)
    after = engine.sampler.totals()
    eng = burst(direct)
    decode_rate = ((after["tokens"]["decode"] - before["tokens"]["decode"])
                   / max(after["seconds"]["step"] - before["seconds"]["step"], 1e-9))
    single_sdk, single_eng = [], []
    for _ in range(single):  # alternate, so a noisy neighbour slows both sides alike
        single_sdk.append(seconds(lambda: via_sdk(prompts[0])) / max_tokens)
        single_eng.append(seconds(lambda: direct(prompts[0])) / max_tokens)
    client.close("success")
    return {**{f"sample_sdk_{k}": v for k, v in sdk.items()}, **{f"sample_engine_{k}": v for k, v in eng.items()},
            "engine_decode_step_tokens_per_s": decode_rate,
            "sdk_tokens_per_s_over_engine_decode": sdk["tokens_per_s"] / decode_rate,
            "single_sdk_s_per_token": statistics.median(single_sdk) if single else None,
            "single_engine_s_per_token": statistics.median(single_eng) if single else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5, help="timed forward_backward calls per side")
    ap.add_argument("--samples", type=int, default=100, help="concurrent sample requests")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama instead of SmolLM2")
    ap.add_argument("--single", type=int, default=3, help="one-at-a-time sample requests per side")
    args = ap.parse_args()

    from mint_server.engine.local import LocalEngine
    from mint_server.engine.settings import EngineSettings

    work = Path(tempfile.mkdtemp(prefix="mint-bench-"))
    if args.tiny:
        from tests.tiny import make_tiny_checkpoint

        model_dir, base = make_tiny_checkpoint(work / "tiny"), "tiny/llama"
    else:
        from mint_server.model.prepare import DEFAULT_BASE_MODEL, resolve_base_model

        model_dir, base = resolve_base_model(None, None), DEFAULT_BASE_MODEL
    settings = EngineSettings()  # what `mint serve` runs with by default
    floors = machine_floors()
    print(f"machine: read {floors['read_bytes_per_s'] / 1e9:.1f} GB/s, fp32 matmul "
          f"{floors['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s, load average {load_average()}", flush=True)
    server = LiveServer(LocalEngine(model_dir, base_model=base, settings=settings), work / "data").start()
    try:
        result = {"model": base, "rows": ROWS, "seq": SEQ, "rank": RANK, "samples": args.samples,
                  "max_tokens": args.max_tokens}
        result.update(bench_forward_backward(server, base, args.repeats))
        result.update(bench_sampling(server, base, args.samples, args.max_tokens, args.single))
        cfg = server.engine.model.config
        floor = decode_floor(cfg, 1, 8 + args.max_tokens // 2, RANK, 0, floors)["memory_floor_s"]
        result.update(read_gb_s=floors["read_bytes_per_s"] / 1e9, load_average_end=load_average(),
                      memory_floor_s_per_token=floor)
        if result["single_sdk_s_per_token"] is not None:
            result["single_sdk_over_floor"] = result["single_sdk_s_per_token"] / floor
            result["single_engine_over_floor"] = result["single_engine_s_per_token"] / floor
    finally:
        server.stop()

    for k, v in result.items():
        if not isinstance(v, list):
            print(f"{k:>28}: {v:.3f}" if isinstance(v, float) else f"{k:>28}: {v}")
    goal = "meets" if result["fb_ratio"] <= 1.15 else "MISSES"
    print(f"forward_backward {ROWS}x{SEQ}: SDK/engine = {result['fb_ratio']:.3f} ({goal} the <= 1.15 goal)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
