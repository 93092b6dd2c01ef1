"""`mint serve`'s first requests with the compiled step on (cold and warm compile cache) vs off.

    python -m benchmarks.first_request [--tokens 16] [--requests 5]

Starts `mint serve` on the embedded default (SmolLM2, prepared on first use) three times, each a
fresh process as a user starts it: `--compile off` (every step eager), `--compile auto` on a fresh
data dir (the compile cache empty: the serving step's and the training blocks' graphs compile in the
background while the first requests run eagerly) and `--compile auto` again on that data dir (the
cache warm). For each: seconds from the process start until /healthz answers, the first chat
completion's seconds (`--tokens` tokens, greedy, ignore_eos), and the median of the next
`--requests` - 1. Ratios are against `off` (the issue's goal: first request ≤ 1.2× today's). The
machine's load average is printed beside: the compile threads share the cores with the requests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import load_average, smollm2_dir
from benchmarks.serving import free_port, stop_server

KEY = "tml-first-request-bench-0001"


def start(model_dir: Path, data: Path, compile_mode: str) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    env["MINT_API_KEYS"] = KEY
    cmd = [sys.executable, "-c", "from mint_server.cli import main; main()", "serve", "--base-model", str(model_dir),
           "--port", str(port), "--data-dir", str(data), "--log-level", "warning", "--compile", compile_mode]
    t0 = time.perf_counter()
    with open(data.parent / "serve.log", "a") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/api/v1/healthz").status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"mint serve exited: {(data.parent / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.1)  # start-up poll


def chat(url: str, model: str, tokens: int) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": tokens,
            "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=900)
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=5)
    args = ap.parse_args()
    model_dir = smollm2_dir()
    work = Path(tempfile.mkdtemp(prefix="mint-bench-first-"))
    rows = {}
    try:
        for name, mode, data in (("off", "off", work / "off"), ("auto, cold cache", "auto", work / "auto"),
                                 ("auto, warm cache", "auto", work / "auto")):
            data.mkdir(exist_ok=True)
            load0 = load_average()
            proc, url, ready_s = start(model_dir, data, mode)
            try:
                model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
                times = [chat(url, model, args.tokens) for _ in range(args.requests)]
                metrics = httpx.get(f"{url}/metrics").text
            finally:
                stop_server(proc)
            compiled = [line for line in metrics.splitlines() if line.startswith("mint_compile")]
            rows[name] = {"ready_s": ready_s, "first_s": times[0], "next_median_s": statistics.median(times[1:]),
                          "load_average": load0, "compile_metrics": compiled}
            print(f"{name}: {json.dumps(rows[name])}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    off = rows["off"]
    print("\n| mint serve | ready s | first request s | ÷ off | next requests s (median) | ÷ off |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['ready_s']:.1f} | {r['first_s']:.2f} | {r['first_s'] / off['first_s']:.2f}x "
              f"| {r['next_median_s']:.2f} | {r['next_median_s'] / off['next_median_s']:.2f}x |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
