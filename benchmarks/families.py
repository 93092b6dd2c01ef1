"""Per-family throughput on the tiny test configs, ours vs transformers + PEFT, side by side in one run
(a script, not a test): catches a family that is accidentally slow. Final stdout line: a JSON summary.

For each family (the tiny random checkpoints the tests build: llama, qwen3, qwen3_moe, deepseek_v3,
deepseek_v32, gpt_oss, glm_moe_dsa), one adapter of rank --rank with nonzero A and B:
- train: tokens/s of one forward + backward (cross-entropy over every position, gradients of the
  LoRA weights only) on --rows × --seq tokens. Ours: the model with the LoRA bank's batch, LoRA on
  every target; transformers: a PeftModel with LoRA on the attention projections, lm_head, dense
  MLPs of dense families and the experts (PEFT `target_parameters` on transformers' fused expert
  stacks). DeepSeek-style bases' dense MLPs and shared experts are left out on the PEFT side (its
  transformers-5 MoE conversion remaps those names onto the routed experts), so ours does a little
  more LoRA work there.
- decode: generated tokens/s of --rows greedy sequences, a --prompt-token prefill then --decode new
  tokens each. Ours: the sampler's model runner (`engine.executor.Executor` over the paged KV cache:
  one ragged step per token, or per segment kind on MLA bases); transformers: `generate` with its
  dynamic cache (eager attention, as the oracle runs).
Both in float32 on the same device, timed as medians of --repeats after a warm-up, the four
measurements' runs interleaved so a shared machine's load falls on all alike. The machine's read
bandwidth / matmul peak and its load average are printed with them (a shared box inflates both).

    python -m benchmarks.families [--families gpt_oss,glm_moe_dsa] [--rows 4] [--seq 64] [--decode 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import load_average, machine_floors

FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32", "gpt_oss", "glm_moe_dsa")
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MLA_MODULES = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "lm_head"]
ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
# family → (PEFT target_modules, target_parameters)
PEFT_TARGETS: dict[str, tuple[list[str], list[str]]] = {
    "llama": (ATTN_MODULES + ["gate_proj", "up_proj", "down_proj"], []),
    "qwen3": (ATTN_MODULES + ["gate_proj", "up_proj", "down_proj"], []),
    "qwen3_moe": (ATTN_MODULES, EXPERT_PARAMS),
    "deepseek_v3": (MLA_MODULES, EXPERT_PARAMS),
    "deepseek_v32": (MLA_MODULES, EXPERT_PARAMS),
    "gpt_oss": (ATTN_MODULES, EXPERT_PARAMS),
    "glm_moe_dsa": (MLA_MODULES, EXPERT_PARAMS),
}


def build(family: str, dest: Path) -> Path:
    """The tests' tiny random checkpoint of `family` (untied embeddings, so lm_head has its own LoRA)."""
    from tests.families.tiny_families import make_tiny_glm, make_tiny_gpt_oss
    from tests.mla.tiny_deepseek import make_tiny_deepseek
    from tests.tiny import make_tiny_checkpoint

    if family in ("llama", "qwen3", "qwen3_moe"):
        return make_tiny_checkpoint(dest, family, tie=False)
    if family in ("deepseek_v3", "deepseek_v32"):
        return make_tiny_deepseek(dest, "v3" if family == "deepseek_v3" else "v32")
    return (make_tiny_gpt_oss if family == "gpt_oss" else make_tiny_glm)(dest)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, device: str) -> dict[str, float]:
    """Median seconds of each fn, their runs interleaved (a, b, c, a, b, c, …) so that a shared machine's
    load falls on all of them alike; one warm-up run each first."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats + 1):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if i:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def ours(model_dir: Path, args: argparse.Namespace, tokens: torch.Tensor) -> dict[str, Callable[[], None]]:
    from mint_server.engine.executor import Executor, StepBatch
    from mint_server.model.loader import load_model
    from mint_server.model.lora import LoraBank, init_lora_weights, select_targets

    dev = args.device
    model = load_model(model_dir, device=dev, dtype=torch.float32)
    cfg = model.config
    bank = LoraBank(cfg, num_slots=1, max_rank=args.rank, device=dev, dtype=torch.float32)
    w = init_lora_weights(bank.shapes, select_targets(), args.rank, seed=0, dtype=torch.float32, experts=bank.experts)
    bank.write(0, {t: (a.to(dev), torch.randn_like(b).to(dev) * 0.01) for t, (a, b) in w.items()}, args.rank, 32.0)
    rows, seq = tokens.shape
    params = [*bank.A.values(), *bank.B.values()]

    def train() -> None:
        for p in params:
            p.requires_grad_(True)
        lora = bank.batch([0] * rows)
        logits = model(tokens, lora=lora)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        torch.autograd.grad(loss, params, allow_unused=True)
        for p in params:
            p.requires_grad_(False)

    block, prompt = 16, tokens[:, : args.prompt].tolist()
    per_row = -(-(args.prompt + args.decode) // block)
    executor = Executor(model, bank, torch.device(dev), num_blocks=1 + rows * per_row, block_size=block)
    tables = [[1 + r * per_row + i for i in range(per_row)] for r in range(rows)]

    def decode() -> None:
        step = StepBatch(tokens=[t for p in prompt for t in p], positions=[i for p in prompt for i in range(len(p))],
                         lengths=[len(p) for p in prompt], slots=[0] * rows, tables=tables, logits_at=list(range(rows)))
        nxt = executor.step(step).logits.argmax(-1).tolist()
        for i in range(args.decode - 1):
            step = StepBatch(tokens=nxt, positions=[args.prompt + i] * rows, lengths=[1] * rows, slots=[0] * rows,
                             tables=tables, logits_at=list(range(rows)))
            nxt = executor.step(step).logits.argmax(-1).tolist()

    return {"train": train, "decode": decode}


def transformers_peft(model_dir: Path, family: str, args: argparse.Namespace,
                      tokens: torch.Tensor) -> dict[str, Callable[[], None]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dev = args.device
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    modules, parameters = PEFT_TARGETS[family]
    peft = get_peft_model(hf, LoraConfig(r=args.rank, lora_alpha=32, target_modules=modules,
                                         target_parameters=parameters or None))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    params = [p for n, p in peft.named_parameters() if "lora_" in n]
    rows = tokens.shape[0]

    def train() -> None:
        loss = peft(input_ids=tokens, labels=tokens).loss
        torch.autograd.grad(loss, params, allow_unused=True)

    prompt = tokens[:, : args.prompt]
    mask = torch.ones_like(prompt)

    def decode() -> None:
        with torch.no_grad():
            out = peft.generate(input_ids=prompt, attention_mask=mask, do_sample=False, max_new_tokens=args.decode,
                                min_new_tokens=args.decode, pad_token_id=0)
        assert out.shape == (rows, args.prompt + args.decode)

    return {"train": train, "decode": decode}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64, help="tokens per training row")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode", type=int, default=16, help="new tokens per sequence")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads for torch (0: its default). Use 1 on a loaded shared box: a multi-threaded op "
                         "there waits ~0.1 s whenever one of its threads is descheduled")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    families = [f for f in args.families.split(",") if f]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        ap.error(f"--families: unknown {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    torch.manual_seed(0)
    floors = machine_floors(args.device)
    results: dict = {}
    print(f"{'family':<14} {'train tok/s ours':>17} {'transformers+PEFT':>18} {'ratio':>6}   "
          f"{'decode tok/s ours':>17} {'transformers+PEFT':>18} {'ratio':>6}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            model_dir = build(family, Path(tmp) / family)
            tokens = torch.randint(3, 320, (args.rows, args.seq), device=args.device)
            a, b = ours(model_dir, args, tokens), transformers_peft(model_dir, family, args, tokens)
            t = interleaved({"ours_train": a["train"], "hf_train": b["train"], "ours_decode": a["decode"],
                             "hf_decode": b["decode"]}, args.repeats, args.device)
            train_tok, decode_tok = args.rows * args.seq, args.rows * args.decode
            row = {"ours_train_tok_s": train_tok / t["ours_train"], "hf_train_tok_s": train_tok / t["hf_train"],
                   "ours_decode_tok_s": decode_tok / t["ours_decode"], "hf_decode_tok_s": decode_tok / t["hf_decode"]}
            row["train_ratio"] = row["ours_train_tok_s"] / row["hf_train_tok_s"]
            row["decode_ratio"] = row["ours_decode_tok_s"] / row["hf_decode_tok_s"]
            results[family] = {k: round(v, 2) for k, v in row.items()}
            print(f"{family:<14} {row['ours_train_tok_s']:>17,.0f} {row['hf_train_tok_s']:>18,.0f} "
                  f"{row['train_ratio']:>5.2f}x   {row['ours_decode_tok_s']:>17,.0f} {row['hf_decode_tok_s']:>18,.0f} "
                  f"{row['decode_ratio']:>5.2f}x", flush=True)
    summary = {"families": results, "rows": args.rows, "seq": args.seq, "prompt": args.prompt, "decode": args.decode,
               "rank": args.rank, "repeats": args.repeats, "device": args.device, "threads": torch.get_num_threads(),
               "load_average": load_average(),
               "read_gb_s": round(floors["read_bytes_per_s"] / 1e9, 2),
               "matmul_gflop_s": round(floors["matmul_flop_per_s"] / 1e9, 1), "time": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
