"""Memory and time of one fused training pass, straight on the Trainer (no server, no SDK).

    python -m benchmarks.train_memory [--adapters 4] [--rows 8] [--length 78] [--quick]

The training pass `benchmarks/grpo.py` sends through the SDK (--adapters policies × --rows datums
of about --length tokens, importance_sampling, LoRA rank 16 on attention + MLP + unembed), on
SmolLM2 (a tiny random Llama with --quick), run once per trainer configuration, each in a fresh
subprocess: the pass's peak resident memory above the process's resident memory just before it
(VmHWM reset through /proc/self/clear_refs), and the median seconds of --repeats passes after the
first. A configuration is Trainer keyword arguments (max_tokens_per_pass, checkpoint_from_tokens,
logits_chunk), by name from CONFIGS or as JSON objects separated by ';'. Last line: one JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def one(model_dir: str, config: dict, args) -> dict:
    """In the child: build the trainer, run the pass, measure."""
    import numpy as np
    import torch
    from tinker import types

    from mint_server.engine.settings import EngineSettings
    from mint_server.model.loader import load_model
    from tests.engine.helpers import TrainerHarness, TrainRequest, make_residency

    torch.set_num_threads(EngineSettings().intra_op_threads())
    model = load_model(Path(model_dir), device="cpu")
    residency = make_residency(model.config, num_slots=args.adapters, max_rank=16)
    trainer = TrainerHarness(model, residency, "bench", **config)
    ids = [residency.create(16, seed=i).id for i in range(args.adapters)]
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    reqs = []
    for aid in ids:
        datums = []
        for _ in range(args.rows):
            n = int(rng.integers(args.length - 8, args.length + 1))
            seq = rng.integers(3, vocab, n + 1).tolist()
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={
                "target_tokens": seq[1:], "logprobs": (-rng.random(n) * 5).tolist(),
                "advantages": rng.standard_normal(n).tolist()}))
        reqs.append(TrainRequest(aid, datums, "importance_sampling"))
    before_kb = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    outs = trainer.run(reqs)
    first_s = time.perf_counter() - t0
    peak_kb = status_kb("VmHWM")
    for o in outs:
        if isinstance(o, Exception):
            raise o
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        trainer.run(reqs)
        times.append(time.perf_counter() - t0)
    return {"config": config, "pass_peak_mb": (peak_kb - before_kb) / 1024, "rss_before_mb": before_kb / 1024,
            "first_pass_s": first_s, "pass_s": statistics.median(times) if times else first_s,
            "loss_sum": sum(o.metrics["loss:sum"] for o in outs)}


CONFIGS = {
    "today": {},
    "split_one_policy": {"max_tokens_per_pass": 624},
    "logits_64mb": {"logits_chunk": 64 * 2**20 // 4},
    "checkpoint_all": {"checkpoint_from_tokens": 1},
    "checkpoint_all_logits_64mb": {"checkpoint_from_tokens": 1, "logits_chunk": 64 * 2**20 // 4},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=78)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="names from CONFIGS, or JSON objects")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(one(args.model_dir, json.loads(args.child), args)))
        return
    if args.quick:
        import tempfile

        from tests.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="mint-trainmem-")) / "tiny")
    else:
        from benchmarks.common import smollm2_dir

        model_dir = smollm2_dir()
    results = {}
    for name in args.configs.split(";" if "{" in args.configs else ","):
        config = json.loads(name) if name.startswith("{") else CONFIGS[name]
        cmd = [sys.executable, "-m", "benchmarks.train_memory", "--child", json.dumps(config), "--model-dir",
               str(model_dir), "--adapters", str(args.adapters), "--rows", str(args.rows), "--length",
               str(args.length), "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            raise SystemExit(f"{name}: child failed")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results[name] = r
        print(f"{name:32s} peak +{r['pass_peak_mb']:7.0f} MB  first {r['first_pass_s']:6.2f}s  "
              f"pass {r['pass_s']:6.2f}s  loss {r['loss_sum']:.6g}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
