"""Mixture-of-experts LoRA benchmarks (a script, not a test). Final stdout line: a JSON summary.

1. Load: one adapter with Qwen3-30B-A3B shapes (hidden 2048, 128 experts, expert intermediate
   768, 32×128 query / 4×128 KV heads, vocab 151936; rank 4 on attention, every expert's
   gate/up/down and lm_head; --layers of the 48, reduced to fit memory) read from a PEFT dir into
   a device LoRA bank slot (load_peft + LoraBank.write, synchronised): packed layout (one
   [E, r, in] / [E, out, r] pair per projection per layer) vs per-expert tensors. Wall-time ratio.
   Both files are read warm from the page cache, so the ratio is the per-tensor overhead, not disk.
2. Throughput on a tiny-but-wide random MoE (built in code): a decode step of 8 rows that use 8
   different adapters vs 8 rows on one adapter (the sampler, greedy, after a short prefill), and a
   fused training pass (one Trainer.run over 8 adapters' requests, 8 rows × 64 tokens) vs the same
   rows on one adapter.
3. Bytes per adapter (attention + experts + lm_head, all layers) for Qwen3-30B-A3B and a
   Kimi-K2-class config at ranks 1, 8, 32 — the table in docs/moe.md.
4. Grouped (`--only grouped`): one sparse MoE layer with expert LoRA (rank --rank on every expert's
   gate/up/down), forward + backward (the LoRA weights' and the input's gradients), its segments
   through torch._grouped_mm ("grouped") vs one matmul per segment ("loop"), the same tokens on one
   adapter vs spread over 8 fused adapters; on a tiny-but-wide layer (the throughput model's: hidden
   512, 64 experts of 256, top-8, 512 tokens) and a Qwen3-30B-A3B-shaped one (hidden 2048, 128
   experts of 768, top-8, --tokens tokens). Where the grouped kernel runs and the adapters are few
   (lora.EXPERT_WIDE_FLOPS: the Qwen3-30B-A3B layer at rank 16), the 8 adapters' A/B of an expert go
   side by side in one group instead of 8 segments. Imports only mint_server.model (runs where the server's
   dependencies are not installed).

    python -m benchmarks.moe [--layers 8] [--repeats 5] [--device cpu]
    python -m benchmarks.moe --only grouped --device cuda --dtype bfloat16 [--tokens 4096] [--repeats 20] [--shape tiny]
    python -m benchmarks.moe --only grouped --keep-freed-memory   # CPU, as a server with that flag runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from mint_server.model.config import ModelConfig

QWEN3_30B_A3B = dict(
    architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
    num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
    tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True,
)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_of(fn, repeats: int, device: str) -> float:
    fn()  # warm-up (and page cache)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- 1. load ----------------------------------------------------------------------------------------


def bench_load(layers: int, repeats: int, device: str) -> dict:
    from safetensors import safe_open

    from mint_server.model.lora import LoraBank, init_lora_weights, select_targets
    from mint_server.model.peft_io import LoraWeights, load_peft, save_peft

    cfg = ModelConfig(**{**QWEN3_30B_A3B, "num_layers": layers})
    bank = LoraBank(cfg, num_slots=1, max_rank=4, device=device, dtype=torch.float32)
    weights = init_lora_weights(bank.shapes, select_targets(), 4, seed=0, dtype=torch.float32, experts=bank.experts)
    weights = {t: (a, torch.randn_like(b) * 0.01) for t, (a, b) in weights.items()}
    adapter = LoraWeights(weights, rank=4, alpha=32.0)
    out: dict = {"layers": layers, "rank": 4}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in ("packed", "per-expert"):
            d = Path(tmp) / layout
            save_peft(adapter, d, base_model="qwen3-30b-a3b-shapes", cfg=cfg, moe_layout=layout)
            with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
                n = len(list(f.keys()))
            size = (d / "adapter_model.safetensors").stat().st_size

            def load(d: Path = d) -> None:
                w = load_peft(d, cfg)
                bank.write(0, {t: (a.to(device), b.to(device)) for t, (a, b) in w.weights.items()}, w.rank, w.alpha)

            out[layout] = {"tensors": n, "bytes": size, "seconds": median_of(load, repeats, device)}
            print(f"load {layout:>10}: {n:6d} tensors, {size / 2**20:7.1f} MiB, "
                  f"{out[layout]['seconds'] * 1e3:8.1f} ms (median of {repeats})", flush=True)
        # The floor of a load: the file's bytes out of the page cache once (mapped, as safetensors
        # reads them, and every page touched), and one copy into the slot.
        packed_file = Path(tmp) / "packed" / "adapter_model.safetensors"
        size = packed_file.stat().st_size

        def read_mapped() -> None:
            torch.from_file(str(packed_file), shared=True, size=size // 4, dtype=torch.float32).sum()

        out["read_s"] = median_of(read_mapped, repeats, "cpu")
        src, dst = torch.empty(size // 4), torch.empty(size // 4)
        out["copy_s"] = median_of(partial(dst.copy_, src), repeats, "cpu")
    out["ratio"] = out["per-expert"]["seconds"] / out["packed"]["seconds"]
    out["packed_over_floor"] = out["packed"]["seconds"] / (out["read_s"] + out["copy_s"])
    print(f"load: packed is {out['ratio']:.2f}x faster than per-expert (MinT: 8.5-8.7x); floor: the file mapped "
          f"from the page cache {out['read_s'] * 1e3:.1f} ms ({size / out['read_s'] / 1e9:.2f} GB/s) + one copy "
          f"{out['copy_s'] * 1e3:.1f} ms; packed load = {out['packed_over_floor']:.2f}x that floor", flush=True)
    return out


# --- 2. throughput ----------------------------------------------------------------------------------


def wide_moe(device: str) -> torch.nn.Module:
    from mint_server.model.transformer import Transformer, rope_inv_freq

    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4,
        num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_ids=(), num_experts=64, num_experts_per_tok=8,
        moe_intermediate_size=256, norm_topk_prob=True,
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.05)
    model.inv_freq = rope_inv_freq(cfg)
    return model.to(device).requires_grad_(False).eval()


def bench_throughput(device: str, repeats: int) -> dict:
    from tinker import types

    from mint_server.engine.records import SamplingRecords

    # the unit-test harness: the engine's parser in front of the trainer and sampler
    from tests.engine.helpers import AdapterRegistry, TrainRequest
    from tests.engine.helpers import SamplerHarness as Sampler
    from tests.engine.helpers import TrainerHarness as Trainer

    model = wide_moe(device)
    cfg = model.config
    residency = AdapterRegistry(cfg, num_slots=8, max_rank=8, device=device, dtype=torch.float32)
    trainer = Trainer(model, residency, base_model="wide-moe")
    ids = [trainer.create_adapter(types.LoraConfig(rank=8, seed=i)) for i in range(8)]
    for aid in ids:  # nonzero B, so every adapter's expert LoRA does real work
        w = residency.weights(aid)
        residency.set_weights(aid, type(w)({t: (a, torch.randn_like(b) * 0.01) for t, (a, b) in w.weights.items()},
                                          w.rank, w.alpha))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (16,), generator=g).tolist() for _ in range(8)]
    new_tokens = 16

    def decode(adapters: list[str]) -> float:
        s = Sampler(model, residency, kv_slots=8, max_seq_len=64, block_size=16, records=SamplingRecords())
        p = types.SamplingParams(stop=[], max_tokens=new_tokens, temperature=0.0)
        for a, pr in zip(adapters, prompts, strict=True):
            s.submit(a, pr, 1, p)
        s.step()  # the prefill
        sync(device)
        t0 = time.perf_counter()
        while s.has_work():
            s.step()
        sync(device)
        return (time.perf_counter() - t0) / (new_tokens - 1)

    out: dict = {}
    for name, adapters in (("single", [ids[0]] * 8), ("mixed8", ids)):
        decode(adapters)
        out[f"decode_{name}_s"] = statistics.median(decode(adapters) for _ in range(repeats))
    out["decode_mixed_over_single"] = out["decode_mixed8_s"] / out["decode_single_s"]
    print(f"decode step, 8 rows: one adapter {out['decode_single_s'] * 1e3:.1f} ms, 8 adapters "
          f"{out['decode_mixed8_s'] * 1e3:.1f} ms ({out['decode_mixed_over_single']:.2f}x)", flush=True)

    def datums(seed: int, n: int) -> list:
        gg = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            seq = torch.randint(0, cfg.vocab_size, (65,), generator=gg)
            out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                                   loss_fn_inputs={"target_tokens": seq[1:], "weights": torch.ones(64)}))
        return out

    fused = [TrainRequest(a, datums(i, 1), "cross_entropy") for i, a in enumerate(ids)]
    single = [TrainRequest(ids[0], [d for r in fused for d in r.datums], "cross_entropy")]
    for name, reqs in (("single", single), ("fused8", fused)):
        out[f"train_{name}_s"] = median_of(lambda reqs=reqs: trainer.run(reqs), repeats, device)
    for aid in ids:
        residency.get(aid).grads.clear()
    out["train_fused_over_single"] = out["train_fused8_s"] / out["train_single_s"]
    print(f"training pass, 8 rows x 64 tokens: one adapter {out['train_single_s']:.2f} s, 8 adapters fused "
          f"{out['train_fused8_s']:.2f} s ({out['train_fused_over_single']:.2f}x)", flush=True)
    return out


# --- 4. grouped vs per-segment products ---------------------------------------------------------

GROUPED_SHAPES = {  # hidden, expert intermediate, experts, top-k, tokens (None: --tokens)
    "tiny": (512, 256, 64, 8, 512),
    "qwen3-30b-a3b": (2048, 768, 128, 8, None),
}


def moe_layer(hidden: int, inter: int, experts: int, top_k: int, device: str, dtype: torch.dtype):
    from mint_server.model.moe import SparseMoE

    cfg = ModelConfig(**{**QWEN3_30B_A3B, "hidden_size": hidden, "num_layers": 1, "num_experts": experts,
                         "num_experts_per_tok": top_k, "moe_intermediate_size": inter})
    torch.manual_seed(0)
    layer = SparseMoE(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, hidden**-0.5)
    return layer.to(device, dtype).requires_grad_(False)


def expert_lora(layer, rows: list[int], rank: int, device: str, dtype: torch.dtype):
    """A LoraBatch over max(rows) + 1 adapters, trainable A/B (nonzero B) on every expert projection."""
    from mint_server.model.lora import EXPERT_PREFIX, LoraBatch

    n, E = max(rows) + 1, layer.num_experts
    g = torch.Generator().manual_seed(n)
    weights = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        fan_out, fan_in = getattr(layer.experts, name).shape[1:]
        A = torch.randn(n, 1, E, rank, fan_in, generator=g) * fan_in**-0.5
        B = torch.randn(n, 1, E, fan_out, rank, generator=g) * 0.01
        weights[EXPERT_PREFIX + name] = (A.to(device, dtype).requires_grad_(), B.to(device, dtype).requires_grad_())
    return LoraBatch(weights, torch.tensor(rows, device=device), torch.full((n,), 2.0, device=device))


def train_step(layer, x: torch.Tensor, dy: torch.Tensor, batch) -> None:
    """Forward and backward to the input and every LoRA weight (no accumulation into .grad)."""
    torch.autograd.grad(layer(x, batch), [x, *(t for ab in batch.weights.values() for t in ab)], dy)


def bench_grouped(device: str, dtype: torch.dtype, repeats: int, tokens: int, rank: int, shapes: list[str]) -> dict:
    from mint_server.model import kernels
    from mint_server.model import lora as lora_mod

    rows = 8
    lora_mod.EXPERT_GATHER_LIMIT = 0  # the segments path at every size (training's, at real sizes)
    out: dict = {"dtype": str(dtype).removeprefix("torch."), "rank": rank}
    for shape in shapes:
        hidden, inter, experts, top_k, n_tokens = GROUPED_SHAPES[shape]
        n_tokens = n_tokens or tokens
        layer = moe_layer(hidden, inter, experts, top_k, device, dtype)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(rows, n_tokens // rows, hidden, generator=g).to(device, dtype).requires_grad_()
        dy = torch.randn(rows, n_tokens // rows, hidden, generator=g).to(device, dtype)
        batches = {"single": expert_lora(layer, [0] * rows, rank, device, dtype),
                   "fused8": expert_lora(layer, list(range(rows)), rank, device, dtype)}
        pairs = rows * (n_tokens // rows) * top_k
        # base: forward and the input gradient (the experts are frozen), 3 projections of 2·in·out per pair
        flops = 3 * 2 * 3 * pairs * hidden * inter
        res: dict = {"tokens": rows * (n_tokens // rows), "base_gflop": flops / 1e9}
        for path, devices in (("grouped", [torch.device(device).type]), ("loop", [])):
            with kernels.use_grouped_devices(devices):
                for name, batch in batches.items():
                    res[f"{path}_{name}_s"] = median_of(partial(train_step, layer, x, dy, batch), repeats, device)
            res[f"{path}_fused8_over_single"] = res[f"{path}_fused8_s"] / res[f"{path}_single_s"]
            print(f"grouped {shape:>13} {path:>7}: one adapter {res[f'{path}_single_s'] * 1e3:9.2f} ms "
                  f"({flops / res[f'{path}_single_s'] / 1e12:.2f} base TFLOP/s), 8 fused "
                  f"{res[f'{path}_fused8_s'] * 1e3:9.2f} ms: 8 fused / 1 = {res[f'{path}_fused8_over_single']:.2f}x",
                  flush=True)
        for name in batches:
            res[f"grouped_over_loop_{name}"] = res[f"grouped_{name}_s"] / res[f"loop_{name}_s"]
        print(f"grouped {shape:>13}: grouped / loop = {res['grouped_over_loop_single']:.2f}x (one adapter), "
              f"{res['grouped_over_loop_fused8']:.2f}x (8 fused)", flush=True)
        out[shape] = res
    return out


# --- 3. bytes per adapter ---------------------------------------------------------------------------


def params_per_rank(cfg: dict) -> dict[str, int]:
    """LoRA parameters per unit of rank: r·(in + out) per projection, summed."""
    layers, h = cfg["layers"], cfg["hidden"]
    attn = layers * sum(i + o for i, o in cfg["attn"])
    sparse = layers - cfg["dense_layers"]
    experts = sparse * cfg["experts"] * 3 * (h + cfg["expert_inter"])
    shared = sparse * cfg.get("shared_experts", 0) * 3 * (h + cfg["expert_inter"])
    dense = cfg["dense_layers"] * 3 * (h + cfg["dense_inter"])
    unembed = h + cfg["vocab"]
    return {"attention": attn, "experts": experts, "other": shared + dense + unembed,
            "total": attn + experts + shared + dense + unembed}


CONFIGS = {
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, vocab=151936, experts=128, expert_inter=768, dense_layers=0,
                          dense_inter=6144, attn=[(2048, 4096), (2048, 512), (2048, 512), (4096, 2048)]),
    # Kimi-K2 / DeepSeek-V3 shapes: 61 layers (first dense), 384 routed + 1 shared expert, MLA attention
    "Kimi-K2-class": dict(layers=61, hidden=7168, vocab=163840, experts=384, shared_experts=1, expert_inter=2048,
                          dense_layers=1, dense_inter=18432,
                          attn=[(7168, 1536), (1536, 64 * 192), (7168, 512 + 64), (512, 64 * 256), (64 * 128, 7168)]),
}


def bytes_table() -> dict:
    rows = {}
    for name, cfg in CONFIGS.items():
        p = params_per_rank(cfg)
        rows[name] = {"params_per_rank": p, **{f"r{r}_bf16_bytes": 2 * r * p["total"] for r in (1, 8, 32)}}
        print(f"{name}: {p['total']:,} LoRA params per rank ({p['experts'] / p['total']:.1%} experts); "
              + ", ".join(f"r={r}: {2 * r * p['total'] / 1e9:.2f} GB bf16" for r in (1, 8, 32)), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8, help="layers of Qwen3-30B-A3B's 48 in the load benchmark")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--only", choices=("grouped",), help="run only this benchmark")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the grouped benchmark's")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens through the Qwen3-30B-A3B-shaped layer (grouped)")
    ap.add_argument("--rank", type=int, default=16, help="expert LoRA rank (grouped)")
    ap.add_argument("--shape", action="append", choices=tuple(GROUPED_SHAPES), help="the grouped layers (default: all)")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="CPU: keep freed host memory for reuse, as `mint serve --keep-freed-memory` does "
                         "(without it a fused pass's bigger blocks page-fault anew every step)")
    args = ap.parse_args()
    summary: dict = {"device": args.device}
    if args.keep_freed_memory:
        from mint_server.engine.host_memory import keep_freed_memory  # stdlib only, like mint_server.model

        summary["keep_freed_memory"] = keep_freed_memory()
    if args.only is None:
        summary["bytes_per_adapter"] = bytes_table()
        summary["load"] = bench_load(args.layers, args.repeats, args.device)
        if not args.skip_throughput:
            summary["throughput"] = bench_throughput(args.device, args.repeats)
    if args.only in (None, "grouped"):
        summary["grouped"] = bench_grouped(args.device, getattr(torch, args.dtype), args.repeats, args.tokens,
                                           args.rank, args.shape or list(GROUPED_SHAPES))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
