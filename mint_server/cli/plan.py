"""`mint plan`: the memory plan for serving and LoRA-training a base on N GPUs, from its config.json."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)


def plan_cmd(
    config: Path = typer.Option(..., "--config", help="An HF config.json (or a checkpoint dir holding one)."),
    gpus: int = typer.Option(8, "--gpus", min=1, help="Accelerators."),
    gpu_mem: float = typer.Option(80.0, "--gpu-mem", min=1.0, help="Memory per accelerator, GiB."),
    rank: int = typer.Option(32, "--rank", min=1, help="LoRA rank of each adapter."),
    tp: int = typer.Option(None, "--tp", min=1, help="Tensor-parallel degree for attention/dense [default: --gpus]."),
    ep: int = typer.Option(None, "--ep", min=1, help="Expert-parallel degree [default: --gpus]."),
    weight_bytes: float = typer.Option(2.0, "--weight-bytes", help="Bytes per base parameter (2 bf16, 1 fp8)."),
    kv_fraction: float = typer.Option(0.5, "--kv-fraction", min=0.0, max=1.0,
                                      help="Share of the memory left after the base that goes to the KV cache."),
    context: int = typer.Option(8192, "--context", min=1, help="Tokens per sequence for the sequences-fit count."),
    host_mem: float = typer.Option(512.0, "--host-mem", min=0.0, help="Host memory for paged adapters, GiB."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
) -> None:
    """Print the memory plan: base weights per GPU under TP/EP, KV bytes per token (latent vs full),
    adapter bytes per rank, and how many adapters fit per tier."""
    from mint_server.model.config import ModelConfig, ModelError
    from mint_server.model.plan import plan, plan_dict, render

    path = config / "config.json" if config.is_dir() else config
    try:
        hf = json.loads(path.read_text())
        # The plan prices weights by --weight-bytes, whatever the checkpoint's storage: a quantization
        # the loader cannot read (compressed-tensors int4, …) still has a plan.
        cfg = ModelConfig.from_hf_dict({k: v for k, v in hf.items() if k != "quantization_config"})
    except (OSError, json.JSONDecodeError, ModelError) as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None
    p = plan(cfg, gpus=gpus, gpu_mem_gib=gpu_mem, rank=rank, tp=tp, ep=ep, weight_bytes=weight_bytes,
             kv_fraction=kv_fraction, context=context, host_mem_gib=host_mem)
    typer.echo(json.dumps(plan_dict(p)) if as_json else render(p, rank, context))
