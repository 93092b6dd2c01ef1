"""Multi-head Latent Attention benchmarks (a script, not a test). Final stdout line: a JSON summary.

1. KV bytes per token, all layers, bf16: MLA's latent cache (kv_lora_rank + rope key per token and
   layer; V3.2 adds the indexer key) vs caching the expanded per-head K/V, for DeepSeek-V3's real
   dimensions (and V3.2, Kimi-K2), and how many 8k-token sequences a fixed 64 GiB KV budget holds.
2. Decode step on a tiny-but-wide random DeepSeek-V3 (built in code): the absorbed latent decode vs
   the naive path that expands every cached latent through kv_b_proj each step, B rows over a
   --context-token cache, with a kv_b_proj LoRA active on half the rows.

    python -m benchmarks.mla [--context 1024] [--rows 8] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import median_seconds
from mint_server.model.config import ModelConfig
from mint_server.model.deepseek import DeepseekTransformer, MLAttention
from mint_server.model.kv_cache import CacheView, KVCache
from mint_server.model.lora import LoraBank
from mint_server.model.plan import kv_elems_per_token

CONFIGS = Path(__file__).resolve().parent.parent / "docs" / "configs"
V3 = {  # DeepSeek-V3's attention dims (the MoE does not change the KV cache)
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
}
WIDE = {  # tiny-but-wide: V3's per-head shape at 1/4 the heads, 2 layers, few experts
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 512, "hidden_size": 1024, "intermediate_size": 1024,
    "moe_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 32, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 512,
    "q_lora_rank": 384, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "max_position_embeddings": 8192,
}


def kv_table(budget_gib: float = 64.0, context: int = 8192) -> dict:
    out = {}
    named = {"deepseek-v3": V3, **{p.stem: json.loads(p.read_text()) for p in sorted(CONFIGS.glob("*.json"))}}
    for name, hf in named.items():
        cfg = ModelConfig.from_hf_dict(hf)
        latent, full = kv_elems_per_token(cfg)
        if latent is None:  # not an MLA base (docs/configs also holds gpt-oss)
            continue
        lb, fb = latent * cfg.num_layers * 2, full * cfg.num_layers * 2
        budget = int(budget_gib * 2**30)
        out[name] = {"latent_bytes_per_token": lb, "full_bytes_per_token": fb, "ratio": round(fb / lb, 2),
                     f"seqs_{context}_in_{budget_gib:g}GiB_latent": budget // (lb * context),
                     f"seqs_{context}_in_{budget_gib:g}GiB_full": budget // (fb * context)}
    return out


def decode_bench(context: int, rows: int, repeats: int, device: str) -> dict:
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf_dict(WIDE)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = DeepseekTransformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model = model.to(dtype).eval()
    bank = LoraBank(cfg, num_slots=2, max_rank=16, device=device, dtype=dtype)
    A, B = bank.A["kv_b_proj"], bank.B["kv_b_proj"]
    w = {"kv_b_proj": (torch.randn(A.shape[1:-2] + (16, A.shape[-1])) * 0.02,
                       torch.randn(B.shape[1:-1] + (16,)) * 0.02)}
    bank.write(0, w, 16, 32.0)
    lora = bank.batch([0 if i % 2 == 0 else -1 for i in range(rows)])
    bs = 16
    n_blocks = -(-(context + 1) // bs)
    cache = KVCache(cfg, 1 + rows * n_blocks, bs, device, dtype)
    table = torch.arange(1, 1 + rows * n_blocks, device=device).view(rows, n_blocks)
    tokens = torch.randint(0, cfg.vocab_size, (rows, context), device=device)
    pos = torch.arange(context, device=device).expand(rows, context)
    with torch.no_grad():
        for start in range(0, context, 256):  # prefill in chunks
            p = pos[:, start : start + 256]
            model(tokens[:, start : start + 256], p, lora, CacheView(cache, table, p))
    step_pos = torch.full((rows, 1), context, device=device)
    tok = tokens[:, -1:]

    def step() -> None:
        with torch.no_grad():
            model(tok, step_pos, lora, CacheView(cache, table, step_pos))
        if device != "cpu":
            torch.cuda.synchronize()

    out = {}
    for absorb in (True, False):
        MLAttention.absorb = absorb
        out["absorbed_s" if absorb else "naive_s"] = median_seconds(step, repeats=repeats, warmup=2)
    MLAttention.absorb = True
    out["naive_over_absorbed"] = round(out["naive_s"] / out["absorbed_s"], 2)
    out.update(rows=rows, context=context, heads=cfg.num_heads, kv_lora_rank=cfg.mla.kv_lora_rank, device=device,
               cache_mib=round(cache.nbytes / 2**20, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    table = kv_table()
    for name, row in table.items():
        print(f"{name:<16} latent {row['latent_bytes_per_token']:>9,} B/token  full {row['full_bytes_per_token']:>11,} "
              f"B/token  ({row['ratio']}x)  8k-token sequences in 64 GiB: "
              f"{row['seqs_8192_in_64GiB_latent']:,} vs {row['seqs_8192_in_64GiB_full']:,}")
    dec = decode_bench(args.context, args.rows, args.repeats, args.device)
    print(f"decode step, {dec['rows']} rows x {dec['context']} cached tokens, {dec['heads']} heads: absorbed "
          f"{dec['absorbed_s'] * 1e3:.1f} ms vs naive {dec['naive_s'] * 1e3:.1f} ms ({dec['naive_over_absorbed']}x)")
    print(json.dumps({"kv": table, "decode": dec}))


if __name__ == "__main__":
    main()
