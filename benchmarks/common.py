"""Shared bits for benchmark scripts: the model dir, timing with warm-up, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path


def smollm2_dir() -> Path:
    """The prepared SmolLM2 dir (prepares it into the data dir on first use)."""
    from mint_server.model.prepare import resolve_base_model

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
