"""Which implementation of the hot tensor paths runs: `MINT_KERNELS=fast` (default) or `reference`.

fast: gather-free mixed-adapter LoRA (`lora.add_lora` reads each adapter's A/B straight from its
bank slot: one batched matmul over a contiguous range of slots, or one matmul per adapter segment),
fused/in-place elementwise ops in the model (RMSNorm, RoPE, SiLU·mul, residual adds).
reference: the plain formulations (per-row gather of A/B, out-of-place elementwise ops) that the
fast ones are tested against. Both give the same results to float rounding; CI runs the parity
suites on both (tests/conftest.py). The mode is read from the environment at import; `use` switches
it in-process (tests, benchmarks comparing the two side by side).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

MODES = ("fast", "reference")


def _from_env() -> str:
    value = os.environ.get("MINT_KERNELS", "fast").strip().lower() or "fast"
    if value not in MODES:
        raise ValueError(f"MINT_KERNELS must be one of {', '.join(MODES)}, got {value!r}")
    return value


_mode = _from_env()


def mode() -> str:
    return _mode


def fast() -> bool:
    return _mode == "fast"


def set_mode(value: str) -> None:
    global _mode
    if value not in MODES:
        raise ValueError(f"kernel mode must be one of {', '.join(MODES)}, got {value!r}")
    _mode = value


@contextmanager
def use(value: str) -> Iterator[None]:
    """Run a block with the given mode, then restore the previous one."""
    old = _mode
    set_mode(value)
    try:
        yield
    finally:
        set_mode(old)
