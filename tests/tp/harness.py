"""Run a function on N gloo ranks (torch.multiprocessing spawn on loopback); rank 0's result comes back."""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from mint_server.model import tp as tpmod


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share the machine's cores
    tp = tpmod.init(rank, world, port, backend="gloo")
    try:
        result = fn(tp, *args)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2) -> Any:
    """fn(tp, *args) on `world` ranks; returns rank 0's (picklable) result. A rank's exception fails the call."""
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "result.pkl")
        mp.spawn(_entry, args=(world, tpmod.free_port(), fn, args, out), nprocs=world, join=True)
        return pickle.loads(Path(out).read_bytes())
