"""Tensor-parallel engine step time on CPU: TP=1 vs TP=2 on the same cores (a script, not a test).

A random Qwen3-style base (default hidden 768, 6 layers, 12 heads / 4 KV heads, intermediate
2048, vocab 16384: big enough that matmuls, not Python, dominate a step) is built in a temp dir.
Each variant is a real LocalEngine: TP=1 with --cores intra-op threads, TP=2 with --cores / 2
threads on each of its two ranks (gloo on loopback), so both use the same cores. Both engines live
side by side and their steps alternate, so both see the same load from other jobs. Measured,
medians after a warm-up:
  train: forward_backward + optim_step of one rank-16 adapter on ROWS × SEQ tokens;
  decode: greedy sampling of ROWS sequences × NEW tokens after a short prompt (seconds per token step).
On one machine TP only splits the work the same cores already shared, and adds a gloo all-reduce
(through loopback TCP) after every attention and MLP block plus the rank-0 → followers broadcast of
each op, so expect TP=2 to be *slower* here; what TP buys is memory per device (each rank holds
half of the base, the bank and the KV cache) and, on several GPUs, their summed compute and
bandwidth. The figures show what that overhead costs on this machine. Last stdout line: JSON.

--arch deepseek_v3: a DeepSeek-V3-style MLA base instead (hidden 768, 6 layers, 12 heads with V3's
per-head dims halved, kv_lora_rank 256, q_lora_rank 384, the first layer dense, 8 experts top-2 and a
shared expert). It also reports what rank 0 holds: its base weights and its KV cache per token (MLA's
latent is replicated on every rank, so this one does not shrink with TP; per-head K/V would).

    python benchmarks/tp.py [--arch qwen3|deepseek_v3] [--cores 2] [--steps 5] [--rows 4] [--seq 256] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_average  # noqa: E402


def build(dest: Path, hidden: int, layers: int, vocab: int, arch: str = "qwen3") -> Path:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from tests.tiny import save_tiny_tokenizer

    torch.manual_seed(0)
    if arch == "deepseek_v3":
        mla = DeepseekV3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                               moe_intermediate_size=hidden // 2, num_hidden_layers=layers, first_k_dense_replace=1,
                               num_attention_heads=hidden // 64, n_routed_experts=8, num_experts_per_tok=2,
                               n_group=1, topk_group=1, n_shared_experts=1, kv_lora_rank=256, q_lora_rank=384,
                               qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=2048,
                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        DeepseekV3ForCausalLM(mla).save_pretrained(dest)
        save_tiny_tokenizer(dest)
        return dest
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
                      head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Qwen3ForCausalLM(cfg).save_pretrained(dest)
    save_tiny_tokenizer(dest)
    return dest


class Variant:
    """One LocalEngine (TP = tp on `cores` cores) with a trained-on adapter and its two timed actions."""

    def __init__(self, model_dir: Path, tp: int, cores: int, args: argparse.Namespace) -> None:
        import torch
        from tinker import types

        from mint_server.engine.local import LocalEngine
        from mint_server.engine.settings import EngineSettings

        s = EngineSettings(device_slots=2, max_rank=16, kv_budget_tokens=8192, max_context=1024,
                           threads=max(1, cores // tp), tp=tp)
        self.e = e = LocalEngine(model_dir, "bench", device="cpu", dtype=torch.float32, settings=s)
        self.aid = e.create_adapter(types.LoraConfig(rank=16, seed=0)).result()
        g = torch.Generator().manual_seed(1)
        self.data = []
        for _ in range(args.rows):
            seq = torch.randint(3, 300, (args.seq + 1,), generator=g).tolist()
            self.data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                         loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * args.seq}))
        self.adam = types.AdamParams(learning_rate=1e-4)
        self.params = types.SamplingParams(max_tokens=args.new, temperature=0.0, stop=[])
        self.rows = args.rows
        self.times: dict[str, list[float]] = {"train_step_s": [], "decode_s": []}
        cache = e.sampler.cache
        self.memory = {"rank0_weights_bytes": sum(p.numel() * p.element_size() for p in e.model.parameters()),
                       "rank0_kv_bytes_per_token": cache.nbytes // (cache.num_blocks * cache.block_size)}

    def train(self) -> None:
        e = self.e
        e.submit(e.prepare_train(self.data, "cross_entropy", None).on(self.aid)).result()
        e.submit(e.prepare_optim(self.adam).on(self.aid)).result()

    def decode(self) -> None:
        e = self.e
        e.submit(e.prepare_sample(self.aid, [5, 9, 13, 40, 7, 11, 12, 14], self.rows, self.params)).result()

    def timed(self, name: str, fn: object) -> None:
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        self.times[name].append(time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=("qwen3", "deepseek_v3"), default="qwen3")
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16384)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model_dir = build(Path(d) / "model", args.hidden, args.layers, args.vocab, args.arch)
        load_before = load_average()
        variants = {f"tp{tp}": Variant(model_dir, tp, args.cores, args) for tp in (1, 2)}
        try:
            for v in variants.values():  # warm-up
                v.train()
                v.decode()
            for _ in range(args.steps):  # interleaved, so both see the same load from other jobs
                for v in variants.values():
                    v.timed("train_step_s", v.train)
                for v in variants.values():
                    v.timed("decode_s", v.decode)
        finally:
            for v in variants.values():
                v.e.shutdown()
        results = {name: {"train_step_s": statistics.median(v.times["train_step_s"]),
                          "decode_token_step_s": statistics.median(v.times["decode_s"]) / args.new, **v.memory}
                   for name, v in variants.items()}
    one, two = results["tp1"], results["tp2"]
    for tp, r in results.items():
        print(f"{tp}: train step {r['train_step_s'] * 1e3:8.1f} ms   decode token step "
              f"{r['decode_token_step_s'] * 1e3:7.2f} ms   ({args.rows} rows)   rank 0 holds "
              f"{r['rank0_weights_bytes'] / 2**20:.1f} MiB of weights, {r['rank0_kv_bytes_per_token']:,} B of KV per token")
    summary = {
        "arch": args.arch, "cores": args.cores, "rows": args.rows, "seq": args.seq, "new_tokens": args.new,
        "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
        **{f"{tp}_{k}": v for tp, r in results.items() for k, v in r.items()},
        "train_ratio_tp2_over_tp1": two["train_step_s"] / one["train_step_s"],
        "decode_ratio_tp2_over_tp1": two["decode_token_step_s"] / one["decode_token_step_s"],
        "load_average_before": load_before, "load_average_after": load_average(),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
