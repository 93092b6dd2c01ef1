"""Forward throughput on SmolLM2, batch 8 × 256: ours vs transformers, and mixed adapters vs one.

    python -m benchmarks.forward [--repeats 5]

Prints a table and a final JSON line. Ratios are measured side by side in one process.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import median_seconds, smollm2_dir
from mint_server.model.loader import load_model
from mint_server.model.lora import ALL_TARGETS, LoraBank, target_shapes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model_dir = smollm2_dir()
    ours = load_model(model_dir, device="cpu")
    cfg = ours.config
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    n_tok = args.batch * args.seq

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    bank = LoraBank(cfg, num_slots=args.batch, max_rank=args.rank, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for slot in range(args.batch):
        weights = {
            t: (torch.randn(L, args.rank, fi, generator=g) * 0.01, torch.randn(L, fo, args.rank, generator=g) * 0.01)
            for t, (L, fi, fo) in target_shapes(cfg).items() if t in ALL_TARGETS
        }
        bank.write(slot, weights, args.rank, 32.0)
    one = bank.batch([0] * args.batch)
    mixed = bank.batch(list(range(args.batch)))

    with torch.inference_mode():
        t_hf = median_seconds(lambda: hf(tokens).logits, args.repeats)
        t_base = median_seconds(lambda: ours(tokens), args.repeats)
        t_one = median_seconds(lambda: ours(tokens, lora=one), args.repeats)
        t_mixed = median_seconds(lambda: ours(tokens, lora=mixed), args.repeats)

    result = {
        "batch": args.batch, "seq": args.seq, "rank": args.rank, "threads": torch.get_num_threads(),
        "tok_s_transformers": n_tok / t_hf,
        "tok_s_ours_base": n_tok / t_base,
        "tok_s_ours_one_adapter": n_tok / t_one,
        "tok_s_ours_8_adapters": n_tok / t_mixed,
        "ratio_ours_vs_transformers": t_hf / t_base,
        "ratio_8_adapters_vs_one": t_one / t_mixed,
    }
    for k, v in result.items():
        print(f"{k:32s} {v:,.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
