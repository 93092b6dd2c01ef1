"""Sampling throughput on SmolLM2: continuous batching over many LoRA adapters.

    python -m benchmarks.sampling [--seqs 64] [--new-tokens 128] [--rank 32] [--profile]
    python -m benchmarks.sampling --step-rounds 10 --skip-full   # quick, load-robust step ratios
    python -m benchmarks.sampling --through sdk [--seqs 64 --new-tokens 32]   # a and b via mint serve + SDK

Workloads, each `seqs` concurrent sequences × `new-tokens` new tokens (temperature 1, no stop):
  a  every sequence on one adapter          c  base model only
  b  every sequence on its own adapter      d  (b) with transformers + PEFT generate(adapter_names=…)
  e  `seqs / 8` prompts × 8 samples: one shared prefill per prompt vs 8 separate prefills
Reports aggregate tokens/s (prefill included) and the ratios b/a (goal ≥ 0.85), b/d (goal ≥ 10),
e = shared / separate prefill time (goal ≤ 0.2). a, b and c run interleaved, one step each in turn;
--step-rounds also times single decode steps of a, b, c and d in turn (medians), which holds up best
when other processes share the machine, at each of --ranks (goals: b/a ≥ 0.85 at r8, ≥ 0.7 at r32,
b ≥ 5× d at r32, b's step ≤ 1.25× its floor); `b_reference` is workload b on MINT_KERNELS=reference
(the per-row gather, plain elementwise ops) stepped in the same rounds: the before/after ratio.

First it prints the machine's measured read bandwidth and fp32 matmul peak (benchmarks.common), and
each step time also as a multiple of its floor (bytes / bandwidth, FLOPs / peak; the larger).
Prints results as they come, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tinker import types

from benchmarks.common import decode_floor, load_average, machine_floors, smollm2_dir
from mint_server.model import kernels
from mint_server.model.loader import load_model
from mint_server.model.lora import ALL_TARGETS, target_shapes
from mint_server.model.peft_io import LoraWeights, save_peft
from tests.engine.helpers import AdapterRegistry
from tests.engine.helpers import SamplerHarness as Sampler


def random_adapter(cfg, rank: int, seed: int) -> LoraWeights:
    # Small weights: the adapters perturb the model without making it degenerate.
    g = torch.Generator().manual_seed(seed)
    weights = {
        t: (torch.randn(L, rank, fi, generator=g) * 0.02, torch.randn(L, fo, rank, generator=g) * 0.02)
        for t, (L, fi, fo) in target_shapes(cfg).items() if t in ALL_TARGETS
    }
    return LoraWeights(weights, rank, alpha=32.0)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def submit_all(sampler: Sampler, adapters: list[str | None], batch: list[list[int]], new_tokens: int,
               num_samples: int = 1) -> list:
    return [
        sampler.submit(a, p, num_samples, types.SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, stop=[]))
        for i, (a, p) in enumerate(zip(adapters, batch, strict=True))
    ]


def run_ours(sampler: Sampler, adapters: list[str | None], batch: list[list[int]], new_tokens: int,
             num_samples: int = 1) -> tuple[float, int]:
    """Submit everything at once, step until done; (seconds, tokens generated)."""
    t0 = time.perf_counter()
    futures = submit_all(sampler, adapters, batch, new_tokens, num_samples)
    while sampler.has_work():
        sampler.step()
    seconds = time.perf_counter() - t0
    return seconds, sum(len(s.tokens) for f in futures for s in f.result().sequences)


def run_interleaved(samplers: dict[str, Sampler], workloads: dict[str, list[str | None]], batch: list[list[int]],
                    new_tokens: int) -> dict[str, float]:
    """Run several workloads side by side, one step of each in turn; tokens/s of each over its own steps.

    On a shared machine, load from other processes then falls on every workload alike instead of
    on whichever happened to run at the time, so their ratios stay meaningful.
    """
    futures = {k: submit_all(samplers[k], workloads[k], batch, new_tokens) for k in workloads}
    busy = dict.fromkeys(workloads, 0.0)
    while any(s.has_work() for s in samplers.values()):
        for k, s in samplers.items():
            if s.has_work():
                t0 = time.perf_counter()
                s.step()
                busy[k] += time.perf_counter() - t0
    return {k: sum(len(q.tokens) for f in futures[k] for q in f.result().sequences) / busy[k] for k in workloads}


def load_peft_model(model_dir: Path, adapters: list[LoraWeights]):
    """transformers model with every adapter loaded through PEFT (as a0, a1, …), eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        for i, w in enumerate(adapters):
            save_peft(w, Path(tmp) / f"a{i}", base_model=str(model_dir))
            if i == 0:
                hf = PeftModel.from_pretrained(hf, Path(tmp) / "a0", adapter_name="a0")
            else:
                hf.load_adapter(Path(tmp) / f"a{i}", adapter_name=f"a{i}")
    hf.get_base_model().generation_config.eos_token_id = None  # like stop=[]: exactly new_tokens each
    return hf.eval()


def run_peft(hf, batch: list[list[int]], new_tokens: int) -> float:
    """PEFT mixed-adapter generate, row i on adapter a{i}; returns seconds."""
    ids = torch.tensor(batch)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=[f"a{i}" for i in range(len(batch))],
              do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(**{**kw, "max_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        out = hf.generate(**kw)
        seconds = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return seconds


def compare_steps(samplers: dict[str, Sampler], workloads: dict[str, list[str | None]], hf,
                  batch: list[list[int]], rounds: int) -> dict[str, float]:
    """Median seconds of one decode step of each workload (a, b, c; d = PEFT with a KV cache), one
    step of each in turn for `rounds` rounds, all at the same context length."""
    for k, s in samplers.items():
        submit_all(s, workloads[k], batch, rounds + 2)
        s.step()  # prefill
    n = len(batch)
    names = [f"a{i}" for i in range(n)]
    with torch.inference_mode():
        ids = torch.tensor(batch)
        mask = torch.ones_like(ids)
        state: dict = {}
        if hf is not None:
            out = hf(input_ids=ids, attention_mask=mask, adapter_names=names, use_cache=True)
            state = {"cache": out.past_key_values, "next": out.logits[:, -1:].argmax(-1), "mask": mask}

        def peft_step() -> None:  # what generate does per token, minus its bookkeeping
            state["mask"] = torch.cat([state["mask"], torch.ones(n, 1, dtype=torch.long)], dim=1)
            o = hf(input_ids=state["next"], attention_mask=state["mask"], past_key_values=state["cache"],
                   adapter_names=names, use_cache=True)
            probs = torch.softmax(o.logits[:, -1].float(), dim=-1)
            state["cache"], state["next"] = o.past_key_values, torch.multinomial(probs, 1)

        steps = {k: _stepper(k, s) for k, s in samplers.items()}
        if hf is not None:
            steps["d_transformers_peft"] = peft_step
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(rounds):
            for k, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    for s in samplers.values():
        while s.has_work():
            s.step()
    return {k: statistics.median(v) for k, v in times.items()}


def _stepper(name: str, sampler: Sampler):
    """The sampler's step, on the reference kernels if the workload's name ends in _reference."""
    if not name.endswith("_reference"):
        return sampler.step

    def step() -> None:
        with kernels.use("reference"):
            sampler.step()

    return step


def profile_decode(sampler: Sampler, adapters: list[str | None], batch: list[list[int]], steps: int = 5) -> str:
    from torch.profiler import ProfilerActivity, profile

    futures = [
        sampler.submit(a, p, 1, types.SamplingParams(max_tokens=steps + 10, temperature=1.0, seed=i, stop=[]))
        for i, (a, p) in enumerate(zip(adapters, batch, strict=True))
    ]
    sampler.step()  # prefill
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            sampler.step()
    while sampler.has_work():
        sampler.step()
    assert all(f.done() for f in futures)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def run_through_sdk(args) -> None:
    """Workloads a and b as a user drives them: `mint serve` in its own process (--device-slots so
    every adapter fits, as in the engine runs above), the tinker SDK here, `seqs` concurrent
    sample requests (one thread each) of `new-tokens` tokens, on one adapter and on `seqs` distinct
    ones, alternated --sdk-rounds times; tokens/s and b/a, with the server's own decode-step rate
    (mint_sampler_* totals from /metrics) beside it, so what the service adds shows."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import tinker

    from tests.service.live import KEY_A, ServeProcess

    model_dir = smollm2_dir()
    n = args.seqs
    floors = machine_floors("cpu")
    print(f"machine: read {floors['read_bytes_per_s'] / 1e9:.1f} GB/s, fp32 matmul "
          f"{floors['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s, load average {load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mint-sampling-sdk-") as data, ServeProcess(
        "--base-model", str(model_dir), "--data-dir", data, "--max-rank", str(args.rank),
        "--device-slots", str(n + 1), "--log-level", "warning",
    ) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        paths = []
        for i in range(n):  # fresh adapters (B = 0 at init: the LoRA products cost the same)
            tc = client.create_lora_training_client(base_model=str(model_dir), rank=args.rank, seed=i).result()
            paths.append(tc.save_weights_for_sampler(f"s{i}").result().path)
        samplers = [client.create_sampling_client(model_path=p) for p in paths]
        params = types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, stop=[])
        batch = prompts(n, args.prompt_len, 49152)

        def decode_totals() -> tuple[float, float]:
            text = httpx.get(f"{server.url}/metrics").text
            tokens = seconds = 0.0
            for line in text.splitlines():
                if line.startswith('mint_sampler_tokens_total{phase="decode"}'):
                    tokens = float(line.split()[-1])
                elif line.startswith('mint_sampler_seconds_total{phase="step"}'):
                    seconds = float(line.split()[-1])
            return tokens, seconds

        def burst(on: list) -> tuple[float, float]:
            t_before, s_before = decode_totals()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                got = sum(pool.map(lambda k: len(on[k].sample(types.ModelInput.from_ints(batch[k]), 1, params)
                                                 .result().sequences[0].tokens), range(len(on))))
            wall = time.perf_counter() - t0
            t_after, s_after = decode_totals()
            step_rate = (t_after - t_before) / max(s_after - s_before, 1e-9)
            return got / wall, step_rate

        burst([samplers[0]] * 4 + samplers[:4])  # warm-up: every path once
        one, many = {"sdk": [], "step": []}, {"sdk": [], "step": []}
        for _ in range(args.sdk_rounds):
            for out, on in ((one, [samplers[0]] * n), (many, samplers)):
                rate, step_rate = burst(on)
                out["sdk"].append(rate)
                out["step"].append(step_rate)
        client.close("success").result()
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in (("one", one), ("many", many))}
    result = {
        "seqs": n, "rank": args.rank, "new_tokens": args.new_tokens, "rounds": args.sdk_rounds,
        "sdk_one_adapter_tokens_per_s": med["one"]["sdk"], "sdk_distinct_adapters_tokens_per_s": med["many"]["sdk"],
        "sdk_ratio_b_over_a": med["many"]["sdk"] / med["one"]["sdk"],
        "server_decode_step_one_tokens_per_s": med["one"]["step"],
        "server_decode_step_distinct_tokens_per_s": med["many"]["step"],
        "server_step_ratio_b_over_a": med["many"]["step"] / med["one"]["step"],
        "read_gb_s": floors["read_bytes_per_s"] / 1e9, "matmul_gflop_s": floors["matmul_flop_per_s"] / 1e9,
        "load_average_end": load_average(),
    }
    for k, v in result.items():
        print(f"{k:40s} {v:,.3f}" if isinstance(v, float) else f"{k:40s} {v}", flush=True)
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--e-prompt-len", type=int, default=512)
    ap.add_argument("--e-new-tokens", type=int, default=8)
    ap.add_argument("--peft-new-tokens", type=int, default=None, help="shorter (d) run; tokens/s is still comparable")
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--skip-full", action="store_true", help="skip the full a-d runs (e.g. with --step-rounds)")
    ap.add_argument("--step-rounds", type=int, default=0, help="also compare single decode steps, N rounds")
    ap.add_argument("--ranks", default="8,32", help="ranks of the --step-rounds comparison (PEFT at --rank only)")
    ap.add_argument("--skip-e", action="store_true", help="skip the shared-prefill comparison (e)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--through", choices=["engine", "sdk"], default="engine",
                    help="sdk: workloads a and b through `mint serve` and the tinker SDK (see run_through_sdk)")
    ap.add_argument("--sdk-rounds", type=int, default=3)
    args = ap.parse_args()
    if args.through == "sdk":
        run_through_sdk(args)
        return

    model_dir = smollm2_dir()
    model = load_model(model_dir, device=args.device)
    cfg, dev, dtype = model.config, model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    n = args.seqs
    floors = machine_floors(str(dev))
    print(f"machine: read {floors['read_bytes_per_s'] / 1e9:.1f} GB/s, fp32 matmul "
          f"{floors['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s, load average {load_average()}, "
          f"MINT_KERNELS={kernels.mode()}", flush=True)
    residency = AdapterRegistry(cfg, num_slots=n + 1, max_rank=args.rank, device=dev, dtype=dtype)
    weights = [random_adapter(cfg, args.rank, seed=i) for i in range(n)]
    ids = [residency.install(w, trainable=False).id for w in weights]
    batch = prompts(n, args.prompt_len, cfg.vocab_size)

    def sampler(**kw) -> Sampler:
        kw = {"kv_slots": n, "max_seq_len": args.prompt_len + args.new_tokens, **kw}
        return Sampler(model, residency, **kw)

    result: dict[str, object] = {}

    def report(**kv: object) -> None:  # print as we go: the whole run takes a while on a CPU
        result.update(kv)
        for k, v in kv.items():
            print(f"{k:34s} {v:,.3f}" if isinstance(v, float) else f"{k:34s} {v}", flush=True)

    run_ours(sampler(), ids[:4], batch[:4], 4)  # warm-up
    report(**{
        "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "seqs": n, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "rank": args.rank,
    })
    workloads = {"a_one_adapter": [ids[0]] * n, "b_distinct_adapters": ids, "c_base": [None] * n}
    hf = None if args.skip_peft else load_peft_model(model_dir, weights)
    report(read_gb_s=floors["read_bytes_per_s"] / 1e9, matmul_gflop_s=floors["matmul_flop_per_s"] / 1e9,
           load_average_start=load_average())
    if args.step_rounds:
        # Per-step medians, every workload stepping in turn at the same context length: the most
        # load-robust comparison on a shared machine (the full runs below take minutes each).
        for rank in sorted({int(r) for r in args.ranks.split(",")} | {args.rank}):
            if rank == args.rank:
                reg, peft_model = residency, hf
                rids = ids
            else:  # another bank and set of adapters at this rank; no PEFT run
                reg = AdapterRegistry(cfg, num_slots=n + 1, max_rank=rank, device=dev, dtype=dtype)
                rids = [reg.install(random_adapter(cfg, rank, seed=i), trainable=False).id for i in range(n)]
                peft_model = None
            wl = {"a_one_adapter": [rids[0]] * n, "b_distinct_adapters": rids, "b_distinct_adapters_reference": rids,
                  "c_base": [None] * n}
            kw = {"kv_slots": n, "max_seq_len": args.prompt_len + args.step_rounds + 2}
            med = compare_steps({k: Sampler(model, reg, **kw) for k in wl}, wl, peft_model, batch, args.step_rounds)
            ctx = args.prompt_len + args.step_rounds // 2
            floor_b = decode_floor(cfg, n, ctx, rank, n, floors)
            floor_a = decode_floor(cfg, n, ctx, rank, 1, floors)
            b, a = med["b_distinct_adapters"], med["a_one_adapter"]
            report(**{f"r{rank}_step_s_{k}": v for k, v in med.items()})
            report(**{
                f"r{rank}_step_ratio_b_over_a": a / b,
                f"r{rank}_step_ratio_b_over_a_reference": a / med["b_distinct_adapters_reference"],
                f"r{rank}_speedup_b_fast_over_reference": med["b_distinct_adapters_reference"] / b,
                f"r{rank}_floor_s_b": floor_b["floor_s"], f"r{rank}_floor_s_a": floor_a["floor_s"],
                f"r{rank}_b_over_floor": b / floor_b["floor_s"], f"r{rank}_a_over_floor": a / floor_a["floor_s"],
                f"r{rank}_b_memory_floor_s": floor_b["memory_floor_s"],
                f"r{rank}_b_compute_floor_s": floor_b["compute_floor_s"],
            })
            if peft_model is not None:
                report(**{f"r{rank}_step_ratio_b_over_d": med["d_transformers_peft"] / b})
            if reg is not residency:
                del reg
        report(load_average_end=load_average())
    if not args.skip_full:
        # a, b, c step in turn (see run_interleaved), so load from other processes skews them alike.
        samplers = {k: sampler() for k in workloads}
        rates = run_interleaved(samplers, workloads, batch, args.new_tokens)
        for k, rate in rates.items():
            st = samplers[k].stats
            report(**{f"tok_s_{k}": rate, f"decode_tok_s_{k}": st.decode_tokens / st.step_s})
        report(ratio_b_over_a=rates["b_distinct_adapters"] / rates["a_one_adapter"])
        if hf is not None:
            peft_tokens = args.peft_new_tokens or args.new_tokens
            peft_rate = n * peft_tokens / run_peft(hf, batch, peft_tokens)
            report(d_new_tokens=peft_tokens, tok_s_d_transformers_peft=peft_rate,
                   ratio_b_over_d=rates["b_distinct_adapters"] / peft_rate)

    # (e): n/8 prompts × 8 samples on one adapter each; shared = one request with num_samples=8,
    # separate = 8 requests of one sample with prompt sharing switched off.
    if args.skip_e:
        print(json.dumps(result))
        return
    groups = max(n // 8, 1)
    long_prompts = prompts(groups, args.e_prompt_len, cfg.vocab_size, seed=1)
    e_len = args.e_prompt_len + args.e_new_tokens
    shared = sampler(max_seq_len=e_len)
    run_ours(shared, ids[:groups], long_prompts, args.e_new_tokens, num_samples=8)
    separate = sampler(max_seq_len=e_len, dedupe_prompts=False)
    run_ours(separate, [a for a in ids[:groups] for _ in range(8)], [p for p in long_prompts for _ in range(8)],
             args.e_new_tokens)
    report(**{
        "e_prompt_len": args.e_prompt_len,
        "e_step_s_shared": shared.stats.step_s, "e_step_s_separate": separate.stats.step_s,
        "e_prefill_tokens_shared": shared.stats.prefill_tokens,
        "e_prefill_tokens_separate": separate.stats.prefill_tokens,
        "e_kv_blocks_peak_shared": shared.pool.peak_used, "e_kv_blocks_peak_separate": separate.pool.peak_used,
        "ratio_e_step_s": shared.stats.step_s / separate.stats.step_s,
    })

    if args.profile:
        for name, adapters in [("a_one_adapter", [ids[0]] * n), ("b_distinct_adapters", ids)]:
            print(f"\ndecode step profile, {name}:")
            print(profile_decode(sampler(), adapters, batch))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
