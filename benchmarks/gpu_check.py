"""The prepared GPU check (benchmarks/gpu.sh): one table, then exit; no network.

Random-weight checkpoints in SmolLM2-135M and Qwen3-1.7B shapes are made on the spot. For each: the
decode step at 1, 8 and 64 adapters (rank 32) eager vs compiled (on CUDA: inductor's Triton kernels
replayed as CUDA graphs, one per row bucket) against the memory floor, and a 4K-token prefill against
its FLOP floor; then the training rows (issue: training at the machine's limit): one LoRA step
(r16 on every target, 8 × 256 tokens) ours vs transformers + PEFT on the same batch, and 4 policies'
steps fused in one pass vs one after another, with peak device memory. `--tiny` runs the same logic
on a tiny config (CPU, CI).

    python -m benchmarks.gpu_check [--tiny] [--shapes smollm2 qwen3-1.7b]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine_floors
from benchmarks.compiled import decode_table

SHAPES = {  # transformers config fields of each shape (random weights)
    "smollm2": dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "qwen3-1.7b": dict(arch="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "tiny": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, tie_word_embeddings=True),
}


def make_checkpoint(shape: str, dest: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    fields = dict(SHAPES[shape])
    arch = fields.pop("arch")
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    model = model_cls(config_cls(**fields, max_position_embeddings=8192))
    model.save_pretrained(dest)
    return dest


def prefill_row(model_dir: Path, device: str, dtype: torch.dtype, tokens: int) -> str:
    """A `tokens`-token prompt's prefill (eager, one chunk) against its FLOP floor."""
    from mint_server.engine.executor import Executor, StepBatch
    from mint_server.model.loader import load_model

    model = load_model(model_dir, device=device, dtype=dtype)
    cfg = model.config
    from mint_server.model.lora import LoraBank

    bank = LoraBank(cfg, 1, 8, device, dtype)
    blocks = -(-tokens // 16) + 1
    ex = Executor(model, bank, torch.device(device), num_blocks=blocks + 1, block_size=16)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    batch = StepBatch(list(range(1, tokens + 1)), list(range(tokens)), [tokens], [-1], [list(range(1, blocks + 1))], [0])
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        ex.step(batch)
        sync()
        times.append(time.perf_counter() - t0)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "norm" not in n)
    flops = 2 * tokens * params + 2 * tokens * tokens * cfg.num_layers * cfg.num_heads * cfg.head_dim
    floor = flops / machine_floors(device)["matmul_flop_per_s"]
    t = statistics.median(times[1:])
    return f"| {tokens}-token prefill | {t * 1e3:.1f} ms | floor {floor * 1e3:.1f} ms | {t / floor:.2f}x |"


def training_rows(model_dir: Path, device: str, dtype: torch.dtype, tiny: bool) -> list[str]:
    """Markdown rows: our LoRA training step vs PEFT's on the same batch; 4 policies fused vs in turn.
    The workers are benchmarks/train.py's, run in this process one after another (peak memory is
    reset between them on CUDA; on CPU it is not measured here)."""
    from benchmarks import train
    from mint_server.engine.settings import EngineSettings

    args = argparse.Namespace(model_dir=str(model_dir), device=device, dtype=str(dtype).removeprefix("torch."),
                              rows=8, seq=16 if tiny else 256, rank=4 if tiny else 16, adapters=4,
                              warmup=1 if tiny else 2, steps=2 if tiny else 5, checkpoint_from_tokens=0,
                              logits_chunk_mb=EngineSettings.logits_chunk_mb, variant="ours", compile="off")
    cuda = device.startswith("cuda")

    def measure(variant: str) -> tuple[float, float]:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        step = train.peft_step(args) if variant == "peft" else \
            train.worker_ours(argparse.Namespace(**vars(args) | {"variant": variant}), build_only=True)
        t = statistics.median(train.timed(step, args)["step_s"])
        return t, (torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan"))

    (ours, ours_mb), (peft, peft_mb) = measure("ours"), measure("peft")
    (fused, fused_mb), (seq, seq_mb) = measure("fused"), measure("sequential")
    tokens = args.rows * args.seq
    return [f"| training step, {args.rows} × {args.seq} tokens, r{args.rank} | ours {ours * 1e3:.1f} ms "
            f"({tokens / ours:.0f} tok/s, {ours_mb:.0f} MB peak) | PEFT {peft * 1e3:.1f} ms ({peft_mb:.0f} MB) "
            f"| {peft / ours:.2f}x PEFT |",
            f"| {args.adapters} policies fused vs in turn | fused {fused * 1e3:.1f} ms ({fused_mb:.0f} MB) "
            f"| in turn {seq * 1e3:.1f} ms ({seq_mb:.0f} MB) | {seq / fused:.2f}x faster, "
            f"{fused_mb / seq_mb:.2f}x peak |"]  # nan on CPU (not measured here)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the logic at tiny size (CPU)")
    ap.add_argument("--shapes", nargs="+", default=["smollm2", "qwen3-1.7b"])
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = ["tiny"] if args.tiny else args.shapes
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}, {dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            d = make_checkpoint(shape, Path(tmp) / shape)
            print(f"## {shape}")
            rows = [1, 2] if args.tiny else [1, 8, 64]
            print("\n".join(decode_table(d, device, dtype, rows, 4 if args.tiny else 32, 32 if args.tiny else 512,
                                         3 if args.tiny else 10)))
            print(prefill_row(d, device, dtype, 64 if args.tiny else 4096))
            print("\n".join(training_rows(d, device, dtype, args.tiny)))


if __name__ == "__main__":
    main()
