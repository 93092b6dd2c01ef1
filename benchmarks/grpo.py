"""Scale Down, fused multi-policy GRPO: 4 policies trained concurrently vs one after another.

    python -m benchmarks.grpo [--policies 4] [--iterations 3] [--warmup 1] [--quick]

Starts `mint serve` on SmolLM2 (prepared on first use; a tiny random Llama with --quick) as a
subprocess on a loopback port, once per mode, and drives --policies GRPO policies through the real
tinker SDK. One GRPO iteration of one policy: `save_weights_and_get_sampling_client()`, --problems
arithmetic prompts (made in code, the chat template applied) × --group samples of exactly
--max-tokens tokens each (stop=[], so every iteration does the same work in both modes), a 0/1
reward (the first integer of the completion equals the sum), group-centred advantages, then
`forward_backward(…, "importance_sampling")` + `optim_step`. Every datum is kept (a zero advantage
still costs its forward/backward), again so that both modes do the same work.

- fused: each policy's client runs its iteration in its own thread, all at once: the engine fuses
  their training passes and batches their samples in one decode loop, and one policy's sampling
  overlaps another's training.
- sequential: the same policies, one iteration after another.
- fused_one_pass (with --one-pass): fused, with a training budget that holds every policy's batch
  in one pass, and the memory held to one policy's: a pass bigger than one policy's batch
  recomputes enough of its blocks in backward to keep one policy's block activations
  (`--checkpoint-from-tokens` = one policy's batch + 1).

The server runs with `--max-fused-tokens` at one policy's padded batch (unless given): a fused
pass is split into micro-batches of that size, so it never holds more training activations than
one policy's pass (MinT's "no more peak memory"). With a budget that holds every policy's batch
(the engine's default is 32768) the policies' batches go through in one pass and the peak grows
with them.

Per mode: wall time per iteration (all policies' iterations; median over --iterations after
--warmup; and the server's and the client's CPU seconds per iteration, the work done, which load
from other processes stretches far less than wall time), and the server process's peak resident memory (VmHWM from /proc/<pid>/status; a fresh
server per mode so each peak is its own) next to its resident memory once the policies exist.
MinT's goal (GPU): fused ≥ 1.77× faster with peak memory ≤ 1.05×. On a CPU the fused pass can
only save per-call overhead and overlap the SDK's and the server's work: the matmuls already keep
every core busy, so there is no idle accelerator for the fused work to fill. Last line: one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

KEY = "tml-bench-grpo-key-0001"
RANK = 16
ROOT = Path(__file__).resolve().parent.parent


# --- the server ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (from /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_kb(pid: int, field: str) -> int:
    """A memory figure (kB) from /proc/<pid>/status: VmHWM (peak resident), VmRSS (now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def start_server(model_dir: Path, data_dir: Path, args, fused_tokens: int,
                 extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-c", "from mint_server.cli import main; main()", "serve", "--port", str(port),
           "--data-dir", str(data_dir), "--api-key", KEY, "--kv-budget-tokens", str(args.kv_tokens),
           "--max-seq-len", str(args.max_seq), "--max-fused-tokens", str(fused_tokens), "--log-level", "warning", "--base-model", str(model_dir), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mint serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("mint serve did not come up within 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --- one GRPO policy ----------------------------------------------------------------------------


def first_int(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return int(m.group()) if m else None


class Policy:
    def __init__(self, index: int, tc, tokenizer, args) -> None:
        self.index, self.tc, self.tok, self.args = index, tc, tokenizer, args

    def problems(self, iteration: int) -> list[tuple[list[int], int]]:
        """--problems (prompt tokens, answer) pairs; the same per (policy, iteration) in every mode."""
        rng = np.random.default_rng(1000 * self.index + iteration)
        out = []
        for a, b in rng.integers(10, 100, size=(self.args.problems, 2)).tolist():
            messages = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
            prompt = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(prompt, list):  # newer transformers return a BatchEncoding
                prompt = prompt["input_ids"]
            out.append((list(prompt), a + b))
        return out

    def iteration(self, iteration: int) -> dict:
        from tinker import types

        args = self.args
        sampler = self.tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[],
                                      seed=iteration)  # fmt: skip
        problems = self.problems(iteration)
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group, params) for p, _ in problems]
        datums, rewards, sampled = [], [], 0
        for (prompt, answer), fut in zip(problems, futures, strict=True):
            seqs = fut.result().sequences
            group = [float(first_int(self.tok.decode(s.tokens)) == answer) for s in seqs]
            mean = sum(group) / len(group)
            rewards += group
            for s, r in zip(seqs, group, strict=True):
                tokens = prompt + list(s.tokens)
                pad = [0.0] * (len(prompt) - 1)
                sampled += len(s.tokens)
                datums.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": pad + list(s.logprobs),
                                    "advantages": pad + [r - mean] * len(s.tokens)},
                ))
        fb = self.tc.forward_backward(datums, "importance_sampling")
        opt = self.tc.optim_step(types.AdamParams(learning_rate=args.lr))
        fb.result()
        opt.result()
        return {"reward": sum(rewards) / len(rewards), "sampled_tokens": sampled,
                "trained_tokens": sum(d.model_input.length for d in datums)}


# --- one mode -----------------------------------------------------------------------------------


def run_mode(mode: str, model_dir: Path, args, work: Path, fused_tokens: int) -> dict:
    import tinker
    from transformers import AutoTokenizer

    base_mode, _, extra = mode.partition("@")  # "mode@--flag=value,--flag=value": extra server flags
    proc, url = start_server(model_dir, work / f"data-{len(os.listdir(work))}", args, fused_tokens,
                             extra.split(",") if extra else [])
    try:
        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        base = client.get_server_capabilities().supported_models[0].model_name
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        policies = [Policy(i, client.create_lora_training_client(base_model=base, rank=RANK, seed=i).result(),
                           tokenizer, args) for i in range(args.policies)]  # fmt: skip
        setup_rss_kb = proc_status_kb(proc.pid, "VmRSS")
        pool = ThreadPoolExecutor(args.policies)
        walls, server_cpu, client_cpu, rewards, sampled, trained = [], [], [], [], 0, 0
        for it in range(args.warmup + args.iterations):
            t0, s0, c0 = time.perf_counter(), cpu_seconds(proc.pid), time.process_time()
            if base_mode.startswith("fused"):
                stats = list(pool.map(lambda p, it=it: p.iteration(it), policies))
            else:
                stats = [p.iteration(it) for p in policies]
            wall = time.perf_counter() - t0
            print(f"[{mode}] iteration {it}{' (warm-up)' if it < args.warmup else ''}: {wall:.2f}s, reward "
                  f"{statistics.mean(s['reward'] for s in stats):.3f}", file=sys.stderr, flush=True)
            if it >= args.warmup:
                walls.append(wall)
                server_cpu.append(cpu_seconds(proc.pid) - s0)
                client_cpu.append(time.process_time() - c0)
                rewards.append(statistics.mean(s["reward"] for s in stats))
                sampled += sum(s["sampled_tokens"] for s in stats)
                trained += sum(s["trained_tokens"] for s in stats)
        pool.shutdown()
        peak_kb = proc_status_kb(proc.pid, "VmHWM")
        client.close("success")
    finally:
        stop_server(proc)
    return {"iteration_s": statistics.median(walls), "all_iteration_s": walls, "max_fused_tokens": fused_tokens,
            # CPU seconds per iteration: the work done, which load from other processes stretches far less
            "server_cpu_s": statistics.median(server_cpu), "client_cpu_s": statistics.median(client_cpu),
            "peak_rss_mb": peak_kb / 1024,
            "setup_rss_mb": setup_rss_kb / 1024, "mean_reward": statistics.mean(rewards),
            "sampled_tokens_per_iteration": sampled / len(walls), "trained_tokens_per_iteration": trained / len(walls)}


def default_model_dir() -> Path:
    from benchmarks.common import smollm2_dir

    return smollm2_dir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", type=int, default=4)
    ap.add_argument("--problems", type=int, default=8, help="prompts per policy per iteration")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (the GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations per mode")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--kv-tokens", type=int, default=16384, help="the server's KV pool (fits every policy's batch)")
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--max-fused-tokens", type=int, default=0,
                    help="the server's fused-pass budget in padded tokens; 0 (default): one policy's batch "
                         "(problems × group × (longest prompt + max tokens)), so a fused pass holds no more "
                         "activations than one policy's")
    ap.add_argument("--one-pass", action="store_true",
                    help="also run fused with a budget holding every policy's batch (one pass; more peak memory)")
    ap.add_argument("--modes", default="fused sequential fused_one_pass",
                    help="modes to run (space-separated; fused_one_pass only with --one-pass; MODE@--flag=v,--flag=v "
                         "adds `mint serve` flags to one mode); ratios are to sequential")
    ap.add_argument("--quick", action="store_true", help="tiny random Llama, 2 problems, 1 iteration (smoke run)")
    args = ap.parse_args()

    from benchmarks.common import load_average

    with tempfile.TemporaryDirectory(prefix="mint-grpo-") as tmp:
        work = Path(tmp)
        if args.quick:
            from tests.tiny import make_tiny_checkpoint

            model_dir = make_tiny_checkpoint(work / "tiny")
            args.problems, args.iterations, args.max_tokens, args.kv_tokens = 2, 1, 16, 2048
        else:  # the prepared dir, so no server spends its memory peak preparing the model
            model_dir = default_model_dir()
        if not args.max_fused_tokens:  # one policy's padded batch, from the prompts every mode will send
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
            longest = max(len(p) for i in range(args.policies) for it in range(args.warmup + args.iterations)
                          for p, _ in Policy(i, None, tok, args).problems(it))
            args.max_fused_tokens = args.problems * args.group * (longest + args.max_tokens)
        summary: dict = {"model": "tiny/llama" if args.quick else "SmolLM2-135M-Instruct",
                         "max_fused_tokens": args.max_fused_tokens, "policies": args.policies, "problems": args.problems, "group": args.group,
                         "max_tokens": args.max_tokens, "iterations": args.iterations, "warmup": args.warmup,
                         "cores": len(os.sched_getaffinity(0)), "load_average_start": load_average()}
        one_pass = args.max_fused_tokens * args.policies  # every policy's batch in one pass
        for mode in args.modes.split():
            if mode.startswith("fused_one_pass") and not args.one_pass:
                continue
            budget = one_pass if mode.startswith("fused_one_pass") else args.max_fused_tokens
            if mode == "fused_one_pass":  # memory by budget: a pass bigger than one policy's batch recomputes
                mode = f"fused_one_pass@--checkpoint-from-tokens={args.max_fused_tokens + 1}"
            summary[mode] = run_mode(mode, model_dir, args, work, budget)
    summary.update(goal_speedup=1.77, goal_peak_ratio=1.05, load_average_end=load_average())
    seq = summary.get("sequential")
    if seq is not None:
        fused = summary.get("fused")
        if fused is not None:
            summary.update(speedup=seq["iteration_s"] / fused["iteration_s"],
                           peak_ratio=fused["peak_rss_mb"] / seq["peak_rss_mb"],
                           server_cpu_ratio=seq["server_cpu_s"] / fused["server_cpu_s"])
        for mode in [m for m in summary if m.startswith("fused_one_pass")]:
            one = summary[mode]
            one.update(speedup=seq["iteration_s"] / one["iteration_s"], peak_ratio=one["peak_rss_mb"] / seq["peak_rss_mb"],
                       server_cpu_ratio=seq["server_cpu_s"] / one["server_cpu_s"])
        print(f"per iteration ({args.policies} policies × {args.problems} × {args.group} × {args.max_tokens} tokens): "
              f"sequential {seq['iteration_s']:.2f}s, peak {seq['peak_rss_mb']:.0f} MB", flush=True)
        if fused is not None:
            print(f"fused {fused['iteration_s']:.2f}s, sequential {seq['iteration_s']:.2f}s → {summary['speedup']:.2f}× "
                  f"(goal ≥ 1.77×); server peak RSS fused {fused['peak_rss_mb']:.0f} MB vs sequential "
                  f"{seq['peak_rss_mb']:.0f} MB → {summary['peak_ratio']:.3f}× (goal ≤ 1.05×); server CPU s per iteration "
                  f"sequential/fused {summary['server_cpu_ratio']:.2f}×", flush=True)
        for mode in [m for m in summary if m.startswith("fused_one_pass")]:
            one = summary[mode]
            print(f"{mode}: {one['iteration_s']:.2f}s → {one['speedup']:.2f}×, peak {one['peak_rss_mb']:.0f} MB → "
                  f"{one['peak_ratio']:.3f}×, server CPU s sequential/this {one['server_cpu_ratio']:.2f}×", flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
