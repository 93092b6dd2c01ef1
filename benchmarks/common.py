"""Shared bits for benchmark scripts: the model dir, timing with warm-up, medians."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def smollm2_dir() -> Path:
    """The prepared SmolLM2 dir (prepares it into the data dir on first use), or $MINT_BENCH_MODEL_DIR:
    a checkpoint of the same shape (random weights, say, on a GPU machine without the package's GGUF;
    speeds hold, greedy outputs mean nothing)."""
    from mint_server.model.prepare import resolve_base_model

    if os.environ.get("MINT_BENCH_MODEL_DIR"):
        return Path(os.environ["MINT_BENCH_MODEL_DIR"])
    return resolve_base_model(None, None)


def median_seconds(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_floors(device: str = "cpu", repeats: int = 8) -> dict[str, float]:
    """This machine's measured read bandwidth (bytes/s: best of several sums over a 256 MiB fp32
    tensor, far larger than any cache) and fp32 matmul peak (FLOP/s: best of several 2048³
    products). The floors of the results are work / these; best-of, so load from other processes
    shrinks them less than it shrinks a median."""
    import torch

    def sync() -> None:
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()

    big = torch.ones(64 * 2**20, device=device)
    a = torch.randn(2048, 2048, device=device)
    b = torch.randn(2048, 2048, device=device)
    bw = peak = 0.0
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        big.sum()
        sync()
        bw = max(bw, big.numel() * 4 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        a @ b
        sync()
        peak = max(peak, 2 * 2048**3 / (time.perf_counter() - t0))
    return {"read_bytes_per_s": bw, "matmul_flop_per_s": peak}


def load_average() -> float | None:
    """1-minute load average (how busy the shared machine was), None where unknown."""
    import os

    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def decode_floor(cfg, rows: int, context: int, rank: int, adapters: int, floors: dict[str, float],
                 bytes_per: int = 4) -> dict[str, float]:
    """The least time one decode step of `rows` sequences at `context` positions can take here:
    bytes it must read (every base matmul weight once, each of `adapters` distinct adapters' A/B on
    every target once, each row's K/V) / read bandwidth, and FLOPs (2 per weight per row, the rows'
    LoRA products, attention) / matmul peak. floor_s is the larger of the two."""
    from mint_server.model.lora import ALL_TARGETS, target_shapes

    shapes = {t: s for t, s in target_shapes(cfg).items() if t in ALL_TARGETS}
    base = sum(L * fi * fo for L, fi, fo in shapes.values())
    lora = sum(L * rank * (fi + fo) for L, fi, fo in shapes.values())
    kv = rows * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    read = (base + adapters * lora + kv) * bytes_per
    flops = 2 * rows * (base + lora) + 4 * rows * context * cfg.num_layers * cfg.num_heads * cfg.head_dim
    mem_s, flop_s = read / floors["read_bytes_per_s"], flops / floors["matmul_flop_per_s"]
    return {"bytes": read, "flops": flops, "memory_floor_s": mem_s, "compute_floor_s": flop_s,
            "floor_s": max(mem_s, flop_s)}
