"""A quantized base (`mint serve --quantize`, model/quantize.py) against fp32, side by side in one run.

SmolLM2-135M on CPU (or $MINT_BENCH_MODEL_DIR), each base fp32, int8 and int4:
- decode: one request's step — one row on a rank-32 adapter at `--context` positions of KV, through
  the engine's eager Executor — as a median over `--repeats` steps, the three bases' steps taken in
  turn (a spell of load from other processes slows one step of each, not every step of one); beside
  the bytes its base weights take and their floor at this machine's measured read bandwidth;
- resident base bytes (parameters and buffers, a tied table once);
- QLoRA training: one fused pass of `--adapters` × `--rows` datums of `--length` tokens, rank 16 on
  every target (importance_sampling), each base in a fresh subprocess: tokens/s (median of
  `--train-repeats` passes after the first) and the peak resident memory the base and the pass take
  (VmHWM above the process's RSS before the model was loaded, the high-water mark reset after load
  so that the fp32 checkpoint read before quantizing does not count; that transient is reported apart).

    python -m benchmarks.quantization [--context 256] [--repeats 15] [--quick]

Last stdout line: one JSON summary.
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
KINDS = ("none", "int8", "int4")


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def load(model_dir: Path, kind: str):
    from mint_server.model.loader import load_model
    from mint_server.model.quantize import quantize_model

    model = load_model(model_dir, device="cpu")
    return model if kind == "none" else quantize_model(model, kind)


def decode(model_dir: Path, context: int, repeats: int, threads: int | None = None) -> dict:
    import torch

    from benchmarks.common import load_average, machine_floors
    from mint_server.engine.executor import Executor, StepBatch
    from mint_server.engine.settings import EngineSettings
    from mint_server.model import kernels
    from mint_server.model.lora import LoraBank, init_lora_weights, target_shapes
    from mint_server.model.quantize import QuantizedWeight, resident_bytes

    torch.set_num_threads(threads or EngineSettings().intra_op_threads())
    torch.manual_seed(0)
    rank, bs = 32, 16
    runs = {}
    for kind in KINDS:
        model = load(model_dir, kind)
        if kind == "none":  # the engine's own start-up choice of fp32 product form, as it serves
            kernels.calibrate_skinny_once([m.weight for m in model.modules()
                                           if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2])
        cfg = model.config
        bank = LoraBank(cfg, 1, rank, "cpu", torch.float32)
        w = init_lora_weights(target_shapes(cfg), tuple(bank.shapes), rank, seed=0, dtype=torch.float32)
        bank.write(0, {t: (a, torch.randn_like(b) * 0.01) for t, (a, b) in w.items()}, rank, 2.0 * rank)
        per_row = -(-(context + repeats + 8) // bs)
        ex = Executor(model, bank, torch.device("cpu"), num_blocks=per_row + 2, block_size=bs, compile="off")
        table = list(range(1, 1 + per_row))
        prompt = torch.randint(1, cfg.vocab_size, (context,)).tolist()
        ex.step(StepBatch(prompt, list(range(context)), [context], [0], [table], []))
        weights = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), QuantizedWeight)
                   or isinstance(m, torch.nn.Linear | torch.nn.Embedding)]
        base_weight_bytes = sum(
            (w.qdata.numel() * w.qdata.element_size() + w.scales.numel() * w.scales.element_size())
            if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
            for w in {id(w): w for w in weights}.values())
        # a decode step reads every projection's weight and the lm_head's once; the embedding one row
        runs[kind] = {"executor": ex, "table": table, "resident_bytes": resident_bytes(model),
                      "weight_bytes": base_weight_bytes, "times": []}
    floors = machine_floors("cpu")
    for i in range(repeats + 1):
        for r in runs.values():
            batch = StepBatch([7], [context + i], [1], [0], [r["table"]], [0])
            t0 = time.perf_counter()
            r["executor"].step(batch)
            if i:  # the first round warms caches
                r["times"].append(time.perf_counter() - t0)
    out = {"read_bytes_per_s": floors["read_bytes_per_s"], "load_average": load_average(), "context": context}
    fp32 = statistics.median(runs["none"]["times"])
    for kind, r in runs.items():
        s = statistics.median(r["times"])
        out[kind] = {"s_per_token": s, "vs_fp32": s / fp32, "resident_bytes": r["resident_bytes"],
                     "resident_vs_fp32": r["resident_bytes"] / runs["none"]["resident_bytes"],
                     "weight_bytes": r["weight_bytes"], "floor_s": r["weight_bytes"] / floors["read_bytes_per_s"]}
    return out


def train_child(model_dir: str, kind: str, args) -> dict:
    """In a fresh process: load (and quantize) the base, run the fused pass, measure."""
    import numpy as np
    import torch
    from tinker import types

    from mint_server.engine.settings import EngineSettings
    from tests.engine.helpers import TrainerHarness, TrainRequest, make_residency

    torch.set_num_threads(args.threads or EngineSettings().intra_op_threads())
    rss0 = status_kb("VmRSS")
    model = load(Path(model_dir), kind)
    load_peak = status_kb("VmHWM")
    residency = make_residency(model.config, num_slots=args.adapters, max_rank=16)
    trainer = TrainerHarness(model, residency, "bench")
    ids = [residency.create(16, seed=i).id for i in range(args.adapters)]
    rng = np.random.default_rng(0)
    vocab, tokens = model.config.vocab_size, 0
    reqs = []
    for aid in ids:
        datums = []
        for _ in range(args.rows):
            seq = rng.integers(3, vocab, args.length + 1).tolist()
            tokens += args.length
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={
                "target_tokens": seq[1:], "logprobs": (-rng.random(args.length) * 5).tolist(),
                "advantages": rng.standard_normal(args.length).tolist()}))
        reqs.append(TrainRequest(aid, datums, "importance_sampling"))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the load's transient apart
    times = []
    for i in range(args.train_repeats + 1):
        t0 = time.perf_counter()
        outs = trainer.run(reqs)
        if i:
            times.append(time.perf_counter() - t0)
        for o in outs:
            if isinstance(o, Exception):
                raise o
    s = statistics.median(times)
    return {"tokens": tokens, "pass_s": s, "tokens_per_s": tokens / s,
            "peak_mb": (status_kb("VmHWM") - rss0) / 1024, "load_peak_mb": (load_peak - rss0) / 1024,
            "loss_sum": sum(o.metrics["loss:sum"] for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--adapters", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--train-repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, help="intra-op threads (default: the engine's, the cores given); "
                    "1 on a machine loaded by other work, where a team of threads waits on its slowest")
    ap.add_argument("--no-train", action="store_true", help="decode and bytes only")
    ap.add_argument("--no-decode", action="store_true", help="training only")
    ap.add_argument("--quick", action="store_true", help="a tiny random model: checks the script runs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(train_child(args.model_dir, args.child, args)))
        return
    if args.quick:
        import tempfile

        from tests.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="mint-quant-")) / "tiny", "qwen3")
    else:
        from benchmarks.common import smollm2_dir

        model_dir = smollm2_dir()
    d: dict = {}
    if not args.no_decode:
        d = decode(model_dir, args.context, args.repeats, args.threads)
        print(f"machine: read {d['read_bytes_per_s'] / 1e9:.1f} GB/s, load average {d['load_average']}, "
              f"{args.threads or 'default'} threads; "
              f"decode at {args.context} positions of KV, one row on a rank-32 adapter, eager")
        print("| base | s/token | vs fp32 | base weight bytes | read floor s/token | resident bytes | vs fp32 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for kind in KINDS:
            r = d[kind]
            print(f"| {'fp32' if kind == 'none' else kind} | {r['s_per_token'] * 1e3:.2f} ms | {r['vs_fp32']:.2f}x "
                  f"| {r['weight_bytes'] / 1e6:.1f} MB | {r['floor_s'] * 1e3:.2f} ms | {r['resident_bytes'] / 1e6:.1f} MB "
                  f"| {r['resident_vs_fp32']:.3f} |")
    train: dict = {}
    for kind in () if args.no_train else KINDS:
        cmd = [sys.executable, "-m", "benchmarks.quantization", "--child", kind, "--model-dir", str(model_dir),
               "--adapters", str(args.adapters), "--rows", str(args.rows), "--length", str(args.length),
               "--train-repeats", str(args.train_repeats), *(["--threads", str(args.threads)] if args.threads else [])]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"training child {kind} failed:\n{proc.stderr[-3000:]}")
        train[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    if not train:
        print(json.dumps({"decode": d}))
        return
    print(f"\nQLoRA training: one fused pass of {args.adapters} adapters x {args.rows} datums x {args.length} "
          "tokens, rank 16 on every target, importance_sampling")
    print("| base | tokens/s | vs fp32 | peak MB (base + pass) | vs fp32 | load transient MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in KINDS:
        t, f = train[kind], train["none"]
        print(f"| {'fp32' if kind == 'none' else kind} | {t['tokens_per_s']:.0f} | {t['tokens_per_s'] / f['tokens_per_s']:.2f}x "
              f"| {t['peak_mb']:.0f} | {t['peak_mb'] / f['peak_mb']:.2f} | {t['load_peak_mb']:.0f} |")
    print(json.dumps({"decode": d, "train": train}))


if __name__ == "__main__":
    main()
