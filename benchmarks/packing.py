"""Training without padding: mixed-length datums vs a uniform batch, padded and packed (a script).

SmolLM2-135M, one adapter of rank 16 on every linear layer and the unembedding, the engine's
training-memory settings (EngineSettings' defaults, as `mint serve` runs them), engine-direct
(`Trainer.run` + `optim_step`). Two batches of the same 2,048 tokens:

    uniform  8 × 256
    mixed    8 datums of 32–900 tokens (32, 900, 64, 400, 128, 300, 96, 128)

each trained padded (`Trainer(pack=False)`, the path before packing: every datum padded to the
longest, attention over the padding) and packed (the default), the four variants interleaved round
by round in one process. Prints tokens/s of each and the ratio mixed ÷ uniform per path (the
issue's measure; goal ≥ 0.9 packed), and packed ÷ padded on the mixed batch. Last line: JSON.

    python benchmarks/packing.py [--rounds 3] [--steps 1] [--warmup 1] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

MIXED = (32, 900, 64, 400, 128, 300, 96, 128)
UNIFORM = (256,) * 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per variant before the rounds")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()

    import torch
    from tinker import types

    from benchmarks.common import smollm2_dir
    from mint_server.engine.settings import EngineSettings
    from mint_server.model.loader import load_model
    from tests.engine.helpers import AdapterRegistry, TrainRequest
    from tests.engine.helpers import TrainerHarness as Trainer

    assert sum(MIXED) == sum(UNIFORM) == 2048 and min(MIXED) == 32 and max(MIXED) == 900
    model = load_model(Path(args.model_dir) if args.model_dir else smollm2_dir(), device="cpu")
    cfg = model.config
    s = EngineSettings()
    residency = AdapterRegistry(cfg, num_slots=1, max_rank=args.rank, device="cpu", dtype=torch.float32)
    trainer = Trainer(model, residency, "bench", max_tokens_per_pass=s.max_fused_tokens,
                      checkpoint_from_tokens=s.checkpoint_from_tokens or None, logits_chunk=s.logits_chunk_elements())
    aid = trainer.create_adapter(types.LoraConfig(rank=args.rank, seed=0))
    g = torch.Generator().manual_seed(0)

    def request(lengths: tuple[int, ...]) -> TrainRequest:
        datums = []
        for n in lengths:
            seq = torch.randint(0, cfg.vocab_size, (n + 1,), generator=g)
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                                      loss_fn_inputs={"target_tokens": seq[1:], "weights": torch.ones(n)}))
        return TrainRequest(aid, datums, "cross_entropy")

    batches = {"uniform": request(UNIFORM), "mixed": request(MIXED)}
    adam = types.AdamParams(learning_rate=1e-5)

    def step(pack: bool, batch: str) -> float:
        trainer.pack = pack
        t0 = time.perf_counter()
        (out,) = trainer.run([batches[batch]])
        if isinstance(out, Exception):
            raise out
        trainer.optim_step(aid, adam)
        return time.perf_counter() - t0

    variants = [(pack, batch) for pack in (False, True) for batch in ("uniform", "mixed")]
    for v in variants:
        for _ in range(args.warmup):
            print(f"warm-up {'packed' if v[0] else 'padded'} {v[1]}: {step(*v):.2f} s", flush=True)
    times: dict[tuple[bool, str], list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            for _ in range(args.steps):
                times[v].append(step(*v))
        print(f"round {r + 1}: " + ", ".join(f"{'packed' if p else 'padded'} {b} {times[p, b][-1]:.2f} s"
                                             for p, b in variants), flush=True)
    med = {v: statistics.median(t) for v, t in times.items()}
    tps = {v: 2048 / m for v, m in med.items()}
    summary = {"steps": {f"{'packed' if p else 'padded'}_{b}": round(m, 3) for (p, b), m in med.items()},
               "tokens_per_s": {f"{'packed' if p else 'padded'}_{b}": round(t, 1) for (p, b), t in tps.items()},
               "mixed_over_uniform_padded": round(tps[False, "mixed"] / tps[False, "uniform"], 3),
               "mixed_over_uniform_packed": round(tps[True, "mixed"] / tps[True, "uniform"], 3),
               "mixed_packed_over_padded": round(tps[True, "mixed"] / tps[False, "mixed"], 3),
               "uniform_packed_over_padded": round(tps[True, "uniform"] / tps[False, "uniform"], 3),
               "trainer_stats": trainer.stats, "threads": torch.get_num_threads()}
    print(f"tokens/s (median of {len(times[variants[0]])} steps; 2,048 tokens a step):")
    for (p, b), t in tps.items():
        print(f"  {'packed' if p else 'padded'} {b:8s} {t:8.1f}  ({med[p, b]:.2f} s)")
    print(f"mixed ÷ uniform: padded {summary['mixed_over_uniform_padded']}, packed {summary['mixed_over_uniform_packed']}"
          f" (goal ≥ 0.9); mixed packed ÷ padded {summary['mixed_packed_over_padded']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
