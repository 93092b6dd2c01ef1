"""The compiled decode step against the eager one, side by side in one process (docs/engine.md).

SmolLM2-135M (fp32 on CPU) with rank-32 adapters on every target: one row on an adapter, one row on
the base, and 64 rows on 64 distinct adapters, each at `--context` positions of KV. Every figure is
a median over `--repeats` steps with the eager and compiled steps taken in turn, beside the step's
floor on this machine (benchmarks.common.decode_floor: the bytes it must read at the measured read
bandwidth, or its FLOPs at the measured matmul peak, whichever is slower).

    python -m benchmarks.compiled [--context 256] [--repeats 15] [--rows 1 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import decode_floor, load_average, machine_floors, smollm2_dir
from mint_server.engine.executor import Executor, StepBatch
from mint_server.model.loader import load_model
from mint_server.model.lora import LoraBank, init_lora_weights, target_shapes


def decode_table(model_dir: Path, device: str, dtype: torch.dtype, rows_list: list[int], rank: int, context: int,
                 repeats: int) -> list[str]:
    """Markdown rows: eager vs compiled decode step for each row count (row i on adapter i; one row
    on the base too) beside the floor."""
    torch.manual_seed(0)
    model = load_model(model_dir, device=device, dtype=dtype)
    cfg = model.config
    slots = max(rows_list)
    bank = LoraBank(cfg, slots, rank, device, dtype)
    shapes = target_shapes(cfg)
    for s in range(slots):
        w = init_lora_weights(shapes, tuple(bank.shapes), rank, seed=s, dtype=dtype)
        bank.write(s, {t: (a, torch.randn_like(b) * 0.01) for t, (a, b) in w.items()}, rank, 2.0 * rank)
    bs = 16
    per_row = -(-(context + 2 * repeats + 8) // bs)
    ex = Executor(model, bank, torch.device(device), num_blocks=slots * per_row + 2, block_size=bs, compile="auto")
    assert ex.graph is not None, ex._eager_reason
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t0 = time.perf_counter()
    ex.graph.warm_up()
    compile_s = time.perf_counter() - t0
    tables = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(slots)]
    prompt = torch.randint(1, cfg.vocab_size, (context,)).tolist()
    for r in range(slots):  # prefill every row's context (eagerly)
        ex.step(StepBatch(prompt, list(range(context)), [context], [r], [tables[r]], []))
    floors = machine_floors(device)
    out = [f"machine: read {floors['read_bytes_per_s'] / 1e9:.1f} GB/s, matmul peak "
           f"{floors['matmul_flop_per_s'] / 1e9:.0f} GFLOP/s (fp32), load average {load_average()}; "
           f"warm-up compile {compile_s:.1f} s ({ex.compile_stats.graphs} graphs)",
           "| case | eager ms | compiled ms | eager / compiled | floor ms | eager / floor | compiled / floor |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    cases = []
    for rows in rows_list:
        cases.append((f"{rows} row{'s' if rows > 1 else ''} on {rows} adapter{'s' if rows > 1 else ''}",
                      list(range(rows)), rows))
        if rows == 1:
            cases.append(("1 row on the base", [-1], 0))
    size = torch.empty((), dtype=dtype).element_size()
    for name, row_slots, adapters in cases:
        rows = len(row_slots)
        eager, compiled = [], []
        for i in range(repeats + 1):
            batch = StepBatch([7] * rows, [context + i] * rows, [1] * rows, row_slots, tables[:rows],
                              list(range(rows)))
            sync()
            t0 = time.perf_counter()
            ex.call("step", batch=batch)
            sync()
            t1 = time.perf_counter()
            ex.step(batch)
            sync()
            t2 = time.perf_counter()
            if i:  # the first round warms caches
                eager.append(t1 - t0)
                compiled.append(t2 - t1)
        e, c = statistics.median(eager), statistics.median(compiled)
        floor = decode_floor(cfg, rows, context, rank, adapters, floors, bytes_per=size)["floor_s"]
        out.append(f"| {name} | {e * 1e3:.2f} | {c * 1e3:.2f} | {e / c:.2f}x | {floor * 1e3:.2f} | {e / floor:.2f}x "
                   f"| {c / floor:.2f}x |")
    out.append(f"compile stats: {ex.compile_stats.totals()}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    args = ap.parse_args()
    print("\n".join(decode_table(smollm2_dir(), "cpu", torch.float32, args.rows, args.rank, args.context,
                                 args.repeats)))


if __name__ == "__main__":
    main()
