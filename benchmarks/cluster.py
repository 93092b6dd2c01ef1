"""The Ray fleet (a script, not a test): a thousand-adapter wave on 1 vs 2 replicas.

Tiny model, each replica a Ray actor pinned to its own core (one torch thread). Parts:

1. wave — `--wave` distinct cold adapters (PEFT dirs on disk), one greedy sample request each, all
   submitted at once through FleetEngine: completion time and sampled tokens/s on 1 and on 2
   replicas; scaling ratio = tokens/s(2) / tokens/s(1) (goal ≥ 1.7). Both fleets live side by side
   and their waves alternate (`--rounds` each, fresh keys every wave); figures are medians.
2. affinity — the same wave again on 2 replicas: share of requests served by their home replica.
3. overhead — sequential one-token requests on the bare base: median latency through the router
   (1 replica) minus a direct call on an in-process LocalEngine (also one thread).
4. CPU seconds of each wave, read from /proc: the router process (per request) and each replica.
   They do not depend on what else the machine runs, so `cpu_scaling` (one replica's CPU for the
   wave / the busiest of two replicas' CPU) is the scaling the replicas' own work allows when each
   has a free core; wall-clock scaling on a shared 2-core box also pays for the router, Ray's own
   processes and everyone else.

    python -m benchmarks.cluster [--wave 1000] [--max-tokens 16] [--rounds 3]

The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tinker import types

from benchmarks.residency import write_adapters
from mint_server.engine.settings import EngineSettings, FleetSettings
from mint_server.engine.values import AdapterSource
from mint_server.model.config import ModelConfig

PROMPT = [5, 17, 33, 60, 61, 62, 63, 9]
SETTINGS = EngineSettings(max_rank=8, kv_budget_tokens=65536, max_context=256, device_slots=32)


def wave(fleet: object, sources: list[AdapterSource], max_tokens: int) -> tuple[float, int]:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[])
    t0 = time.perf_counter()
    futures = [fleet.submit(fleet.prepare_sample(s, PROMPT, 1, params, key=f"k{i % 64}"))  # type: ignore[attr-defined]
               for i, s in enumerate(sources)]
    tokens = sum(len(f.result(timeout=1800).sequences[0].tokens) for f in futures)
    return time.perf_counter() - t0, tokens


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def latency(engine: object, n: int) -> float:
    params = types.SamplingParams(max_tokens=1, temperature=0.0, stop=[])
    times = []
    for i in range(n + 3):
        t0 = time.perf_counter()
        engine.submit(engine.prepare_sample(None, PROMPT, 1, params)).result(timeout=60)  # type: ignore[attr-defined]
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wave", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="waves per fleet, interleaved 1, 2, 1, 2, ...")
    ap.add_argument("--latency-requests", type=int, default=50)
    args = ap.parse_args()

    import ray

    from mint_server.engine.fleet import FleetEngine
    from mint_server.engine.local import LocalEngine
    from tests.tiny import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="mint-cluster-"))
    model = make_tiny_checkpoint(work / "tiny", "llama", tie=True)
    cfg = ModelConfig.from_hf_dir(model)
    dirs = write_adapters(cfg, work / "adapters", args.wave)
    # Three replicas in all (one fleet of 1, one of 2), each reserving one logical CPU; the cores
    # they run on are set by pinning: both fleets' replica 0 on core 0, the second one's 1 on core 1.
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=256 * 1024 * 1024, log_to_driver=False)
    out: dict[str, object] = {"wave": args.wave, "max_tokens": args.max_tokens, "rounds": args.rounds,
                              "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    fleets: dict[int, FleetEngine] = {}
    try:
        for n in (1, 2):
            fleets[n] = FleetEngine(model, "bench", settings=SETTINGS, device="cpu", dtype="float32",
                                    fleet=FleetSettings(replicas=n, pin_cores=True, cpus_per_replica=1))
            warm = [AdapterSource(f"warm{n}:{d.name}", peft_dir=d) for d in dirs[:16]]
            wave(fleets[n], warm, args.max_tokens)  # imports, first steps
        # Interleaved rounds, so both fleets see the same drift in the machine's load; fresh keys
        # every wave, so every adapter starts cold (store tier) on every replica.
        runs: dict[int, list[dict[str, object]]] = {1: [], 2: []}
        for rnd in range(args.rounds):
            for n in (1, 2):
                fleet = fleets[n]
                sources = [AdapterSource(f"r{rnd}n{n}:{d.name}", peft_dir=d) for d in dirs]
                pids = fleet.replica_pids()
                driver0, replicas0 = own_cpu(), [process_cpu(p) for p in pids]
                seconds, tokens = wave(fleet, sources, args.max_tokens)
                driver = own_cpu() - driver0
                replica_cpu = [round(process_cpu(p) - c, 2) for p, c in zip(pids, replicas0, strict=True)]
                runs[n].append({"s": seconds, "tokens_per_s": tokens / seconds, "replica_cpu": replica_cpu,
                                "router_cpu": driver})
                print(f"round {rnd}, {n} replica(s): wave of {args.wave} cold adapters in {seconds:.2f} s, "
                      f"{tokens / seconds:.1f} sampled tokens/s; CPU s: replicas {replica_cpu}, router "
                      f"{driver:.2f}; load {os.getloadavg()[0]:.1f}", flush=True)
        for n in (1, 2):
            out[f"wave_s_{n}"] = round(statistics.median(r["s"] for r in runs[n]), 2)  # type: ignore[misc]
            out[f"tokens_per_s_{n}"] = round(statistics.median(r["tokens_per_s"] for r in runs[n]), 1)  # type: ignore[misc]
            out[f"replica_cpu_s_{n}"] = [round(statistics.median(r["replica_cpu"][i] for r in runs[n]), 3)  # type: ignore[index]
                                         for i in range(n)]
            out[f"router_cpu_ms_per_request_{n}"] = round(
                1000 * statistics.median(r["router_cpu"] for r in runs[n]) / args.wave, 3)  # type: ignore[misc]
        out["scaling_per_round"] = [round(b["tokens_per_s"] / a["tokens_per_s"], 3)  # type: ignore[operator]
                                    for a, b in zip(runs[1], runs[2], strict=True)]

        fleet = fleets[2]  # the last round's adapters again: now hot, each on its home
        sources = [AdapterSource(f"r{args.rounds - 1}n2:{d.name}", peft_dir=d) for d in dirs]
        before = dict(fleet.routed)
        wave(fleet, sources, args.max_tokens)
        d = {k: v - before.get(k, 0) for k, v in fleet.routed.items()}
        home = sum(v for (_, dec), v in d.items() if dec == "home")
        spread = [sum(v for (i, _), v in d.items() if i == r) for r in range(2)]
        out["affinity_hit_rate"] = round(home / sum(d.values()), 4)
        out["requests_per_replica"] = spread
        print(f"second wave on 2 replicas: {home}/{sum(d.values())} on their home replica; spread {spread}",
              flush=True)

        out["router_latency_ms"] = round(1000 * latency(fleets[1], args.latency_requests), 3)
        pings = [fleets[1].ping_replica(0) for _ in range(args.latency_requests)]
        out["ray_roundtrip_ms"] = round(1000 * statistics.median(pings), 3)
    finally:
        for fleet in fleets.values():
            fleet.shutdown()
        ray.shutdown()
    torch.set_num_threads(1)
    local = LocalEngine(model, "bench", device="cpu", dtype=torch.float32, settings=SETTINGS)
    try:
        out["direct_latency_ms"] = round(1000 * latency(local, args.latency_requests), 3)
    finally:
        local.shutdown()
    out["scaling_ratio"] = round(out["tokens_per_s_2"] / out["tokens_per_s_1"], 3)  # type: ignore[operator]
    out["cpu_scaling"] = round(out["replica_cpu_s_1"][0] / max(out["replica_cpu_s_2"]), 3)  # type: ignore[index]
    out["router_overhead_ms"] = round(out["router_latency_ms"] - out["direct_latency_ms"], 3)  # type: ignore[operator]
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"scaling 2 vs 1 replica: {out['scaling_ratio']}x wall, median of {args.rounds} interleaved rounds "
          f"{out['scaling_per_round']} (goal >= 1.7), {out['cpu_scaling']}x by replica CPU; load average "
          f"{out['loadavg_start']} -> {out['loadavg_end']}; router overhead per request {out['router_overhead_ms']} ms "
          f"({out['router_latency_ms']} vs {out['direct_latency_ms']} direct; an empty Ray actor round trip "
          f"{out['ray_roundtrip_ms']} ms)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
