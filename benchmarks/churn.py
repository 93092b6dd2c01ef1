"""Churn: does `mint serve` give back what each short-lived client took?

    python -m benchmarks.churn [--cycles 1000] [--warmup 20]

`mint serve` (a subprocess, on a tiny random Llama) serves --cycles clients one after another, each
as a user's script runs: a tinker ServiceClient → a LoRA training client → forward_backward +
optim_step → save_weights_for_sampler → a sampling client on that checkpoint → one sample → close
(session finished). The server's RSS, open files and threads are read from /proc after --warmup
cycles (caches filled, pools started) and at the end; goal: each within 10% of its warm value.
Both readings are taken after the server's keep-alive timeout has passed with no traffic: the tinker
SDK keeps a closed client's idle connections open (it does not close their pools), and the server
closes idle connections only after `ConnectionLimits.keep_alive_s`.
Durable records (one run and one sampler checkpoint per cycle, in the data dir) are expected to
grow; they are counted, not judged. The server's adapter host cache is bounded by
`--host-cache-mb` (small here, so that it is full before the warm reading: a cache filling up to its
bound is not a leak).

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.soak import free_port, rss_mb
from mint_server.api.http.server import ConnectionLimits

KEY = "tml-churn-key-0001"


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def open_file_kinds(pid: int) -> dict[str, int]:
    """Open descriptors by kind (socket, pipe, anon_inode, or the path of a file), for a leak's cause."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kind = target.split(":")[0] if target.startswith(("socket:", "pipe:", "anon_inode:")) else target
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def snapshot(pid: int) -> dict[str, float]:
    return {"rss_mb": rss_mb(pid), "open_files": open_files(pid), "threads": threads(pid)}


def cycle(url: str, base: str, i: int) -> None:
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        tc = client.create_lora_training_client(base_model=base, rank=4).result()
        tokens = [(i * 7 + j) % 200 + 1 for j in range(17)]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 16})
        fb = tc.forward_backward([datum], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result(), opt.result()
        path = tc.save_weights_for_sampler(f"c{i}").result().path
        sampler = client.create_sampling_client(model_path=path).result()
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=i)
        sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, params).result()
    finally:
        client.close("success").result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--host-cache-mb", type=float, default=4.0)
    parser.add_argument("--settle", type=float, default=ConnectionLimits().keep_alive_s + 5,
                        help="idle seconds before each reading (past the server's keep-alive timeout)")
    args = parser.parse_args()

    from tests.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="mint-churn-") as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "llama", family="llama", tie=True)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "TINKER_"))}
        env["MINT_API_KEYS"] = KEY
        cmd = [sys.executable, "-c", "from mint_server.cli import main; main()", "serve", "--base-model", str(model_dir),
               "--port", str(port), "--data-dir", str(Path(tmp) / "data"), "--log-level", "warning",
               "--host-cache-mb", str(args.host_cache_mb)]  # fmt: skip
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
            base = httpx.get(f"{url}/api/v1/get_server_capabilities",
                             headers={"X-API-Key": KEY}).json()["supported_models"][0]["model_name"]
            start = snapshot(proc.pid)
            warm: dict[str, float] = {}
            warm_kinds = open_file_kinds(proc.pid)
            t0 = time.monotonic()
            seconds: list[float] = []
            for i in range(args.cycles):
                c0 = time.monotonic()
                cycle(url, base, i)
                seconds.append(time.monotonic() - c0)
                if i + 1 == args.warmup:
                    time.sleep(args.settle)
                    warm = snapshot(proc.pid)
                    warm_kinds = open_file_kinds(proc.pid)
                if (i + 1) % 100 == 0:
                    print(f"cycle {i + 1}: {snapshot(proc.pid)}", file=sys.stderr, flush=True)
            wall = time.monotonic() - t0 - (args.settle if args.cycles >= args.warmup else 0)
            time.sleep(args.settle)
            end = snapshot(proc.pid)
            end_kinds = open_file_kinds(proc.pid)
            runs = sum(1 for _ in (Path(tmp) / "data" / "runs").glob("*/run.json"))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    warm = warm or start
    seconds.sort()
    out: dict[str, object] = {"cycles": args.cycles, "wall_s": round(wall, 1),
                              "cycle_p50_s": round(seconds[len(seconds) // 2], 3),
                              "runs_on_disk": runs}  # fmt: skip
    for name in ("rss_mb", "open_files", "threads"):
        out[f"{name}_start"] = round(start[name], 1)
        out[f"{name}_warm"] = round(warm[name], 1)
        out[f"{name}_end"] = round(end[name], 1)
        out[f"{name}_end_vs_warm"] = round(end[name] / warm[name], 3)
    out["open_files_changed"] = {k: [warm_kinds.get(k, 0), n] for k, n in end_kinds.items()
                                 if n != warm_kinds.get(k, 0)}  # fmt: skip
    out["within_10pct"] = all(out[f"{n}_end_vs_warm"] <= 1.10 for n in ("rss_mb", "open_files", "threads"))
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:<{width}}  {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
