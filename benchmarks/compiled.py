"""The compiled decode step against the eager one, side by side in one process (docs/engine.md).

SmolLM2-135M (fp32 on CPU) with rank-32 adapters on every target: one row on an adapter, one row on
the base, and 64 rows on 64 distinct adapters, each at `--context` positions of KV. Every figure is
a median over `--repeats` steps with the eager and compiled steps taken in turn, beside the step's
floor on this machine (benchmarks.common.decode_floor: the bytes it must read at the measured read
bandwidth, or its FLOPs at the measured matmul peak, whichever is slower). Then one
`--prefill`-token prompt on the base in chunks of `--chunk` tokens, eager and compiled in turn
(`--prefill-rounds` each, the median), beside its FLOP floor (benchmarks/serving.py's: 2·params·tokens
+ causal attention 2·layers·tokens²·hidden, at the matmul peak).

    python -m benchmarks.compiled [--context 256] [--repeats 15] [--rows 1 64] [--prefill 6000] [--chunk 256]
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
                 repeats: int, prefill: int = 0, chunk: int = 256, prefill_rounds: int = 2) -> list[str]:
    """Markdown rows: eager vs compiled decode step for each row count (row i on adapter i; one row
    on the base too) beside the floor; then the long prompt's prefill (none if prefill is 0)."""
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
    prefill_blocks = -(-prefill // bs)
    ex = Executor(model, bank, torch.device(device), num_blocks=slots * per_row + prefill_blocks + 2, block_size=bs,
                  compile="auto")
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
    if prefill:
        long_table = list(range(1 + slots * per_row, 1 + slots * per_row + prefill_blocks))
        out.append(prefill_row(ex, cfg, floors, long_table, prefill, chunk, prefill_rounds, sync))
    out.append(f"compile stats: {ex.compile_stats.totals()}; load average after {load_average()}")
    return out


def prefill_row(ex: Executor, cfg, floors: dict[str, float], table: list[int], tokens: int, chunk: int, rounds: int,
                sync) -> str:
    """The prompt's prefill, chunk by chunk (each chunk after the first continues the prefix in the
    KV), eagerly and compiled in turn; the markdown row beside its FLOP floor."""
    from mint_server.model.lora import ALL_TARGETS, target_shapes

    prompt = torch.randint(1, cfg.vocab_size, (tokens,)).tolist()

    def run(compiled: bool) -> float:
        sync()
        t0 = time.perf_counter()
        for a in range(0, tokens, chunk):
            n = min(chunk, tokens - a)
            batch = StepBatch(prompt[a : a + n], list(range(a, a + n)), [n], [-1], [table], [0])
            if compiled:
                ex.step(batch)
            else:
                ex.call("step", batch=batch)
        sync()
        return time.perf_counter() - t0

    eager, compiled = [], []
    for _ in range(rounds):
        eager.append(run(False))
        compiled.append(run(True))
    e, c = statistics.median(eager), statistics.median(compiled)
    shapes = {t: s for t, s in target_shapes(cfg).items() if t in ALL_TARGETS and t != "lm_head"}
    params = sum(L * fi * fo for L, fi, fo in shapes.values())
    floor = (2 * params * tokens + 2 * cfg.num_layers * tokens**2 * cfg.hidden_size) / floors["matmul_flop_per_s"]
    return (f"| {tokens}-token prefill, chunks of {chunk} (s) | {e:.2f} | {c:.2f} | {e / c:.2f}x | {floor:.2f} "
            f"| {e / floor:.2f}x | {c / floor:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prefill", type=int, default=6000, help="the long prompt's tokens (0: no prefill row)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--prefill-rounds", type=int, default=2)
    args = ap.parse_args()
    print("\n".join(decode_table(smollm2_dir(), "cpu", torch.float32, args.rows, args.rank, args.context,
                                 args.repeats, args.prefill, args.chunk, args.prefill_rounds)))


if __name__ == "__main__":
    main()
