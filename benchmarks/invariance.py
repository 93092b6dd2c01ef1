"""Batch-invariant mode: what it costs and what it removes, side by side in one run (SmolLM2, fp32).

- sampling: 64 rows on 8 mixed rank-32 adapters, decode tokens/s, invariant vs default (interleaved
  rounds, medians);
- training: forward_backward of 8 × 256 tokens on one adapter, tokens/s, invariant vs default;
- drift: max |Δ logprob| between a row alone and the same row in a 64-row mixed batch, default
  mode (rounding of other kernels) vs invariant mode (0 by construction).

    python -m benchmarks.invariance [--rows 64] [--new-tokens 16] [--rounds 3]

The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tinker import types

from benchmarks.common import load_average, machine_floors, smollm2_dir
from mint_server.model import invariant
from mint_server.model.loader import load_model
from tests.engine.helpers import AdapterRegistry, SamplerHarness, TrainRequest
from tests.engine.helpers import TrainerHarness as Trainer
from tests.model.test_parity import random_adapter


def decode_rate(model, residency, ids, rows: int, new_tokens: int) -> float:
    sampler = SamplerHarness(model, residency, kv_slots=rows * 8, max_seq_len=512, block_size=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (24,), generator=g).tolist() for _ in range(rows)]
    p = types.SamplingParams(stop=[], max_tokens=new_tokens, temperature=1.0, seed=1)
    for i, prompt in enumerate(prompts):
        sampler.submit(ids[i % len(ids)], prompt, 1, p)
    sampler.step()  # prefill, which also draws each row's first token
    t0 = time.perf_counter()
    while sampler.has_work():
        sampler.step()
    return rows * (new_tokens - 1) / (time.perf_counter() - t0)


def train_rate(model, trainer, aid, rows: int, length: int) -> float:
    g = torch.Generator().manual_seed(1)
    datums = []
    for _ in range(rows):
        seq = torch.randint(3, model.config.vocab_size, (length + 1,), generator=g)
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                                  loss_fn_inputs={"target_tokens": seq[1:], "weights": torch.ones(length)}))
    t0 = time.perf_counter()
    (out,) = trainer.run([TrainRequest(aid, datums, "cross_entropy")])
    assert not isinstance(out, Exception), out
    return rows * length / (time.perf_counter() - t0)


def drift(model, residency, ids, rows: int) -> float:
    bank = residency.bank
    slots = [residency.get(ids[i % len(ids)]).slot for i in range(rows)]
    tokens = torch.randint(3, model.config.vocab_size, (rows, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batch = torch.log_softmax(model(tokens, lora=bank.batch(slots)), -1)
        worst = 0.0
        for i in range(0, rows, max(1, rows // 8)):
            alone = torch.log_softmax(model(tokens[i : i + 1], lora=bank.batch([slots[i]])), -1)
            worst = max(worst, (batch[i] - alone[0]).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--train-rows", type=int, default=8)
    ap.add_argument("--train-length", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    model = load_model(smollm2_dir(), device="cpu")
    residency = AdapterRegistry(model.config, num_slots=args.adapters + 1, max_rank=32, device="cpu",
                               dtype=torch.float32)
    ids = [residency.install(random_adapter(model.config, 32, seed=k), trainable=False).id
           for k in range(args.adapters)]
    trainer = Trainer(model, residency, base_model="smollm2")
    aid = trainer.create_adapter(types.LoraConfig(rank=32, seed=0))
    invariant.enable_for_model(model.config, max_rank=32)  # checks this machine's kernels
    invariant.set_enabled(False)
    print(f"machine: {json.dumps(machine_floors())} load {load_average()}")

    rates: dict[str, dict[str, list[float]]] = {m: {"decode": [], "train": []} for m in ("default", "invariant")}
    for r in range(args.rounds):  # interleaved, so machine noise falls on both sides alike
        for mode in ("default", "invariant"):
            with invariant.use(mode == "invariant"):
                rates[mode]["decode"].append(decode_rate(model, residency, ids, args.rows, args.new_tokens))
                rates[mode]["train"].append(train_rate(model, trainer, aid, args.train_rows, args.train_length))
            print(f"round {r} {mode}: decode {rates[mode]['decode'][-1]:.1f} tok/s, "
                  f"train {rates[mode]['train'][-1]:.1f} tok/s", flush=True)
    med = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in rates.items()}
    with invariant.use(False):
        drift_default = drift(model, residency, ids, args.rows)
    with invariant.use(True):
        drift_invariant = drift(model, residency, ids, args.rows)
    result = {
        "decode_tok_s": med["default"]["decode"], "decode_tok_s_invariant": med["invariant"]["decode"],
        "decode_slowdown": med["default"]["decode"] / med["invariant"]["decode"],
        "train_tok_s": med["default"]["train"], "train_tok_s_invariant": med["invariant"]["train"],
        "train_slowdown": med["default"]["train"] / med["invariant"]["train"],
        "drift_default": drift_default, "drift_invariant": drift_invariant,
        "rows": args.rows, "adapters": args.adapters, "rounds": args.rounds,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
