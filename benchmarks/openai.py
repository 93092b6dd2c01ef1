"""Streaming chat through the OpenAI face vs the same load on the engine directly.

    python -m benchmarks.openai [--streams 32] [--policies 8] [--max-tokens 64] [--repeats 3] [--tiny]

Starts the app in-process on a loopback port over LocalEngine on SmolLM2 (prepared with
`mint model prepare` on first use; a tiny random Llama with --tiny) with the engine's default
settings (`mint serve`'s), publishes --policies policy revisions (one LoRA training client each, one optimizer
step so they differ), then runs, alternately, --repeats times each:

1. face: --streams concurrent streaming chat completions (`stream=true`, `ignore_eos`, so every
   stream yields exactly --max-tokens tokens) spread over the policies, from a separate client
   process (its JSON parsing must not share the server's interpreter), run at --client-nice
   (default 10) so that on a small machine it takes the cores the engine leaves idle rather than
   stretching the engine's forwards: a real client runs elsewhere (the engine side has none);
2. engine: the same prompts (the chat template's tokens) on the same revisions through
   `engine.submit(engine.prepare_sample(...).streaming(on_token, None))` in this process.

Reports time to first token and inter-token latency (p50/p99 over all streams) and tokens/s, the
ratio face/engine of tokens/s (goal ≥ 0.9), medians over the repeats, and last one JSON line. Next
to them, where the wall time went: the engine's forward seconds (the same work on both sides, so a
difference there is CPU contention, not the face), the rest of the wall time, and the CPU seconds
of the server process and of the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.service.live import KEY_A, LiveServer

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity briefly.",
             "List three fruits.", "How do birds fly?", "Say hello in Spanish.", "What is 12 times 7?",
             "Name a famous painter."]  # fmt: skip


def summarize(ttft: list[float], itl: list[float], tokens: int, wall: float) -> dict[str, float]:
    return {"ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "itl_p50_s": float(np.percentile(itl, 50)) if itl else 0.0,
            "itl_p99_s": float(np.percentile(itl, 99)) if itl else 0.0,
            "tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall}  # fmt: skip


# --- the client process ---------------------------------------------------------------------------

async def _load(url: str, key: str, jobs: list[dict[str, Any]]) -> dict[str, float]:
    import httpx

    limits = httpx.Limits(max_connections=len(jobs) + 4, max_keepalive_connections=len(jobs) + 4)
    async with httpx.AsyncClient(base_url=f"{url}/v1", headers={"Authorization": f"Bearer {key}"},
                                 timeout=httpx.Timeout(600.0), limits=limits) as client:  # fmt: skip

        async def one(body: dict[str, Any]) -> tuple[float, list[float], int]:
            t0 = time.perf_counter()
            arrivals: list[float] = []
            tokens = 0
            async with client.stream("POST", "chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if any(c["delta"].get("content") for c in event["choices"]):
                        arrivals.append(time.perf_counter())
            return t0, arrivals, tokens

        start = time.perf_counter()
        results = await asyncio.gather(*(one(body) for body in jobs))
        wall = time.perf_counter() - start
    ttft = [arrivals[0] - t0 for t0, arrivals, _ in results if arrivals]
    itl = [b - a for _, arrivals, _ in results for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return summarize(ttft, itl, sum(n for _, _, n in results), wall)


def client_main(spec: str) -> None:
    args = json.loads(spec)
    print(json.dumps(asyncio.run(_load(args["url"], args["key"], args["jobs"]))))


def run_client(url: str, jobs: list[dict[str, Any]], niceness: int = 0) -> dict[str, float]:
    spec = json.dumps({"url": url, "key": KEY_A, "jobs": jobs})
    before = _children_cpu()
    proc = subprocess.run(["nice", "-n", str(niceness), sys.executable, "-m", "benchmarks.openai", "--client", spec],
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"client failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "client_cpu_s": _children_cpu() - before}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured(engine: Any, run: Any) -> dict[str, float]:
    """`run()`'s figures, with where the server process's time went: its CPU seconds (all threads)
    and the engine's forward seconds. Forwards slower in one phase than the other, for the same
    work, mean the CPU was contended (the load generator, other tenants), not that the face did more."""
    totals = engine.sampler.totals
    cpu0, before = time.process_time(), totals()
    out = run()
    after = totals()
    out["server_cpu_s"] = time.process_time() - cpu0
    out["forward_s"] = sum(after["seconds"].values()) - sum(before["seconds"].values())
    out["forwards"] = after["forwards"]["step"] - before["forwards"]["step"]
    out["outside_forward_s"] = out["wall_s"] - out["forward_s"]
    return out


# --- the engine directly --------------------------------------------------------------------------

def run_engine(engine: Any, work: list[tuple[Any, list[int]]], max_tokens: int, key: str) -> dict[str, float]:
    from tinker import types

    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
    arrivals: list[list[float]] = [[] for _ in work]

    def on_token_for(k: int) -> Any:
        def on_token(_i: int, _token: int, _logprob: float, _top: Any) -> None:
            arrivals[k].append(time.perf_counter())

        return on_token

    start = time.perf_counter()
    futures = [engine.submit(engine.prepare_sample(source, prompt, 1, params, key=key).streaming(on_token_for(k), None))
               for k, (source, prompt) in enumerate(work)]  # fmt: skip
    tokens = sum(len(f.result().sequences[0].tokens) for f in futures)
    wall = time.perf_counter() - start
    ttft = [a[0] - start for a in arrivals if a]
    itl = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False)]
    return summarize(ttft, itl, tokens, wall)


# --- setup ----------------------------------------------------------------------------------------

def publish_policies(server: LiveServer, base: str, count: int) -> list[str]:
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    names = []
    for i in range(count):
        name = f"bench-{i}"
        tc = client.create_lora_training_client(base_model=base, rank=8, seed=i, user_metadata={"policy": name}).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                            loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4})  # fmt: skip
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # so the revisions differ
        tc.save_weights_for_sampler("r1").result()
        names.append(name)
    client.close("success")
    return names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--policies", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama instead of SmolLM2")
    ap.add_argument("--client-nice", type=int, default=10,
                    help="niceness of the load generator: it shares this machine's cores with the engine, where a "
                         "real client would not (0: compete as an equal)")  # fmt: skip
    ap.add_argument("--client", help=argparse.SUPPRESS)  # internal: run the load generator
    args = ap.parse_args()
    if args.client:
        return client_main(args.client)

    from mint_server.api.auth.keys import owner_id
    from mint_server.engine.local import LocalEngine
    from mint_server.engine.settings import EngineSettings

    work_dir = Path(tempfile.mkdtemp(prefix="mint-bench-oai-"))
    if args.tiny:
        from tests.tiny import make_tiny_checkpoint

        model_dir, base = make_tiny_checkpoint(work_dir / "tiny"), "tiny/llama"
    else:
        from mint_server.model.prepare import DEFAULT_BASE_MODEL, resolve_base_model

        model_dir, base = resolve_base_model(None, None), DEFAULT_BASE_MODEL
    engine = LocalEngine(model_dir, base_model=base, settings=EngineSettings())  # `mint serve`'s defaults
    server = LiveServer(engine, work_dir / "data").start()
    try:
        names = publish_policies(server, base, args.policies)
        face = server.service.openai
        jobs, work = [], []
        owner = owner_id(KEY_A)
        # The engine side samples the very same revisions (the same sources, so the same loaded adapters).
        sources = {name: face.resolve(name, owner).source for name in names}
        for k in range(args.streams):
            name = names[k % len(names)]
            messages = [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
            jobs.append({"model": name, "messages": messages, "max_tokens": args.max_tokens, "stream": True,
                         "ignore_eos": True, "stream_options": {"include_usage": True}})  # fmt: skip
            work.append((sources[name], face.template.render(messages)))

        run_client(server.url, jobs[: len(names)])  # warm-up: loads every policy's adapter, JIT paths
        run_engine(engine, work[:2], 4, owner)
        face_runs, engine_runs = [], []
        for _ in range(args.repeats):  # alternate, so a noisy neighbour slows both sides alike
            face_runs.append(measured(engine, lambda: run_client(server.url, jobs, args.client_nice)))
            engine_runs.append(measured(engine, lambda: run_engine(engine, work, args.max_tokens, owner)))
    finally:
        server.stop()

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    result: dict[str, Any] = {"model": base, "streams": args.streams, "policies": args.policies,
                              "max_tokens": args.max_tokens, "repeats": args.repeats,
                              "client_nice": args.client_nice}  # fmt: skip
    for side, runs in (("face", face_runs), ("engine", engine_runs)):
        for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "tokens_per_s", "wall_s", "forward_s",
                    "outside_forward_s", "server_cpu_s", "client_cpu_s", "forwards"):
            if key not in runs[0]:
                continue
            result[f"{side}_{key}"] = med(runs, key)
    result["tokens_per_s_ratio"] = result["face_tokens_per_s"] / result["engine_tokens_per_s"]
    result["face_tokens_per_s_all"] = [r["tokens_per_s"] for r in face_runs]
    result["engine_tokens_per_s_all"] = [r["tokens_per_s"] for r in engine_runs]
    for k, v in result.items():
        if not isinstance(v, list):
            print(f"{k:>24}: {v:.4f}" if isinstance(v, float) else f"{k:>24}: {v}")
    goal = "meets" if result["tokens_per_s_ratio"] >= 0.9 else "MISSES"
    print(f"streaming tokens/s, OpenAI face / engine = {result['tokens_per_s_ratio']:.3f} ({goal} the >= 0.9 goal)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
