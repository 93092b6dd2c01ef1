"""End-to-end service throughput: real tinker SDK clients against `mint serve`'s app on loopback.

    python -m benchmarks.service [--clients 4] [--steps 10] [--samples 32] [--tiny]

Starts the app in-process on a free loopback port (LocalEngine on SmolLM2, or a tiny random
Llama with --tiny), then runs N training clients concurrently (forward_backward + optim_step per
step) and a burst of sampling requests. Reports per-step latency, steps/s and samples/s. Prints a
table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tinker
from tinker import types

from tests.service.live import KEY_A, LiveServer


def _batch(i: int) -> list[types.Datum]:
    seq = [(i * 7 + j) % 200 + 10 for j in range(65)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * 64},
        )
        for _ in range(4)
    ]


def _train(url: str, base: str, steps: int, i: int) -> list[float]:
    client = tinker.ServiceClient(base_url=url, api_key=KEY_A)
    tc = client.create_lora_training_client(base_model=base, rank=16).result()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fb = tc.forward_backward(_batch(i), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        times.append(time.perf_counter() - t0)
    client.close("success")
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama instead of SmolLM2")
    args = ap.parse_args()

    from mint_server.engine.local import LocalEngine

    work = Path(tempfile.mkdtemp(prefix="mint-bench-"))
    if args.tiny:
        from tests.tiny import make_tiny_checkpoint

        model_dir, base = make_tiny_checkpoint(work / "tiny"), "tiny/llama"
    else:
        from benchmarks.common import smollm2_dir
        from mint_server.model.prepare import DEFAULT_BASE_MODEL

        model_dir, base = smollm2_dir(), DEFAULT_BASE_MODEL
    server = LiveServer(LocalEngine(model_dir, base_model=base), work / "data").start()
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            per_client = list(pool.map(lambda i: _train(server.url, base, args.steps, i), range(args.clients)))
        train_s = time.perf_counter() - t0
        steps = [t for ts in per_client for t in ts[1:]]  # the first step includes adapter warm-up

        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        sampler = client.create_sampling_client(base_model=base).result()
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
        t0 = time.perf_counter()
        futures = [sampler.sample(types.ModelInput.from_ints([10 + i % 50, 11, 12]), 1, params)
                   for i in range(args.samples)]
        tokens = sum(len(f.result().sequences[0].tokens) for f in futures)
        sample_s = time.perf_counter() - t0
        client.close("success")
    finally:
        server.stop()

    result = {
        "clients": args.clients,
        "step_median_s": statistics.median(steps),
        "steps_per_s": args.clients * args.steps / train_s,
        "samples_per_s": args.samples / sample_s,
        "sampled_tokens_per_s": tokens / sample_s,
    }
    for k, v in result.items():
        print(f"{k:>22}: {v:.3f}" if isinstance(v, float) else f"{k:>22}: {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
