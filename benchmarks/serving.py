"""Serving under contention: what one tenant's latency costs while another loads the same server.

    python -m benchmarks.serving [--tiny] [--cases flood,storm,train,long,single] [--tries N]
                                 [--probes 20] [--flood 200] [--storm N] [--device-slots 16]
                                 [--serve-args "--linger-s 1 --max-step-tokens 128"]

Starts one `mint serve` (a subprocess, as a user runs it: soak.py's pattern) on SmolLM2 (prepared
on first use; a tiny random Llama with --tiny) with `--device-slots`, and two API keys: key A
makes the load, key B is the tenant whose latency is measured. The policies are seeded into the
data dir's catalog before the server starts (`mint catalog seed --servable`'s code: distinct real
rank-1 adapters, `NAME@prod`), so a thousand adapters cost no training. The load runs in a separate
client process (`--load`, at --client-nice, default 10, as benchmarks/openai.py does: its JSON and
polling must not share the measuring client's interpreter, and on a small machine it should take
the cores the engine leaves idle); key B's requests are sent from this process. Every case
measures its quiet baseline first, then the same requests under load, in the same run, and reports
ratio = loaded / quiet (medians unless named otherwise):

* flood — key A keeps --flood (200) sample requests in flight on the tinker wire (32–64 tokens
  each, on --flood-policies policies of its own), while key B sends --probes (≥ 20) sequential
  8-token greedy requests on its own policy. B's latency p50 and p99, flood / quiet. Goal ≤ 2×.
* own — fairness inside a key: the same flood, while key A itself sends the probes, on a policy of
  its own outside the flood's (the last cold one, warmed first). A's latency p50 and p99, flood /
  quiet. Goal ≤ 2×.
* storm — key B's hot closed loop (the same 8-token request, one adapter) while key A samples
  --storm cold adapters once each in one burst (default 1000 on --tiny, 200 on SmolLM2), far more
  than the device slots. Hot p50/p99, storm / quiet. Goal p50 ≤ 1.25×.
* train — key B's streaming decode on the OpenAI face (`stream=true`, `ignore_eos`, --stream-tokens
  tokens) alone vs while key A runs forward_backward (8 datums × 256 tokens) + optim_step back to
  back: inter-token latency p50, ratio goal ≤ 1.5×; and key A's training steps/s alone vs beside
  the streams, goal ≥ 0.8×.
* long — a 32-token stream's completion time quiet vs started right after key A submits a long
  prompt (--long-tokens, default 6,000 on SmolLM2, the tiny model's context less a few on --tiny;
  max_tokens 1, fresh tokens each try so no prefix is shared). Goal ≤ 3×. And the long prompt's own
  prefill time next to its FLOP floor (2·params·tokens + attention 2·layers·tokens²·hidden, over the
  matmul peak from benchmarks.common.machine_floors).
* abandon — --abandon (200) requests in flight, then let go at once: first as OpenAI-face streams
  (`stream=true`, ignore_eos, 512 tokens) whose clients all hang up, then as tinker-wire sample
  requests of one sampling session cancelled by one `POST /api/v1/mint/sampling/abort`. Each side
  reports the seconds from letting go until `mint_kv_blocks_in_use` (/metrics, polled every 20 ms)
  is back to its idle value, and the blocks held when let go. Goal ≤ 1 s.
* single — one streaming request alone: time to first token on a short prompt and seconds per
  decoded token, next to the memory floor (every weight read once per token / read bandwidth).

The machine floors and the load average are printed next to the results (the figures of a shared
machine move with its load). Prints a table and, last, one JSON line with every figure and ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

KEY_A, KEY_B = "tml-serving-bench-load-0001", "tml-serving-bench-probe-0002"
ALIAS = "prod"
COLD_PREFIX = "cold-"
PROBE_TOKENS = 8  # key B's tinker-wire request (flood, storm)
FLOOD_TOKENS = (32, 64)
COLD_TOKENS = 4
LONG_STREAM_TOKENS = 32
TRAIN_ROWS, TRAIN_SEQ, TRAIN_RANK = 8, 256, 16
PROBE_PROMPT = [5, 17, 33, 60, 61, 62, 63, 9]
QUESTION = "Write a short story about a lighthouse keeper."
SHORT_QUESTION = "Say hello."


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def ratio(loaded: float, quiet: float) -> float:
    return loaded / quiet if quiet > 0 else float("nan")


def policy_name(prefix: str, i: int) -> str:
    from mint_server.catalog.seed import DIGITS

    return f"{prefix}{i:0{DIGITS}d}"


# --- the tinker wire over raw HTTP (benchmarks/soak.py's client) ---------------------------------


class Wire:
    def __init__(self, url: str, key: str, connections: int = 8) -> None:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.http = httpx.AsyncClient(base_url=f"{url}/api/v1", headers={"X-API-Key": key},
                                      timeout=httpx.Timeout(900.0), limits=limits)  # fmt: skip
        self.refused = 0  # 429/503 answers (the per-key limit pushing back), retried after Retry-After
        self._seq = itertools.count()
        self._sample_seq: dict[str, itertools.count] = {}
        self._heartbeats: list[asyncio.Task] = []

    async def post(self, path: str, body: dict) -> dict:
        while True:
            r = await self.http.post(path, json=body)
            if r.status_code in (429, 503):
                self.refused += 1
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))  # the server's pacing
                continue
            if r.status_code == 408:  # retrieve_future: queued behind others after a long poll
                return r.json()
            if r.status_code >= 400:
                raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
            return r.json()

    async def wait(self, request_id: str) -> dict:
        """Poll a future (each poll is a long poll) to its result."""
        while True:
            out = await self.post("retrieve_future", {"request_id": request_id})
            if out.get("type") == "try_again" or out.get("status") == "queued":
                continue
            if "error" in out:
                raise RuntimeError(f"request {request_id}: {out['error']}")
            return out

    async def call(self, path: str, body: dict) -> dict:
        return await self.wait((await self.post(path, body))["request_id"])

    async def session(self) -> str:
        """A session kept alive by heartbeats, as the SDK keeps its own (one that misses them for the
        server's session TTL ends, and its queued samples are cancelled)."""
        body = {"tags": [], "user_metadata": None, "sdk_version": "bench-serving"}
        session_id = (await self.post("create_session", body))["session_id"]
        self._heartbeats.append(asyncio.create_task(self._heartbeat(session_id)))
        return session_id

    async def _heartbeat(self, session_id: str) -> None:
        while True:
            await asyncio.sleep(10.0)
            await self.http.post("session_heartbeat", json={"session_id": session_id})

    async def sampler(self, session_id: str, base: str, policy: str | None) -> str:
        body = {"session_id": session_id, "sampling_session_seq_id": next(self._seq), "base_model": base,
                "model_path": f"tinker://{policy}@{ALIAS}" if policy else None}  # fmt: skip
        sampler_id = (await self.post("create_sampling_session", body))["sampling_session_id"]
        self._sample_seq[sampler_id] = itertools.count(1)
        return sampler_id

    async def submit_sample(
        self, sampler_id: str, prompt: list[int], max_tokens: int, temperature: float
    ) -> str:
        body = {"sampling_session_id": sampler_id, "seq_id": next(self._sample_seq[sampler_id]), "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": {"max_tokens": max_tokens, "temperature": temperature, "stop": []}}  # fmt: skip
        return (await self.post("asample", body))["request_id"]

    async def sample(
        self, sampler_id: str, prompt: list[int], max_tokens: int, temperature: float = 0.0
    ) -> int:
        """One sample request to its end; the number of tokens it sampled."""
        out = await self.wait(await self.submit_sample(sampler_id, prompt, max_tokens, temperature))
        return len(out["sequences"][0]["tokens"])

    async def close(self) -> None:
        for task in self._heartbeats:
            task.cancel()
        await self.http.aclose()


async def timed(coro: Awaitable[object]) -> float:
    t0 = time.perf_counter()
    await coro
    return time.perf_counter() - t0


# --- the OpenAI face (streams) --------------------------------------------------------------------


async def stream(oai: Any, model: str, question: str, max_tokens: int) -> dict[str, Any]:
    """One streaming chat completion of exactly max_tokens tokens (ignore_eos): TTFT, the gaps
    between content chunks, total time, and seconds per token after the first."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    response = await oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in response:
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        if any(c.delta.content for c in chunk.choices):
            arrivals.append(time.perf_counter())
    total = time.perf_counter() - t0
    if not arrivals:
        raise RuntimeError(f"stream on {model} yielded no content")
    return {"ttft_s": arrivals[0] - t0, "total_s": total, "tokens": tokens,
            "itl_s": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
            "s_per_token": (arrivals[-1] - arrivals[0]) / max(tokens - 1, 1)}  # fmt: skip


# --- the load generator (a separate, niced process: `--load SPEC`) --------------------------------


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def load_flood(spec: dict, stop: asyncio.Event) -> dict:
    """spec["flood"] closed loops, each one request in flight, until told to stop; then drain."""
    n, base = spec["flood"], spec["base"]
    wire = Wire(spec["url"], KEY_A, n + 8)
    session = await wire.session()
    samplers = await asyncio.gather(*(wire.sampler(session, base, spec["policies"][i % len(spec["policies"])])
                                      for i in range(n)))  # fmt: skip
    all_in = asyncio.Event()
    tally = {"requests": 0, "tokens": 0, "submitted": 0}

    async def worker(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            prompt = [rng.randrange(5, spec["vocab"]) for _ in range(16)]
            rid = await wire.submit_sample(samplers[i], prompt, rng.randint(*FLOOD_TOKENS), 1.0)
            tally["submitted"] += 1
            if tally["submitted"] == n:
                all_in.set()
            out = await wire.wait(rid)
            tally["requests"] += 1
            tally["tokens"] += len(out["sequences"][0]["tokens"])

    t0 = time.perf_counter()
    work = asyncio.gather(*(worker(i) for i in range(n)))
    await first_of(all_in.wait(), work)
    emit("started", in_flight=n)
    started = time.perf_counter()
    await work
    wall = time.perf_counter() - started
    await wire.close()
    return {**tally, "tokens_per_s": tally["tokens"] / wall, "refused": wire.refused, "wall_s": wall,
            "setup_s": started - t0}  # fmt: skip


async def load_streams(spec: dict, stop: asyncio.Event) -> dict:
    """spec["count"] OpenAI-face streams (key B) held open once each has its first chunk; "started"
    when all have. The driver kills this process to hang them all up at once."""
    n = spec["count"]
    http = httpx.AsyncClient(base_url=f"{spec['url']}/v1", headers={"Authorization": f"Bearer {KEY_B}"},
                             timeout=httpx.Timeout(900.0), limits=httpx.Limits(max_connections=n + 8))
    first = asyncio.Semaphore(0)

    async def one() -> None:
        body = {"model": spec["policy"], "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": spec["max_tokens"], "temperature": 0.0, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"stream refused: {r.status_code} {(await r.aread())[:300]!r}")
            async for _ in r.aiter_lines():
                first.release()
                await stop.wait()  # hold the connection until killed
                return

    streams = asyncio.gather(*(one() for _ in range(n)))

    async def all_first() -> None:
        for _ in range(n):
            await first.acquire()

    await first_of(all_first(), streams)
    emit("started", streams=n)
    await streams
    await http.aclose()
    return {"streams": n}


async def load_storm(spec: dict, stop: asyncio.Event) -> dict:
    """Every cold policy sampled once, all submitted at once."""
    base = spec["base"]
    wire = Wire(spec["url"], KEY_A, 256)
    session = await wire.session()
    policies = [policy_name(spec["prefix"], i) for i in range(spec["count"])]  # not in argv: 128 KiB at most
    samplers = await asyncio.gather(*(wire.sampler(session, base, p) for p in policies))
    emit("started", adapters=len(samplers))
    t0 = time.perf_counter()
    latencies = await asyncio.gather(*(timed(wire.sample(s, PROBE_PROMPT, COLD_TOKENS)) for s in samplers))
    wall = time.perf_counter() - t0
    await wire.close()
    return {"adapters": len(samplers), "storm_s": wall, "adapters_per_s": len(samplers) / wall,
            "cold_p50_s": pct(latencies, 50), "cold_p99_s": pct(latencies, 99), "refused": wire.refused}  # fmt: skip


async def load_train(spec: dict, stop: asyncio.Event) -> dict:
    """forward_backward (8 × 256 tokens) + optim_step back to back on one LoRA until told to stop;
    one "step" event (with its monotonic time) per finished step."""
    wire = Wire(spec["url"], KEY_A, 4)
    session = await wire.session()
    body = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": spec["base"],
        "lora_config": {"rank": TRAIN_RANK},
    }
    model_id = (await wire.call("create_model", body))["model_id"]
    rng = random.Random(0)
    data = []
    for _ in range(TRAIN_ROWS):
        tokens = [rng.randrange(5, spec["vocab"]) for _ in range(TRAIN_SEQ + 1)]
        data.append({"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
                     "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64"}}})  # fmt: skip
    seq = itertools.count(1)

    async def step() -> None:
        fb = {"model_id": model_id, "seq_id": next(seq),
              "forward_backward_input": {"loss_fn": "cross_entropy", "data": data}}  # fmt: skip
        await wire.call("forward_backward", fb)
        await wire.call("optim_step", {"model_id": model_id, "seq_id": next(seq),
                                       "optim_params": {"learning_rate": 1e-4}})  # fmt: skip

    await step()  # warm-up: the adapter's optimizer state, first-call paths
    emit("started", t=time.monotonic())
    steps = 0
    while not stop.is_set():
        await step()
        steps += 1
        emit("step", t=time.monotonic())
    await wire.close()
    return {"steps": steps}


async def first_of(*aws: Awaitable[object]) -> None:
    """Wait for the first to finish; an exception from it is raised (a load loop that crashed)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        t.result()


def load_main(spec_text: str) -> None:
    spec = json.loads(spec_text)
    run = {"flood": load_flood, "storm": load_storm, "train": load_train, "streams": load_streams}[spec["mode"]]

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # The driver closes our stdin to end a closed-loop load.
        fd = sys.stdin.fileno()

        def readable() -> None:
            if not os.read(fd, 4096):
                loop.remove_reader(fd)
                stop.set()

        loop.add_reader(fd, readable)
        emit("done", **await run(spec, stop))

    asyncio.run(main())


@dataclass
class Load:
    """The driver's side of a load-generator process: its events, and stopping it."""

    spec: dict
    nice: int
    proc: Any = None
    started: dict | None = None
    summary: dict | None = None
    steps: list[float] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    _started: asyncio.Event = field(default_factory=asyncio.Event)
    _stepped: asyncio.Event = field(default_factory=asyncio.Event)

    async def __aenter__(self) -> Load:
        self.proc = await asyncio.create_subprocess_exec(
            "nice",
            "-n",
            str(self.nice),
            sys.executable,
            "-m",
            "benchmarks.serving",
            "--load",
            json.dumps(self.spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=2**24,
        )
        self._reader = asyncio.ensure_future(self._read())
        await first_of(self._started.wait(), self.done.wait())
        if self.started is None:
            await self.proc.wait()
            raise RuntimeError(f"load generator ({self.spec['mode']}) ended before its load started")
        return self

    async def _read(self) -> None:
        try:
            async for line in self.proc.stdout:
                event = json.loads(line)
                kind = event.pop("event")
                if kind == "started":
                    self.started = event
                    self._started.set()
                elif kind == "step":
                    self.steps.append(event["t"])
                    self._stepped.set()
                elif kind == "done":
                    self.summary = event
        finally:
            self.done.set()  # also on EOF: a crashed generator ends the loops that wait for it

    async def wait_steps(self, n: int) -> None:
        """Until the training load has finished n steps (or ended)."""
        while len(self.steps) < n and not self.done.is_set():
            self._stepped.clear()
            await first_of(self._stepped.wait(), self.done.wait())

    async def stop(self) -> dict:
        """End a closed-loop load (it drains what it has in flight, so the next case starts quiet)."""
        self.proc.stdin.close()
        await self.done.wait()
        if await self.proc.wait() != 0 or self.summary is None:
            raise RuntimeError(f"load generator ({self.spec['mode']}) failed (exit {self.proc.returncode})")
        return self.summary

    async def __aexit__(self, *exc: object) -> None:
        if self.proc.returncode is None and exc[0] is not None:
            self.proc.kill()
        await self.proc.wait()
        self._reader.cancel()


# --- the cases (key B measures; key A loads) -------------------------------------------------------


@dataclass
class Ctx:
    url: str
    base: str
    vocab: int
    cfg: Any
    floors: dict[str, float]
    bytes_per: int
    args: argparse.Namespace
    b_policy: str
    flood_policies: list[str]
    cold_policies: list[str]
    long_tokens: int

    def load(self, mode: str, **spec: Any) -> Load:
        return Load(
            {"mode": mode, "url": self.url, "base": self.base, "vocab": self.vocab, **spec},
            self.args.client_nice,
        )

    def oai(self) -> Any:
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY_B, max_retries=0, timeout=900.0)


Row = tuple[str, float, float, float, str, bool | None]  # metric, quiet, loaded, ratio, goal, met


def row(metric: str, quiet: float, loaded: float, goal: str = "") -> Row:
    """A table row; goal "<= X" / ">= X" bounds loaded / quiet."""
    r = ratio(loaded, quiet)
    met = None if not goal else (r <= float(goal[2:]) if goal.startswith("<=") else r >= float(goal[2:]))
    return metric, quiet, loaded, r, goal, met


async def case_flood(c: Ctx) -> tuple[dict, list[Row]]:
    return await probe_beside_flood(c, KEY_B, c.b_policy, "B")


async def case_own(c: Ctx) -> tuple[dict, list[Row]]:
    """Fairness inside a key: key A's own probe, on a policy of A's outside the flood."""
    return await probe_beside_flood(c, KEY_A, c.cold_policies[-1], "A")


async def probe_beside_flood(c: Ctx, key: str, policy: str, who: str) -> tuple[dict, list[Row]]:
    b = Wire(c.url, key)
    sampler = await b.sampler(await b.session(), c.base, policy)
    for _ in range(3):  # warm-up: B's adapter in a slot, first-call paths
        await b.sample(sampler, PROBE_PROMPT, PROBE_TOKENS)
    quiet = [await timed(b.sample(sampler, PROBE_PROMPT, PROBE_TOKENS)) for _ in range(c.args.probes)]
    async with c.load("flood", flood=c.args.flood, policies=c.flood_policies) as load:
        loaded = []
        for _ in range(c.args.probes):
            loaded.append(await timed(b.sample(sampler, PROBE_PROMPT, PROBE_TOKENS)))
            print(f"  flood probe {len(loaded)}: {loaded[-1]:.3f} s", file=sys.stderr, flush=True)
        flood = await load.stop()
    await b.close()
    out = {"probes": c.args.probes, "in_flight": c.args.flood, "quiet_p50_s": pct(quiet, 50),
           "quiet_p99_s": pct(quiet, 99), "flood_p50_s": pct(loaded, 50), "flood_p99_s": pct(loaded, 99),
           "flood_requests": flood["requests"], "flood_tokens_per_s": flood["tokens_per_s"],
           "flood_refused": flood["refused"]}  # fmt: skip
    out["p50_ratio"] = ratio(out["flood_p50_s"], out["quiet_p50_s"])
    out["p99_ratio"] = ratio(out["flood_p99_s"], out["quiet_p99_s"])
    return out, [row(f"{who} 8-token p50 s", out["quiet_p50_s"], out["flood_p50_s"], "<= 2"),
                 row(f"{who} 8-token p99 s", out["quiet_p99_s"], out["flood_p99_s"], "<= 2")]  # fmt: skip


async def case_storm(c: Ctx) -> tuple[dict, list[Row]]:
    b = Wire(c.url, KEY_B)
    sampler = await b.sampler(await b.session(), c.base, c.b_policy)
    for _ in range(3):
        await b.sample(sampler, PROBE_PROMPT, PROBE_TOKENS)
    quiet = [await timed(b.sample(sampler, PROBE_PROMPT, PROBE_TOKENS)) for _ in range(c.args.probes)]
    stormy: list[float] = []
    async with c.load("storm", prefix=COLD_PREFIX, count=len(c.cold_policies)) as load:
        while not load.done.is_set():  # the hot loop, for as long as the burst lasts
            stormy.append(await timed(b.sample(sampler, PROBE_PROMPT, PROBE_TOKENS)))
        storm = await load.stop()
    await b.close()
    out = {"cold_adapters": len(c.cold_policies), "device_slots": c.args.device_slots,
           "quiet_p50_s": pct(quiet, 50), "quiet_p99_s": pct(quiet, 99), "storm_p50_s": pct(stormy, 50),
           "storm_p99_s": pct(stormy, 99), "hot_requests_during_storm": len(stormy), "storm_s": storm["storm_s"],
           "cold_adapters_per_s": storm["adapters_per_s"], "cold_p50_s": storm["cold_p50_s"],
           "storm_refused": storm["refused"]}  # fmt: skip
    out["p50_ratio"] = ratio(out["storm_p50_s"], out["quiet_p50_s"])
    out["p99_ratio"] = ratio(out["storm_p99_s"], out["quiet_p99_s"])
    return out, [row("hot 8-token p50 s", out["quiet_p50_s"], out["storm_p50_s"], "<= 1.25"),
                 row("hot 8-token p99 s", out["quiet_p99_s"], out["storm_p99_s"])]  # fmt: skip


def steps_per_s(started: float, steps: list[float], upto: int | None = None) -> float:
    """Training steps finished per second since the generator's "started"."""
    steps = steps[:upto] if upto is not None else steps
    return len(steps) / (steps[-1] - started) if steps else float("nan")


async def case_train(c: Ctx) -> tuple[dict, list[Row]]:
    oai, n, want_steps = c.oai(), c.args.stream_tokens, c.args.train_steps
    await stream(oai, c.b_policy, QUESTION, 4)  # warm-up
    quiet = [await stream(oai, c.b_policy, QUESTION, n) for _ in range(c.args.tries)]
    async with c.load("train") as load:  # training alone
        await load.wait_steps(want_steps)
        alone = steps_per_s(load.started["t"], load.steps, want_steps)
        await load.stop()
    beside: list[dict] = []
    async with c.load("train") as load:  # the streams beside training
        while (len(beside) < c.args.tries or len(load.steps) < want_steps) and not load.done.is_set():
            beside.append(await stream(oai, c.b_policy, QUESTION, n))
        with_streams = steps_per_s(load.started["t"], load.steps)
        await load.stop()
    await oai.close()
    q_itl = [g for s in quiet for g in s["itl_s"]]
    l_itl = [g for s in beside for g in s["itl_s"]]
    out = {"stream_tokens": n, "streams_quiet": len(quiet), "streams_beside_training": len(beside),
           "train_rows": TRAIN_ROWS, "train_seq": TRAIN_SEQ, "quiet_itl_p50_s": pct(q_itl, 50),
           "quiet_itl_p99_s": pct(q_itl, 99), "training_itl_p50_s": pct(l_itl, 50),
           "training_itl_p99_s": pct(l_itl, 99), "train_steps_per_s_alone": alone,
           "train_steps_per_s_beside_stream": with_streams}  # fmt: skip
    out["itl_p50_ratio"] = ratio(out["training_itl_p50_s"], out["quiet_itl_p50_s"])
    out["itl_p99_ratio"] = ratio(out["training_itl_p99_s"], out["quiet_itl_p99_s"])
    out["train_steps_ratio"] = ratio(with_streams, alone)
    return out, [row("stream ITL p50 s", out["quiet_itl_p50_s"], out["training_itl_p50_s"], "<= 1.5"),
                 row("stream ITL p99 s", out["quiet_itl_p99_s"], out["training_itl_p99_s"]),
                 row("train steps/s (alone | beside)", alone, with_streams, ">= 0.8")]  # fmt: skip


def prefill_floor(c: Ctx, tokens: int) -> dict[str, float]:
    """The least time a prefill of `tokens` can take here: 2·params·tokens (every block matmul weight
    per token) + causal attention 2·layers·tokens²·hidden, over the matmul peak."""
    from mint_server.model.lora import ALL_TARGETS, target_shapes

    shapes = {t: s for t, s in target_shapes(c.cfg).items() if t in ALL_TARGETS and t != "lm_head"}
    params = sum(L * fi * fo for L, fi, fo in shapes.values())
    flops = 2 * params * tokens + 2 * c.cfg.num_layers * tokens**2 * c.cfg.hidden_size
    return {"params": params, "flops": flops, "floor_s": flops / c.floors["matmul_flop_per_s"]}


async def case_long(c: Ctx) -> tuple[dict, list[Row]]:
    oai = c.oai()
    await stream(oai, c.b_policy, QUESTION, 4)
    quiet = [
        (await stream(oai, c.b_policy, QUESTION, LONG_STREAM_TOKENS))["total_s"] for _ in range(c.args.tries)
    ]
    a = Wire(c.url, KEY_A)
    long_sampler = await a.sampler(await a.session(), c.base, None)
    loaded, prefill = [], []
    for k in range(c.args.tries):
        rng = random.Random(1000 + k)  # fresh tokens each try: no shared prefix with an earlier one
        prompt = [rng.randrange(5, c.vocab) for _ in range(c.long_tokens)]
        t0 = time.perf_counter()
        rid = await a.submit_sample(long_sampler, prompt, 1, 0.0)
        long_done = asyncio.ensure_future(a.wait(rid))
        s = await stream(oai, c.b_policy, QUESTION, LONG_STREAM_TOKENS)  # right after the long one is in
        await long_done
        prefill.append(time.perf_counter() - t0)
        loaded.append(s["total_s"])
    await a.close()
    await oai.close()
    floor = prefill_floor(c, c.long_tokens)
    out = {"long_tokens": c.long_tokens, "stream_tokens": LONG_STREAM_TOKENS, "quiet_stream_s": float(np.median(quiet)),
           "after_long_stream_s": float(np.median(loaded)), "long_prefill_s": float(np.median(prefill)),
           "long_prefill_floor_s": floor["floor_s"], "long_prefill_flops": floor["flops"]}  # fmt: skip
    out["stream_ratio"] = ratio(out["after_long_stream_s"], out["quiet_stream_s"])
    out["prefill_over_floor"] = out["long_prefill_s"] / floor["floor_s"]
    return out, [row("32-token stream s", out["quiet_stream_s"], out["after_long_stream_s"], "<= 3"),
                 row(f"prefill {c.long_tokens} tok s (floor | run)", floor["floor_s"], out["long_prefill_s"])]  # fmt: skip


def kv_blocks_in_use(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("mint_kv_blocks_in_use "):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("/metrics has no mint_kv_blocks_in_use")


async def blocks_back(url: str, idle: float) -> float:
    """Seconds until the KV blocks in use are back to `idle` (polled every 20 ms; bound 120 s)."""
    t0 = time.perf_counter()
    while await asyncio.to_thread(kv_blocks_in_use, url) > idle:
        if time.perf_counter() - t0 > 120:
            raise RuntimeError("KV blocks not back to idle within 120 s")
        await asyncio.sleep(0.02)  # a poll interval, not a wait for work
    return time.perf_counter() - t0


async def case_abandon(c: Ctx) -> tuple[dict, list[Row]]:
    n, max_tokens = c.args.abandon, min(512, c.cfg.max_position_embeddings // 2)
    idle = await asyncio.to_thread(kv_blocks_in_use, c.url)
    # 1. OpenAI-face streams whose clients hang up: the load process holding them is killed, so
    # the OS closes all their connections at once (as many clients going away together).
    load = c.load("streams", count=n, policy=c.b_policy, max_tokens=max_tokens)
    async with load:
        held_streams = await asyncio.to_thread(kv_blocks_in_use, c.url)  # every stream has its first chunk
        t0 = time.perf_counter()
        load.proc.kill()
        await blocks_back(c.url, idle)
        hangup_s = time.perf_counter() - t0
    # 2. tinker-wire sample requests of one session, cancelled by one abort.
    a = Wire(c.url, KEY_B, connections=16)
    sampler = await a.sampler(await a.session(), c.base, c.b_policy)
    rids = [await a.submit_sample(sampler, PROBE_PROMPT, max_tokens, 0.0) for _ in range(n)]
    while (held_wire := await asyncio.to_thread(kv_blocks_in_use, c.url)) <= idle:
        await asyncio.sleep(0.05)  # a poll until the engine has started some of them
    t0 = time.perf_counter()
    aborted = (await a.post("mint/sampling/abort", {"sampling_session_id": sampler}))["aborted"]
    await blocks_back(c.url, idle)
    abort_s = time.perf_counter() - t0
    await a.close()
    out = {"requests": n, "idle_blocks": idle, "blocks_held_streams": held_streams,
           "hangup_blocks_back_s": hangup_s, "wire_request_ids": len(rids), "blocks_held_wire": held_wire,
           "aborted": aborted, "abort_blocks_back_s": abort_s}  # fmt: skip
    return out, [row("hang-up: blocks back s (goal | run)", 1.0, hangup_s, "<= 1"),
                 row("abort: blocks back s (goal | run)", 1.0, abort_s, "<= 1")]  # fmt: skip


async def case_single(c: Ctx) -> tuple[dict, list[Row]]:
    from benchmarks.common import decode_floor

    oai, n = c.oai(), c.args.stream_tokens
    await stream(oai, c.b_policy, SHORT_QUESTION, 4)
    runs = [await stream(oai, c.b_policy, SHORT_QUESTION, n) for _ in range(c.args.tries)]
    await oai.close()
    floor = decode_floor(c.cfg, 1, 32 + n // 2, 1, 1, c.floors, c.bytes_per)["memory_floor_s"]
    out = {"tokens": n, "ttft_s": float(np.median([r["ttft_s"] for r in runs])),
           "s_per_token": float(np.median([r["s_per_token"] for r in runs])), "memory_floor_s_per_token": floor}  # fmt: skip
    out["ttft_over_floor"] = out["ttft_s"] / floor
    out["s_per_token_over_floor"] = out["s_per_token"] / floor
    return out, [row("TTFT s (floor | run)", floor, out["ttft_s"]),
                 row("s per token (floor | run)", floor, out["s_per_token"])]  # fmt: skip


CASES: dict[str, Callable[[Ctx], Awaitable[tuple[dict, list[Row]]]]] = {
    "flood": case_flood,
    "own": case_own,
    "storm": case_storm,
    "train": case_train,
    "long": case_long,
    "single": case_single,
    "abandon": case_abandon,
}


# --- setup: the model, the seeded policies, the server ---------------------------------------------


def seed_policies(data: Path, model_dir: Path, flood: int, cold: int) -> tuple[str, list[str], list[str]]:
    """Distinct servable rank-1 adapters, published as NAME@prod: one for key B, `flood` and `cold`
    for key A (their payload indices apart, so no two share bytes)."""
    from mint_server.api.auth.keys import owner_id
    from mint_server.catalog.catalog import Catalog
    from mint_server.catalog.seed import seed
    from mint_server.cli.sweep import servable_payloads

    name, lora, payload_for = servable_payloads(model_dir, rank=1)
    with Catalog.open(data_dir=data) as catalog:
        for owner, prefix, count, offset in ((KEY_B, "quiet-", 1, 0), (KEY_A, "flood-", flood, 1_000),
                                             (KEY_A, COLD_PREFIX, cold, 100_000)):  # fmt: skip
            seed(
                catalog,
                count,
                1,
                owner_id(owner),
                prefix=prefix,
                batch_size=1000,
                base_model=name,
                lora_config=lora,
                payload_for=lambda i, offset=offset: payload_for(offset + i),
            )
    return (
        policy_name("quiet-", 0),
        [policy_name("flood-", i) for i in range(flood)],
        [policy_name(COLD_PREFIX, i) for i in range(cold)],
    )


def server_calibration(url: str) -> dict[str, float]:
    """What the server measured at start-up (skinny_rows, max_step_tokens, step costs): /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("mint_engine_calibration{"):
            name = line.split('quantity="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, data: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
    env["MINT_API_KEYS"] = f"{KEY_A},{KEY_B}"
    cmd = [sys.executable, "-c", "from mint_server.cli import main; main()", "serve", "--base-model", str(model_dir),
           "--port", str(port), "--data-dir", str(data), "--log-level", "warning",
           "--device-slots", str(args.device_slots)]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += shlex.split(args.serve_args)
    log_path = data.parent / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{url}/api/v1/healthz").status_code == 200:
                return proc, url, log_path
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"mint serve did not start:\n{log_path.read_text()[-5000:]}")
        time.sleep(0.2)  # start-up poll


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama instead of SmolLM2")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, run in this order")
    ap.add_argument("--tries", type=int, default=5, help="streams per side (train, long, single)")
    ap.add_argument(
        "--probes", type=int, default=20, help="key B's sequential requests per side (flood, storm)"
    )
    ap.add_argument("--flood", type=int, default=200, help="key A's sample requests in flight (flood)")
    ap.add_argument("--flood-policies", type=int, default=8, help="key A's policies the flood samples")
    ap.add_argument(
        "--storm", type=int, default=None, help="cold adapters (default 1000 on --tiny, 200 on SmolLM2)"
    )
    ap.add_argument("--device-slots", type=int, default=16, help="the server's --device-slots")
    ap.add_argument("--threads", type=int, default=None, help="the server's --threads (default: its own)")
    ap.add_argument("--serve-args", default="", help="more `mint serve` flags, e.g. \"--linger-s 1 --max-step-tokens 128\"")
    ap.add_argument("--stream-tokens", type=int, default=64, help="tokens per stream (train, single)")
    ap.add_argument("--train-steps", type=int, default=3, help="training steps timed per side (train)")
    ap.add_argument(
        "--long-tokens",
        type=int,
        default=None,
        help="the long prompt (default 6000; on --tiny the model's context less 8)",
    )
    ap.add_argument("--abandon", type=int, default=200, help="requests let go at once (abandon)")
    ap.add_argument("--client-nice", type=int, default=10, help="niceness of the load-generator process")
    ap.add_argument("--load", help=argparse.SUPPRESS)  # internal: run a load generator
    args = ap.parse_args()
    if args.load:
        return load_main(args.load)
    cases = [c for c in args.cases.split(",") if c]
    if unknown := set(cases) - set(CASES):
        ap.error(f"unknown cases {sorted(unknown)}; choose from {','.join(CASES)}")

    import torch

    from benchmarks.common import load_average as _load_average
    from benchmarks.common import machine_floors

    def load_average() -> float | None:
        value = _load_average()
        return None if value is None else round(value, 2)

    from mint_server.cli.serve import base_model_name
    from mint_server.model.config import ModelConfig

    work = Path(tempfile.mkdtemp(prefix="mint-bench-serving-"))
    if args.tiny:
        from tests.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(work / "tiny")
    else:
        from benchmarks.common import smollm2_dir

        model_dir = smollm2_dir()
    cfg = ModelConfig.from_hf_dir(model_dir)
    base = base_model_name(str(model_dir), model_dir)
    storm = args.storm if args.storm is not None else (1000 if args.tiny else 200)
    long_tokens = args.long_tokens or (cfg.max_position_embeddings - 8 if args.tiny else 6000)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # what `mint serve` picks
    floors = machine_floors(device)
    load0 = load_average()
    print(
        f"model {base}; machine ({device}): read {floors['read_bytes_per_s'] / 1e9:.1f} GB/s, matmul "
        f"{floors['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s; load average {load0}",
        flush=True,
    )
    b_policy, flood_policies, cold_policies = seed_policies(
        work / "data", model_dir, args.flood_policies, storm
    )
    proc, url, log_path = start_server(model_dir, work / "data", args)
    ctx = Ctx(url, base, cfg.vocab_size, cfg, floors, 4 if device == "cpu" else 2, args, b_policy, flood_policies,
              cold_policies, long_tokens)  # fmt: skip
    result: dict[str, Any] = {"model": base, "device": device, "device_slots": args.device_slots,
                              "tries": args.tries, "probes": args.probes, "client_nice": args.client_nice,
                              "read_bytes_per_s": floors["read_bytes_per_s"],
                              "matmul_flop_per_s": floors["matmul_flop_per_s"], "load_average_start": load0}  # fmt: skip
    rows: list[tuple[str, Row]] = []
    try:
        for name in cases:
            t0 = time.perf_counter()
            out, case_rows = asyncio.run(CASES[name](ctx))
            out.update(seconds=time.perf_counter() - t0, load_average=load_average())
            result[name] = out
            rows += [(name, r) for r in case_rows]
            print(f"{name}: {json.dumps(out)}", flush=True)
        if proc.poll() is not None:
            raise SystemExit(f"mint serve died:\n{log_path.read_text()[-5000:]}")
        result["calibration"] = server_calibration(url)  # measured by the worker before its first step
        print(f"server calibration: {json.dumps(result['calibration'])}", flush=True)
    finally:
        stop_server(proc)
    result["load_average_end"] = load_average()

    print(f"\n{'case':<7} {'metric':<30} {'quiet':>11} {'loaded':>11} {'ratio':>8}  goal")
    for case, (metric, quiet, loaded, r, goal, met) in rows:
        verdict = "" if met is None else ("meets" if met else "MISSES")
        print(f"{case:<7} {metric:<30} {quiet:>11.4g} {loaded:>11.4g} {r:>8.3f}  {goal} {verdict}")
    print(f"(rows '(floor | run)': the quiet column is the floor, the ratio the multiple of it; load average "
          f"{result['load_average_start']} -> {result['load_average_end']})")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
