"""Soak: `mint serve` (a subprocess, on a tiny random Llama) under many concurrent clients.

    python -m benchmarks.soak [--duration 300] [--samplers 200] [--trainers 4]

One heavy key runs --samplers concurrent sampling loops and --trainers training loops
(forward_backward + optim_step, in seq_id order) for --duration seconds. A quiet key meanwhile sends
one small sample request at a time; its latency is measured first alone (a quiet phase of
--quiet seconds) and then during the heavy load. Reported:

* lost futures (goal 0): accepted requests whose result never came back (unknown request id,
  still pending after the run, or failed with a server-side error);
* 5xx answers (goal 0); 429s are counted apart (the per-key limit pushing back, then retried);
* p99 latency of the quiet key's small request, loaded vs quiet (goal ≤ 2×);
* the server's RSS after warm-up and at the end (goal: flat).

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

HEAVY, QUIET = "tml-soak-heavy-key-0001", "tml-soak-quiet-key-0002"
BASE_PROMPT = [5, 17, 33, 60]


@dataclass
class Tally:
    accepted: int = 0
    done: int = 0
    lost: int = 0
    server_errors: int = 0
    refused_429: int = 0
    user_errors: int = 0
    train_steps: int = 0
    quiet_idle_s: list[float] = field(default_factory=list)
    quiet_loaded_s: list[float] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Api:
    def __init__(self, url: str, key: str, tally: Tally, connections: int) -> None:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.http = httpx.AsyncClient(base_url=f"{url}/api/v1", headers={"X-API-Key": key}, timeout=120, limits=limits)
        self.tally = tally

    async def post(self, path: str, body: dict) -> dict:
        """POST, retrying 429/503 after Retry-After; a 5xx is counted and raised."""
        while True:
            r = await self.http.post(path, json=body)
            if r.status_code in (429, 503):
                self.tally.refused_429 += r.status_code == 429
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            if r.status_code >= 500:
                self.tally.server_errors += 1
                raise RuntimeError(f"{path}: {r.status_code} {r.text[:200]}")
            if r.status_code >= 400:
                self.tally.user_errors += 1
                raise RuntimeError(f"{path}: {r.status_code} {r.text[:200]}")
            return r.json()

    async def submit_and_wait(self, path: str, body: dict) -> dict | None:
        """Submit a future-returning request and poll it to the end; None if it was lost."""
        request_id = (await self.post(path, body))["request_id"]
        self.tally.accepted += 1
        while True:
            try:
                out = await self.post("retrieve_future", {"request_id": request_id})
            except RuntimeError:
                self.tally.lost += 1
                return None
            if out.get("type") == "try_again":
                continue
            if "error" in out:
                if out.get("category") != "user":
                    self.tally.lost += 1
                    return None
                self.tally.user_errors += 1
                return out
            self.tally.done += 1
            return out

    async def session(self) -> str:
        return (await self.post("create_session", {"tags": [], "user_metadata": None, "sdk_version": "soak"}))["session_id"]

    async def sampler(self, session_id: str, n: int, base: str) -> str:
        body = {"session_id": session_id, "sampling_session_seq_id": n, "base_model": base}
        return (await self.post("create_sampling_session", body))["sampling_session_id"]


def sample_body(sampler_id: str, seq: int, prompt: list[int], num_samples: int, max_tokens: int) -> dict:
    return {"sampling_session_id": sampler_id, "seq_id": seq, "num_samples": num_samples,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "stop": []}}  # fmt: skip


async def heavy_sampler(api: Api, sampler_id: str, stop_at: float, i: int) -> None:
    seq = 0
    while time.monotonic() < stop_at:
        seq += 1
        prompt = [(i * 7 + j) % 300 + 1 for j in range(16)]
        await api.submit_and_wait("asample", sample_body(sampler_id, seq, prompt, 4, 32))


async def trainer(api: Api, session_id: str, n: int, base: str, stop_at: float) -> None:
    body = {"session_id": session_id, "model_seq_id": n, "base_model": base, "lora_config": {"rank": 4}}
    model_id = (await api.submit_and_wait("create_model", body) or {}).get("model_id")
    if model_id is None:
        return
    tokens = [(n * 11 + j) % 300 + 1 for j in range(65)]
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
             "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"}}}  # fmt: skip
    seq = 0
    while time.monotonic() < stop_at:
        seq += 1
        fb = {"model_id": model_id, "seq_id": seq, "forward_backward_input": {"loss_fn": "cross_entropy", "data": [datum] * 4}}
        await api.submit_and_wait("forward_backward", fb)
        seq += 1
        step = {"model_id": model_id, "seq_id": seq, "optim_params": {"learning_rate": 1e-3}}
        if await api.submit_and_wait("optim_step", step) is not None:
            api.tally.train_steps += 1


async def quiet_loop(api: Api, sampler_id: str, stop_at: float, into: list[float]) -> None:
    seq = len(into) + 1_000_000 * (into is api.tally.quiet_loaded_s)
    while time.monotonic() < stop_at:
        seq += 1
        t0 = time.perf_counter()
        await api.submit_and_wait("asample", sample_body(sampler_id, seq, BASE_PROMPT, 1, 4))
        into.append(time.perf_counter() - t0)


async def run(url: str, pid: int, base: str, args: argparse.Namespace) -> dict:
    tally = Tally()
    heavy = Api(url, HEAVY, tally, args.samplers + args.trainers + 8)
    quiet = Api(url, QUIET, tally, 4)
    q_session = await quiet.session()
    q_sampler = await quiet.sampler(q_session, 0, base)
    # Warm-up (first-call paths, allocator), then the quiet phase: the quiet key alone.
    await quiet_loop(quiet, q_sampler, time.monotonic() + 3, [])
    await quiet_loop(quiet, q_sampler, time.monotonic() + args.quiet, tally.quiet_idle_s)
    h_session = await heavy.session()
    samplers = await asyncio.gather(*(heavy.sampler(h_session, i, base) for i in range(args.samplers)))
    rss_start = rss_mb(pid)
    stop_at = time.monotonic() + args.duration
    started = time.monotonic()
    tasks = [heavy_sampler(heavy, s, stop_at, i) for i, s in enumerate(samplers)]
    tasks += [trainer(heavy, h_session, 1000 + i, base, stop_at) for i in range(args.trainers)]
    tasks.append(quiet_loop(quiet, q_sampler, stop_at, tally.quiet_loaded_s))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.monotonic() - started
    crashed = [r for r in results if isinstance(r, BaseException)]
    rss_end = rss_mb(pid)
    await heavy.http.aclose()
    await quiet.http.aclose()
    p99_idle = float(np.percentile(tally.quiet_idle_s, 99))
    p99_loaded = float(np.percentile(tally.quiet_loaded_s, 99)) if tally.quiet_loaded_s else float("nan")
    return {
        "duration_s": round(elapsed, 1), "samplers": args.samplers, "trainers": args.trainers,
        "accepted": tally.accepted, "done": tally.done, "lost_futures": tally.lost,
        "server_errors_5xx": tally.server_errors, "refused_429": tally.refused_429, "user_errors": tally.user_errors,
        "client_loops_failed": len(crashed), "train_steps": tally.train_steps,
        "quiet_p99_idle_s": round(p99_idle, 4), "quiet_p99_loaded_s": round(p99_loaded, 4),
        "quiet_p99_ratio": round(p99_loaded / p99_idle, 2), "quiet_requests_loaded": len(tally.quiet_loaded_s),
        "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of heavy load")
    parser.add_argument("--quiet", type=float, default=20.0, help="seconds of the quiet-only phase")
    parser.add_argument("--samplers", type=int, default=200)
    parser.add_argument("--trainers", type=int, default=4)
    args = parser.parse_args()

    from tests.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="mint-soak-") as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "llama", family="llama", tie=True)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
        env["MINT_API_KEYS"] = f"{HEAVY},{QUIET}"
        cmd = [sys.executable, "-c", "from mint_server.cli import main; main()", "serve", "--base-model", str(model_dir),
               "--port", str(port), "--data-dir", str(Path(tmp) / "data"), "--log-level", "warning",
               "--max-seq-len", "128"]  # fmt: skip
        with open(Path(tmp) / "serve.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{url}/api/v1/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"mint serve did not start:\n{(Path(tmp) / 'serve.log').read_text()}")
                time.sleep(0.2)
            out = asyncio.run(run(url, proc.pid, model_dir.name, args))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:<{width}}  {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
