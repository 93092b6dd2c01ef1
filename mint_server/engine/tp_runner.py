"""Tensor parallelism's ranks: starting the followers (ranks 1..N-1) and their op loop.

The runner (engine/runner.py) is one engine on N ranks; this module spawns the N − 1 follower
processes, joins the process group as rank 0, and runs each follower's loop: receive rank 0's next
op, run it on the follower's own `Shard`, until told to stop. Importing it registers every op (the
training pass's, reverse KL's and the sampler's live beside their callers).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mint_server.engine import executor, reverse_kl, training  # noqa: F401 - their ops, for the followers
from mint_server.engine.host_memory import keep_freed_memory
from mint_server.engine.runner import OPS, Shard
from mint_server.engine.values import EngineError
from mint_server.model import tp as tpmod
from mint_server.model.lora import LoraBank

log = logging.getLogger(__name__)


# Idle followers wait for rank 0's next op in a gloo group of its own, whose timeout is this long
# (in effect none); rank 0 bounds its side of each dispatch, and the collectives inside ops use the
# default group, by tp_timeout_s.
CONTROL_TIMEOUT = timedelta(days=365)


def control_group() -> Any:
    """The group ops are dispatched over; every rank creates it right after joining."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def receive_op(group: Any) -> Any:
    """A follower: wait (without a limit) for rank 0's next op."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


# --- starting ranks -------------------------------------------------------------------------------
def start_followers(world: int, model_dir: Path, settings: Any, device: torch.device,
                    dtype: torch.dtype) -> tuple[tpmod.TP, list[Any], Any]:
    """Spawn ranks 1..world-1 and join the group as rank 0 (returns once every rank has joined)."""
    port = tpmod.free_port()
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        p = ctx.Process(target=follower_main, args=(rank, world, port, str(model_dir), settings, str(device), dtype),
                        name=f"mint-tp-{rank}", daemon=True)
        p.start()
        procs.append(p)
    try:
        tp = tpmod.init(0, world, port, backend="nccl" if device.type == "cuda" else "gloo",
                        timeout_s=settings.tp_timeout_s)
        control = control_group()
    except Exception:
        for p in procs:
            p.kill()
        raise
    return tp, procs, control


def follower_main(rank: int, world: int, port: int, model_dir: str, settings: Any, device: str,
                  dtype: torch.dtype) -> None:
    """A follower rank: load and split the model, then run rank 0's ops until told to stop."""
    from mint_server.model.loader import load_model

    torch.set_num_threads(settings.intra_op_threads())
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
    elif settings.keep_freed_memory:
        keep_freed_memory()
    tp = tpmod.init(rank, world, port, backend="nccl" if dev.type == "cuda" else "gloo",
                    timeout_s=settings.tp_timeout_s)
    control = control_group()
    model = load_model(Path(model_dir), dev, dtype, tp=tp)  # reads only this rank's slices
    cfg = model.config
    bank = LoraBank(cfg, settings.device_slots, settings.max_rank, dev, dtype,
                    shapes=tpmod.local_target_shapes(cfg, world))
    shard = Shard(tp, model, bank, dev, dtype)
    while True:
        name, inputs = receive_op(control)
        if name == "stop":
            break
        try:
            OPS[name](shard, **inputs)
        except EngineError:  # rank 0 raised the same and answers the request
            pass
        except Exception:  # noqa: BLE001 - a follower keeps serving; rank 0 sees its own error
            log.exception("tp rank %d: op %s failed", rank, name)
    dist.destroy_process_group()
