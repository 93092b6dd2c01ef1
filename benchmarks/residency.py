"""Tiered residency on one engine (a script, not a test): what paging adapters costs.

Parts (each on a fresh LocalEngine; the tiny model is built in code, SmolLM2 is the prepared one):

1. cold storm — one hot adapter sampled in a closed loop with short requests; then 1,000 cold
   adapters (store tier: PEFT dirs on disk) requested at once while the loop goes on. Hot-request
   latency p50/p99 during the storm vs quiet. Goal: p50 ≤ 1.25× quiet.
2. training rotation — 64 training clients (threads), each forward_backward + optim_step in turn,
   on 8 device slots vs 64: step throughput ratio. Goal ≥ 0.8.
3. sweep — N servable policies (distinct real adapters) sampled once each through the engine:
   adapters/s and the load vs compute split (store-read seconds from the residency stats). Goal:
   per-adapter cost at the largest N ≤ 1.5× at the smallest.

    python -m benchmarks.residency [--model tiny|smollm2] [--storm 1000] [--clients 64]
                                   [--sweep 1000,10000] [--parts storm,rotation,sweep]

The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from tinker import types

from mint_server.engine.local import LocalEngine
from mint_server.engine.settings import EngineSettings
from mint_server.engine.values import AdapterSource
from mint_server.model.lora import target_shapes
from mint_server.model.peft_io import LoraWeights, save_peft

GREEDY = dict(temperature=0.0, stop=[])


def model_dir(name: str, work: Path) -> Path:
    if name == "tiny":
        from tests.tiny import make_tiny_checkpoint

        return make_tiny_checkpoint(work / "tiny", "llama", tie=True)
    from benchmarks.train import model_dir as smollm2

    return smollm2(None)


def engine(path: Path, work: Path, **kw: object) -> LocalEngine:
    s = EngineSettings(**{"max_rank": 8, "kv_budget_tokens": 65536, "max_context": 2048,
                          "store_dir": work / "pages", **kw})  # type: ignore[arg-type]
    return LocalEngine(path, "bench", device="cpu", dtype=torch.float32, settings=s)


def write_adapters(cfg: object, dest: Path, n: int, rank: int = 1, start: int = 0) -> list[Path]:
    """n distinct, deterministic PEFT dirs (rank `rank` on q_proj and v_proj)."""
    shapes = target_shapes(cfg)  # type: ignore[arg-type]
    out = []
    for i in range(start, start + n):
        d = dest / f"a{i}"
        if not (d / "adapter_config.json").exists():
            g = torch.Generator().manual_seed(i)
            w = {t: (torch.randn(shapes[t][0], rank, shapes[t][1], generator=g) * 0.05,
                     torch.randn(shapes[t][0], shapes[t][2], rank, generator=g) * 0.05) for t in ("q_proj", "v_proj")}
            save_peft(LoraWeights(w, rank, 2.0 * rank), d, "bench")
        out.append(d)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def sample(e: LocalEngine, src: AdapterSource | None, prompt: list[int], max_tokens: int, key: str = "bench") -> object:
    p = types.SamplingParams(max_tokens=max_tokens, **GREEDY)
    return e.submit(e.prepare_sample(src, prompt, 1, p, key=key))


def part_storm(path: Path, work: Path, n_cold: int, slots: int, step_tokens: int) -> dict:
    e = engine(path, work, device_slots=slots, host_cache_mb=256.0, max_step_tokens=step_tokens)
    try:
        dirs = write_adapters(e.model.config, work / "storm", n_cold + 1)
        hot = AdapterSource("hot", peft_dir=dirs[0])
        prompt = [5, 6, 7, 8, 9, 10, 11, 12]

        def loop(until: threading.Event | None, count: int) -> list[float]:
            lat = []
            while (until is None and len(lat) < count) or (until is not None and not until.is_set()):
                t0 = time.perf_counter()
                sample(e, hot, prompt, 8, key="hot").result()  # type: ignore[attr-defined]
                lat.append(time.perf_counter() - t0)
            return lat

        loop(None, 5)  # warm: the hot adapter in a slot
        quiet = loop(None, 40)
        done = threading.Event()
        t0 = time.perf_counter()
        cold = [sample(e, AdapterSource(f"c{i}", peft_dir=d), prompt, 4, key="storm") for i, d in enumerate(dirs[1:])]
        waiter = threading.Thread(target=lambda: ([f.result() for f in cold], done.set()))  # type: ignore[attr-defined]
        waiter.start()
        stormy = loop(done, 0)
        waiter.join()
        storm_s = time.perf_counter() - t0
        return {"quiet_p50_s": pct(quiet, 0.5), "quiet_p99_s": pct(quiet, 0.99), "storm_p50_s": pct(stormy, 0.5),
                "storm_p99_s": pct(stormy, 0.99), "p50_ratio": pct(stormy, 0.5) / pct(quiet, 0.5),
                "p99_ratio": pct(stormy, 0.99) / pct(quiet, 0.99), "hot_requests_during_storm": len(stormy),
                "cold_adapters": n_cold, "storm_seconds": storm_s, "cold_adapters_per_s": n_cold / storm_s,
                "device_slots": slots, "max_step_tokens": step_tokens}
    finally:
        e.shutdown()


def part_rotation(path: Path, work: Path, clients: int, steps: int) -> dict:
    from tests.engine.test_training import sft_datums

    out = {}
    for slots in (clients, 8):
        e = engine(path, work / f"rot{slots}", device_slots=slots, host_cache_mb=4096.0)
        try:
            ids = [e.create_adapter(types.LoraConfig(rank=8, seed=i)).result() for i in range(clients)]
            data = sft_datums([32, 32], seed=1)
            vocab = e.model.config.vocab_size
            data = [types.Datum(model_input=d.model_input, loss_fn_inputs={
                "target_tokens": [t % vocab for t in d.loss_fn_inputs["target_tokens"].tolist()],
                "weights": d.loss_fn_inputs["weights"]}) for d in data]
            adam = e.prepare_optim(types.AdamParams(learning_rate=1e-3))
            job = e.prepare_train(data, "cross_entropy", None)

            def client(aid: str, e: LocalEngine = e, job: object = job, adam: object = adam) -> None:
                for _ in range(steps):
                    e.submit(job.on(aid)).result()  # type: ignore[attr-defined]
                    e.submit(adam.on(aid)).result()  # type: ignore[attr-defined]

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(a,)) for a in ids]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            out[slots] = {"steps_per_s": clients * steps / wall, "evictions": dict(e.residency.stats.evictions)}
        finally:
            e.shutdown()
    return {"clients": clients, "few_slots": 8, "steps_per_s_8_slots": out[8]["steps_per_s"],
            f"steps_per_s_{clients}_slots": out[clients]["steps_per_s"],
            "ratio": out[8]["steps_per_s"] / out[clients]["steps_per_s"], "evictions_8_slots": out[8]["evictions"]}


def part_sweep(path: Path, work: Path, sizes: list[int], slots: int) -> dict:
    """Seed N servable policies into a catalog (`mint catalog seed --servable`'s code), then sweep
    them (`mint sweep`'s loop): per-adapter cost, and how much of it is reading from the store."""
    from mint_server.catalog.catalog import Catalog
    from mint_server.catalog.seed import seed
    from mint_server.cli.sweep import run_sweep, servable_payloads

    results = {}
    name, lora, payload_for = servable_payloads(path, rank=1)
    for n in sizes:
        data = work / f"sweep-{n}"
        with Catalog.open(data_dir=data) as catalog:
            have = len(catalog.list_policies("bench", limit=1).items)
            t_seed = time.perf_counter()
            if not have:
                seed(catalog, n, 1, "bench", prefix="sv-", batch_size=1000, payload_for=payload_for,
                     base_model=name, lora_config=lora)
            t_seed = time.perf_counter() - t_seed
            e = engine(path, data, device_slots=slots, host_cache_mb=256.0)
            try:
                t0 = time.perf_counter()
                counts = run_sweep(e, catalog, "bench", ["hello world"], "sv-", "prod", 4,
                                   f"bench-{time.time_ns()}", data / "out", 4 * slots)
                wall = time.perf_counter() - t0
                load_s = sum(e.residency.stats.load_seconds)
            finally:
                e.shutdown()
        results[n] = {"adapters_per_s": n / wall, "ms_per_adapter": 1000 * wall / n,
                      "store_read_ms_per_adapter": 1000 * load_s / n, "seed_s": t_seed, "counts": counts}
    lo, hi = min(sizes), max(sizes)
    return {"sizes": results, "cost_ratio_largest_vs_smallest": results[hi]["ms_per_adapter"] / results[lo]["ms_per_adapter"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--storm", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sweep", default="1000,10000")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--parts", default="storm,rotation,sweep")
    ap.add_argument("--max-step-tokens", type=int, default=64, help="The engine's per-step token budget.")
    ap.add_argument("--work", default=None, help="Where adapters are written (kept between runs).")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="mint-residency-"))
    path = model_dir(a.model, work)
    summary: dict = {"model": a.model, "threads": torch.get_num_threads()}
    parts = a.parts.split(",")
    if "storm" in parts:
        summary["storm"] = part_storm(path, work, a.storm, a.slots, a.max_step_tokens)
        print("storm", json.dumps(summary["storm"]), flush=True)
    if "rotation" in parts:
        summary["rotation"] = part_rotation(path, work, a.clients, a.steps)
        print("rotation", json.dumps(summary["rotation"]), flush=True)
    if "sweep" in parts:
        summary["sweep"] = part_sweep(path, work, [int(x) for x in a.sweep.split(",")], a.slots)
        print("sweep", json.dumps(summary["sweep"]), flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
